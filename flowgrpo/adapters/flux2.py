"""FLUX.2 adapters: ``Flux2Pipeline`` (FLUX.2 [dev], family ``flux2``) and ``Flux2KleinPipeline`` (FLUX.2 [klein],
family ``flux2-klein``), text-to-image. Everything follows the pipelines' ``__call__`` in diffusers 0.42
(``pipelines/flux2/pipeline_flux2.py``, ``pipeline_flux2_klein.py``) step by step:

- Text. [dev]: Mistral-Small-3.1 (``Mistral3ForConditionalGeneration``) on the chat ``[SYSTEM_PROMPT]`` FLUX.2's
  system message ``[/SYSTEM_PROMPT][INST]`` prompt ``[/INST]``, hidden states of layers (10, 20, 30); [klein]: Qwen3 on
  its chat template (``add_generation_prompt``, ``enable_thinking=False``), layers (9, 18, 27). Both pad every prompt to
  ``max_sequence_length`` (512), feed the padding too (no mask reaches the transformer), and stack the three layers
  per token: ``[B, L, 3 · width]``. No pooled embedding. ``pipe.encode_prompt`` does it here.
- Latents. ``[B, (H/2f)(W/2f), 4C]``: the VAE's latents in 2x2 patches (``_patchify_latents``), packed row-major
  (``_pack_latents``); ``pipe(latents=...)`` takes them unpacked ``[B, 4C, H/2f, W/2f]`` (the packing is a reshape).
- Positions. 4-D ids ``(t, h, w, l)``: ``(0, row, column, 0)`` per image token (``_prepare_latent_ids``) and
  ``(0, 0, 0, i)`` per text token (``_prepare_text_ids``). The image ids are cached per (rows, columns) of the token
  grid, read from the rows' ``PromptEmbeds.image_size``: a token count alone does not tell 32x48 from 48x32.
- Schedule. ``sigmas = linspace(1, 1/T, T)`` with the scheduler's dynamic shift at ``mu = compute_empirical_mu(image
  tokens, T)`` (FLUX.2's empirical fit of mu to the token count and the step count, not FLUX.1's ``calculate_shift``).
- Guidance. [dev]: the guidance embedding (``guidance_scale``, no second forward). [klein]: true CFG
  ``neg + s · (cond − neg)`` with the empty negative prompt when ``guidance_scale > 1`` and the checkpoint is not
  step-distilled (``is_distilled: false``, the "base" checkpoints); a distilled one (FLUX.2-klein-4B / -9B) ignores
  ``guidance_scale``, as pipe() does. ``model.negative_prompt`` replaces the empty prompt (pipe() takes it as
  ``negative_prompt_embeds``); a family without CFG refuses one.
- Decoding. Unpack by the position ids (``_unpack_latents_with_ids``), undo the VAE's BatchNorm normalisation
  (``x · sqrt(running_var + eps) + running_mean``, per patchified channel), unpatchify, decode.

Not supported: the reference images FLUX.2 can condition on (``pipe(image=...)``) and the prompt upsampling of [dev]
(``caption_upsample_temperature``); the Klein inpainting and KV-cache pipelines are other classes, refused.

LoRA targets, from diffusers' DreamBooth LoRA trainers (``examples/dreambooth/``, huggingface/diffusers):
``train_dreambooth_lora_flux2.py`` @04c6304 (FLUX.2 [dev]) trains ``["to_k", "to_q", "to_v", "to_out.0"]``, the
double-stream blocks' attention; ``train_dreambooth_lora_flux2_klein.py`` @027e8ee adds the single-stream blocks' fused
``to_qkv_mlp_proj`` and their ``attn.to_out`` (``single_transformer_blocks.{i}.attn.to_out`` for i < 24, named one by
one because a bare ``to_out`` also matches the double-stream blocks' ``to_out`` ModuleList, which peft cannot wrap).
Here ``attn.to_out`` stands for those, whatever the depth: :meth:`Flux2Adapter.lora_exclude` takes the double-stream
ModuleLists out of every target list.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..checks import ConfigError
from .base import PipelineAdapter, PromptEmbeds
from .registry import FamilySpec, register_family


class Flux2Adapter(PipelineAdapter):
    """``Flux2Pipeline`` (FLUX.2 [dev]): guidance-distilled, ``guidance_scale`` goes into the guidance embedding."""

    family = "flux2"
    uses_cfg = False
    default_lora_targets = ("to_k", "to_q", "to_v", "to_out.0")  # train_dreambooth_lora_flux2.py's default

    def __init__(self, pipe: Any, *, negative_prompt: str = "", max_sequence_length: int = 512) -> None:
        super().__init__(pipe, negative_prompt=negative_prompt)
        if max_sequence_length < 1:
            raise ValueError(f"{self.family}: max_sequence_length must be >= 1, got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length  # pipe()'s default: 512
        # (rows, columns, device) of the packed token grid -> its [rows · columns, 4] ids; (length, device) -> text ids
        self._grid_ids: dict[tuple[int, int, torch.device], Tensor] = {}
        self._text_ids: dict[tuple[int, torch.device], Tensor] = {}
        self._check_negative_prompt()

    def _check_negative_prompt(self) -> None:
        if not self.uses_cfg and self.negative_prompt:
            raise ConfigError(
                f"model.negative_prompt={self.negative_prompt!r}: {type(self.pipe).__name__} here samples without a "
                "negative prompt (FLUX.2 [dev]: the guidance embedding; a step-distilled [klein]: no guidance), so it "
                "would never be used; remove model.negative_prompt"
            )

    @staticmethod
    def lora_exclude(transformer: torch.nn.Module) -> list[str]:
        """The double-stream blocks' ``attn.to_out``: a ModuleList (the Linear, a Dropout) that peft cannot wrap, so
        that a target ``attn.to_out`` reaches exactly the single-stream blocks' output projections (Linears), as
        diffusers' Klein trainer names them. Their ``to_out.0`` Linears stay targetable."""
        return [f"transformer_blocks.{i}.attn.to_out" for i in range(len(transformer.transformer_blocks))]

    # ------------------------------------------------------------------ sizes
    @property
    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # 2x2 patches on top of the VAE factor

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """``(tokens, 4C)``: one image's packed latents (``prepare_latents`` after ``_pack_latents``)."""
        self.check_size(height, width)
        m = self.size_multiple
        return ((height // m) * (width // m), self.pipe.transformer.config.in_channels)

    def image_seq_len(self, height: int, width: int) -> int:
        return self.latent_shape(height, width)[0]

    # ------------------------------------------------------------------ prompts
    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(embeddings [N, max_sequence_length, 3 · width], an empty [N, 0]: no pooled embedding, so
        :meth:`encode_prompts` gives ``pooled`` None), from ``pipe.encode_prompt`` (chat template, padding, the three
        hidden layers)."""
        embeds, _ = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return embeds, embeds.new_zeros(len(prompts), 0)

    # ------------------------------------------------------------------ positions
    def _ids_for(self, rows: int, cols: int) -> Tensor:
        """The pipeline's image ids ``[rows · cols, 4]``, ``(0, row, column, 0)`` row-major, cached per grid."""
        key = (rows, cols, self.device)
        if key not in self._grid_ids:
            grid = torch.empty(1, 1, rows, cols)  # only its shape is read
            self._grid_ids[key] = self.pipe._prepare_latent_ids(grid)[0].to(self.device)
        return self._grid_ids[key]

    def _text_ids_for(self, text: Tensor) -> Tensor:
        """The pipeline's text ids ``[L, 4]``, ``(0, 0, 0, i)``, cached per length."""
        key = (text.shape[1], self.device)
        if key not in self._text_ids:
            self._text_ids[key] = self.pipe._prepare_text_ids(text[:1])[0].to(self.device)
        return self._text_ids[key]

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
        """``pipe()``'s prediction: the conditional forward and, when the family guides by CFG
        (:meth:`needs_negative`), the negative prompt's, ``neg + s · (cond − neg)``."""
        batch = latents.shape[0]
        # As the pipelines: the timestep in the latents' dtype, then scaled to [0, 1].
        timestep = self._timestep(sigma, batch, timestep).to(latents.dtype) / 1000
        image_ids = self._ids_for(*self._packed_grid(latents.shape[1], embeds))
        guidance = self._guidance(guidance_scale, batch, latents.device)
        cond = self._forward(latents, image_ids, timestep, guidance, embeds.prompt_embeds)
        if not self.needs_negative(guidance_scale):
            return cond
        if embeds.negative_embeds is None:
            raise ValueError("guidance_scale > 1 needs negative embeddings (encode_prompts with_negative=True)")
        uncond = self._forward(latents, image_ids, timestep, guidance, embeds.negative_embeds)
        return uncond + guidance_scale * (cond - uncond)

    def _guidance(self, guidance_scale: float, batch: int, device: torch.device) -> Tensor | None:
        """[dev]: ``guidance_scale`` per sample, float32, for the guidance embedding (pipe() passes it whatever the
        transformer's ``guidance_embeds``; without an embedder the transformer ignores it)."""
        return torch.full([1], guidance_scale, device=device, dtype=torch.float32).expand(batch)

    def _forward(
        self, latents: Tensor, image_ids: Tensor, timestep: Tensor, guidance: Tensor | None, text: Tensor
    ) -> Tensor:
        return self.transformer(
            hidden_states=latents.to(self.dtype),
            timestep=timestep,
            guidance=guidance,
            encoder_hidden_states=text,
            txt_ids=self._text_ids_for(text),
            img_ids=image_ids,
            return_dict=False,
        )[0]

    # ------------------------------------------------------------------ schedule and decoding
    def schedule(
        self, num_steps: int, height: int, width: int, *, time_shift: float | None = None
    ) -> tuple[Tensor, Tensor]:
        """As ``pipe(num_inference_steps=num_steps)``: ``sigmas = linspace(1, 1/T, T)`` (none with
        ``use_flow_sigmas``), the scheduler's shift at ``mu = compute_empirical_mu(image_seq_len, T)``."""
        if time_shift is not None:
            return super().schedule(num_steps, height, width, time_shift=time_shift)
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu  # imported on use: heavy

        mu = compute_empirical_mu(image_seq_len=self.image_seq_len(height, width), num_steps=num_steps)
        scheduler = copy.deepcopy(self.scheduler)
        if scheduler.config.get("use_flow_sigmas", False):
            scheduler.set_timesteps(num_steps, device=self.device, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device=self.device, mu=mu)
        return scheduler.sigmas.to(torch.float32), scheduler.timesteps

    def _latents_to_vae(self, latents: Tensor, height: int, width: int) -> Tensor:
        """Packed latents -> the VAE's ``[B, C, H/f, W/f]``: scattered by the position ids, the BatchNorm
        normalisation undone (in the VAE's dtype), unpatchified, as the pipelines before ``vae.decode``."""
        m = self.size_multiple
        ids = self._ids_for(height // m, width // m)
        latents = self.pipe._unpack_latents_with_ids(latents, ids.expand(latents.shape[0], -1, -1))
        latents = latents.to(self.vae.dtype)
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(
            latents.device, latents.dtype
        )
        return self.pipe._unpatchify_latents(latents * std + mean)

    @torch.no_grad()
    def decode(self, latents: Tensor, height: int, width: int) -> Tensor:
        """Latents -> float images ``[B, 3, H, W]`` in [0, 1], as ``pipe(output_type="pt")``."""
        image = self.vae.decode(self._latents_to_vae(latents, height, width), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()


class Flux2KleinAdapter(Flux2Adapter):
    """``Flux2KleinPipeline`` (FLUX.2 [klein]): no guidance embedding; true CFG with the negative prompt (pipe():
    the empty prompt) when ``guidance_scale > 1``, unless the checkpoint is step-distilled (``is_distilled``)."""

    family = "flux2-klein"
    uses_cfg = True  # per instance: False for a step-distilled checkpoint
    # train_dreambooth_lora_flux2_klein.py's default: double-stream attention, the single-stream blocks' fused
    # QKV+MLP input and their output projection (attn.to_out: see lora_exclude).
    default_lora_targets = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj", "attn.to_out")

    def __init__(self, pipe: Any, *, negative_prompt: str = "", max_sequence_length: int = 512) -> None:
        # Flux2KleinPipeline.do_classifier_free_guidance: guidance_scale > 1 and not is_distilled
        self.uses_cfg = not bool(pipe.config.get("is_distilled", False))
        super().__init__(pipe, negative_prompt=negative_prompt, max_sequence_length=max_sequence_length)

    def _guidance(self, guidance_scale: float, batch: int, device: torch.device) -> None:
        return None  # pipe() passes guidance=None: Klein has no guidance embedding


SPEC = register_family(
    FamilySpec(
        name="flux2",
        pipelines=("Flux2Pipeline",),  # FLUX.2 [dev] text-to-image
        transformer="Flux2Transformer2DModel",
        adapter=Flux2Adapter,
        tiny="flowgrpo.tiny:flux2_components",  # its own AutoencoderKLFlux2 only (no -taesd)
    )
)
KLEIN_SPEC = register_family(
    FamilySpec(
        name="flux2-klein",
        pipelines=("Flux2KleinPipeline",),  # the inpainting and KV-cache Klein pipelines: other inputs, refused
        transformer="Flux2Transformer2DModel",
        adapter=Flux2KleinAdapter,
        tiny="flowgrpo.tiny:flux2_klein_components",
    )
)
