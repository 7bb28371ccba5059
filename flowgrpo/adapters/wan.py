"""Wan text-to-video adapter (``WanPipeline``): Wan2.1, Wan2.2's two experts (A14B) and Wan2.2's per-token timesteps
(TI2V-5B). UMT5 prompts zero-padded to ``max_sequence_length``, latents ``[C, F', H/8, W/8]`` with
``F' = (F - 1) / 4 + 1`` latent frames, CFG as two forwards, AutoencoderKLWan with per-channel latent statistics.
Follows ``diffusers.WanPipeline.__call__`` step by step.

Wan2.2 A14B: two experts. ``transformer`` denoises the high-noise steps, ``transformer_2`` the rest: a step whose
timestep ``t >= boundary_ratio · num_train_timesteps`` runs ``transformer`` with ``guidance_scale``, any other
``transformer_2`` with ``guidance_scale_2`` (None: ``guidance_scale``), exactly as ``pipe()`` picks them. The choice is
made per sample from the timestep the network is fed, in the rollout and in every re-scoring alike, so a step's
log-prob is always its own expert's (a micro-batch that mixes steps of both runs each expert on its rows). Both
experts form one module (:class:`WanExperts`) for LoRA, the optimizer, EMA, checkpoints and DDP; LoRA goes on both
(``lora_experts: both``) or on one (``high_noise``: ``transformer``, ``low_noise``: ``transformer_2``). Export writes
one diffusers LoRA file per expert: ``transformer``'s as ``pytorch_lora_weights.safetensors``, ``transformer_2``'s
as ``pytorch_lora_weights_transformer_2.safetensors``, loaded with ``load_lora_weights(...,
load_into_transformer_2=True)`` (diffusers' way for Wan2.2).

Wan2.2 TI2V-5B (``expand_timesteps``): its text-to-video mode feeds the transformer one timestep per latent token,
``(mask[:, ::2, ::2] · t).flatten()`` with a mask of ones, as ``pipe()`` does (the same t everywhere).

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
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..checks import ConfigError, check_num_frames, one_of
from .base import PipelineAdapter, PromptEmbeds, unwrap
from .registry import FamilySpec, register_family

EXPERTS = ("transformer", "transformer_2")  # Wan2.2's high- and low-noise experts, by their pipeline component names
# model.lora_experts -> the experts that get LoRA
LORA_EXPERTS = {"both": EXPERTS, "high_noise": ("transformer",), "low_noise": ("transformer_2",)}


class WanExperts(torch.nn.Module):
    """Wan2.2's two experts as one module: what LoRA, the optimizer, EMA, checkpoints (``transformer.<...>`` and
    ``transformer_2.<...>``, the pipeline's component names) and DDP see. The experts are the pipeline's own modules,
    so ``pipe()`` runs the same weights. :meth:`forward` runs each row on the expert it is told (the adapter picks
    it), both experts in one call when a batch straddles the boundary.

    It names no ``_no_split_modules``, so FSDP2's transformer-based wrapping shards it as one unit (gathered whole in
    each forward): per-block units would issue each expert's own collectives, and processes whose micro-batches sit on
    different experts (shuffled timesteps) would then run different ones. (Checked by hand, two CPU processes on the
    tiny model: without the tie below DDP fails, with per-block units FSDP2 does; DDP with one process's micro-batch
    across the boundary is tests/test_wan22_ddp.py.)

    Two consequences. The idle expert's tie gives its LoRA a gradient of exactly 0, not None, so in an update where
    no sample sat on that expert AdamW still moves its LoRA (weight decay, and the step from the moments of earlier
    updates), where a parameter without gradient would be skipped. With ``model.lora_experts: high_noise`` or
    ``low_noise``, the steps of the expert without LoRA are still sampled as SDE steps and re-scored in the loss (the
    window is not restricted to the adapted expert's steps): forwards that train nothing (their backward is the zero
    tie only); a window (``sampler.window``) on the adapted expert's steps avoids them."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module, *, lora: Sequence[str]) -> None:
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        unknown = set(lora) - set(EXPERTS)
        if not lora or unknown:
            raise ValueError(f"WanExperts: lora names experts among {EXPERTS}, got {list(lora)}")
        self.lora = tuple(lora)  # the experts that get LoRA (add_adapter)

    @property
    def experts(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        return self.transformer, self.transformer_2

    def _adapted(self) -> list[torch.nn.Module]:
        return [m for m in self.experts if getattr(m, "_hf_peft_config_loaded", False)]

    def forward(self, *, expert: Tensor, **inputs: Any) -> Tensor:
        """Each row ``i``'s prediction by ``experts[expert[i]]`` (``expert`` ``[B]``, :meth:`WanAdapter.expert_of`):
        a batch on one expert runs it whole, a batch across the boundary runs each expert on its own rows (every
        tensor input is split by rows) and puts the rows back in order. The split happens here, inside one call, so
        whatever wraps this module (DDP, FSDP, DeepSpeed) is entered once per forward whatever the split: DDP
        broadcasts the buffers (the rope tables) at every training forward, and a process entering it more often
        than another (its micro-batch across the boundary, the other's not) would pair its broadcasts with the
        other's collectives: a hang. With gradient, an expert that runs no row has its trainable weights tied in
        with weight exactly 0: every trainable parameter then takes part in every training forward (DDP's reducer
        expects each one, and a step on an expert without LoRA still has a graph to back up); the value is
        unchanged and their gradient is 0."""
        expert = torch.as_tensor(expert).reshape(-1)
        used = expert.unique().tolist()  # sorted
        if len(used) == 1:
            out = self.experts[used[0]](**inputs, return_dict=False)[0]
        else:
            rows = [torch.nonzero(expert == e).flatten() for e in used]
            parts = [self.experts[e](**_rows(inputs, r), return_dict=False)[0] for e, r in zip(used, rows, strict=True)]
            out = torch.cat(parts)[torch.cat(rows).argsort()]
        if torch.is_grad_enabled():
            idle = [p for e in (0, 1) if e not in used for p in self.experts[e].parameters() if p.requires_grad]
            if idle:
                out = out + (sum(p.sum() for p in idle) * 0.0).to(out.dtype)
        return out

    # what PipelineAdapter calls on the module it trains (diffusers' ModelMixin / PeftAdapterMixin), for both experts
    def add_adapter(self, config: Any) -> None:
        for name in self.lora:
            getattr(self, name).add_adapter(copy.deepcopy(config))  # peft may fill the config in: one each

    @property
    def peft_config(self) -> dict[str, Any]:
        """The LoRA config (both adapted experts have the same): what checkpoints store as adapter_config.json."""
        adapted = self._adapted()
        if not adapted:
            raise AttributeError("WanExperts: no expert has a LoRA adapter")
        return adapted[0].peft_config

    @property
    def _hf_peft_config_loaded(self) -> bool:
        return bool(self._adapted())

    def disable_adapters(self) -> None:
        for model in self._adapted():
            model.disable_adapters()

    def enable_adapters(self) -> None:
        for model in self._adapted():
            model.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for model in self.experts:
            model.enable_gradient_checkpointing()

    def enable_xformers_memory_efficient_attention(self) -> None:
        for model in self.experts:
            model.enable_xformers_memory_efficient_attention()

    def compile(self, **options: Any) -> None:
        for model in self.experts:  # each expert's forward, as for one transformer (this module only dispatches)
            model.compile(**options)


class WanAdapter(PipelineAdapter):
    """``WanPipeline`` (Wan2.1 / Wan2.2 text-to-video). ``num_frames`` (``4k + 1``, the VAE's temporal factor 4) is
    fixed per adapter; ``guidance_scale > 1``: CFG with ``negative_prompt`` (Flow-GRPO: ``""``, the pipeline's default).
    Wan2.2's two experts: ``guidance_scale_2`` (``model.guidance_scale_2``) guides the low-noise expert's steps
    (None: ``guidance_scale``, as ``pipe()``), ``lora_experts`` (``model.lora_experts``: ``both`` | ``high_noise`` |
    ``low_noise``) says which get LoRA; with one, the other's steps train nothing (their gradient is 0) but are still
    sampled and re-scored (:class:`WanExperts`)."""

    family = "wan"
    uses_cfg = True
    schedule_family = "sd3"  # FlowMatchEulerDiscreteScheduler: a static shift, set as SD3's pipe() sets it
    # Flow-GRPO's train_wan2_1.py targets to_q / to_k / to_v / to_out.0 (+ add_*_proj / to_add_out, which the
    # text-to-video transformer does not have): the self- and cross-attention projections of every block.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    lora_components = EXPERTS  # Wan2.2's transformer_2 where the pipeline has one

    def __init__(
        self,
        pipe: Any,
        *,
        negative_prompt: str = "",
        max_sequence_length: int = 512,
        num_frames: int = 81,
        guidance_scale_2: float | None = None,
        lora_experts: str = "both",
    ) -> None:
        super().__init__(pipe, negative_prompt=negative_prompt)
        self.boundary_ratio = check_experts(pipe, guidance_scale_2, lora_experts, self.family)
        self.guidance_scale_2 = guidance_scale_2
        self.lora_experts = lora_experts
        self.transformer = self.lora_model(pipe.components, lora_experts=lora_experts)
        if max_sequence_length < 1:
            raise ValueError(f"wan: max_sequence_length must be >= 1, got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length  # pipe()'s default and Flow-GRPO's: 512 UMT5 tokens
        self.temporal_factor = int(pipe.vae_scale_factor_temporal)
        check_num_frames(num_frames, self.temporal_factor, key="num_frames")
        self.num_frames = num_frames
        self._network_timesteps: dict[float, float] = {}  # sigma -> the scheduler's own timestep (UniPC: integers)

    @classmethod
    def lora_model(cls, components: Mapping[str, Any], **options: Any) -> torch.nn.Module:
        """The transformer, or with Wan2.2's ``transformer_2`` both experts as one :class:`WanExperts` whose LoRA goes
        where ``lora_experts`` says."""
        if components.get("transformer_2") is None:
            return components["transformer"]
        lora = LORA_EXPERTS[options.get("lora_experts", "both")]
        return WanExperts(components["transformer"], components["transformer_2"], lora=lora)

    @classmethod
    def split_lora(cls, weights: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
        """:class:`WanExperts`' weights (``transformer.<...>`` / ``transformer_2.<...>``) by expert, without the
        prefix; a single transformer's are all ``transformer``'s."""
        if not weights or not all(key.split(".", 1)[0] in EXPERTS for key in weights):
            return super().split_lora(weights)
        parts: dict[str, dict[str, Tensor]] = {}
        for key, value in weights.items():
            expert, _, name = key.partition(".")
            parts.setdefault(expert, {})[name] = value
        return parts

    @property
    def experts(self) -> int:
        """1 (Wan2.1, TI2V-5B) or 2 (Wan2.2 A14B: ``transformer`` and ``transformer_2``)."""
        return 2 if isinstance(unwrap(self.transformer), WanExperts) else 1

    def expert_of(self, timestep: Tensor) -> Tensor:
        """``[B]`` long: 0 where ``pipe()`` runs ``transformer`` (``t >= boundary_ratio · num_train_timesteps``, or
        always with one expert), 1 where it runs ``transformer_2``; ``timestep`` ``[B]`` is what the network is fed."""
        if self.boundary_ratio is None:
            return torch.zeros(timestep.shape, dtype=torch.long, device=timestep.device)
        boundary = self.boundary_ratio * self.scheduler.config.num_train_timesteps  # pipe()'s boundary_timestep
        return (timestep < boundary).long()

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
        forward, ``uncond + s · (cond − uncond)``; each sample on the expert ``pipe()`` runs at its timestep
        (:meth:`expert_of`), the low-noise one guided by ``guidance_scale_2`` when set. One call of the transformer
        per forward (conditional, negative) whatever the experts: :class:`WanExperts` splits the rows itself."""
        timestep = self._timestep(sigma, latents.shape[0], timestep)
        expert = self.expert_of(timestep)
        cond = self._forward(latents, timestep, embeds.prompt_embeds, embeds, expert)
        if not self.needs_negative(guidance_scale):  # pipe(): CFG on both experts iff guidance_scale > 1
            return cond
        if embeds.negative_embeds is None:
            raise ValueError("guidance_scale > 1 needs negative embeddings (encode_prompts with_negative=True)")
        uncond = self._forward(latents, timestep, embeds.negative_embeds, embeds, expert)
        low = expert == 1
        scale_2 = guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
        if scale_2 == guidance_scale or not bool(low.any()):
            return uncond + guidance_scale * (cond - uncond)
        if bool(low.all()):
            return uncond + scale_2 * (cond - uncond)
        # a micro-batch across the boundary: each row with its expert's scale (pipe()'s expression, per row)
        low = low.view(-1, *[1] * (cond.ndim - 1))
        return torch.where(low, uncond + scale_2 * (cond - uncond), uncond + guidance_scale * (cond - uncond))

    def _model_inputs(self, latents: Tensor, embeds: PromptEmbeds) -> tuple[Tensor, dict[str, Tensor]]:
        """The transformer's ``hidden_states`` and any inputs besides the text and timestep (image-to-video's)."""
        return latents, {}

    def _forward(self, latents: Tensor, timestep: Tensor, text: Tensor, embeds: PromptEmbeds, expert: Tensor) -> Tensor:
        """One forward through ``self.transformer`` (once, whatever the experts: see :meth:`WanExperts.forward`)."""
        dtype = self.dtype  # as pipe(): latents and prompt embeddings in the transformer's dtype
        hidden, extra = self._model_inputs(latents, embeds)
        inputs = {
            "hidden_states": hidden.to(dtype),
            "timestep": self._token_timesteps(timestep, latents),
            "encoder_hidden_states": text.to(dtype),
            **{k: v.to(dtype) for k, v in extra.items()},
        }
        if self.experts == 1:
            return self.transformer(**inputs, return_dict=False)[0]
        return self.transformer(expert=expert, **inputs)

    def _token_timesteps(self, timestep: Tensor, latents: Tensor) -> Tensor:
        """``expand_timesteps`` (TI2V-5B): ``[B, F' · ⌈h/2⌉ · ⌈w/2⌉]``, each sample's t on every token, as ``pipe()``
        builds ``(mask[0][0][:, ::2, ::2] * t).flatten()``; else ``[B]`` as it is."""
        if not self.pipe.config.get("expand_timesteps"):
            return timestep
        frames, h, w = latents.shape[-3:]
        return timestep[:, None].expand(-1, frames * ((h + 1) // 2) * ((w + 1) // 2))

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


def _rows(inputs: Mapping[str, Any], rows: Tensor) -> dict[str, Any]:
    """The transformer's keyword inputs of those rows: every tensor is batch-first (hidden states, timesteps, text and
    image embeddings)."""
    return {k: v[rows] if isinstance(v, Tensor) else v for k, v in inputs.items()}


def check_experts(pipe: Any, guidance_scale_2: float | None, lora_experts: str, family: str) -> float | None:
    """The pipeline's ``boundary_ratio`` (None: one transformer), after refusing what ``pipe()`` cannot run or never
    runs: Wan2.2's ``transformer_2`` without a boundary (``pipe()`` would ignore it) or the other way round, no
    ``transformer``, and the two-expert options (``model.guidance_scale_2``, ``model.lora_experts``) on one expert."""
    boundary = pipe.config.get("boundary_ratio")
    second = getattr(pipe, "transformer_2", None)
    if pipe.transformer is None:
        raise ValueError(
            f"{family}: this pipeline has no transformer (the high-noise expert that pipe() runs first); load it whole"
        )
    if second is not None and boundary is None:
        raise ValueError(
            f"{family}: this pipeline has a transformer_2 but no boundary_ratio, so pipe() never runs it (every step "
            "is transformer's); set the pipeline's boundary_ratio (Wan2.2 A14B: 0.875 text-to-video, 0.9 "
            "image-to-video) or leave transformer_2 out"
        )
    if second is None and boundary is not None:
        raise ValueError(
            f"{family}: boundary_ratio={boundary} switches the steps below it to Wan2.2's low-noise expert, but this "
            "pipeline has no transformer_2; load it with its transformer_2, or drop boundary_ratio"
        )
    one_of("model.lora_experts", lora_experts, tuple(LORA_EXPERTS))
    if second is None and lora_experts != "both":
        raise ConfigError(
            f"model.lora_experts={lora_experts} picks one of Wan2.2's two experts, but this pipeline has one "
            "transformer: remove model.lora_experts"
        )
    if second is None and guidance_scale_2 is not None:
        raise ConfigError(
            f"model.guidance_scale_2={guidance_scale_2} guides Wan2.2's low-noise expert, but this pipeline has one "
            "transformer (no boundary_ratio; pipe() refuses it too): remove model.guidance_scale_2"
        )
    return boundary


SPEC = register_family(
    FamilySpec(
        name="wan",
        pipelines=("WanPipeline",),  # Wan2.1 / Wan2.2 text-to-video; image-to-video: wan-i2v; VACE, video-to-video: no
        transformer="WanTransformer3DModel",
        adapter=WanAdapter,
        tiny="flowgrpo.tiny:wan_components",  # its own AutoencoderKLWan only (no -taesd)
        video=True,
    )
)
