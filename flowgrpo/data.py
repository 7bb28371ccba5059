"""Prompt files and the epoch sampler that puts ``group_size`` copies of each prompt into an epoch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class DataError(ValueError):
    """A missing, empty or malformed prompt file."""


@dataclass
class PromptDataset:
    """Prompts with per-prompt metadata (passed to rewards, e.g. GenEval's tags / OCR targets)."""

    prompts: list[str]
    metadata: list[dict[str, Any]]
    path: str = ""

    def __len__(self) -> int:
        return len(self.prompts)

    @classmethod
    def from_file(cls, path: str | Path, key: str = "data.train") -> PromptDataset:
        """``.txt``: one prompt a line (blank lines skipped); ``.jsonl``: ``{"prompt": ..., **metadata}``."""
        path = Path(path)
        text = _read_prompt_file(path, key)
        prompts: list[str] = []
        metadata: list[dict[str, Any]] = []
        if path.suffix == ".jsonl":
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{key}: {path}:{number} is not valid JSON ({err.msg})") from None
                except RecursionError:
                    raise DataError(f"{key}: {path}:{number} is nested too deeply to be a prompt row") from None
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise DataError(f'{key}: {path}:{number} needs a "prompt" string field')
                prompts.append(row.pop("prompt"))
                metadata.append(row)
        else:
            prompts = [line.strip() for line in text.splitlines() if line.strip()]
            metadata = [{} for _ in prompts]
        if not prompts:
            raise DataError(f"{key}: prompt file {path} holds no prompts")
        return cls(prompts, metadata, str(path))


def _read_prompt_file(path: Path, key: str) -> str:
    """The file's text; every failure is a ``DataError`` naming the config key and the file."""
    fix = f"point {key} at a .txt or .jsonl file"
    if path.is_dir():
        raise DataError(f"{key}: {path} is a directory, not a prompt file; {fix}")
    if not path.is_file():
        raise DataError(f"{key}: prompt file {path} does not exist; {fix}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{key}: prompt file {path} is not UTF-8 text (byte {err.start}: {err.reason}); re-save it as UTF-8"
        ) from None
    except OSError as err:  # permissions, I/O errors
        raise DataError(f"{key}: cannot read prompt file {path} ({err.strerror or err}); {fix}") from None


@dataclass(frozen=True)
class EpochSample:
    """One image slot of an epoch: which prompt, and the explicit id of its group."""

    prompt_index: int
    group_id: int


def epoch_plan(num_prompts: int, group_size: int, groups_per_epoch: int, *, seed: int, epoch: int) -> list[EpochSample]:
    """All ``group_size × groups_per_epoch`` slots of an epoch, shuffled; deterministic in (seed, epoch).

    Group ids are ``epoch × groups_per_epoch + g``, unique across epochs. Prompts are drawn without
    replacement while the file has enough (with replacement otherwise); copies of a prompt land anywhere
    in the shuffled list, so a group may span processes — advantages are computed after gathering.
    """
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    if num_prompts >= groups_per_epoch:
        chosen = torch.randperm(num_prompts, generator=generator)[:groups_per_epoch]
    else:
        chosen = torch.randint(0, num_prompts, (groups_per_epoch,), generator=generator)
    first_id = epoch * groups_per_epoch
    slots = [EpochSample(int(chosen[g]), first_id + g) for g in range(groups_per_epoch) for _ in range(group_size)]
    order = torch.randperm(len(slots), generator=generator)
    return [slots[i] for i in order.tolist()]


def rank_slice(plan: list[EpochSample], rank: int, world_size: int) -> list[EpochSample]:
    """This process's contiguous share of the epoch (the config guarantees an even split)."""
    per_rank = len(plan) // world_size
    return plan[rank * per_rank : (rank + 1) * per_rank]
