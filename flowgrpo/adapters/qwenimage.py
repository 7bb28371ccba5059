"""Qwen-Image adapter: Qwen2.5-VL text encoder (masked, variable length), packed [B, (H/16)(W/16), 4C] latents, true
CFG with a negative prompt and the norm rescale, dynamic exponential shift, AutoencoderKLQwenImage with per-channel
latent statistics. Everything follows ``diffusers.QwenImagePipeline.__call__`` step by step."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .base import PipelineAdapter, PromptEmbeds
from .registry import FamilySpec, register_family


class QwenImageAdapter(PipelineAdapter):
    """``QwenImagePipeline`` (text-to-image). ``guidance_scale`` is the pipeline's ``true_cfg_scale``: above 1, a
    second forward with ``negative_prompt`` (Flow-GRPO: ``" "``) and ``pipe()``'s rescale of the combined
    prediction to the conditional one's norm."""

    family = "qwenimage"
    uses_cfg = True
    # Flow-GRPO's Qwen-Image targets (train_qwenimage.py): joint attention on both streams and both streams' MLPs,
    # the Linear layers of QwenImageTransformer2DModel's blocks (its tensor-parallel plan lists the same twelve).
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )

    def __init__(self, pipe: Any, *, negative_prompt: str = "", max_sequence_length: int = 512) -> None:
        super().__init__(pipe, negative_prompt=negative_prompt)
        if pipe.transformer.config.guidance_embeds:
            raise ValueError(
                "qwenimage: this transformer has guidance_embeds=True (a guidance-distilled variant); only the "
                "true-CFG Qwen-Image (guidance_embeds=False) is supported"
            )
        if not 1 <= max_sequence_length <= 1024:  # QwenImagePipeline.check_inputs' limit
            raise ValueError(f"qwenimage: max_sequence_length must be in 1..1024, got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length  # pipe()'s default: 512

    @staticmethod
    def lora_exclude(transformer: torch.nn.Module) -> list[str]:
        """The last block's text-stream outputs (``to_add_out``, ``txt_mlp``): the model keeps only the image stream
        of its last block, so LoRA there would never get a gradient (and DDP would refuse the unused parameters).
        The last block's ``add_q_proj`` stays: its gradient is zero but defined (it is part of the joint attention)."""
        last = len(transformer.transformer_blocks) - 1
        names = ("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
        return [f"transformer_blocks.{last}.{name}" for name in names]

    @property
    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # 2x2 packing on top of the VAE factor

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        self.check_size(height, width)
        f = self.pipe.vae_scale_factor
        rows, cols = height // (f * 2), width // (f * 2)
        return (rows * cols, self.pipe.transformer.config.in_channels)  # in_channels = 4 x latent channels

    def image_seq_len(self, height: int, width: int) -> int:
        return self.latent_shape(height, width)[0]

    # ------------------------------------------------------------------ prompts
    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(token embeddings [N, L, D] zero-padded to the longest, valid lengths [N]), from ``pipe.encode_prompt``
        (the chat template, its 34 system tokens dropped, the last hidden state, ``max_sequence_length``)."""
        embeds, mask = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        if mask is None:  # encode_prompt returns None when no prompt is padded
            lengths = torch.full((len(prompts),), embeds.shape[1], dtype=torch.long)
        else:
            lengths = mask.sum(dim=1).long().cpu()
        return embeds, lengths

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_negative: bool = False) -> PromptEmbeds:
        """As the base class, with masks: each prompt is cached at its own length and a batch is zero-padded to its
        longest prompt, as ``pipe()`` pads; ``mask`` / ``negative_mask`` say which tokens are real."""
        prompts = self._encode_missing(prompts, with_negative)
        embeds, mask = _pad_rows([self._cached(p) for p in prompts])
        if not with_negative:
            return PromptEmbeds(embeds, mask=mask)
        negative = self._cached(self.negative_prompt)
        n = len(prompts)
        negative_mask = torch.ones(negative.shape[0], dtype=torch.long, device=negative.device)
        return PromptEmbeds(
            embeds,
            mask=mask,
            negative_embeds=negative.expand(n, *negative.shape),
            negative_mask=negative_mask.expand(n, -1),
        )

    def _cached(self, prompt: str) -> Tensor:
        embeds, length = self._cache[prompt]
        return embeds[: int(length)]  # [L_prompt, D]

    # ------------------------------------------------------------------ velocity
    def velocity(
        self,
        latents: Tensor,
        sigma: Tensor | float,
        embeds: PromptEmbeds,
        guidance_scale: float,
        *,
        timestep: Tensor | None = None,
    ) -> Tensor:
        """``pipe()``'s prediction: the conditional forward, and with ``guidance_scale > 1`` a separate negative
        forward, ``comb = neg + s·(cond − neg)`` rescaled to the conditional prediction's norm per token."""
        batch = latents.shape[0]
        # As QwenImagePipeline: the timestep is cast to the latents' dtype, then scaled to [0, 1].
        timestep = self._timestep(sigma, batch, timestep).to(latents.dtype) / 1000
        hidden, img_shapes = self._image_tokens(latents, embeds)
        generated = latents.shape[1]  # the output is cut back to the generated tokens (editing appends the source's)
        cond = self._forward(hidden, timestep, embeds.prompt_embeds, embeds.mask, img_shapes)[:, :generated]
        if not self.needs_negative(guidance_scale):
            return cond
        if embeds.negative_embeds is None:
            raise ValueError("guidance_scale > 1 needs negative embeddings (encode_prompts with_negative=True)")
        negative = self._forward(hidden, timestep, embeds.negative_embeds, embeds.negative_mask, img_shapes)
        uncond = negative[:, :generated]
        combined = uncond + guidance_scale * (cond - uncond)
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        combined_norm = torch.norm(combined, dim=-1, keepdim=True)
        return combined * (cond_norm / combined_norm)

    def _image_tokens(self, latents: Tensor, embeds: PromptEmbeds) -> tuple[Tensor, list]:
        """The transformer's image sequence and its ``img_shapes`` (one list of ``(frames, rows, columns)`` per sample):
        here the generated latents alone; Qwen-Image-Edit appends its source image's tokens."""
        rows, cols = self._packed_grid(latents.shape[1], embeds)
        return latents, [[(1, rows, cols)]] * latents.shape[0]

    def _forward(
        self, latents: Tensor, timestep: Tensor, text: Tensor, mask: Tensor | None, img_shapes: list
    ) -> Tensor:
        if mask is not None:
            # What pipe() feeds for this batch: padded to the batch's longest prompt, no mask when none is padded.
            # A training micro-batch mixing rows of several rollout batches may be padded to another length than
            # its rows were sampled with: masked attention makes that equal in exact arithmetic (and on the CPU
            # bit for bit, tested), but GPU attention kernels may round differently (Flow-GRPO pads the same way).
            length = int(mask.sum(dim=1).max())
            text, mask = text[:, :length], mask[:, :length]
            if bool(mask.all()):
                mask = None
        return self.transformer(
            hidden_states=latents,
            timestep=timestep,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=text,
            img_shapes=img_shapes,
            return_dict=False,
        )[0]

    # ------------------------------------------------------------------ schedule and decoding
    def schedule(
        self, num_steps: int, height: int, width: int, *, time_shift: float | None = None
    ) -> tuple[Tensor, Tensor]:
        """As ``pipe(num_inference_steps=num_steps)``: ``sigmas = linspace(1, 1/T, T)``, then the scheduler's dynamic
        shift with ``mu = calculate_shift(image_seq_len, ...)`` from its config (and its terminal stretch)."""
        if time_shift is not None:
            return super().schedule(num_steps, height, width, time_shift=time_shift)
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift  # imported on use: heavy

        config = self.scheduler.config
        mu = calculate_shift(
            self.image_seq_len(height, width),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device=self.device, mu=mu)
        return scheduler.sigmas.to(torch.float32), scheduler.timesteps

    def _latents_to_vae(self, latents: Tensor, height: int, width: int) -> Tensor:
        return self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)  # [B, C, 1, H, W]

    @torch.no_grad()
    def decode(self, latents: Tensor, height: int, width: int) -> Tensor:
        """Latents → float images ``[B, 3, H, W]`` in [0, 1], as ``pipe(output_type="pt")``: unpack, undo the
        per-channel ``latents_mean`` / ``latents_std``, decode the single frame."""
        latents = self._latents_to_vae(latents, height, width).to(self.vae.dtype)
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = latents / inverse_std + mean  # the pipeline's own expression (bit for bit)
        image = self.vae.decode(latents, return_dict=False)[0][:, :, 0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()


def _pad_rows(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """``[L_i, D]`` rows -> (``[N, L, D]`` zero-padded to the longest, mask ``[N, L]`` long), as encode_prompt pads."""
    length = max(row.shape[0] for row in rows)
    embeds = torch.stack([torch.cat([row, row.new_zeros(length - row.shape[0], row.shape[1])]) for row in rows])
    mask = torch.stack(
        [
            torch.cat(
                [torch.ones(row.shape[0], dtype=torch.long), torch.zeros(length - row.shape[0], dtype=torch.long)]
            )
            for row in rows
        ]
    ).to(embeds.device)
    return embeds, mask


SPEC = register_family(
    FamilySpec(
        name="qwenimage",
        pipelines=("QwenImagePipeline",),  # text-to-image; the inpaint / ControlNet / layered siblings: no
        transformer="QwenImageTransformer2DModel",
        adapter=QwenImageAdapter,
        tiny="flowgrpo.tiny:qwenimage_components",  # its own AutoencoderKLQwenImage only (no -taesd)
    )
)
