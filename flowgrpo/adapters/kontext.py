"""FLUX.1-Kontext adapter (``FluxKontextPipeline``): FLUX.1 plus a source image whose packed VAE latents are appended
to the image token sequence, with positional ids whose first axis is 1 instead of 0.

As the pipeline does (diffusers ``FluxKontextPipeline.__call__`` / ``prepare_latents``): the source is VAE-encoded
once (the distribution's mode, ``(z - shift) · scale``), packed 2x2, concatenated after the noisy latents at every
step, and the transformer's output is cut back to the generated tokens. The schedule is FLUX's, its dynamic shift
from the generated image's token count only (the source tokens do not count), and guidance goes through the
guidance embedding (no CFG).

The source is resized to the generated size, H x W (``model.size``), bicubic (Flow-GRPO's ``train_flux_kontext.py``
resizes every reference image to its square ``config.resolution``; :meth:`PipelineAdapter._prepare_source`); a rollout
then equals ``pipe(image=<that image>, height=H, width=W, max_area=H * W, _auto_resize=False)``. Without sources it is
text-to-image, as ``pipe(image=None)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import PromptEmbeds
from .flux import FluxAdapter
from .registry import FamilySpec, register_family


class FluxKontextAdapter(FluxAdapter):
    family = "flux-kontext"
    schedule_family = "flux"
    edits = True
    # Flow-GRPO's Kontext targets (scripts/train_flux_kontext.py) are FLUX's: attention on both streams + FFNs.
    default_lora_targets = FluxAdapter.default_lora_targets

    def _encode_sources(self, pixels: Tensor) -> Tensor:
        """``[N, 3, h, w]`` in [-1, 1] -> packed latents ``[N, (h/16)(w/16), 4C]`` (the pipeline's image_latents)."""
        pipe = self.pipe
        image = pixels.to(device=self.vae.device, dtype=self.vae.dtype)
        latents = pipe._encode_vae_image(image, generator=None)  # mode of the posterior, shifted and scaled
        n, c, h, w = latents.shape
        return pipe._pack_latents(latents, n, c, h, w).to(device=self.device, dtype=self.dtype)

    def _image_tokens(self, latents: Tensor, embeds: PromptEmbeds) -> tuple[Tensor, Tensor]:
        if embeds.source_latents is None:
            return super()._image_tokens(latents, embeds)
        source = embeds.source_latents.to(device=latents.device, dtype=latents.dtype)
        if source.shape[0] != latents.shape[0]:
            raise ValueError(f"{source.shape[0]} source images for a batch of {latents.shape[0]} latents")
        if embeds.source_images is None:
            raise ValueError("flux-kontext: source latents without their images: use encode_conditions(sources=...)")
        generated, generated_ids = super()._image_tokens(latents, embeds)
        h, w = embeds.source_images.shape[-2:]  # the source's grid, first axis 1 (the pipeline's image_ids)
        source_ids = self._ids_for(h // self.size_multiple, w // self.size_multiple, first=1)
        return torch.cat([generated, source], dim=1), torch.cat([generated_ids, source_ids])


# FluxKontextInpaintPipeline also concatenates mask latents, which this adapter never builds: refused.
SPEC = register_family(
    FamilySpec(
        name="flux-kontext",
        pipelines=("FluxKontextPipeline",),
        transformer="FluxTransformer2DModel",
        adapter=FluxKontextAdapter,
        tiny="flowgrpo.tiny:flux_components",  # the FLUX components (same seed, same weights) in the editing pipeline
        tiny_vaes=("kl", "tiny"),
    )
)
