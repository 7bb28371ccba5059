"""Wan image-to-video adapter (``WanImageToVideoPipeline``): Wan2.1 I2V (the image also read by a CLIP vision tower)
and Wan2.2 I2V A14B (two experts, no image encoder). Everything else is text-to-video's (:class:`WanAdapter`): the
UMT5 prompts, CFG, the schedule, the experts and their boundary, decoding.

The conditioning image comes from the prompt file, one per prompt, as for the editing families (a ``.jsonl`` row's
``"image"``; ``edits``, ``requires_sources``): resized to the clip's size, bicubic, when it has another
(:meth:`PipelineAdapter._prepare_source`, Flow-GRPO's ``ref_image.resize``), then, as ``WanImageToVideoPipeline``
does (``__call__`` / ``prepare_latents`` / ``encode_image``):

- the first frame of a clip whose other frames are black is VAE-encoded (the posterior's mode), normalised by the
  per-channel ``latents_mean`` / ``latents_std``, and concatenated after a 4-channel mask (1 on the first latent
  frame: its 4 video frames are the image; 0 after) into the condition ``[4 + z, F', h, w]``, which is concatenated
  to the noisy latents on the channel axis at every step (``source_latents``);
- where the transformer has an image branch (``image_dim``: Wan2.1), the CLIP vision tower's penultimate hidden states
  of the image (``encode_image``) go in as ``encoder_hidden_states_image`` with every forward, the negative one's too
  (``source_embeds``); without it (Wan2.2) there are none.

Encoded once per image and size and cached until :meth:`clear_prompt_cache`. A rollout then equals
``pipe(image=<the image at H x W>, height=H, width=W, ...)``. Not built: ``last_image`` (first-last-frame), and
TI2V-5B's image-to-video (``expand_timesteps``: the image's latents replace the first latent frame, whose tokens get
timestep 0), refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from ..checks import ConfigError
from .base import PromptEmbeds
from .registry import FamilySpec, register_family
from .wan import WanAdapter

# WanAttnProcessor splits the image tokens off the front of the context by a text length of 512 it hard-codes.
TEXT_TOKENS = 512


class WanImageToVideoAdapter(WanAdapter):
    """``WanImageToVideoPipeline``. Needs a source image per prompt (:meth:`encode_conditions` with ``sources``); the
    options are :class:`WanAdapter`'s."""

    family = "wan-i2v"
    edits = True
    requires_sources = True  # pipe() cannot generate without its image
    # text-to-video's targets plus the image cross-attention's key / value projections (Wan2.1's image branch), the
    # add_*_proj of Flow-GRPO's target list that the text-to-video transformer lacks
    default_lora_targets = (*WanAdapter.default_lora_targets, "add_k_proj", "add_v_proj")

    def __init__(self, pipe: Any, **options: Any) -> None:
        super().__init__(pipe, **options)
        if pipe.config.get("expand_timesteps"):
            raise ValueError(
                "wan-i2v: expand_timesteps (Wan2.2 TI2V-5B's image-to-video: the image's latents replace the first "
                "latent frame, whose tokens get timestep 0) is not supported; TI2V-5B's text-to-video is (WanPipeline, "
                "model.kind wan)"
            )
        self.image_embeds = pipe.transformer.config.image_dim is not None  # Wan2.1's CLIP branch
        if self.image_embeds and (pipe.image_encoder is None or pipe.image_processor is None):
            raise ValueError(
                "wan-i2v: the transformer reads CLIP image embeddings (image_dim is set), but the pipeline has no "
                "image_encoder / image_processor; load it whole"
            )
        if self.image_embeds and self.max_sequence_length != TEXT_TOKENS:
            raise ConfigError(
                f"model.max_sequence_length={self.max_sequence_length}: with CLIP image embeddings the transformer "
                f"takes the text as exactly {TEXT_TOKENS} tokens (diffusers' WanAttnProcessor splits the image tokens "
                f"off by that length): set model.max_sequence_length: {TEXT_TOKENS} or null"
            )
        self._image_cache: dict[tuple[str, int, int], Tensor] = {}  # (image, H, W) -> CLIP hidden states [N, D]

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """``(z, F', H / f, W / f)``: the VAE's channels (``pipe()``'s ``num_channels_latents``), not the transformer's
        input, which also takes the condition."""
        self.check_size(height, width)
        f = self.pipe.vae_scale_factor_spatial
        return (self.vae.config.z_dim, self.latent_frames, height // f, width // f)

    # ------------------------------------------------------------------ the conditioning image
    def _prepare_source(self, image: Any, height: int, width: int) -> Tensor:
        """Resized to ``width`` x ``height`` (bicubic) when it has another size, then the pipeline's video processor:
        ``[1, 3, H, W]`` in [-1, 1] (``pipe()``'s ``video_processor.preprocess``)."""
        if image.size != (width, height):
            image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
        return self.pipe.video_processor.preprocess(image, height=height, width=width).float()

    @torch.no_grad()
    def _encode_sources(self, pixels: Tensor) -> Tensor:
        """Images ``[N, 3, H, W]`` in [-1, 1] -> conditions ``[N, 4 + z, F', h, w]`` float32: the mask, then the
        normalised latents of the clip [image, black, ...] (``prepare_latents`` without ``last_image``)."""
        n, _, height, width = pixels.shape
        video = torch.cat([pixels.unsqueeze(2), pixels.new_zeros(n, 3, self.num_frames - 1, height, width)], dim=2)
        video = video.to(device=self.vae.device, dtype=self.vae.dtype)
        latents = self.vae.encode(video).latent_dist.mode()  # retrieve_latents(..., sample_mode="argmax")
        latents = latents.to(device=self.device, dtype=torch.float32)
        shape = (1, self.vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(latents)
        inverse_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(shape).to(latents)
        latents = (latents - mean) * inverse_std  # the pipeline's own expression
        # pipe()'s mask: the first video frame repeated over the temporal factor, so the first latent frame is 1.
        mask = torch.zeros(n, self.temporal_factor, *latents.shape[2:], dtype=latents.dtype, device=latents.device)
        mask[:, :, 0] = 1
        return torch.cat([mask, latents], dim=1)

    @torch.no_grad()
    def encode_conditions(
        self,
        prompts: Sequence[str],
        *,
        with_negative: bool = False,
        sources: Sequence[Any] | None = None,
        height: int | None = None,
        width: int | None = None,
    ) -> PromptEmbeds:
        """The text-to-video conditions plus each prompt's image: ``source_latents`` (the condition), ``source_images``
        and, with Wan2.1's image branch, ``source_embeds`` (CLIP's penultimate hidden states of the image at H x W)."""
        if sources is None:
            raise ValueError(
                "wan-i2v animates an image: give each prompt its first frame (a .jsonl prompt file whose rows have an "
                '"image"); WanImageToVideoPipeline cannot generate from text alone'
            )
        embeds = super().encode_conditions(
            prompts, with_negative=with_negative, sources=sources, height=height, width=width
        )
        if not self.image_embeds:
            return embeds
        return replace(embeds, source_embeds=self._clip_embeds(sources, embeds.source_images))

    def _clip_embeds(self, sources: Sequence[Any], images: Tensor) -> Tensor:
        """``[B, N, D]``: ``pipe.encode_image`` of each source as the VAE saw it (the H x W image, rebuilt exactly
        from its 8-bit pixels), each unique one once."""
        from ..images import image_key

        height, width = images.shape[-2:]
        keys = [(image_key(s), height, width) for s in sources]
        missing = {k: i for i, k in enumerate(keys) if k not in self._image_cache}
        if missing:
            shown = [_to_pil(images[i]) for i in missing.values()]
            hidden = self.pipe.encode_image(shown, device=self.device)  # CLIP's hidden_states[-2]
            for row, key in enumerate(missing):
                self._image_cache[key] = hidden[row]
        return torch.stack([self._image_cache[k] for k in keys])

    def clear_prompt_cache(self) -> None:
        super().clear_prompt_cache()
        self._image_cache.clear()

    # ------------------------------------------------------------------ velocity: the condition beside the latents
    def _model_inputs(self, latents: Tensor, embeds: PromptEmbeds) -> tuple[Tensor, dict[str, Tensor]]:
        """``cat([latents, condition], dim=1)`` and, with the image branch, ``encoder_hidden_states_image``."""
        if embeds.source_latents is None:
            raise ValueError("wan-i2v needs each sample's image: encode_conditions(..., sources=...)")
        condition = embeds.source_latents.to(device=latents.device, dtype=latents.dtype)
        if condition.shape[0] != latents.shape[0]:
            raise ValueError(f"{condition.shape[0]} source images for a batch of {latents.shape[0]} latents")
        hidden = torch.cat([latents, condition], dim=1)
        if not self.image_embeds:
            return hidden, {}
        if embeds.source_embeds is None:
            raise ValueError("wan-i2v: this transformer reads CLIP image embeddings: encode_conditions(sources=...)")
        return hidden, {"encoder_hidden_states_image": embeds.source_embeds.to(latents.device)}


def _to_pil(image: Tensor) -> Image.Image:
    """A ``[3, H, W]`` image in [0, 1] whose values are 8-bit levels / 255 as a PIL image of those levels."""
    levels = (image.float() * 255).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(levels.permute(1, 2, 0).cpu().numpy())


SPEC = register_family(
    FamilySpec(
        name="wan-i2v",
        pipelines=("WanImageToVideoPipeline",),  # Wan2.1 I2V, Wan2.2 I2V A14B; not first-last-frame, not TI2V's I2V
        transformer="WanTransformer3DModel",
        adapter=WanImageToVideoAdapter,
        tiny="flowgrpo.tiny:wan_i2v_components",  # Wan2.1's layout (CLIP image branch); wan22=True: Wan2.2's
        video=True,
    )
)
