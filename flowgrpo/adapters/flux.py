"""FLUX.1 adapter: CLIP (pooled) + T5 encoders, packed [B, (H/16)(W/16), 4C] latents, guidance embedding, and
``FluxPipeline``'s optional true CFG with a negative prompt (``model.true_cfg_scale``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..checks import check_true_cfg
from .base import PipelineAdapter, PromptEmbeds
from .registry import FamilySpec, register_family


class FluxAdapter(PipelineAdapter):
    family = "flux"
    uses_cfg = False
    # Attention on both streams plus the feed-forward layers (double and single blocks).
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
        "proj_mlp",
    )

    def __init__(
        self, pipe: Any, *, negative_prompt: str = "", max_sequence_length: int = 512, true_cfg_scale: float = 1.0
    ) -> None:
        super().__init__(pipe, negative_prompt=negative_prompt)
        check_true_cfg(true_cfg_scale, negative_prompt)
        self.max_sequence_length = max_sequence_length
        self.true_cfg_scale = true_cfg_scale  # pipe()'s true_cfg_scale (model.true_cfg_scale); 1: off
        # (rows, columns, first axis, device, dtype) of a packed token grid -> its [rows · columns, 3] positional ids
        self._grid_ids: dict[tuple[int, int, int, torch.device, torch.dtype], Tensor] = {}

    @property
    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # 2x2 packing on top of the VAE factor

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        f = self.pipe.vae_scale_factor
        return 2 * (height // (f * 2)), 2 * (width // (f * 2))

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        self.check_size(height, width)
        h, w = self._latent_hw(height, width)
        channels = self.pipe.transformer.config.in_channels // 4
        return ((h // 2) * (w // 2), channels * 4)

    def image_seq_len(self, height: int, width: int) -> int:
        return self.latent_shape(height, width)[0]

    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return embeds, pooled

    def _ids_for(self, rows: int, cols: int, first: int = 0) -> Tensor:
        """The pipeline's positional ids ``[rows · cols, 3]`` of a grid of packed tokens: ``(first, row, column)``
        (first axis 0 for the generated image, 1 for Kontext's source), cached per grid, device and dtype."""
        key = (rows, cols, first, self.device, self.dtype)
        if key not in self._grid_ids:
            ids = self.pipe._prepare_latent_image_ids(1, rows, cols, self.device, self.dtype)
            ids[..., 0] = first
            self._grid_ids[key] = ids
        return self._grid_ids[key]

    def velocity(
        self,
        latents: Tensor,
        sigma: Tensor | float,
        embeds: PromptEmbeds,
        guidance_scale: float,
        *,
        timestep: Tensor | None = None,
    ) -> Tensor:
        """Guidance-distilled: ``guidance_scale`` goes into the guidance embedding. With ``true_cfg_scale > 1``, as
        ``pipe(true_cfg_scale=s, negative_prompt=...)``: a second forward on the negative prompt, ``neg + s·(cond −
        neg)`` (on top of the guidance embedding)."""
        batch = latents.shape[0]
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance = torch.full([1], guidance_scale, device=latents.device, dtype=torch.float32).expand(batch)
        # As FluxPipeline: the timestep is cast to the latents' dtype, then scaled to [0, 1].
        timestep = self._timestep(sigma, batch, timestep).to(latents.dtype) / 1000
        hidden, image_ids = self._image_tokens(latents, embeds)
        generated = latents.shape[1]  # the output is cut back to the generated tokens (editing appends the source's)
        cond = self._forward(hidden, image_ids, timestep, guidance, embeds.prompt_embeds, embeds.pooled)[:, :generated]
        if not self.needs_negative(guidance_scale):
            return cond
        if embeds.negative_embeds is None:
            raise ValueError("true_cfg_scale > 1 needs negative embeddings (encode_prompts with_negative=True)")
        negative = self._forward(hidden, image_ids, timestep, guidance, embeds.negative_embeds, embeds.negative_pooled)
        uncond = negative[:, :generated]
        return uncond + self.true_cfg_scale * (cond - uncond)

    def _forward(
        self, hidden: Tensor, image_ids: Tensor, timestep: Tensor, guidance: Tensor | None, text: Tensor, pooled: Tensor
    ) -> Tensor:
        text_ids = torch.zeros(text.shape[1], 3, device=text.device, dtype=text.dtype)
        return self.transformer(
            hidden_states=hidden,
            timestep=timestep,
            guidance=guidance,
            pooled_projections=pooled,
            encoder_hidden_states=text,
            txt_ids=text_ids,
            img_ids=image_ids,
            return_dict=False,
        )[0]

    def needs_negative(self, guidance_scale: float) -> bool:
        """True CFG, whatever the guidance embedding's scale."""
        return self.true_cfg_scale > 1

    def _image_tokens(self, latents: Tensor, embeds: PromptEmbeds) -> tuple[Tensor, Tensor]:
        """The image-stream tokens ``[B, N, C]`` and their positional ids ``[N, 3]``: the latents alone (FLUX.1)."""
        return latents, self._ids_for(*self._packed_grid(latents.shape[1], embeds))

    def _latents_to_vae(self, latents: Tensor, height: int, width: int) -> Tensor:
        return self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)


# FLUX.1 text-to-image only: FluxFill / FluxControl / FluxImg2Img / FluxInpaint feed other inputs, refused by
# make_adapter. FLUX.2 is another model, its own families (flowgrpo/adapters/flux2.py).
SPEC = register_family(
    FamilySpec(
        name="flux",
        pipelines=("FluxPipeline",),
        transformer="FluxTransformer2DModel",
        adapter=FluxAdapter,
        tiny="flowgrpo.tiny:flux_components",
        tiny_vaes=("kl", "tiny"),
    )
)
