"""``consistency``: how much of the source image an edit keeps — the cosine similarity of open_clip image embeddings
of the edited image and the image it edits (image editing; needs ``source_images``).

Flow-GRPO's FLUX.1-Kontext recipe (``counting_flux_kontext`` in yifan123/flow_grpo ``config/grpo.py``) weights this
0.5 as ``image_similarity``: CLIP ViT-L/14 (``openai/clip-vit-large-patch14``) image features of edit and reference,
normalised, their dot product. The default here is the same network through open_clip (``ViT-L-14``, ``openai``)::

    rewards: [{name: consistency, weight: 0.5}]                       # ViT-L-14 / openai, cached or downloaded
    rewards: [{name: consistency, model: ViT-B-32, pretrained: /ckpt/clip.pt}]
    rewards: [{name: consistency, random_init: true, model_config: {...}}]   # tests: no weights
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from .clip_models import ClipScore
from .registry import register_reward


@register_reward("consistency")
class Consistency(ClipScore):
    """Cosine similarity of the open_clip image embeddings of each image and its source image, in [-1, 1].

    Options as ``clipscore`` (``model``, ``pretrained``, ``model_config``, ``random_init``, ``device``, ``dtype``,
    ``batch_size``, ``preprocessing``); both images go through the same preprocessing (by default Flow-GRPO's
    ``image_similarity``: bilinear resize of the shortest side, centre crop), so their sizes may differ.
    """

    uses_source_images = True

    def score(
        self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]], source_images: Tensor
    ) -> Tensor:
        edited = self.model.encode_image(self._pixels(images)).float()
        source = self.model.encode_image(self._pixels(source_images)).float()
        return (F.normalize(edited, dim=-1) * F.normalize(source, dim=-1)).sum(-1)
