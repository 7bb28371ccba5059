"""Stable Diffusion 3 / 3.5 adapter: two CLIP + T5 encoders, MMDiT on [B, C, H/8, W/8] latents, batched CFG."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import PipelineAdapter, PromptEmbeds
from .registry import FamilySpec, register_family


class SD3Adapter(PipelineAdapter):
    family = "sd3"
    uses_cfg = True
    # Flow-GRPO's SD3 targets: joint attention on the image and text streams.
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
    )

    def __init__(self, pipe: Any, *, negative_prompt: str = "", max_sequence_length: int = 256) -> None:
        super().__init__(pipe, negative_prompt=negative_prompt)
        self.max_sequence_length = max_sequence_length

    @property
    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor * self.pipe.transformer.config.patch_size

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        self.check_size(height, width)
        f = self.pipe.vae_scale_factor
        return (self.pipe.transformer.config.in_channels, height // f, width // f)

    def image_seq_len(self, height: int, width: int) -> int:
        p = self.pipe.transformer.config.patch_size
        _, h, w = self.latent_shape(height, width)
        return (h // p) * (w // p)

    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return embeds, pooled

    def velocity(
        self,
        latents: Tensor,
        sigma: Tensor | float,
        embeds: PromptEmbeds,
        guidance_scale: float,
        *,
        timestep: Tensor | None = None,
    ) -> Tensor:
        """CFG as ``pipe()``: uncond + cond batched in one forward when ``guidance_scale > 1``."""
        timestep = self._timestep(sigma, latents.shape[0], timestep)
        cfg = self.needs_negative(guidance_scale)
        if cfg:
            if embeds.negative_embeds is None:
                raise ValueError("guidance_scale > 1 needs negative embeddings (encode_prompts with_negative=True)")
            latents = torch.cat([latents, latents])
            timestep = torch.cat([timestep, timestep])
            hidden = torch.cat([embeds.negative_embeds, embeds.prompt_embeds])
            pooled = torch.cat([embeds.negative_pooled, embeds.pooled])
        else:
            hidden, pooled = embeds.prompt_embeds, embeds.pooled
        out = self.transformer(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=hidden,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        if cfg:
            uncond, cond = out.chunk(2)
            out = uncond + guidance_scale * (cond - uncond)
        return out

    def _latents_to_vae(self, latents: Tensor, height: int, width: int) -> Tensor:
        return latents


SPEC = register_family(
    FamilySpec(
        name="sd3",
        pipelines=("StableDiffusion3Pipeline",),
        transformer="SD3Transformer2DModel",
        adapter=SD3Adapter,
        tiny="flowgrpo.tiny:sd3_components",
        tiny_vaes=("kl", "tiny"),
    )
)
