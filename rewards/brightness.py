"""Mean brightness: a cheap, model-free reward that a policy can visibly move (CPU learning tests, demos)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import BaseReward
from .registry import register_reward

# ITU-R BT.601 luma weights.
_LUMA = (0.299, 0.587, 0.114)


@register_reward("brightness")
class Brightness(BaseReward):
    """Mean luma of the image in [0, 1] (``0.299 R + 0.587 G + 0.114 B``, averaged over pixels)."""

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        weights = torch.tensor(_LUMA, dtype=torch.float64).view(1, 3, 1, 1)
        return (images.double().cpu() * weights).sum(dim=1).mean(dim=(1, 2))
