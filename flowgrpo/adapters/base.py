"""One interface to drive any flow-matching diffusers pipeline: encode, predict velocity, schedule, decode.

An adapter owns the pipeline's components; the trainer and rollout only call this interface, so they
hold no model-specific branches. Subclasses (SD3, FLUX) fill in the family-specific parts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import torch
from PIL import Image
from torch import Tensor

from samplers import pipeline_schedule, static_shift_schedule


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch, one row per image (rows of the same prompt share storage).

    prompt_embeds:   [B, L, D] token embeddings fed as ``encoder_hidden_states``
    pooled:          [B, P]    pooled embeddings fed as ``pooled_projections`` (None: the family has none, Qwen-Image)
    negative_embeds / negative_pooled: the empty prompt's, for classifier-free guidance (SD3), or None
    mask / negative_mask: [B, L] 1 for a real token, 0 for padding, for families whose prompts vary in length
                     (Qwen-Image; each batch is zero-padded to its longest prompt), or None: every token is real
    source_latents:  [B, S, C] editing only: each row's source image in the transformer's token layout (FLUX.1-Kontext:
                     packed VAE latents, appended to the image sequence), or None (text-to-image)
    source_images:   [B, 3, h, w] editing only: the source images as the model sees them, float in [0, 1] on the CPU
                     (what rewards get as ``source_images``), or None
    source_embeds:   [B, N, D] editing only: an image encoder's features of each row's source image, fed beside the text
                     (Wan2.1 image-to-video: CLIP's penultimate hidden states), or None
    image_size:      [B, 2] long on the CPU: (height, width) in pixels of the image each row is generated at, set by
                     :meth:`PipelineAdapter.encode_conditions` (every rollout), or None. A packed token sequence
                     (FLUX, Qwen-Image) does not say whether it is 32x48 or 48x32 tokens: its positions come from here
    """

    prompt_embeds: Tensor
    pooled: Tensor | None = None
    negative_embeds: Tensor | None = None
    negative_pooled: Tensor | None = None
    mask: Tensor | None = None
    negative_mask: Tensor | None = None
    source_latents: Tensor | None = None
    source_images: Tensor | None = None
    source_embeds: Tensor | None = None
    image_size: Tensor | None = None

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def select(self, index: Tensor | slice | Sequence[int]) -> PromptEmbeds:
        """Rows ``index`` (a micro-batch) of every field."""
        if not isinstance(index, slice | Tensor):
            index = torch.as_tensor(list(index), dtype=torch.long)
        return replace(self, **{f.name: _take(getattr(self, f.name), index) for f in fields(self)})

    @staticmethod
    def cat(parts: Sequence[PromptEmbeds]) -> PromptEmbeds:
        """The rows of several batches; masked token fields of different lengths are zero-padded to the longest."""
        values = {}
        for f in fields(PromptEmbeds):
            items = [getattr(p, f.name) for p in parts]
            if any(v is None for v in items):
                values[f.name] = None
                continue
            length = max(v.shape[1] for v in items) if f.name in _TOKEN_FIELDS else None
            if length is not None and any(v.shape[1] != length for v in items):
                if any(getattr(p, _MASK_OF[f.name]) is None for p in parts):
                    raise ValueError(f"PromptEmbeds.cat: {f.name} of different lengths needs a mask to be padded")
                items = [torch.nn.functional.pad(v, (0, 0) * (v.ndim - 2) + (0, length - v.shape[1])) for v in items]
            values[f.name] = torch.cat(items)
        return PromptEmbeds(**values)


# Token fields ([B, L, ...]) and the mask that says which of their positions are padding.
_MASK_OF = {
    "prompt_embeds": "mask",
    "mask": "mask",
    "negative_embeds": "negative_mask",
    "negative_mask": "negative_mask",
}
_TOKEN_FIELDS = frozenset(_MASK_OF)


def _take(value: Tensor | None, index: Any) -> Tensor | None:
    if value is None:
        return None
    if isinstance(index, Tensor):
        index = index.to(value.device)
    return value[index]


