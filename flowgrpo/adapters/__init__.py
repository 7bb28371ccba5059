"""Model adapters: one small class per model family behind one interface (``PipelineAdapter``)."""

from __future__ import annotations

from typing import Any

from .base import PipelineAdapter, PromptEmbeds, unwrap
from .flux import FluxAdapter
from .sd3 import SD3Adapter

ADAPTERS: dict[str, type[PipelineAdapter]] = {"sd3": SD3Adapter, "flux": FluxAdapter}


def make_adapter(pipe: Any, **kwargs: Any) -> PipelineAdapter:
    """The adapter for a loaded diffusers pipeline (kind from its class)."""
    name = type(pipe).__name__
    if name.startswith("StableDiffusion3"):
        return SD3Adapter(pipe, **kwargs)
    if name.startswith("Flux"):
        return FluxAdapter(pipe, **kwargs)
    raise ValueError(f"no adapter for {name}: supported pipelines are StableDiffusion3Pipeline and FluxPipeline")


__all__ = ["ADAPTERS", "FluxAdapter", "PipelineAdapter", "PromptEmbeds", "SD3Adapter", "make_adapter", "unwrap"]
