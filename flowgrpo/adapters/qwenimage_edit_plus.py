"""Qwen-Image-Edit-Plus adapter (``QwenImageEditPlusPipeline``: Qwen-Image-Edit-2509 and -2511): Qwen-Image-Edit with
one or several source images per prompt ("Picture 1", "Picture 2", ...), each read twice, at two sizes.

As the pipeline does (diffusers 0.42.1 ``QwenImageEditPlusPipeline.__call__`` / ``_get_qwen_prompt_embeds`` /
``prepare_latents``), for each source image at its aspect ratio ``r = W / H``:

- the VAE gets it at ``calculate_dimensions(VAE_IMAGE_SIZE = 1024², r)`` (multiples of 32; ``model.source_area``
  replaces 1024², as for :class:`QwenImageEditAdapter`), encoded by the posterior's mode, normalised per channel,
  packed 2x2; a prompt's sources follow the noisy latents along the image sequence in order, each its own
  ``img_shapes`` entry ``(1, h / 16, w / 16)`` after the generated image's, and the output is cut back to the
  generated tokens;
- the Qwen2.5-VL text encoder gets it at ``calculate_dimensions(CONDITION_IMAGE_SIZE = 384², r)`` (Qwen-Image-Edit
  reads its one source at the VAE's size), in the edit chat template (its first 64 tokens dropped) as
  ``"Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: ...<instruction>"``; the negative prompt is
  read with the same pictures.

Everything else is Qwen-Image's (:class:`QwenImageAdapter`): the schedule's dynamic shift from the generated token
count alone, true CFG with the negative prompt and the norm rescale, decoding. Qwen-Image-Edit-2511's
``zero_cond_t`` (the source tokens modulated at timestep 0) is the transformer's own, read from ``img_shapes``.

Choices, as :class:`QwenImageEditAdapter` (whose code this subclass reuses):

- Every source is first resized to the output size H x W (bicubic; Flow-GRPO's ``ref_image.resize`` for its one
  source), so all sources of a batch have one size and a batch stacks; ``pipe()`` keeps each source's own ratio. A
  rollout equals ``pipe(image=[each source resized to W x H], height=H, width=W)`` (tests/test_qwenimage_edit_plus.py),
  one prompt at a time: ``pipe()`` refuses batches. Flow-Factory's adapter samples one prompt at a time for this
  reason; here every prompt of a prompt file gives the same number of sources (``flowgrpo.data`` refuses a file
  mixing counts), so a batch is rectangular.
- Rewards that compare an edit with its source (``source_images``) get Picture 1.
- The text encoder reads each (prompt, pictures) pair in its own ``pipe.encode_prompt`` call (cached, as the other
  families' prompts): the pipeline's template numbers every picture it is given, so pairs cannot share a call.

LoRA targets: Flow-Factory's Qwen-Image-Edit-Plus adapter (X-GenGroup/Flow-Factory
``src/flow_factory/models/qwen_image/qwen_image_edit_plus.py``, ``default_target_modules``: ``to_q``, ``to_k``,
``to_v``, ``to_out.0``, ``add_q_proj``, ``add_k_proj``, ``add_v_proj``, ``to_add_out``, ``net.0.proj``, ``net.2``),
which select the same twelve Linear layers of every block as Flow-GRPO's Qwen-Image(-Edit) list
(:attr:`QwenImageAdapter.default_lora_targets`; asserted in the tests).
"""

from __future__ import annotations

from typing import Any

from PIL import Image
from torch import Tensor

from .qwenimage import QwenImageAdapter
from .qwenimage_edit import QwenImageEditAdapter
from .registry import FamilySpec, register_family

# Flow-Factory's default_target_modules (suffixes), for the test that they select the same layers as ours.
FLOW_FACTORY_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "net.0.proj",
    "net.2",
)


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """``QwenImageEditPlusPipeline``. Each prompt takes one source image or a list of them (the same number for every
    prompt of a batch); ``guidance_scale`` is ``true_cfg_scale``; ``source_area`` replaces ``VAE_IMAGE_SIZE``."""

    family = "qwenimage-edit-plus"
    max_sources = None  # any number (Qwen-Image-Edit-2509's model card: 1 to 3 work best)
    default_lora_targets = QwenImageAdapter.default_lora_targets  # = Flow-Factory's (module docstring)

    def condition_size(self, height: int, width: int) -> tuple[int, int]:
        """``(h, w)`` a source is read at by the text encoder for a ``height`` x ``width`` output:
        ``calculate_dimensions(CONDITION_IMAGE_SIZE, width / height)`` as ``pipe()`` (384²: 384x384 when square)."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus  # heavy: on use

        w, h = plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE, width / height)
        return int(h), int(w)

    def _condition_image(self, image: Image.Image, height: int, width: int) -> Image.Image:
        """The RGB source as the text encoder gets it: at the output size, then resized to :meth:`condition_size`
        by the pipeline's ``image_processor.resize`` (what ``pipe()`` hands ``encode_prompt``)."""
        h, w = self.condition_size(height, width)
        return self.pipe.image_processor.resize(self._at_output_size(image, height, width), h, w)

    def _encode_pairs(self, pairs: list[tuple[str, tuple[Any, ...]]], height: int, width: int) -> list[Tensor]:
        """One ``pipe.encode_prompt(prompt=[text], image=[picture, ...])`` per pair: ``pipe()``'s own call."""
        from ..images import open_image

        out = []
        for text, group in pairs:
            self.text_encoder_calls += 1
            shown = [self._condition_image(open_image(s), height, width) for s in group]
            embeds, mask = self.pipe.encode_prompt(prompt=[text], image=shown, device=self.device)
            out.append(embeds[0] if mask is None else embeds[0, : int(mask.sum())])
        return out


SPEC = register_family(
    FamilySpec(
        name="qwenimage-edit-plus",
        pipelines=("QwenImageEditPlusPipeline",),  # Qwen-Image-Edit-2509 and -2511 (zero_cond_t)
        transformer="QwenImageTransformer2DModel",
        adapter=QwenImageEditPlusAdapter,
        tiny="flowgrpo.tiny:qwenimage_edit_plus_components",
    )
)
