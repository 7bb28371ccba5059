"""Evaluation in plain diffusers: an exported LoRA (``scripts/export.py``) loaded into the base pipeline by diffusers
itself (``StableDiffusion3Pipeline.from_pretrained`` + ``pipe.load_lora_weights``) and sampled with ``pipe(...)``.

    python scripts/evaluate.py --lora my-lora --config configs/shapes_best.yaml eval.samples_per_prompt=8

:func:`flowgrpo.evaluation.evaluate` takes a :class:`PlainPipeline` where it takes an adapter: the same fixed noise
per held-out line (drawn as the adapter draws it: ``N(0, I)`` float32 latents from the same generator), the same
rewards and the same summary keys, with no flowgrpo model code between the weights and the images. For an fp32 model
(the shapes model) the images equal the trainer's evaluation of the checkpoint within float tolerance, and so does the
summary (``tests/test_checkpoint.py``). A model whose config sets ``model.vae_fp32`` with another ``model.dtype`` (the
SD3.5 presets: bf16) is decoded by ``pipe(...)`` in the model's dtype, as plain diffusers does, where flowgrpo decodes
in fp32: its scores may differ slightly from the checkpoint's evaluation (:func:`dtype_note`). SD3-family
text-to-image models only (the shapes model, SD3.5), from a local directory or a hub id (not the in-code tiny builds).
:func:`check_plain` makes every refusal before the model's weights are read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from .adapters import family
from .checkpoint import CheckpointError
from .config import Config
from .data import PromptDataset
from .export import LORA_FILE, _empty_transformer, model_kind
from .pipelines import _DTYPE_KWARG, _absent_components, parse_dtype, read_model_index, resolve_source, tiny_sources

PLAIN_FAMILIES = ("sd3",)  # whose pipe(...) samples from given latents as the evaluation's ODE does (tested)


class PlainPipeline:
    """A diffusers pipeline as the evaluation samples it: :meth:`initial_noise` draws the adapter's noise,
    :meth:`images` runs ``pipe(...)`` from it."""

    def __init__(self, pipe: Any, *, negative_prompt: str = "", max_sequence_length: int | None = None) -> None:
        self.pipe = pipe
        self.negative_prompt = negative_prompt
        self.max_sequence_length = max_sequence_length
        pipe.set_progress_bar_config(disable=True)

    def initial_noise(
        self, batch_size: int, height: int, width: int, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """``N(0, I)`` float32 latents ``[B, C, H/f, W/f]``, drawn on the generator's device (as the adapter's)."""
        f = self.pipe.vae_scale_factor
        shape = (batch_size, self.pipe.transformer.config.in_channels, height // f, width // f)
        device = generator.device if generator is not None else "cpu"
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)

    @torch.no_grad()
    def images(
        self, prompts: list[str], latents: Tensor, *, height: int, width: int, num_steps: int, guidance_scale: float
    ) -> Tensor:
        """``pipe(prompts, latents=...)``'s images, float ``[B, 3, H, W]`` in [0, 1]."""
        options = {} if self.max_sequence_length is None else {"max_sequence_length": self.max_sequence_length}
        out = self.pipe(
            prompt=prompts,
            negative_prompt=self.negative_prompt,
            latents=latents.to(self.pipe.device),
            num_inference_steps=num_steps,
            guidance_scale=guidance_scale,
            height=height,
            width=width,
            output_type="pt",
            **options,
        )
        return out.images.float()


def check_plain(config: Config, lora: str | Path, dataset: PromptDataset | None = None) -> None:
    """The checks :func:`load_plain` makes before loading anything, cheap enough to run before the rewards and the
    model load: raises ``CheckpointError`` (a ``ValueError``) for a model family other than SD3, an in-code tiny
    model, a directory without ``pytorch_lora_weights.safetensors``, prompts with source images (``dataset``: image
    editing), or a LoRA whose weights do not all fit the model's linear layers (diffusers would load what matches and
    skip the rest), checked against a weightless transformer built from the model's config alone."""
    from accelerate import init_empty_weights

    lora = Path(lora)
    kind = model_kind(config)
    if kind not in PLAIN_FAMILIES:
        raise CheckpointError(f"--lora evaluates SD3-family models only; model.pretrained is a {kind} model")
    source = config.model.pretrained
    if source in tiny_sources():
        raise CheckpointError(f"model.pretrained={source!r} is built in code: save it with save_pretrained first")
    if dataset is not None:
        check_plain_dataset(dataset)
    file = lora / LORA_FILE
    if not file.is_file():
        raise CheckpointError(f"{lora} has no {LORA_FILE}: pass a directory written by scripts/export.py")
    try:
        weights = load_file(str(file))
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{file} cannot be read ({err}): export it again") from None
    with init_empty_weights():  # parameters on the meta device: the layers' sizes without memory
        transformer = _empty_transformer(resolve_source(source), kind)
    check_lora_fits(transformer, weights, file)


