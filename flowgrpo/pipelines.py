"""Load a pipeline of a registered model family from a hub id, a local diffusers directory, or a tiny offline build.

    pipe = load_pipeline("stabilityai/stable-diffusion-3.5-medium", dtype="bf16", device="cuda")
    pipe = load_pipeline("/models/flux-dev")      # kind read from model_index.json
    pipe = load_pipeline("tiny-sd3", dtype="fp32")  # random tiny weights, no files (see flowgrpo.tiny)
    pipe = load_pipeline("shapes-sd3", dtype="fp32")  # the pretrained shapes model shipped in the package

The kinds are the registered families (:func:`flowgrpo.adapters.registry.available_families`: ``sd3``, ``flux``,
``flux-kontext``, ``qwenimage``, ``qwenimage-edit``, ``wan``, ...), each with its pipeline class; a source's kind is
read from the ``_class_name`` of its ``model_index.json``. The special names ``"tiny-<kind>"`` (and
``"tiny-<kind>-taesd"``, see :func:`tiny_sources`) and ``"shapes-sd3"`` win over a local directory of the same name.
A component that ``model_index.json`` lists as ``[null, null]`` (an SD3 saved without T5) loads as ``None``.
Every ``torch.nn.Module`` component comes back in eval mode (training code turns on what it trains).

:func:`build_adapter` loads a model config's pipeline and sets its family's adapter up for training (LoRA, attention,
checkpointing, the size check).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers.utils import deprecation_utils
from huggingface_hub import constants as hf_constants
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from flowgrpo.adapters import PipelineAdapter, make_adapter
from flowgrpo.adapters.registry import (
    FAMILY_OPTIONS,
    available_families,
    families,
    family,
    family_of_class_name,
    family_of_pipeline,
)
from flowgrpo.checks import ConfigError
from flowgrpo.tiny import build_tiny_pipeline

PipelineKind = str  # a registered family name (flowgrpo.adapters.registry.available_families())
# Pretrained pipelines shipped inside the package (no download): name -> directory.
SHIPPED_MODELS: dict[str, Path] = {"shapes-sd3": Path(__file__).parent / "assets" / "shapes-sd3"}

# Recent diffusers renamed from_pretrained's `torch_dtype` to `dtype` (the old name warns); older ones
# (pyproject admits >= 0.32) know only `torch_dtype`.
_DTYPE_KWARG = "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"

_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


class PipelineLoadError(ValueError):
    """A pipeline source that cannot be opened: missing path, not a pipeline, not cached while offline."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16" | "fp16" | "fp32"`` (or the long names, or a ``torch.dtype``) -> a floating ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"expected a floating-point dtype, got {dtype}")
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of 'bf16', 'fp16', 'fp32' or a torch.dtype")
    return _DTYPES[name]


def tiny_sources() -> dict[str, str]:
    """Names built in code (``flowgrpo.tiny``) -> their kind: ``tiny-<kind>`` of every family with a tiny builder, and
    ``tiny-<kind>-taesd`` (a normalisation-free AutoencoderTiny) where its tiny build offers one."""
    return {source: spec.name for spec in families() for source in spec.tiny_sources}


def pipeline_kind(pipe: Any) -> PipelineKind:
    """The kind of a pipeline object, by its exact class (a sibling such as ``FluxFillPipeline`` has none)."""
    spec = family_of_pipeline(pipe)
    if spec is None:
        raise ValueError(
            f"{type(pipe).__name__} is no registered family's pipeline; supported kinds: {available_families()}"
        )
    return spec.name


def _check_kind(kind: str) -> str:
    kind = kind.lower()
    if kind != "auto" and kind not in available_families():
        raise ValueError(f"unknown pipeline kind {kind!r}; expected 'auto' or one of {available_families()}")
    return kind


def read_model_index(source: str) -> dict[str, Any]:
    """The ``model_index.json`` of a local diffusers directory or a hub id (cache only when offline)."""
    path = Path(source).expanduser()
    if path.is_dir():
        index = path / "model_index.json"
        if not index.is_file():
            raise PipelineLoadError(f"{source!r} is a directory but not a diffusers pipeline (no model_index.json)")
        try:
            return json.loads(index.read_text())
        except (ValueError, OSError) as err:
            why = f"{index} is not a readable model index ({err})"
            raise PipelineLoadError(f"{why}; repair it or re-download {source!r}") from None
    if path.exists():
        raise PipelineLoadError(f"{source!r} is a file; expected a diffusers pipeline directory or a hub id")
    try:
        validate_repo_id(source)
    except HFValidationError:
        # Not a hub id either, so it can only have been meant as a local path.
        raise PipelineLoadError(f"local pipeline directory {source!r} does not exist") from None
    try:
        return json.loads(Path(hf_hub_download(source, "model_index.json")).read_text())
    except (OSError, EntryNotFoundError) as err:
        raise PipelineLoadError(_not_found_message(source, err)) from None


def _not_found_message(source: str, err: BaseException) -> str:
    reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if Path(source).expanduser().is_dir():
        return f"cannot load pipeline from local directory {source!r} ({reason})"
    if hf_constants.HF_HUB_OFFLINE:
        why = "HF_HUB_OFFLINE=1 is set and it is not (fully) in the local Hugging Face cache"
    else:
        why = f"fetching it from the Hub failed ({reason})"
    return (
        f"cannot load pipeline {source!r}: it is not a local directory, and {why}. "
        f"Pass a local diffusers directory, or download it first (`hf download {source}`)."
    )


