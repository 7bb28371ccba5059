"""Model adapters: one small class per model family behind one interface (``PipelineAdapter``).

Each module here that defines a family registers its :class:`~flowgrpo.adapters.registry.FamilySpec` at its bottom;
importing this package imports every module in it, so a new family is one new file (nothing else is edited).
:func:`make_adapter` picks the adapter by the pipeline's exact class; :func:`flowgrpo.pipelines.build_adapter` loads a
model config's pipeline and sets its adapter up for training.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from .base import PipelineAdapter, PromptEmbeds, unwrap
from .flux import FluxAdapter
from .kontext import FluxKontextAdapter
from .qwenimage import QwenImageAdapter
from .qwenimage_edit import QwenImageEditAdapter
from .registry import (
    FamilySpec,
    adapter_options,
    available_families,
    families,
    family,
    family_of_pipeline,
    family_option_error,
    register_family,
    unregister_family,
    unsupported_pipeline_message,
)
from .sd3 import SD3Adapter
from .wan import WanAdapter

for _module in pkgutil.iter_modules(__path__):  # every family module registers its spec when imported
    importlib.import_module(f"{__name__}.{_module.name}")


def __getattr__(name: str) -> Any:
    if name == "ADAPTERS":  # family name -> adapter class, derived from the registry on each access
        return {spec.name: spec.adapter for spec in families()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_adapter(pipe: Any, **kwargs: Any) -> PipelineAdapter:
    """The adapter for a loaded diffusers pipeline, by its exact class (:func:`registry.family_of_pipeline`).

    A subclass or sibling of a supported pipeline (e.g. ``FluxFillPipeline``, ``FluxControlPipeline``,
    ``FluxKontextInpaintPipeline``, ``Flux2KleinKVPipeline``, ``WanVACEPipeline``) is refused with the list of
    supported classes; ``num_frames`` is refused for an image family (None is dropped), and another option the
    family's adapter does not take (``true_cfg_scale`` but for FLUX, ...) with a :class:`ConfigError`."""
    spec = family_of_pipeline(pipe)
    if spec is None:
        raise ValueError(unsupported_pipeline_message(pipe))
    if not spec.video and kwargs.pop("num_frames", None) is not None:
        videos = ", ".join(name for s in families() if s.video for name in s.pipeline_names)
        raise ValueError(
            f"model.num_frames is for video pipelines ({videos}), but {type(pipe).__name__} generates "
            "images: set model.num_frames: null"
        )
    unknown = sorted(set(kwargs) - adapter_options(spec.adapter))
    if unknown:
        raise family_option_error(unknown[0], kwargs[unknown[0]], f"{spec.name} ({type(pipe).__name__})")
    return spec.adapter(pipe, **kwargs)


__all__ = [
    "FamilySpec",
    "FluxAdapter",
    "FluxKontextAdapter",
    "PipelineAdapter",
    "PromptEmbeds",
    "QwenImageAdapter",
    "QwenImageEditAdapter",
    "SD3Adapter",
    "WanAdapter",
    "available_families",
    "family",
    "family_of_pipeline",
    "make_adapter",
    "register_family",
    "unregister_family",
    "unwrap",
]
