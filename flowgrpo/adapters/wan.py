"""Wan2.1 text-to-video adapter: UMT5 prompts zero-padded to ``max_sequence_length``, latents ``[C, F', H/8, W/8]``
with ``F' = (F - 1) / 4 + 1`` latent frames, CFG as two forwards, AutoencoderKLWan with per-channel latent statistics.
Follows ``diffusers.WanPipeline.__call__`` step by step.

The frame axis lives here: rollouts, the trainer and evaluation see latents of whatever shape :meth:`latent_shape`
says, and :meth:`decode` returns clips ``[B, F, 3, H, W]`` in [0, 1] (``pipe(output_type="pt").frames``); rewards
score such clips frame by frame or whole (``rewards.video``).

Schedule. The hub's Wan2.1 checkpoints ship a ``UniPCMultistepScheduler`` with flow sigmas (``flow_shift`` 3.0 for
480p). Our samplers are Euler-type flow steps, so they cannot run UniPC's multistep solver: as Flow-GRPO's
``train_wan2_1.py`` does, the adapter takes UniPC's flow sigmas (``set_timesteps`` of a copy) and its integer
timesteps, and steps on them with its own SDE / ODE steps. A noise-free rollout therefore equals ``pipe(...)`` when the
pipeline's scheduler is ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` (its sigmas, Euler steps: tested to
1e-5), not when it runs UniPC.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..checks import check_num_frames
from .base import PipelineAdapter, PromptEmbeds
from .registry import FamilySpec, register_family


class WanAdapter(PipelineAdapter):
    """``WanPipeline`` (Wan2.1 text-to-video). ``num_frames`` (``4k + 1``, the VAE's temporal factor 4) is fixed per
    adapter; ``guidance_scale > 1``: CFG with ``negative_prompt`` (Flow-GRPO: ``""``, the pipeline's default)."""

    family = "wan"
    uses_cfg = True
    schedule_family = "sd3"  # FlowMatchEulerDiscreteScheduler: a static shift, set as SD3's pipe() sets it
    # Flow-GRPO's train_wan2_1.py targets to_q / to_k / to_v / to_out.0 (+ add_*_proj / to_add_out, which the
    # text-to-video transformer does not have): the self- and cross-attention projections of every block.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(
        self, pipe: Any, *, negative_prompt: str = "", max_sequence_length: int = 512, num_frames: int = 81
    ) -> None:
        super().__init__(pipe, negative_prompt=negative_prompt)
        config = pipe.config
        if pipe.transformer is None or getattr(pipe, "transformer_2", None) is not None or config.get("boundary_ratio"):
            raise ValueError(
                "wan: this WanPipeline has two transformers (Wan2.2's high/low-noise experts, boundary_ratio); only "
                "single-transformer Wan2.1 text-to-video is supported"
            )
        if config.get("expand_timesteps"):
            raise ValueError("wan: expand_timesteps (Wan2.2 TI2V's per-token timesteps) is not supported")
        if max_sequence_length < 1:
            raise ValueError(f"wan: max_sequence_length must be >= 1, got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length  # pipe()'s default and Flow-GRPO's: 512 UMT5 tokens
        self.temporal_factor = int(pipe.vae_scale_factor_temporal)
        check_num_frames(num_frames, self.temporal_factor, key="num_frames")
        self.num_frames = num_frames
        self._network_timesteps: dict[float, float] = {}  # sigma -> the scheduler's own timestep (UniPC: integers)

    # ------------------------------------------------------------------ sizes
    @property
    def size_multiple(self) -> int:
        _, p_h, p_w = self.pipe.transformer.config.patch_size
        # VAE factor × patch size, and WanPipeline.check_inputs' own rule: multiples of 16
        return math.lcm(16, self.pipe.vae_scale_factor_spatial * p_h, self.pipe.vae_scale_factor_spatial * p_w)

    @property
    def latent_frames(self) -> int:
        """Latent frames of a clip: ``(num_frames - 1) / temporal factor + 1`` (``prepare_latents``)."""
        return (self.num_frames - 1) // self.temporal_factor + 1

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """``(C, F', H / f, W / f)``: one clip's latents as ``WanPipeline.prepare_latents`` draws them."""
        self.check_size(height, width)
        f = self.pipe.vae_scale_factor_spatial
        return (self.pipe.transformer.config.in_channels, self.latent_frames, height // f, width // f)

    def image_seq_len(self, height: int, width: int) -> int:
        _, p_h, p_w = self.pipe.transformer.config.patch_size
        _, frames, h, w = self.latent_shape(height, width)
        return frames * (h // p_h) * (w // p_w)

    # ------------------------------------------------------------------ prompts
    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(UMT5 embeddings [N, L, D] zero-padded after each prompt's tokens, an empty [N, 0]: Wan has no pooled
        embedding), from ``pipe.encode_prompt`` (its cleaning, ``max_sequence_length``)."""
        embeds, _ = self.pipe.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return embeds, embeds.new_zeros(len(prompts), 0)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_negative: bool = False) -> PromptEmbeds:
        """As the base class, without pooled embeddings (``pooled`` / ``negative_pooled`` are None)."""
        prompts = self._encode_missing(prompts, with_negative)
        embeds = torch.stack([self._cache[p][0] for p in prompts])
        if not with_negative:
            return PromptEmbeds(embeds)
        negative = self._cache[self.negative_prompt][0]
        return PromptEmbeds(embeds, negative_embeds=negative.expand(len(prompts), *negative.shape))

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
        """``pipe()``'s prediction: the conditional forward and, with ``guidance_scale > 1``, a separate negative
        forward, ``uncond + s · (cond − uncond)``."""
        timestep = self._timestep(sigma, latents.shape[0], timestep)
        cond = self._forward(latents, timestep, embeds.prompt_embeds)
        if not self.needs_negative(guidance_scale):
            return cond
        if embeds.negative_embeds is None:
            raise ValueError("guidance_scale > 1 needs negative embeddings (encode_prompts with_negative=True)")
        uncond = self._forward(latents, timestep, embeds.negative_embeds)
        return uncond + guidance_scale * (cond - uncond)

    def _forward(self, latents: Tensor, timestep: Tensor, text: Tensor) -> Tensor:
        dtype = self.dtype  # as pipe(): latents and prompt embeddings in the transformer's dtype
        return self.transformer(
            hidden_states=latents.to(dtype), timestep=timestep, encoder_hidden_states=text.to(dtype), return_dict=False
        )[0]

    def _timestep(self, sigma: Tensor | float, batch: int, timestep: Tensor | None = None) -> Tensor:
        """The scheduler's own timestep of each sigma when it has its own (UniPC: ``int(1000 σ)`` in float64, what
        ``pipe()`` and Flow-GRPO feed), else ``σ · num_train_timesteps`` (FlowMatchEuler: the same float32 product)."""
        if timestep is None and self._network_timesteps:
            values = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).tolist()
            if all(v in self._network_timesteps for v in values):
                mapped = torch.tensor([self._network_timesteps[v] for v in values], dtype=torch.float32)
                timestep = mapped if torch.as_tensor(sigma).ndim else mapped[0]
        return super()._timestep(sigma, batch, timestep)

    @property
    def latent_dtype(self) -> torch.dtype:
        """float32 whatever the model's dtype: WanPipeline (and Flow-GRPO's Wan rollout) keep the latents and the
        steps in float32 and cast only the transformer's input; bf16 latents would round every step by ~5% of the
        SDE's std."""
        return torch.float32

    # ------------------------------------------------------------------ schedule and decoding
    def schedule(
        self, num_steps: int, height: int, width: int, *, time_shift: float | None = None
    ) -> tuple[Tensor, Tensor]:
        """FlowMatchEulerDiscreteScheduler: exactly as ``pipe(num_inference_steps=num_steps)`` sets it (static shift).
        A scheduler with flow sigmas (the hub's UniPCMultistepScheduler, ``use_flow_sigmas``): its sigmas and its
        timesteps for ``num_steps``, integrated with this project's Euler-type steps (Flow-GRPO's Wan recipe)."""
        from diffusers import FlowMatchEulerDiscreteScheduler  # imported on use: importing diffusers takes seconds

        if time_shift is not None or isinstance(self.scheduler, FlowMatchEulerDiscreteScheduler):
            return super().schedule(num_steps, height, width, time_shift=time_shift)
        if not self.scheduler.config.get("use_flow_sigmas", False):
            raise ValueError(
                f"wan: {type(self.scheduler).__name__} without use_flow_sigmas has no flow-matching sigmas to step on; "
                "use the checkpoint's UniPCMultistepScheduler (use_flow_sigmas=True) or "
                "FlowMatchEulerDiscreteScheduler(shift=flow_shift)"
            )
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.check_size(height, width)
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(num_steps, device=self.device)
        sigmas = scheduler.sigmas.to(device=self.device, dtype=torch.float32)
        if float(sigmas[-1]) != 0.0:  # the flowgrpo_wan diffusion (σ_min + (σ_max − σ_min)·σ) assumes σ_min = 0
            raise ValueError(
                f"wan: the scheduler's last sigma is {float(sigmas[-1]):.4g}, not 0; set the scheduler's "
                "final_sigmas_type to 'zero' (the hub's Wan2.1 UniPC config does)"
            )
        timesteps = scheduler.timesteps
        self._network_timesteps.update(zip(sigmas[:-1].tolist(), timesteps.double().tolist(), strict=True))
        return sigmas, timesteps

    def _latents_to_vae(self, latents: Tensor, height: int, width: int) -> Tensor:
        return latents  # already [B, C, F', h, w]

    @torch.no_grad()
    def decode(self, latents: Tensor, height: int, width: int) -> Tensor:
        """Latents → clips ``[B, F, 3, H, W]`` in [0, 1], as ``pipe(output_type="pt").frames``: undo the per-channel
        ``latents_mean`` / ``latents_std``, decode every frame, postprocess as the pipeline's video processor."""
        latents = latents.to(self.vae.dtype)
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = latents / inverse_std + mean  # the pipeline's own expression (bit for bit)
        video = self.vae.decode(latents, return_dict=False)[0]
        return self.pipe.video_processor.postprocess_video(video, output_type="pt").float()


SPEC = register_family(
    FamilySpec(
        name="wan",
        pipelines=("WanPipeline",),  # Wan2.1 text-to-video; image-to-video, VACE, video-to-video: their own inputs
        transformer="WanTransformer3DModel",
        adapter=WanAdapter,
        tiny="flowgrpo.tiny:wan_components",  # its own AutoencoderKLWan only (no -taesd)
        video=True,
    )
)