def check_plain_dataset(dataset: PromptDataset) -> None:
    """``--lora`` samples text-to-image only: prompts with source images (an editing prompt file) are refused."""
    if dataset.sources is not None:
        raise CheckpointError(
            f"{dataset.path} gives each prompt a source image (image editing): editing models are not supported by "
            "--lora; evaluate the checkpoint with --checkpoint"
        )


def dtype_note(config: Config) -> str | None:
    """A note when the checkpoint's evaluation decodes differently from plain diffusers: ``model.vae_fp32`` moves
    flowgrpo's VAE to fp32, and ``pipe(...)`` decodes in the model's dtype (as plain diffusers does)."""
    if not config.model.vae_fp32 or parse_dtype(config.model.dtype) == torch.float32:
        return None
    return (
        f"note: model.vae_fp32 is set, but --lora decodes as plain diffusers does, in model.dtype={config.model.dtype}"
        ", so its scores may differ slightly from the checkpoint's evaluation"
    )


def load_plain(config: Config, lora: str | Path, device: str = "cpu") -> PlainPipeline:
    """``config.model.pretrained`` opened by the family's diffusers pipeline class with the LoRA directory ``lora``
    loaded by ``load_lora_weights``, after :func:`check_plain`'s checks. Raises ``CheckpointError`` (a
    ``ValueError``) for what those refuse and for a model or LoRA that diffusers cannot load."""
    check_plain(config, lora)
    lora = Path(lora)
    kind = model_kind(config)
    path = resolve_source(config.model.pretrained)
    cls = family(kind).pipeline_class
    dtype = parse_dtype(config.model.dtype)
    try:
        pipe = cls.from_pretrained(path, **_absent_components(read_model_index(path)), **{_DTYPE_KWARG: dtype})
    except (OSError, RuntimeError) as err:
        raise CheckpointError(f"model.pretrained={config.model.pretrained!r} cannot be loaded ({err})") from None
    try:
        pipe.load_lora_weights(str(lora), weight_name=LORA_FILE)
    except (OSError, RuntimeError) as err:
        raise CheckpointError(f"{lora / LORA_FILE} cannot be loaded by load_lora_weights ({err})") from None
    pipe.to(device)
    return PlainPipeline(
        pipe, negative_prompt=config.model.negative_prompt, max_sequence_length=config.model.max_sequence_length
    )


def check_lora_fits(transformer: torch.nn.Module, weights: dict[str, Tensor], file: Path) -> None:
    """Every weight of a diffusers LoRA file (``transformer.<module>.lora_A.weight`` ``[r, in]``, ``lora_B``
    ``[out, r]``) names a linear layer of ``transformer`` of those sizes, and there is at least one."""
    problems = [] if weights else ["it holds no weights"]
    for key, value in sorted(weights.items()):
        if key.startswith("text_encoder"):  # text_encoder.*, text_encoder_2.*, ...: a LoRA on a text encoder
            problems.append(f"{key}: text-encoder LoRA is not supported by --lora")
            continue
        module_name, _, part = key.removeprefix("transformer.").rpartition(".lora_")
        module = _submodule(transformer, module_name) if key.startswith("transformer.") else None
        sizes = (getattr(module, "in_features", None), getattr(module, "out_features", None))
        if module is None or None in sizes:
            problems.append(f"{key}: the model has no such linear layer")
        elif part == "A.weight" and value.shape[1:] != (sizes[0],):
            problems.append(f"{key}: shape {tuple(value.shape)}, the layer takes {sizes[0]} inputs")
        elif part == "B.weight" and value.shape[:1] != (sizes[1],):
            problems.append(f"{key}: shape {tuple(value.shape)}, the layer has {sizes[1]} outputs")
        elif part not in ("A.weight", "B.weight"):
            problems.append(f"{key}: not a LoRA A or B weight")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise CheckpointError(f"{file} does not fit model.pretrained ({shown}): was it exported for another model?")


def _submodule(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
