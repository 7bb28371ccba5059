"""LTX-2 adapter (``LTX2Pipeline``, family ``ltx2``): text-to-video, whose transformer denoises a video and its
soundtrack together. Everything follows ``LTX2Pipeline.__call__`` in diffusers 0.42 (``pipelines/ltx2/``) step by step:

- Audio. The transformer is one audio-visual model: in every block the video tokens attend to the audio tokens
  (``audio_to_video_attn``) and the other way round, and ``pipe()`` always denoises both, so the video it makes
  depends on the audio noise and on every audio step. A video-only rollout cannot equal ``pipe()`` (leaving the audio
  stream out is not an input the transformer takes, and ``isolate_modalities`` is modality guidance's perturbed
  forward, not the sampling one). The adapter's latents therefore hold both streams, ``[B, S_v + S_a, C]``: the
  packed video tokens then the packed audio tokens, both in the transformer's normalised token layout (refused when
  the two token widths differ; they are 128 and 128 in LTX-2). Rollouts, the SDE's log-probabilities and the policy
  ratio cover the joint sample, as the model is a policy over both; :meth:`decode` returns the video only (the audio
  VAE and vocoder are never run, so no reward can hear the audio). Audio-only outputs and audio rewards: not supported.
- Text. Gemma-3 with every hidden state stacked (``pipe.encode_prompt``: left padding to ``max_sequence_length``,
  1024 as ``pipe()``), then ``pipe.connectors``: the video and the audio text embeddings and the connector's mask,
  cached per prompt. ``PromptEmbeds.prompt_embeds`` carries ``[video | audio]`` along the feature axis, ``mask`` the
  connector's mask (as ``encoder_attention_mask`` and ``audio_encoder_attention_mask``).
- Latents. Video ``[B, C, F', H/s, W/s]`` patchified into ``[B, F'·(H/sp)·(W/sp), C·p_t·p²]`` (``_pack_latents``;
  ``F' = (num_frames − 1) / t + 1``, t = 8 and s = 32 for LTX-2's VAE); audio ``[B, C_a, L_a, M']`` packed
  ``[B, L_a, C_a·M']`` with ``L_a = round(num_frames / frame_rate · sample_rate / hop / 4)``. Float32 throughout, as
  ``pipe()`` keeps them; ``pipe(latents=...)`` takes the video part packed (3-D, used as is) and ``audio_latents`` the
  audio part (which it normalises by the audio VAE's statistics first).
- Schedule. ``sigmas = linspace(1, 1/T, T)`` shifted at ``mu = calculate_shift(video tokens, ...)`` with the scheduler's
  base / max sequence lengths and shifts (FLUX's rule; the video tokens alone count). The network is fed
  ``t = 1000 σ`` as both ``timestep`` and ``sigma`` (LTX-2.3's prompt modulation reads the latter), with
  ``use_cross_timestep=True`` (``pipe()``'s default), the positions at ``fps = frame_rate``.
- Velocity and guidance. The transformer predicts ``v ≈ ε − x0``; ``pipe()`` guides in x0-space: ``x0 = x − σ v`` of
  the conditional and negative forwards (one batched forward, negative rows first), ``x0_c + (s − 1)(x0_c − x0_u)``,
  then back to ``v = (x − x0) / σ``; without guidance the same round trip. The adapter does exactly that, for both
  streams with one scale (CFG with the empty negative prompt when ``guidance_scale > 1``).
- Decoding. Unpack the video tokens, denormalise by the VAE's ``latents_mean`` / ``latents_std`` / ``scaling_factor``,
  decode at ``decode_timestep`` 0 (``pipe()``'s default; a timestep-conditioned VAE gets t = 0 and no noise), and
  postprocess: clips ``[B, F, 3, H, W]`` in [0, 1] as ``pipe(output_type="pt").frames``.

Deviation: ``pipe()``'s defaults add what the adapter does not run: spatio-temporal guidance (``stg_scale`` 1 at
block 28) and modality isolation guidance (``modality_scale`` 3), a forward each per step, the guidance rescale (0.7)
and a separate audio guidance scale (7). A noise-free rollout equals ``pipe(..., guidance_scale=s,
audio_guidance_scale=s, stg_scale=0, audio_stg_scale=0, modality_scale=1, audio_modality_scale=1, guidance_rescale=0,
audio_guidance_rescale=0)`` (tested to 1e-5; 0.0 measured on a CPU). Not supported: prompt enhancement, the duration
head (``num_frames`` is always given), image conditioning (``LTX2ImageToVideoPipeline`` and the other LTX-2 pipelines
are other classes, refused).

LoRA targets: Lightricks' LTX-2 trainer (``packages/ltx-trainer/docs/configuration-reference.md``, Lightricks/LTX-2
@ec11c16, "Recommended configurations ... For video-only training"): ``attn1`` / ``attn2`` ``to_k``, ``to_q``, ``to_v``,
``to_out.0``, the video self- and text cross-attention of every block (the rewards here score the video only). Its
audio-video recipe (bare ``to_k`` ... ``to_out.0``, matching the audio and cross-modal attention too) is one
``model.lora.target_modules`` away.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..checks import check_num_frames
from .base import PipelineAdapter, PromptEmbeds
from .registry import FamilySpec, register_family

# The LTX-2 trainer's video-only recipe: video self-attention (attn1) and text cross-attention (attn2).
VIDEO_ATTENTION = tuple(f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_k", "to_q", "to_v", "to_out.0"))


class LTX2Adapter(PipelineAdapter):
    """``LTX2Pipeline`` (LTX-2 text-to-video, its soundtrack sampled alongside). ``num_frames`` (``t·k + 1``, the VAE's
    temporal factor t) and ``frame_rate`` (the positions' fps and the audio length) are fixed per adapter."""

    family = "ltx2"
    uses_cfg = True
    schedule_family = "flux"  # linspace(1, 1/T, T) shifted at calculate_shift(video tokens)
    default_lora_targets = VIDEO_ATTENTION

    def __init__(
        self,
        pipe: Any,
        *,
        negative_prompt: str = "",
        max_sequence_length: int = 1024,
        num_frames: int = 121,
        frame_rate: float = 24.0,
    ) -> None:
        super().__init__(pipe, negative_prompt=negative_prompt)
        if max_sequence_length < 1:
            raise ValueError(f"ltx2: max_sequence_length must be >= 1, got {max_sequence_length}")
        if not frame_rate > 0:
            raise ValueError(f"ltx2: frame_rate must be > 0, got {frame_rate}")
        self.max_sequence_length = max_sequence_length  # pipe()'s default: 1024 Gemma tokens
        self.temporal_factor = int(pipe.vae_temporal_compression_ratio)
        check_num_frames(num_frames, self.temporal_factor, key="model.num_frames")
        self.num_frames = num_frames
        self.frame_rate = float(frame_rate)
        config = pipe.transformer.config
        self.patch, self.patch_t = int(config.patch_size), int(config.patch_size_t)
        if (self.patch, self.patch_t) != (1, 1):  # LTX-2's releases: 1 and 1, the only case tested against pipe()
            raise ValueError(
                f"ltx2: a transformer with patch_size={self.patch}, patch_size_t={self.patch_t} is not supported (the "
                "released LTX-2 checkpoints use 1 and 1; the position grid for larger patches is not checked against "
                "pipe()); use an LTX-2 checkpoint with patch size 1"
            )
        video_width = int(config.in_channels) * self.patch_t * self.patch**2
        audio_width = int(pipe.audio_vae.config.latent_channels) * self.latent_mel_bins
        if video_width != audio_width:
            raise ValueError(
                f"ltx2: the adapter keeps the video and audio tokens in one latent tensor (the transformer denoises "
                f"both together, so the video equals pipe()'s only with its audio stream), but this checkpoint's video "
                f"tokens have {video_width} features and its audio tokens {audio_width} (LTX-2: 128 and 128); such a "
                "checkpoint is not supported"
            )

    # ------------------------------------------------------------------ sizes
    @property
    def size_multiple(self) -> int:
        # LTX2Pipeline.check_inputs' own rule (multiples of 32) and the VAE's factor × patch size
        return math.lcm(32, int(self.pipe.vae_spatial_compression_ratio) * self.patch)

    @property
    def latent_frames(self) -> int:
        """Latent frames of a clip: ``(num_frames − 1) / t + 1`` (``pipe()``'s ``latent_num_frames``)."""
        return (self.num_frames - 1) // self.temporal_factor + 1

    @property
    def latent_mel_bins(self) -> int:
        return int(self.pipe.audio_vae.config.mel_bins) // int(self.pipe.audio_vae_mel_compression_ratio)

    @property
    def audio_tokens(self) -> int:
        """``pipe()``'s ``audio_num_frames``: the clip's length in audio latents, ``round(F / fps · sr / hop / 4)``."""
        pipe = self.pipe
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return round(self.num_frames / self.frame_rate * per_second)

    def _grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(latent frames, rows, columns) of the video latents before patching."""
        self.check_size(height, width)
        s = int(self.pipe.vae_spatial_compression_ratio)
        return self.latent_frames, height // s, width // s

    def video_tokens(self, height: int, width: int) -> int:
        frames, rows, cols = self._grid(height, width)
        return (frames // self.patch_t) * (rows // self.patch) * (cols // self.patch)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """``(S_v + S_a, C)``: the packed video tokens, then the packed audio tokens."""
        return (self.video_tokens(height, width) + self.audio_tokens, int(self.pipe.transformer.config.in_channels))

    def image_seq_len(self, height: int, width: int) -> int:
        return self.video_tokens(height, width)  # pipe()'s mu: latents.shape[1], the packed video tokens

    def split(self, latents: Tensor) -> tuple[Tensor, Tensor]:
        """``(video tokens [B, S_v, C], audio tokens [B, S_a, C])`` of the joint latents."""
        return latents[:, : latents.shape[1] - self.audio_tokens], latents[:, latents.shape[1] - self.audio_tokens :]

    def video_latents(self, latents: Tensor, height: int, width: int) -> Tensor:
        """The video part unpacked, ``[B, C, F', H/s, W/s]``, still normalised (``pipe()``'s ``_unpack_latents``)."""
        frames, rows, cols = self._grid(height, width)
        video, _ = self.split(latents)
        p, p_t = self.patch, self.patch_t
        return self.pipe._unpack_latents(video, frames // p_t, rows // p, cols // p, p, p_t)

    # ------------------------------------------------------------------ prompts
    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(``[video | audio]`` connector embeddings ``[N, L, Dv + Da]``, the connector's mask ``[N, L]``) for unique
        prompts: Gemma-3's stacked hidden states (``pipe.encode_prompt``) through ``pipe.connectors``, as ``pipe()``."""
        embeds, mask, _, _ = self.pipe.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        padding_side = getattr(self.pipe.tokenizer, "padding_side", "left")
        video, audio, mask = self.pipe.connectors(embeds, mask, padding_side=padding_side)
        return torch.cat([video, audio], dim=-1), mask

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_negative: bool = False) -> PromptEmbeds:
        """As the base class, the connector's mask in ``mask`` / ``negative_mask`` (no pooled embedding)."""
        prompts = self._encode_missing(prompts, with_negative)
        embeds = torch.stack([self._cache[p][0] for p in prompts])
        mask = torch.stack([self._cache[p][1] for p in prompts])
        if not with_negative:
            return PromptEmbeds(embeds, mask=mask)
        negative, negative_mask = self._cache[self.negative_prompt]
        n = len(prompts)
        return PromptEmbeds(
            embeds,
            mask=mask,
            negative_embeds=negative.expand(n, *negative.shape),
            negative_mask=negative_mask.expand(n, *negative_mask.shape),
        )

    # ------------------------------------------------------------------ velocity
    def _video_size(self, latents: Tensor, embeds: PromptEmbeds) -> tuple[int, int]:
        """(height, width) in pixels of the rows' clips: their ``image_size``, else the square whose tokens fit."""
        if embeds.image_size is not None:
            size = embeds.image_size[0]
            if not bool((embeds.image_size == size).all()):
                raise ValueError(f"ltx2: a batch mixes sizes {embeds.image_size.unique(dim=0).tolist()}")
            return tuple(size.tolist())
        cells = (latents.shape[1] - self.audio_tokens) // (self.latent_frames // self.patch_t)
        side = math.isqrt(cells) * self.patch * int(self.pipe.vae_spatial_compression_ratio)
        if self.latent_shape(side, side)[0] != latents.shape[1]:
            raise ValueError(
                f"ltx2: {latents.shape[1]} latent tokens and no clip size to arrange them by: build the embeddings "
                "with encode_conditions(..., height=H, width=W) (as a rollout does)"
            )
        return side, side

    def velocity(
        self,
        latents: Tensor,
        sigma: Tensor | float,
        embeds: PromptEmbeds,
        guidance_scale: float,
        *,
        timestep: Tensor | None = None,
    ) -> Tensor:
        """``pipe()``'s guided velocity of both streams (module docstring): x0-space CFG, one batched forward."""
        batch = latents.shape[0]
        timestep = self._timestep(sigma, batch, timestep)
        height, width = self._video_size(latents, embeds)
        guided = self.needs_negative(guidance_scale)
        text, mask, hidden, t = embeds.prompt_embeds, embeds.mask, latents, timestep
        if guided:
            if embeds.negative_embeds is None:
                raise ValueError("guidance_scale > 1 needs negative embeddings (encode_prompts with_negative=True)")
            text = torch.cat([embeds.negative_embeds, text])
            mask = torch.cat([embeds.negative_mask, mask])
            hidden, t = torch.cat([latents, latents]), torch.cat([timestep, timestep])
        prediction = self._forward(hidden, t, text, mask, height, width)
        # pipe(): x0 = x − σ v per stream, guidance on the x0s, v = (x − x0) / σ (σ = 0: the x0s agree, v as is)
        sigmas = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).reshape(-1, 1, 1)
        x = latents.float()
        if guided:
            uncond, cond = prediction.chunk(2)
            cond_x0, uncond_x0 = x - cond * sigmas, x - uncond * sigmas
            x0 = cond_x0 + (guidance_scale - 1) * (cond_x0 - uncond_x0)
            direct = cond + (guidance_scale - 1) * (cond - uncond)
        else:
            x0, direct = x - prediction * sigmas, prediction
        return torch.where(sigmas > 0, (x - x0) / sigmas.clamp_min(1e-30), direct).to(latents.dtype)

    def _forward(self, hidden: Tensor, timestep: Tensor, text: Tensor, mask: Tensor, height: int, width: int) -> Tensor:
        """One transformer forward of both streams, as ``pipe()`` calls it; the prediction ``[B, S_v + S_a, C]``
        in float32 (``pipe()``'s ``.float()``)."""
        dtype = self.dtype
        frames, rows, cols = self._grid(height, width)
        video, audio = self.split(hidden)
        connectors = self.pipe.connectors.config  # the video embeddings' width: the first features of ``text``
        width_v = connectors.video_hidden_dim if connectors.per_modality_projections else connectors.caption_channels
        out_video, out_audio = self.transformer(
            hidden_states=video.to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=text[..., :width_v].to(dtype),
            audio_encoder_hidden_states=text[..., width_v:].to(dtype),
            timestep=timestep,
            sigma=timestep,  # pipe(): the same 1000·σ (LTX-2.3's prompt modulation)
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=frames // self.patch_t,
            height=rows // self.patch,
            width=cols // self.patch,
            fps=self.frame_rate,
            audio_num_frames=self.audio_tokens,
            isolate_modalities=False,
            use_cross_timestep=True,  # pipe()'s default
            return_dict=False,
        )
        return torch.cat([out_video.float(), out_audio.float()], dim=1)

    @property
    def latent_dtype(self) -> torch.dtype:
        """float32 whatever the model's dtype: ``pipe()`` draws and steps both streams in float32."""
        return torch.float32

    # ------------------------------------------------------------------ decoding
    def _latents_to_vae(self, latents: Tensor, height: int, width: int) -> Tensor:
        return self.video_latents(latents, height, width)

    @torch.no_grad()
    def decode(self, latents: Tensor, height: int, width: int) -> Tensor:
        """The video part → clips ``[B, F, 3, H, W]`` in [0, 1], as ``pipe(output_type="pt").frames`` (audio: never)."""
        pipe, vae = self.pipe, self.vae
        video = self.video_latents(latents, height, width).to(pipe.text_encoder.dtype)  # pipe(): prompt_embeds' dtype
        # decode_timestep 0 (pipe()'s default) also means decode_noise_scale 0: the latents as they are
        t = torch.zeros(len(video), device=video.device, dtype=video.dtype)
        t = t if vae.config.timestep_conditioning else None
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        frames = vae.decode(video.to(vae.dtype), t, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(frames, output_type="pt").float()


SPEC = register_family(
    FamilySpec(
        name="ltx2",
        pipelines=("LTX2Pipeline",),  # text-to-video; image-to-video, conditioning, IC-LoRA, HDR, DFR: other classes
        transformer="LTX2VideoTransformer3DModel",
        adapter=LTX2Adapter,
        tiny="flowgrpo.tiny:ltx2_components",
        video=True,
    )
)