def resolve_source(source: str) -> str:
    """A shipped model's name -> its directory; anything else unchanged."""
    return str(SHIPPED_MODELS[source]) if source in SHIPPED_MODELS else source


def _absent_components(index: dict[str, Any]) -> dict[str, None]:
    """Components saved as ``[null, null]`` (e.g. SD3's T5 left out): diffusers loads them only when passed."""
    return {
        name: None
        for name, value in index.items()
        if not name.startswith("_") and isinstance(value, list) and value == [None, None]
    }


def _detect(source: str) -> tuple[str | None, str | None]:
    """(kind or None if unknown, pipeline class name) of a source."""
    source = resolve_source(source)
    tiny = tiny_sources()
    if source in tiny:
        return tiny[source], family(tiny[source]).pipeline_names[0]
    class_name = read_model_index(source).get("_class_name")
    spec = family_of_class_name(class_name)
    return (None if spec is None else spec.name), class_name


def _unknown_kind_message(source: str, class_name: str | None) -> str:
    return (
        f"cannot tell the kind of {source!r}: its model_index.json names {class_name!r}, "
        f"not one of {sorted(name for spec in families() for name in spec.pipeline_names)}; "
        f"pass kind= one of {available_families()}"
    )


def detect_kind(source: str) -> PipelineKind:
    """Kind of a tiny name, local directory or hub id, from ``model_index.json`` ``_class_name``."""
    detected, class_name = _detect(source)
    if detected is None:
        raise ValueError(_unknown_kind_message(source, class_name))
    return detected  # type: ignore[return-value]


def load_pipeline(
    source: str,
    kind: str = "auto",
    dtype: str | torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> Any:
    """Open a pipeline of a registered kind: a hub id, a local diffusers directory or a tiny name (``"tiny-sd3"``...).

    ``kind="auto"`` reads it from ``model_index.json``; an explicit kind must agree with it (a pipeline
    class no family drives, e.g. an img2img export, is loaded as the kind asked for, with that family's class).
    Raises ``PipelineLoadError`` (a ``ValueError``) when the source cannot be found.
    """
    kind = _check_kind(kind)
    torch_dtype = parse_dtype(dtype)
    detected, class_name = _detect(source)
    if kind == "auto":
        if detected is None:
            raise ValueError(_unknown_kind_message(source, class_name))
        kind = detected
    elif detected is not None and detected != kind:
        raise ValueError(f"{source!r} is a {class_name} (kind {detected!r}), but kind={kind!r} was asked for")

    if source in tiny_sources():
        vae = "tiny" if source.endswith("-taesd") else "kl"
        pipe = build_tiny_pipeline(kind, seed=0, dtype=torch_dtype, vae=vae)
    else:
        source = resolve_source(source)
        absent = _absent_components(read_model_index(source))
        try:
            pipe = family(kind).pipeline_class.from_pretrained(source, **absent, **{_DTYPE_KWARG: torch_dtype})
        except OSError as err:  # e.g. model_index.json present but a weight file missing
            raise PipelineLoadError(_not_found_message(source, err)) from None
    pipe.to(device)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipe


def build_adapter(model: Any, device: Any = "cpu", dtype: str | None = None) -> PipelineAdapter:
    """Load ``model.pretrained`` (a ``ModelConfig``) and set it up: LoRA, attention, checkpointing, size check."""
    pipe = load_pipeline(model.pretrained, kind=model.kind, dtype=dtype or model.dtype, device=device)
    if model.vae_fp32:
        pipe.vae.to(torch.float32)
    options = {} if model.max_sequence_length is None else {"max_sequence_length": model.max_sequence_length}
    if model.num_frames is not None:  # video families; make_adapter refuses it for an image pipeline
        options["num_frames"] = model.num_frames
    options.update(family_options(model))  # make_adapter refuses them for the other families
    adapter = make_adapter(pipe, negative_prompt=model.negative_prompt, **options)
    try:
        adapter.check_size(*model.size)  # (height, width)
    except ValueError as err:  # the family's own multiple (16 is checked with the config): name the keys set
        raise ConfigError(f"{model.size_keys}: {err}") from None
    adapter.set_attention_backend(model.attention)
    lora = model.lora
    adapter.add_lora(lora.rank, lora.alpha, lora.target_modules, lora.init, lora.dropout)
    if model.gradient_checkpointing:
        adapter.enable_gradient_checkpointing()
    return adapter


def family_options(model: Any) -> dict[str, Any]:
    """The families' own options (``FAMILY_OPTIONS``) that ``model`` (a ``ModelConfig``) sets to other than their
    defaults: the adapter's keyword options."""
    defaults = type(model)()
    return {k: getattr(model, k) for k in FAMILY_OPTIONS if getattr(model, k) != getattr(defaults, k)}


def __getattr__(name: str) -> Any:
    """The family tables of earlier versions, derived from the registry on each access."""
    tables = {
        "KINDS": available_families,
        "PIPELINE_CLASSES": lambda: {spec.name: spec.pipeline_class for spec in families()},
        "TRANSFORMER_CLASSES": lambda: {spec.name: spec.transformer_class for spec in families()},
        "KIND_BY_CLASS_NAME": lambda: {name: spec.name for spec in families() for name in spec.pipeline_names},
        "TINY_SOURCES": tiny_sources,
    }
    if name in tables:
        return tables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PipelineKind",
    "PipelineLoadError",
    "detect_kind",
    "load_pipeline",
    "parse_dtype",
    "pipeline_kind",
    "read_model_index",
    "resolve_source",
    "tiny_sources",
]
