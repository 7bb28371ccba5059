"""Where a run keeps its checkpoints: ``<run>/checkpoints/epoch-NNNNN/`` (the files inside: the package's docstring)."""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
PREFIX = "epoch-"
CONFIG_FILE = "config.yaml"  # in a run (its first attempt's config) and in each checkpoint (what it trained with)
RUN_FILE = "run.json"  # in a run: its identity ({"run_id": ...}), which each of its checkpoints records too
METRICS_FILE = "metrics.jsonl"  # in a run: one line per epoch
STATE_FILE = "state.json"  # its presence marks a complete checkpoint (written last)
ADAPTER_FILE = "adapter.safetensors"  # LoRA weights, peft's saved names, float32
EMA_FILE = "ema.safetensors"  # their EMA (train.ema > 0)
REFERENCE_FILE = "reference.safetensors"  # the KL reference's snapshot after a reset (grpo.kl.reset_every)
OLD_WEIGHTS_FILE = "old_weights.safetensors"  # weights an objective carries across epochs (nft's soft update, lagged)
ADAPTER_CONFIG_FILE = "adapter_config.json"  # the LoraConfig


def checkpoint_name(epoch: int) -> str:
    """``epoch-NNNNN``: the checkpoint written after ``epoch`` epochs."""
    return f"{PREFIX}{epoch:05d}"


def checkpoint_epoch(checkpoint: Path) -> int:
    """NNNNN of a checkpoint folder ``epoch-NNNNN``."""
    return int(Path(checkpoint).name[len(PREFIX) :])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories are ignored)."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and re.fullmatch(rf"{PREFIX}\d+", p.name)]
    return sorted(p for p in found if (p / STATE_FILE).is_file())
