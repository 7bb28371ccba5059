"""HunyuanVideo text-to-video adapter (``HunyuanVideoPipeline``): a Llama-3 text encoder read through the video prompt
template, CLIP's pooled embedding, a guidance-distilled dual-/single-stream transformer on ``[C, F', H/8, W/8]``
latents, the 3D causal VAE (temporal factor 4, spatial 8: ``num_frames = 4k + 1``). Everything follows
``diffusers.HunyuanVideoPipeline.__call__`` (diffusers 0.42) step by step:

- prompts: ``pipe.encode_prompt`` itself. The Llama reads ``DEFAULT_PROMPT_TEMPLATE`` (the system text asking to
  describe the video, then the prompt) padded on the right to ``crop_start + max_sequence_length`` tokens
  (95 + 256), its ``hidden_states[-3]`` (``num_hidden_layers_to_skip = 2``) with the first ``crop_start = 95`` tokens
  (``<|begin_of_text|>`` and the template before the prompt) cropped off: ``[256, 4096]`` per prompt with its attention
  mask, which the transformer's token refiner and joint attention read (``PromptEmbeds.mask``; rows keep pipe()'s fixed
  length, so a batch is never re-padded). CLIP-L's ``pooler_output`` is the pooled embedding;
- latents: ``[C, F', H/8, W/8]`` float32 (``prepare_latents``, ``F' = (F − 1) / 4 + 1``), cast to the transformer's
  dtype for its input only; the timestep is the scheduler's ``t = 1000 σ`` in the latents' dtype;
- guidance: guidance-distilled, ``guidance_scale`` enters the transformer as ``guidance_scale · 1000`` (a tensor in the
  transformer's dtype, then × 1000, as ``pipe()``: bf16 rounds the scale before the product); no CFG by default.
  ``pipe(true_cfg_scale=s, negative_prompt=...)``'s true CFG, ``neg + s·(cond − neg)`` on top of the embedded guidance,
  is ``model.true_cfg_scale`` (as FLUX's; a second forward on ``model.negative_prompt``, then required);
- schedule: ``sigmas = np.linspace(1, 0, T + 1)[:-1]`` given to the FlowMatchEuler scheduler, which applies its static
  shift (HunyuanVideo's flow shift 7.0) and appends 0;
- decoding: ``latents.to(vae.dtype) / scaling_factor`` (0.476986, no shift), the VAE, the video processor: clips
  ``[B, F, 3, H, W]`` in [0, 1] (``pipe(output_type="pt").frames``), scored frame by frame or whole (``rewards.video``).

DanceGRPO (XueZeyue/DanceGRPO ``fastvideo/train_grpo_hunyuan.py``) samples and trains the same recipe (not bit for
bit: its embeddings come from FastVideo's fp16 text-encoder wrapper, under bf16 autocast): its
transformer (FastVideo's ``hunyuan_hf``, diffusers' layout) reads the same precomputed Llama embeddings and mask
(``encode_prompt``'s defaults: this template, 256 tokens) with the CLIP pooled embedding folded into a first token,
and the embedded guidance ``6018.0`` = ``guidance_scale`` 6.018 here; ``configs/hunyuanvideo_dancegrpo.yaml`` is its
recipe.

LoRA targets: ``to_q``, ``to_k``, ``to_v``, ``to_out.0`` (every attention's projections: the token refiner's, the
dual-stream blocks' image side and output, the single-stream blocks' QKV), FastVideo's LoRA targets for this very
transformer (hao-ai-lab/FastVideo ``fastvideo/train.py`` @883616a, ``model_type == "hunyuan_hf"``: ``LoraConfig(...,
target_modules=["to_k", "to_q", "to_v", "to_out.0"])``, r 128, α 256); FastVideo is the trainer DanceGRPO is built
on. DanceGRPO's own HunyuanVideo trainer fine-tunes every weight (FSDP, no LoRA).

What it cannot do, refused by name: HunyuanVideo's image-to-video (a transformer with ``image_condition_type``; its
pipelines, ``HunyuanVideoImageToVideoPipeline`` / SkyReels / FramePack, are other families that ``make_adapter``
refuses), a scheduler other than FlowMatchEuler (this project's samplers are Euler-type flow steps), source images,
a frame count other than ``4k + 1``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..checks import check_num_frames, check_true_cfg
from .base import PipelineAdapter, PromptEmbeds
from .flux import FluxAdapter
from .registry import FamilySpec, register_family
from .wan import WanAdapter


class HunyuanVideoAdapter(PipelineAdapter):
    """``HunyuanVideoPipeline`` (text-to-video). ``num_frames`` (``4k + 1``) is fixed per adapter; the sampler's
    ``guidance_scale`` is the embedded guidance (``pipe(guidance_scale=...)``, 6.0 by default there);
    ``true_cfg_scale > 1``: true CFG with ``negative_prompt``. See the module docstring."""

    family = "hunyuanvideo"
    uses_cfg = False  # guidance-distilled: the guidance is an input of the network
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # FastVideo's (module docstring)

    def __init__(
        self,
        pipe: Any,
        *,
        negative_prompt: str = "",
        max_sequence_length: int = 256,
        num_frames: int = 129,
        true_cfg_scale: float = 1.0,
    ) -> None:
        super().__init__(pipe, negative_prompt=negative_prompt)
        from diffusers import FlowMatchEulerDiscreteScheduler  # imported on use: importing diffusers takes seconds

        condition = pipe.transformer.config.get("image_condition_type")
        if condition is not None:
            raise ValueError(
                f"hunyuanvideo: this transformer conditions on an image (image_condition_type={condition!r}: "
                "HunyuanVideo's image-to-video), which HunyuanVideoPipeline never feeds; image-to-video is not "
                "supported: load the text-to-video transformer (hunyuanvideo-community/HunyuanVideo)"
            )
        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(
                f"hunyuanvideo: the pipeline's scheduler is {type(pipe.scheduler).__name__}, whose solver this "
                "project's Euler-type flow steps cannot reproduce; use the checkpoint's FlowMatchEulerDiscreteScheduler"
            )
        check_true_cfg(true_cfg_scale, negative_prompt)
        if max_sequence_length < 1:
            raise ValueError(f"hunyuanvideo: max_sequence_length must be >= 1, got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length  # Llama tokens after the template (pipe()'s default 256)
        self.true_cfg_scale = true_cfg_scale  # pipe()'s true_cfg_scale (model.true_cfg_scale); 1: off
        self.temporal_factor = int(pipe.vae_scale_factor_temporal)
        check_num_frames(num_frames, self.temporal_factor, key="num_frames")
        self.num_frames = num_frames
        self._masks: dict[str, Tensor] = {}  # prompt -> its Llama attention mask [L] (long), beside the base cache

    # ------------------------------------------------------------------ sizes
    @property
    def size_multiple(self) -> int:
        # VAE factor × patch size, and HunyuanVideoPipeline.check_inputs' own rule: multiples of 16
        return math.lcm(16, self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size)

    # The clip's latents as WanPipeline's and HunyuanVideoPipeline's prepare_latents both draw them: [C, F', H/f, W/f]
    # float32 (F' = (F - 1) / temporal factor + 1), the transformer's input cast from them.
    latent_frames = WanAdapter.latent_frames
    latent_shape = WanAdapter.latent_shape
    latent_dtype = WanAdapter.latent_dtype

    def image_seq_len(self, height: int, width: int) -> int:
        config = self.pipe.transformer.config
        _, frames, h, w = self.latent_shape(height, width)
        return frames // config.patch_size_t * (h // config.patch_size) * (w // config.patch_size)

    # ------------------------------------------------------------------ prompts
    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(Llama embeddings [N, L, D] after the cropped template, CLIP pooled [N, P]) from ``pipe.encode_prompt``;
        each prompt's attention mask [L] is kept in ``_masks``."""
        embeds, pooled, mask = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        for prompt, row in zip(prompts, mask, strict=True):
            self._masks[prompt] = row.long()
        return embeds, pooled

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_negative: bool = False) -> PromptEmbeds:
        """As the base class, with the Llama attention masks (``mask`` / ``negative_mask``)."""
        embeds = super().encode_prompts(prompts, with_negative=with_negative)
        mask = torch.stack([self._masks[p] for p in prompts])
        if not with_negative:
            return replace(embeds, mask=mask)
        negative = self._masks[self.negative_prompt].expand(len(prompts), -1)
        return replace(embeds, mask=mask, negative_mask=negative)

    def clear_prompt_cache(self) -> None:
        super().clear_prompt_cache()
        self._masks.clear()

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
        """``pipe()``'s prediction: the transformer with the embedded guidance ``guidance_scale · 1000``; with
        ``true_cfg_scale > 1`` a second forward on the negative prompt, ``neg + s·(cond − neg)``."""
        batch = latents.shape[0]
        timestep = self._timestep(sigma, batch, timestep).to(latents.dtype)  # as pipe(): t in the latents' dtype
        guidance = torch.full((batch,), guidance_scale, dtype=self.dtype, device=latents.device) * 1000.0
        cond = self._forward(latents, timestep, guidance, embeds.prompt_embeds, embeds.mask, embeds.pooled)
        if not self.needs_negative(guidance_scale):
            return cond
        if embeds.negative_embeds is None:
            raise ValueError("true_cfg_scale > 1 needs negative embeddings (encode_prompts with_negative=True)")
        negative = embeds.negative_embeds, embeds.negative_mask, embeds.negative_pooled
        uncond = self._forward(latents, timestep, guidance, *negative)
        return uncond + self.true_cfg_scale * (cond - uncond)

    needs_negative = FluxAdapter.needs_negative  # true CFG, whatever the embedded guidance's scale

    def _forward(
        self, latents: Tensor, timestep: Tensor, guidance: Tensor, text: Tensor, mask: Tensor | None, pooled: Tensor
    ) -> Tensor:
        if mask is None:
            raise ValueError(
                "hunyuanvideo: the prompt embeddings carry no attention mask: build them with encode_prompts"
            )
        dtype = self.dtype  # as pipe(): latents, embeddings, mask and pooled embedding in the transformer's dtype
        return self.transformer(
            hidden_states=latents.to(dtype),
            timestep=timestep,
            encoder_hidden_states=text.to(dtype),
            encoder_attention_mask=mask.to(dtype),
            pooled_projections=pooled.to(dtype),
            guidance=guidance,
            return_dict=False,
        )[0]

    # ------------------------------------------------------------------ schedule and decoding
    def schedule(
        self, num_steps: int, height: int, width: int, *, time_shift: float | None = None
    ) -> tuple[Tensor, Tensor]:
        """As ``pipe(num_inference_steps=num_steps)``: ``sigmas = np.linspace(1, 0, T + 1)[:-1]`` given to the
        scheduler's ``set_timesteps``, which shifts them (static shift) and appends 0."""
        if time_shift is not None:
            return super().schedule(num_steps, height, width, time_shift=time_shift)
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.check_size(height, width)
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device=self.device)
        return scheduler.sigmas.to(torch.float32), scheduler.timesteps

    def _latents_to_vae(self, latents: Tensor, height: int, width: int) -> Tensor:
        return latents  # already [B, C, F', h, w]

    @torch.no_grad()
    def decode(self, latents: Tensor, height: int, width: int) -> Tensor:
        """Latents → clips ``[B, F, 3, H, W]`` in [0, 1], as ``pipe(output_type="pt").frames``: cast to the VAE's
        dtype, divided by its scaling factor, decoded, postprocessed by the pipeline's video processor."""
        latents = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        video = self.vae.decode(latents, return_dict=False)[0]
        return self.pipe.video_processor.postprocess_video(video, output_type="pt").float()


SPEC = register_family(
    FamilySpec(
        name="hunyuanvideo",
        # text-to-video; HunyuanVideoImageToVideoPipeline / HunyuanSkyreelsImageToVideoPipeline /
        # HunyuanVideoFramepackPipeline and HunyuanVideo 1.5 take other inputs: refused by make_adapter
        pipelines=("HunyuanVideoPipeline",),
        transformer="HunyuanVideoTransformer3DModel",
        adapter=HunyuanVideoAdapter,
        tiny="flowgrpo.tiny:hunyuanvideo_components",  # its own AutoencoderKLHunyuanVideo only (no -taesd)
        video=True,
    )
)
