"""Z-Image adapter (``ZImagePipeline``: Z-Image, Z-Image-Turbo): a Qwen3 text encoder read through its chat template
(second-to-last hidden state, each prompt at its own length), a single-stream transformer fed lists of ``[C, 1, h, w]``
latents and of caption embeddings, CFG as ``pos + g · (pos − neg)``, the FLUX AutoencoderKL with its scaling and shift
factors. Everything follows ``diffusers.ZImagePipeline.__call__`` (diffusers 0.42) step by step:

- prompts: ``pipe._encode_prompt`` itself (``apply_chat_template(..., add_generation_prompt=True,
  enable_thinking=True)``, padded to ``max_sequence_length`` for the encoder, ``hidden_states[-2]``, the padding
  dropped), cached per prompt at its own length; a batch is zero-padded with a mask (as Qwen-Image's) and the
  transformer gets each row cut back to its length, the per-sample list ``pipe()`` gives it;
- latents: ``[C, H/8, W/8]`` float32 (``prepare_latents``), cast to the transformer's dtype for its input only;
- time: the scheduler's ``t = 1000 σ`` enters the transformer as ``(1000 − t) / 1000`` (0 at noise, 1 at the image),
  and its output points the other way: ``pipe()`` steps with ``−output``, so :meth:`velocity` returns ``−output`` (the
  ``d x / d σ`` the samplers integrate, as the other adapters' velocities);
- schedule: ``sigmas = torch.linspace(1, 1/T, T)`` (``get_default_z_image_sigmas``, float32: not FLUX's float64
  ``np.linspace``, which differs in the last bit) and ``mu = calculate_shift(image_seq_len)``, which the hub's
  schedulers ignore (``use_dynamic_shifting: false``; static shift 3 for Z-Image-Turbo, 6 for Z-Image);
- decoding: ``latents / scaling_factor + shift_factor`` in the VAE's dtype.

Guidance. This project's ``guidance_scale`` ``w`` is the usual CFG scale (``w = 1``: the conditional prediction
alone; ``neg + w · (pos − neg)``), the convention every family shares (the objectives' conditional branch is
``guidance_scale=1``). ``ZImagePipeline`` counts from 0 instead: its ``guidance_scale`` is ``g = w − 1``
(``pos + g · (pos − neg)``, CFG on when ``g > 0``). So ``pipe(guidance_scale=g)`` is ``w = g + 1`` here: Z-Image-Turbo's
``guidance_scale=0.0`` is ``w = 1`` (any ``w ≤ 1`` runs no CFG, as ``pipe()`` at 0), Z-Image's 4.0 is ``w = 5``. With
CFG, the conditional and the negative rows go through the transformer in one batch, as ``pipe()`` runs them.
``pipe()``'s ``cfg_normalization`` (the guided prediction's norm capped at that multiple of the conditional one's, per
sample; False: off) and ``cfg_truncation`` (no CFG at steps whose ``(1000 − t) / 1000`` exceeds it; 1.0: never) are
the adapter's options of the same names, with ``pipe()``'s defaults (no ``model.*`` key sets them yet). A batch whose
rows have different sigmas (shuffled timesteps) with some rows past ``cfg_truncation`` runs the batched CFG forward
and uses the conditional output for those rows (``pipe()`` would run them without the negative rows: equal in exact
arithmetic).

LoRA targets: the attention projections and the SwiGLU feed-forward of every ``ZImageTransformerBlock`` (the main
blocks and both refiners), the targets of Flow-Factory's Z-Image adapter (X-GenGroup/Flow-Factory
``src/flow_factory/models/z_image/z_image.py`` ``default_target_modules``, its GRPO presets' ``target_modules:
default``) and of DiffSynth-Studio's Z-Image LoRA recipe (modelscope/DiffSynth-Studio
``examples/z_image/model_training/lora/Z-Image.sh``: ``to_q,to_k,to_v,to_out.0,w1,w2,w3``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from .base import PipelineAdapter, PromptEmbeds
from .qwenimage import QwenImageAdapter
from .registry import FamilySpec, register_family


class ZImageAdapter(PipelineAdapter):
    """``ZImagePipeline`` (text-to-image). ``guidance_scale > 1``: CFG with ``negative_prompt`` (``pipe()``'s default
    ``""``) at ``pipe(guidance_scale=guidance_scale - 1)``; see the module docstring."""

    family = "zimage"
    uses_cfg = True
    default_lora_targets = (
        "attention.to_q",
        "attention.to_k",
        "attention.to_v",
        "attention.to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )

    def __init__(
        self,
        pipe: Any,
        *,
        negative_prompt: str = "",
        max_sequence_length: int = 512,
        cfg_normalization: float = 0.0,
        cfg_truncation: float | None = 1.0,
    ) -> None:
        super().__init__(pipe, negative_prompt=negative_prompt)
        config = pipe.transformer.config
        if 2 not in config.all_patch_size or 1 not in config.all_f_patch_size:
            raise ValueError(
                f"zimage: ZImagePipeline runs the transformer at patch size 2 (frame patch 1), but this one has "
                f"all_patch_size={tuple(config.all_patch_size)}, all_f_patch_size={tuple(config.all_f_patch_size)}"
            )
        if max_sequence_length < 1:
            raise ValueError(f"zimage: max_sequence_length must be >= 1, got {max_sequence_length}")
        if float(cfg_normalization) < 0:
            raise ValueError(f"zimage: cfg_normalization must be >= 0 (0 or False: off), got {cfg_normalization}")
        self.max_sequence_length = max_sequence_length  # pipe()'s default: 512 tokens, chat template included
        self.cfg_normalization = float(cfg_normalization)
        self.cfg_truncation = cfg_truncation

    # ------------------------------------------------------------------ sizes
    @property
    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # patch 2 on top of the VAE factor (pipe()'s own check)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """``(C, H / f, W / f)``: one image's latents as ``prepare_latents`` draws them."""
        self.check_size(height, width)
        f = self.pipe.vae_scale_factor
        return (self.pipe.transformer.config.in_channels, height // f, width // f)

    def image_seq_len(self, height: int, width: int) -> int:
        _, h, w = self.latent_shape(height, width)
        return (h // 2) * (w // 2)

    @property
    def latent_dtype(self) -> torch.dtype:
        """float32 whatever the model's dtype, as ``pipe()`` keeps its latents and steps (only the transformer's input
        is cast)."""
        return torch.float32

    # ------------------------------------------------------------------ prompts
    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(embeddings [N, L, D] zero-padded to the longest, lengths [N]) from ``pipe._encode_prompt`` (chat template,
        ``hidden_states[-2]``, ``max_sequence_length``, the padding dropped)."""
        # _encode_prompt writes the templated prompts into the list it is given: hand it a copy.
        rows = self.pipe._encode_prompt(list(prompts), device=self.device, max_sequence_length=self.max_sequence_length)
        lengths = torch.tensor([row.shape[0] for row in rows], dtype=torch.long)
        return pad_sequence(rows, batch_first=True), lengths

    # Each prompt cached at its own length, a batch zero-padded with masks: Qwen-Image's handling, reused as is.
    encode_prompts = QwenImageAdapter.encode_prompts
    _cached = QwenImageAdapter._cached

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
        """``pipe()``'s step direction ``−output`` (float32): the conditional forward, or with ``guidance_scale > 1``
        the conditional and negative rows in one forward, ``pos + (w − 1)(pos − neg)`` per sample
        (``cfg_normalization`` and ``cfg_truncation`` as ``pipe()``)."""
        batch = latents.shape[0]
        # As ZImagePipeline: t = σ · 1000 (the scheduler's float32 timestep) enters as (1000 − t) / 1000.
        t = (1000 - self._timestep(sigma, batch, timestep)) / 1000
        cond = _rows(embeds.prompt_embeds, embeds.mask)
        scales = self._guidance(guidance_scale, t)
        if not any(scales):
            return -self._forward(latents, t, cond).squeeze(2)
        if embeds.negative_embeds is None:
            raise ValueError("guidance_scale > 1 needs negative embeddings (encode_prompts with_negative=True)")
        negative = _rows(embeds.negative_embeds, embeds.negative_mask)
        out = self._forward(torch.cat([latents, latents]), torch.cat([t, t]), cond + negative)
        guided = [self._guided(out[i], out[batch + i], scales[i]) for i in range(batch)]
        return -torch.stack(guided).squeeze(2)

    def _guidance(self, guidance_scale: float, t: Tensor) -> list[float]:
        """Each row's ``pipe()`` guidance ``g = w − 1``, 0 where CFG is off: ``w ≤ 1``, or the row's
        ``(1000 − t) / 1000`` above ``cfg_truncation`` (compared in float64, as ``pipe()`` compares Python floats)."""
        if not self.needs_negative(guidance_scale):
            return [0.0] * t.shape[0]
        g = guidance_scale - 1.0
        truncation = self.cfg_truncation
        if truncation is None or float(truncation) > 1:
            return [g] * t.shape[0]
        return [0.0 if value > float(truncation) else g for value in t.double().tolist()]

    def _guided(self, pos: Tensor, neg: Tensor, g: float) -> Tensor:
        """One sample's CFG as ``pipe()``: ``pos + g (pos − neg)``, its norm capped at ``cfg_normalization · |pos|``.
        ``g = 0`` (a row past ``cfg_truncation``): ``pos``, as ``pipe()`` runs such a step without CFG."""
        if g == 0:
            return pos
        pred = pos + g * (pos - neg)
        if self.cfg_normalization > 0:
            max_norm = torch.linalg.vector_norm(pos) * self.cfg_normalization
            norm = torch.linalg.vector_norm(pred)
            if norm > max_norm:
                pred = pred * (max_norm / norm)
        return pred

    def _forward(self, latents: Tensor, t: Tensor, text: list[Tensor]) -> Tensor:
        """The transformer on ``[B, C, h, w]`` latents: ``pipe()``'s per-sample lists in, ``[B, C, 1, h, w]`` float32
        out (the model's own sign)."""
        hidden = list(latents.to(self.dtype).unsqueeze(2).unbind(dim=0))
        out = self.transformer(hidden, t, text, return_dict=False)[0]
        return torch.stack([sample.float() for sample in out])

    # ------------------------------------------------------------------ schedule and decoding
    def schedule(
        self, num_steps: int, height: int, width: int, *, time_shift: float | None = None
    ) -> tuple[Tensor, Tensor]:
        """As ``pipe(num_inference_steps=num_steps)``: ``get_default_z_image_sigmas`` and ``mu`` from the image's token
        count, given to the scheduler's ``set_timesteps`` (which applies its own shift, static or dynamic)."""
        if time_shift is not None:
            return super().schedule(num_steps, height, width, time_shift=time_shift)
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        from diffusers.pipelines.z_image.pipeline_z_image import (  # imported on use: heavy
            calculate_shift,
            get_default_z_image_sigmas,
        )

        config = self.scheduler.config
        mu = calculate_shift(
            self.image_seq_len(height, width),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(num_steps), device=self.device, mu=mu)
        return scheduler.sigmas.to(torch.float32), scheduler.timesteps

    def _latents_to_vae(self, latents: Tensor, height: int, width: int) -> Tensor:
        return latents  # already [B, C, h, w]

    @torch.no_grad()
    def decode(self, latents: Tensor, height: int, width: int) -> Tensor:
        """Latents → float images ``[B, 3, H, W]`` in [0, 1], as ``pipe(output_type="pt")``: cast to the VAE's dtype
        first, then ``latents / scaling_factor + shift_factor``."""
        latents = latents.to(self.vae.dtype)
        latents = (latents / self.vae.config.scaling_factor) + self.vae.config.shift_factor
        image = self.vae.decode(latents, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()


def _rows(embeds: Tensor, mask: Tensor | None) -> list[Tensor]:
    """A padded ``[B, L, D]`` batch as ``pipe()`` hands the transformer its captions: one ``[L_i, D]`` tensor a row."""
    if mask is None:
        return list(embeds.unbind(dim=0))
    return [row[: int(length)] for row, length in zip(embeds, mask.sum(dim=1).tolist(), strict=True)]


SPEC = register_family(
    FamilySpec(
        name="zimage",
        pipelines=("ZImagePipeline",),  # text-to-image; img2img / inpaint / ControlNet / Omni: their own inputs
        transformer="ZImageTransformer2DModel",
        adapter=ZImageAdapter,
        tiny="flowgrpo.tiny:zimage_components",  # its AutoencoderKL only (no -taesd)
    )
)
