"""Model adapters: one small class per model family behind one interface (``PipelineAdapter``)."""

from __future__ import annotations

from typing import Any

import torch

from .base import PipelineAdapter, PromptEmbeds, unwrap
from .flux import FluxAdapter
from .sd3 import SD3Adapter

ADAPTERS: dict[str, type[PipelineAdapter]] = {"sd3": SD3Adapter, "flux": FluxAdapter}


def build_adapter(model: Any, device: Any = "cpu", dtype: str | None = None) -> PipelineAdapter:
    """Load ``model.pretrained`` (a ``ModelConfig``) and set it up: LoRA, attention, checkpointing, size check."""
    from ..pipelines import load_pipeline

    pipe = load_pipeline(model.pretrained, kind=model.kind, dtype=dtype or model.dtype, device=device)
    if model.vae_fp32:
        pipe.vae.to(torch.float32)
    options = {} if model.max_sequence_length is None else {"max_sequence_length": model.max_sequence_length}
    adapter = make_adapter(pipe, negative_prompt=model.negative_prompt, **options)
    adapter.check_size(model.resolution, model.resolution)
    adapter.set_attention_backend(model.attention)
    lora = model.lora
    adapter.add_lora(lora.rank, lora.alpha, lora.target_modules, lora.init, lora.dropout)
    if model.gradient_checkpointing:
        adapter.enable_gradient_checkpointing()
    return adapter


def make_adapter(pipe: Any, **kwargs: Any) -> PipelineAdapter:
    """The adapter for a loaded diffusers pipeline (kind from its class)."""
    name = type(pipe).__name__
    if name.startswith("StableDiffusion3"):
        return SD3Adapter(pipe, **kwargs)
    if name.startswith("Flux"):
        return FluxAdapter(pipe, **kwargs)
    raise ValueError(f"no adapter for {name}: supported pipelines are StableDiffusion3Pipeline and FluxPipeline")


__all__ = [
    "ADAPTERS", "FluxAdapter", "PipelineAdapter", "PromptEmbeds", "SD3Adapter", "build_adapter", "make_adapter",
    "unwrap",
]  # fmt: skip
