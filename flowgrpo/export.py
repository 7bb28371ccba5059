"""Export a checkpoint to plain diffusers: a LoRA directory for ``pipe.load_lora_weights`` or a merged pipeline.

    python scripts/export.py --checkpoint runs/<run>/checkpoints/epoch-00100 --out my-lora
    python scripts/export.py --checkpoint ... --out my-pipeline --merge [--ema]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from .adapters import PipelineAdapter, build_adapter
from .checkpoint import CheckpointError, load_adapter_weights, read_weights
from .config import Config, load_config
from .pipelines import PIPELINE_CLASSES, detect_kind, load_pipeline

LORA_FILE = "pytorch_lora_weights.safetensors"


def run_config(checkpoint: Path, overrides: list[str] | None = None) -> Config:
    """The resolved config a checkpoint's run was trained with (``<run>/config.yaml``)."""
    path = Path(checkpoint).parent.parent / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: is {checkpoint} a checkpoint inside a run? (or pass --config)")
    return load_config(path, ["run.resume=null", *(overrides or [])])


def adapter_from_checkpoint(
    config: Config, checkpoint: Path, *, ema: bool = False, device: str = "cpu", dtype: str | None = None
) -> PipelineAdapter:
    """The run's pipeline with its LoRA adapter loaded from ``checkpoint`` (EMA weights with ``ema``)."""
    adapter = build_adapter(config.model, device, dtype)
    load_adapter_weights(adapter.pipe.transformer, Path(checkpoint), ema=ema)
    return adapter


def save_diffusers_lora(config: Config, checkpoint: Path, out: Path, *, ema: bool = False) -> Path:
    """``out/pytorch_lora_weights.safetensors`` straight from the checkpoint files (no model is loaded), with the
    adapter metadata so that ``lora_alpha`` survives ``load_lora_weights``."""
    metadata: dict[str, Any] = json.loads((Path(checkpoint) / "adapter_config.json").read_text())
    kind = detect_kind(config.model.pretrained) if config.model.kind == "auto" else config.model.kind
    PIPELINE_CLASSES[kind].save_lora_weights(
        str(out), transformer_lora_layers=read_weights(checkpoint, ema=ema),
        transformer_lora_adapter_metadata=metadata, weight_name=LORA_FILE,
    )  # fmt: skip
    return out / LORA_FILE


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    merge: bool = False,
    ema: bool = False,
    config: Config | None = None,
) -> Path:
    """Write a diffusers LoRA directory (default) or, with ``merge``, a full pipeline with fused weights."""
    checkpoint, out = Path(checkpoint), Path(out)
    config = config or run_config(checkpoint)
    if not merge:
        out.mkdir(parents=True, exist_ok=True)
        save_diffusers_lora(config, checkpoint, out, ema=ema)
        return out
    # Merge through diffusers itself: the pipeline loads the exported LoRA, fuses it, and is saved whole.
    with tempfile.TemporaryDirectory() as tmp:
        save_diffusers_lora(config, checkpoint, Path(tmp), ema=ema)
        m = config.model
        pipe = load_pipeline(m.pretrained, kind=m.kind, dtype=m.dtype, device="cpu")
        pipe.load_lora_weights(tmp, weight_name=LORA_FILE)
        pipe.fuse_lora()
        pipe.unload_lora_weights()
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out
