"""Model adapters: one small class per model family behind one interface (``PipelineAdapter``)."""

from __future__ import annotations

from typing import Any

import torch

from .base import PipelineAdapter, PromptEmbeds, unwrap
from .flux import FluxAdapter
from .kontext import FluxKontextAdapter
from .qwenimage import QwenImageAdapter
from .qwenimage_edit import QwenImageEditAdapter
from .sd3 import SD3Adapter
from .wan import WanAdapter

ADAPTERS: dict[str, type[PipelineAdapter]] = {"sd3": SD3Adapter, "flux": FluxAdapter}
ADAPTERS["flux-kontext"] = FluxKontextAdapter  # image editing: FLUX.1 + a source image per prompt
ADAPTERS["qwenimage"] = QwenImageAdapter  # text-to-image only (QwenImagePipeline)
ADAPTERS["qwenimage-edit"] = QwenImageEditAdapter  # image editing (QwenImageEditPipeline): a source image per prompt
ADAPTERS["wan"] = WanAdapter  # text-to-video (WanPipeline, Wan2.1): latents and samples gain a frame axis


def build_adapter(model: Any, device: Any = "cpu", dtype: str | None = None) -> PipelineAdapter:
    """Load ``model.pretrained`` (a ``ModelConfig``) and set it up: LoRA, attention, checkpointing, size check."""
    from ..pipelines import load_pipeline

    pipe = load_pipeline(model.pretrained, kind=model.kind, dtype=dtype or model.dtype, device=device)
    if model.vae_fp32:
        pipe.vae.to(torch.float32)
    options = {} if model.max_sequence_length is None else {"max_sequence_length": model.max_sequence_length}
    if model.num_frames is not None:  # video families; make_adapter refuses it for an image pipeline
        options["num_frames"] = model.num_frames
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
    if name == "WanPipeline":
        return WanAdapter(pipe, **kwargs)
    if name.startswith("Wan"):  # image-to-video, VACE, video-to-video, animate: they need their input images
        raise ValueError(f"{name} is not supported yet: the wan adapter drives the text-to-video WanPipeline only")
    if kwargs.pop("num_frames", None) is not None:
        raise ValueError(f"model.num_frames is for video pipelines (WanPipeline), but {name} generates images: "
                         "set model.num_frames: null")  # fmt: skip
    if name == "QwenImagePipeline":
        return QwenImageAdapter(pipe, **kwargs)
    if name == "QwenImageEditPipeline":
        return QwenImageEditAdapter(pipe, **kwargs)
    if name.startswith("QwenImage"):  # Edit-Plus / inpainting / ControlNet / layered siblings: their own inputs
        raise ValueError(
            f"{name} is not supported yet: the qwenimage adapters drive QwenImagePipeline (text-to-image, "
            "model.kind=qwenimage) and QwenImageEditPipeline (one source image per prompt, model.kind=qwenimage-edit)"
        )
    if name.startswith("StableDiffusion3"):
        return SD3Adapter(pipe, **kwargs)
    if name.startswith("FluxKontext"):  # before FluxAdapter: the source image tokens are Kontext's own
        return FluxKontextAdapter(pipe, **kwargs)
    if name.startswith("Flux"):
        return FluxAdapter(pipe, **kwargs)
    supported = ("StableDiffusion3Pipeline, FluxPipeline, FluxKontextPipeline, QwenImagePipeline, "
                 "QwenImageEditPipeline and WanPipeline")  # fmt: skip
    raise ValueError(f"no adapter for {name}: supported pipelines are {supported}")


__all__ = [
    "ADAPTERS", "FluxAdapter", "FluxKontextAdapter", "PipelineAdapter", "PromptEmbeds", "QwenImageAdapter",
    "QwenImageEditAdapter",
    "SD3Adapter", "WanAdapter", "build_adapter", "make_adapter", "unwrap",
]  # fmt: skip