def image_size_rows(rows: int, height: int, width: int) -> Tensor:
    """``PromptEmbeds.image_size`` of ``rows`` rows generated at ``height`` x ``width``: ``[rows, 2]`` long."""
    return torch.tensor([[height, width]], dtype=torch.long).expand(rows, 2)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare module under DDP / DeepSpeed / FSDP / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


class PipelineAdapter:
    """Family-independent part of an adapter. Subclasses set the class attributes and the abstract methods.

    ``transformer`` may be replaced by a wrapped module (``accelerator.prepare``); forwards go through it,
    while adapter switching and parameter queries use the unwrapped module.
    """

    family: ClassVar[str]
    default_lora_targets: ClassVar[tuple[str, ...]]
    uses_cfg: ClassVar[bool]  # classifier-free guidance with a negative prompt (SD3), or not (FLUX)
    edits: ClassVar[bool] = False  # takes a source image per prompt (FLUX.1-Kontext); see encode_conditions
    max_sources: ClassVar[int | None] = 1  # editing: source images per prompt it takes (None: any number, Edit-Plus)
    schedule_family: ClassVar[str | None] = None  # how pipe() sets its sigmas (samplers.pipeline_schedule): "sd3" |
    # "flux"; None: the family's own name
    # After a reset of the KL's reference (grpo.kl.reset_every, flowgrpo.objectives.reference): the snapshot of the
    # trainable weights the reference forwards swap in (an OldWeights), else None: the adapter-disabled model.
    reference_snapshot: Any = None

    # The pipeline components the trained module is made of (:meth:`lora_model`; export builds them weightless).
    lora_components: ClassVar[tuple[str, ...]] = ("transformer",)

    def __init__(self, pipe: Any, *, negative_prompt: str = "") -> None:
        self.pipe = pipe
        self.transformer: torch.nn.Module = pipe.transformer
        self.vae = pipe.vae
        self.scheduler = pipe.scheduler
        self.negative_prompt = negative_prompt
        self._cache: dict[str, tuple[Tensor, Tensor]] = {}
        self.text_encoder_calls = 0  # batched encode calls, for tests and logs
        self._source_cache: dict[tuple[str, int, int], tuple[Tensor, Tensor]] = {}  # (image, h, w) -> (pixels, latents)
        self.source_encoder_calls = 0  # batched source-image encode calls (editing)

    # ------------------------------------------------------------------ family-specific
    @classmethod
    def lora_model(cls, components: Mapping[str, Any], **options: Any) -> torch.nn.Module:
        """The module LoRA is added to, whose parameter names checkpoints use: the pipeline's transformer.
        ``components``: the pipeline's (``pipe.components``) or weightless ones built from their configs (export's
        shape check); ``options``: the adapter's constructor options (``model.*`` family options)."""
        return components["transformer"]

    @classmethod
    def split_lora(cls, weights: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
        """A checkpoint's LoRA weights by the pipeline component diffusers' ``load_lora_weights`` loads them into,
        under the names that component gives them: all the transformer's."""
        return {"transformer": weights}

    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(token embeddings [N, L, D], pooled [N, P]) for unique prompts, one batched text-encoder pass."""
        raise NotImplementedError

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Shape of one sample's latents in the layout the transformer consumes."""
        raise NotImplementedError

    def image_seq_len(self, height: int, width: int) -> int:
        raise NotImplementedError

    def velocity(
        self,
        latents: Tensor,
        sigma: Tensor | float,
        embeds: PromptEmbeds,
        guidance_scale: float,
        *,
        timestep: Tensor | None = None,
    ) -> Tensor:
        """Predicted velocity ``v ≈ eps - x0`` in the latents' layout and dtype.

        ``timestep`` (scalar or per-sample ``[B]``, on the ``num_train_timesteps`` scale): what the network is fed
        instead of ``sigma · num_train_timesteps``, e.g. MixGRPO's / DanceGRPO's ``int(1000 σ)``.
        """
        raise NotImplementedError

    def _latents_to_vae(self, latents: Tensor, height: int, width: int) -> Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    @property
    def device(self) -> torch.device:
        return next(unwrap(self.transformer).parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(unwrap(self.transformer).parameters()).dtype

    @property
    def latent_dtype(self) -> torch.dtype:
        """The dtype latents are integrated in, as the family's ``pipe()`` keeps them (the model's by default)."""
        return self.dtype

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this (VAE downsampling × patching)."""
        raise NotImplementedError

    def check_size(self, height: int, width: int) -> None:
        m = self.size_multiple
        if height <= 0 or width <= 0 or height % m or width % m:
            raise ValueError(
                f"{self.family}: height and width must be positive multiples of {m} "
                f"(VAE factor × patch size), got {height}x{width}; try {max(m, height // m * m)}x"
                f"{max(m, width // m * m)}"
            )

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], *, with_negative: bool = False) -> PromptEmbeds:
        """Embeddings for ``prompts`` (one row each), encoding each unique prompt once and caching it.

        ``with_negative`` adds the empty/negative prompt's embeddings (encoded once) for CFG. A family without a
        pooled embedding (its ``_encode`` returns an empty ``[N, 0]``) gets ``pooled`` / ``negative_pooled`` None.
        """
        prompts = self._encode_missing(prompts, with_negative)
        embeds = torch.stack([self._cache[p][0] for p in prompts])
        pooled = torch.stack([self._cache[p][1] for p in prompts])
        if pooled.shape[-1] == 0:
            pooled = None
        if not with_negative:
            return PromptEmbeds(embeds, pooled)
        neg_embeds, neg_pooled = self._cache[self.negative_prompt]
        n = len(prompts)
        neg_pooled = None if pooled is None else neg_pooled.expand(n, *neg_pooled.shape)
        return PromptEmbeds(embeds, pooled, neg_embeds.expand(n, *neg_embeds.shape), neg_pooled)

    def _encode_missing(self, prompts: Sequence[str], with_negative: bool) -> list[str]:
        """Check ``prompts`` and fill the cache: one batched ``_encode`` of those (and of the negative prompt, with
        ``with_negative``) not encoded yet. Returns ``prompts`` as a list."""
        prompts = list(prompts)
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt, got an empty list")
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be strings")
        wanted = list(dict.fromkeys(prompts + ([self.negative_prompt] if with_negative else [])))
        missing = [p for p in wanted if p not in self._cache]
        if missing:
            self.text_encoder_calls += 1
            embeds, pooled = self._encode(missing)
            for i, prompt in enumerate(missing):
                self._cache[prompt] = (embeds[i], pooled[i])
        return prompts

    # ------------------------------------------------------------------ editing: a source image per prompt
    def encode_conditions(
        self,
        prompts: Sequence[str],
        *,
        with_negative: bool = False,
        sources: Sequence[Any] | None = None,
        height: int | None = None,
        width: int | None = None,
    ) -> PromptEmbeds:
        """Everything a rollout conditions on: :meth:`encode_prompts`, and for editing each prompt's source image
        (``sources``: file paths or PIL images, one per prompt) as ``source_latents`` / ``source_images``.

        ``height`` / ``width`` given: the rows' ``image_size`` too (the generated image's token grid).
        A family whose text encoder also reads the image (Qwen-Image-Edit) overrides this method."""
        embeds = self.encode_prompts(prompts, with_negative=with_negative)
        if height is not None and width is not None:
            embeds = replace(embeds, image_size=image_size_rows(len(embeds), height, width))
        if sources is None:
            return embeds
        if len(sources) != len(embeds):
            raise ValueError(f"{len(sources)} source images for {len(embeds)} prompts: give one per prompt")
        if height is None or width is None:
            raise ValueError("source images are prepared for the generated size: pass height and width")
        images, latents = self.encode_sources(sources, height, width)
        return replace(embeds, source_latents=latents, source_images=images)

    @torch.no_grad()
    def encode_sources(self, sources: Sequence[Any], height: int, width: int) -> tuple[Tensor, Tensor]:
        """``(images [B, 3, h, w] in [0, 1] on the CPU, latents [B, S, C])`` of each prompt's source image. Each
        unique image is loaded and encoded once per size, in one batch, and cached until :meth:`clear_prompt_cache`
        (like the prompts)."""
        from ..images import image_key, open_image

        if not self.edits:
            raise ValueError(
                f"{self.family} generates from text alone, but the prompts come with source images (an editing "
                'prompt file): use an editing pipeline (FLUX.1-Kontext), or prompts without an "image" field'
            )
        self.check_size(height, width)
        several = next((s for s in sources if isinstance(s, list | tuple)), None)
        if several is not None:
            raise ValueError(
                f"{self.family} takes one source image per prompt, got a list of {len(several)}: give one image per "
                "prompt, or use a model that reads several (qwenimage-edit-plus)"
            )
        keys = [(image_key(s), height, width) for s in sources]
        missing = {k: s for k, s in zip(keys, sources, strict=True) if k not in self._source_cache}
        if missing:
            self.source_encoder_calls += 1
            pixels = torch.cat([self._prepare_source(open_image(s), height, width) for s in missing.values()])
            latents = self._encode_sources(pixels)
            for i, key in enumerate(missing):
                self._source_cache[key] = (((pixels[i].float() + 1) / 2).clamp(0, 1).cpu(), latents[i])
        rows = [self._source_cache[k] for k in keys]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def _prepare_source(self, image: Any, height: int, width: int) -> Tensor:
        """An RGB PIL source image as the model takes it: ``[1, 3, h, w]`` in [-1, 1]. Default: resized to the
        generated size, ``width`` x ``height`` as PIL orders it, bicubic (Flow-GRPO's ``ref_image.resize((resolution,
        resolution))`` at its square sizes), then the pipeline's own image processor (scaling to [-1, 1])."""
        if image.size != (width, height):
            image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
        return self.pipe.image_processor.preprocess(image, height, width)

    def _encode_sources(self, pixels: Tensor) -> Tensor:
        """Source images ``[N, 3, h, w]`` in [-1, 1] -> ``[N, S, C]`` tokens in the transformer's layout."""
        raise NotImplementedError(f"{self.family} takes no source images")

    def _packed_grid(self, length: int, embeds: PromptEmbeds) -> tuple[int, int]:
        """``(rows, columns)`` of the generated image's ``length`` packed tokens (FLUX, Qwen-Image): from the rows'
        ``image_size``, since a token count alone does not tell 32x48 from 48x32; without it (embeddings from
        :meth:`encode_prompts`) a square grid."""
        if embeds.image_size is None:
            side = math.isqrt(length)
            if side * side != length:
                raise ValueError(
                    f"{self.family}: {length} latent tokens and no image size to arrange them by: build the "
                    "embeddings with encode_conditions(..., height=H, width=W) (as a rollout does)"
                )
            return side, side
        size = embeds.image_size[0]
        if not bool((embeds.image_size == size).all()):
            raise ValueError(f"{self.family}: a batch mixes image sizes {embeds.image_size.unique(dim=0).tolist()}")
        height, width = size.tolist()
        rows, cols = height // self.size_multiple, width // self.size_multiple
        if rows * cols != length:
            raise ValueError(f"{self.family}: {length} latent tokens, but a {height}x{width} image has {rows * cols}")
        return rows, cols

    def needs_negative(self, guidance_scale: float) -> bool:
        """Whether ``velocity`` at this guidance scale uses the negative prompt's embeddings."""
        return self.uses_cfg and guidance_scale > 1

    def clear_prompt_cache(self) -> None:
        self._cache.clear()
        self._source_cache.clear()

    def schedule(
        self, num_steps: int, height: int, width: int, *, time_shift: float | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(sigmas [T + 1], timesteps [T])`` exactly as ``pipe(num_inference_steps=num_steps)`` sets them.

        ``time_shift`` given: MixGRPO's / DanceGRPO's static shifted schedule instead
        (:func:`samplers.static_shift_schedule`, the same for every resolution and family).
        """
        self.check_size(height, width)
        if time_shift is not None:
            return static_shift_schedule(num_steps, time_shift, device=self.device)
        sigmas, timesteps = pipeline_schedule(
            self.scheduler,
            num_steps,
            family=self.schedule_family or self.family,
            image_seq_len=self.image_seq_len(height, width),
            device=self.device,
        )
        return sigmas, timesteps

    def _timestep(self, sigma: Tensor | float, batch: int, timestep: Tensor | None = None) -> Tensor:
        if timestep is not None:  # given by the caller (see velocity)
            timestep = torch.as_tensor(timestep, dtype=torch.float32, device=self.device)
            if timestep.ndim == 1 and timestep.shape[0] != batch:
                raise ValueError(f"per-sample timestep has {timestep.shape[0]} entries for a batch of {batch}")
            return timestep.expand(batch)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device)
        if sigma.ndim == 1 and sigma.shape[0] != batch:
            raise ValueError(f"per-sample sigma has {sigma.shape[0]} entries for a batch of {batch}")
        # Same float32 product the scheduler uses for its timesteps (sigmas * num_train_timesteps).
        return (sigma * self.scheduler.config.num_train_timesteps).expand(batch)

    def initial_noise(
        self,
        batch_size: int,
        height: int,
        width: int,
        *,
        generator: torch.Generator | None = None,
        group_ids: Tensor | Sequence[int] | None = None,
        same_within_group: bool = False,
        noise_seed: int = 0,
    ) -> Tensor:
        """``N(0, I)`` latents ``[B, *latent_shape]``.

        same_within_group: every image of a group gets the same draw, seeded by ``(noise_seed, group id)`` so
        that copies of a group in other batches or on other processes match too.
        """
        self.check_size(height, width)
        shape = self.latent_shape(height, width)
        if same_within_group:
            if group_ids is None:
                raise ValueError("same_within_group needs group_ids")
            ids = torch.as_tensor(list(group_ids) if not isinstance(group_ids, Tensor) else group_ids)
            if ids.shape != (batch_size,):
                raise ValueError(f"group_ids must have shape ({batch_size},), got {tuple(ids.shape)}")
            draws = {}
            for group in ids.unique().tolist():
                group_generator = torch.Generator().manual_seed(noise_seed * 1_000_003 + int(group))
                draws[group] = torch.randn(shape, generator=group_generator, dtype=torch.float32)
            noise = torch.stack([draws[g] for g in ids.tolist()])
        else:
            device = generator.device if generator is not None else self.device
            noise = torch.randn((batch_size, *shape), generator=generator, device=device, dtype=torch.float32)
        return noise.to(device=self.device, dtype=self.latent_dtype)

    @torch.no_grad()
    def decode(self, latents: Tensor, height: int, width: int) -> Tensor:
        """Latents → float images ``[B, 3, H, W]`` in [0, 1], as ``pipe(output_type="pt")``."""
        latents = self._latents_to_vae(latents, height, width)
        latents = latents / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
        image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()

    # ------------------------------------------------------------------ LoRA and training switches
    def add_lora(
        self,
        rank: int = 32,
        alpha: float = 64,
        target_modules: str | Sequence[str] = "default",
        init: str | bool = "gaussian",
        dropout: float = 0.0,
    ) -> None:
        """Attach a peft LoRA adapter to the transformer; only adapter parameters will require grad."""
        from peft import LoraConfig

        if rank < 1:
            raise ValueError(f"lora rank must be >= 1, got {rank}")
        targets = list(self.default_lora_targets if target_modules == "default" else target_modules)
        model = unwrap(self.transformer)
        model.requires_grad_(False)
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            init_lora_weights=init,
            target_modules=targets,
            lora_dropout=dropout,
            exclude_modules=self.lora_exclude(model) or None,
        )
        try:
            model.add_adapter(config)
        except ValueError as err:
            message = f"lora.target_modules {targets} do not match the {self.family} transformer: {err}"
            raise ValueError(message) from None
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)
            if param.requires_grad:  # LoRA weights train in float32 even when the base runs in bf16/fp16
                param.data = param.data.float()

    @staticmethod
    def lora_exclude(transformer: torch.nn.Module) -> list[str]:
        """Modules of ``transformer`` that get no LoRA whatever the targets: layers whose output never reaches the
        prediction (their LoRA weights would get no gradient, and DDP refuses unused parameters). Default: none."""
        return []

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in unwrap(self.transformer).parameters() if p.requires_grad]

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The reference model for the KL: the same transformer with its LoRA adapter switched off."""
        model = unwrap(self.transformer)
        if not getattr(model, "_hf_peft_config_loaded", False):
            yield
            return
        model.disable_adapters()
        try:
            yield
        finally:
            model.enable_adapters()

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The reference model (the KL term's; dpo's, dgpo's and gdro's): the adapter-disabled transformer, or after a
        reset of the reference the snapshot of the trainable weights (``reference_snapshot``) swapped in for the block.
        Its forwards run without DDP (:meth:`without_ddp`): a process may skip one (``grpo.kl.gate``)."""
        snapshot = self.reference_snapshot
        with self.without_ddp(), snapshot.swapped_in() if snapshot is not None else self.adapter_disabled():
            yield

    @contextlib.contextmanager
    def without_ddp(self) -> Iterator[None]:
        """Forwards through the module a DDP wrapper holds, for the forwards without gradient inside a loss (the
        reference's, the old weights'): they need nothing from DDP, whose forward broadcasts the module's buffers
        (``broadcast_buffers``; SD3's ``pos_embed``) from rank 0, a collective. Through the wrapper, a forward one
        process runs and another skips (the gated KL's, with no gated sample on one process) would pair that
        broadcast with another collective: a hang, or tensors summed into the wrong ones. Anything else stays as is:
        one process, and DeepSpeed and FSDP, whose forwards gather the parameters they shard."""
        from torch.nn.parallel import DistributedDataParallel

        wrapped = self.transformer
        if not isinstance(wrapped, DistributedDataParallel):
            yield
            return
        self.transformer = wrapped.module
        try:
            yield
        finally:
            self.transformer = wrapped

    @contextlib.contextmanager
    def unwrapped(self) -> Iterator[None]:
        """Forward through the bare transformer (rank-0-only work such as evaluation under DDP)."""
        wrapped = self.transformer
        self.transformer = unwrap(wrapped)
        try:
            yield
        finally:
            self.transformer = wrapped

    def enable_gradient_checkpointing(self) -> None:
        unwrap(self.transformer).enable_gradient_checkpointing()

    def compile(self, **options: Any) -> None:
        """``torch.compile`` the transformer in place (``nn.Module.compile``; ``model.compile``). Every forward through
        it runs compiled: the rollout's, the loss's re-evaluation and the KL reference's alike, so a re-evaluation on
        the rollout's batch reproduces its log-probs exactly (tested). The module, its parameter names (checkpoints)
        and the peft adapter switches stay as they are. Call it after LoRA and gradient checkpointing are set up and
        before ``accelerator.prepare``. ``options`` go to ``torch.compile`` (``backend``, ``mode``, ``dynamic``).

        Grad mode, train/eval mode and the adapter switch each get their own graph (three for a training run with KL,
        a fourth for evaluation), compiled on first use: minutes on a CPU, the first epoch's cost."""
        unwrap(self.transformer).compile(**options)

    def set_attention_backend(self, backend: str) -> None:
        """``sdpa`` (PyTorch's default kernels) or ``xformers`` (CUDA only)."""
        if backend == "sdpa":
            return
        if backend != "xformers":
            raise ValueError(f"model.attention must be 'sdpa' or 'xformers', got {backend!r}")
        if not torch.cuda.is_available() or self.device.type != "cuda":
            raise ValueError("model.attention=xformers needs a CUDA device; use model.attention=sdpa on CPU")
        try:
            unwrap(self.transformer).enable_xformers_memory_efficient_attention()
        except (ImportError, ModuleNotFoundError) as err:
            raise ValueError(f"model.attention=xformers needs `pip install -e .[xformers]`: {err}") from None
