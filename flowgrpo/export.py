"""Export a checkpoint to plain diffusers: a LoRA directory for ``pipe.load_lora_weights`` or a merged pipeline.

    python scripts/export.py --checkpoint runs/<run>/checkpoints/epoch-00100 --out my-lora
    python scripts/export.py --checkpoint ... --out my-pipeline --merge [--ema]
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from .adapters import PipelineAdapter, make_adapter
from .checkpoint import CheckpointError, load_adapter_weights, lora_state
from .config import Config, load_config
from .pipelines import load_pipeline

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
    m = config.model
    pipe = load_pipeline(m.pretrained, kind=m.kind, dtype=dtype or m.dtype, device=device)
    adapter = make_adapter(pipe, negative_prompt=m.negative_prompt)
    adapter.add_lora(m.lora.rank, m.lora.alpha, m.lora.target_modules, m.lora.init, m.lora.dropout)
    load_adapter_weights(pipe.transformer, Path(checkpoint), ema=ema)
    return adapter


def save_diffusers_lora(adapter: PipelineAdapter, out: Path) -> Path:
    """``out/pytorch_lora_weights.safetensors`` with the adapter metadata, so ``lora_alpha`` survives a reload."""
    transformer = adapter.pipe.transformer
    metadata: dict[str, Any] = transformer.peft_config["default"].to_dict()
    metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
    type(adapter.pipe).save_lora_weights(
        str(out), transformer_lora_layers=lora_state(transformer), transformer_lora_adapter_metadata=metadata,
        weight_name=LORA_FILE,
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
    adapter = adapter_from_checkpoint(config, checkpoint, ema=ema, dtype="fp32")
    if not merge:
        out.mkdir(parents=True, exist_ok=True)
        save_diffusers_lora(adapter, out)
        return out
    # Merge through diffusers itself: a fresh pipeline loads the exported LoRA, fuses it, and is saved whole.
    with tempfile.TemporaryDirectory() as tmp:
        save_diffusers_lora(adapter, Path(tmp))
        m = config.model
        pipe = load_pipeline(m.pretrained, kind=m.kind, dtype=m.dtype, device="cpu")
        pipe.load_lora_weights(tmp, weight_name=LORA_FILE)
        pipe.fuse_lora()
        pipe.unload_lora_weights()
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out
