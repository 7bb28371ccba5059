"""Prompt files and the epoch sampler that puts ``group_size`` copies of each prompt into an epoch.

Image editing: a ``.jsonl`` row may name a source image, ``{"prompt": "make the cat blue", "image": "imgs/cat.png"}``
(``instruction`` is accepted for ``prompt``; the path is relative to the prompt file, as in Flow-GRPO's editing
datasets). Every image is opened and decoded when the file is read, so a missing or broken one stops the run before
any work, with its file and line.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

IMAGE_FIELD = "image"  # a jsonl row's source image (editing), relative to the prompt file


class DataError(ValueError):
    """A missing, empty or malformed prompt file."""


@dataclass
class PromptDataset:
    """Prompts with per-prompt metadata (passed to rewards, e.g. GenEval's tags / OCR targets).

    sources: editing datasets only — each prompt's source image file (resolved, checked readable); None otherwise.
    """

    prompts: list[str]
    metadata: list[dict[str, Any]]
    path: str = ""
    sources: list[str] | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def sources_of(self, indices: Sequence[int]) -> list[str] | None:
        """The source images of prompts ``indices`` (a rollout batch); None for a text-to-image dataset."""
        return None if self.sources is None else [self.sources[i] for i in indices]

    @classmethod
    def from_file(cls, path: str | Path, key: str = "data.train") -> PromptDataset:
        """``.txt``: one prompt a line (blank lines skipped); ``.jsonl``: ``{"prompt": ..., **metadata}``, for editing
        with an ``"image"`` path (relative to the file) on every row."""
        path = Path(path)
        text = _read_prompt_file(path, key)
        prompts: list[str] = []
        metadata: list[dict[str, Any]] = []
        images: list[tuple[int, Any]] = []  # (line, the row's "image" value or None)
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
                if isinstance(row, dict) and "prompt" not in row and "instruction" in row:
                    row["prompt"] = row.pop("instruction")  # an editing row may call its prompt the instruction
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise DataError(f'{key}: {path}:{number} needs a "prompt" string field')
                prompts.append(row.pop("prompt"))
                images.append((number, row.pop(IMAGE_FIELD, None)))
                metadata.append(row)
        else:
            prompts = [line.strip() for line in text.splitlines() if line.strip()]
            metadata = [{} for _ in prompts]
        if not prompts:
            raise DataError(f"{key}: prompt file {path} holds no prompts")
        sources = _source_images(images, path, key) if any(v is not None for _, v in images) else None
        return cls(prompts, metadata, str(path), sources)


def _source_images(images: list[tuple[int, Any]], path: Path, key: str) -> list[str]:
    """Each row's source image, resolved against the prompt file's folder; every problem named by file and line."""
    sources, problems = [], []
    for number, value in images:
        if value is None:
            problems.append(
                f'{path}:{number} has no "{IMAGE_FIELD}" field, but other rows do (an editing file gives '
                "every row a source image)"
            )
            continue
        if not isinstance(value, str) or not value.strip():
            problems.append(f'{path}:{number}: "{IMAGE_FIELD}" must be an image file path, got {value!r}')
            continue
        file = path.parent / value
        problem = _unreadable(file)
        if problem:
            problems.append(f"{path}:{number}: image {value!r} {problem}")
        sources.append(str(file.resolve()))
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise DataError(f"{key}: {len(problems)} editing row(s) without a usable source image: {shown}")
    return sources


def _unreadable(file: Path) -> str | None:
    """Why ``file`` cannot serve as a source image, or None. Decodes it whole: a truncated file fails here."""
    if not file.exists():
        return f"does not exist (looked for {file})"
    if not file.is_file():
        return f"is not a file ({file})"
    try:
        with Image.open(file) as image:
            image.load()
    except Exception as err:  # noqa: BLE001 - PIL raises OSError, SyntaxError, DecompressionBombError, ...
        return f"cannot be read as an image ({type(err).__name__}: {err})"
    return None


def open_image(source: str | os.PathLike | Image.Image) -> Image.Image:
    """A source image as RGB: a file path (opened and decoded) or a PIL image (converted if needed)."""
    if isinstance(source, Image.Image):
        return source if source.mode == "RGB" else source.convert("RGB")
    if not isinstance(source, str | os.PathLike):
        raise TypeError(f"a source image must be a file path or a PIL image, got {type(source).__name__}")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except Exception as err:  # noqa: BLE001 - the file changed since the prompt file was read
        raise DataError(f"source image {source} cannot be read ({type(err).__name__}: {err})") from None


def image_key(source: str | os.PathLike | Image.Image) -> str:
    """A cache key for a source image: its resolved path, or a digest of a PIL image's pixels."""
    if isinstance(source, Image.Image):
        digest = hashlib.sha1(source.tobytes()).hexdigest()
        return f"pil:{source.mode}:{source.size[0]}x{source.size[1]}:{digest}"
    if not isinstance(source, str | os.PathLike):
        raise TypeError(f"a source image must be a file path or a PIL image, got {type(source).__name__}")
    return f"file:{Path(source).resolve()}"


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


def check_editing(datasets: dict[str, PromptDataset | None], *, reward: Any = None, adapter: Any = None) -> None:
    """Refuse, before any work, prompt files that do not fit image editing: a reward that compares edits with their
    source images (``reward.needs_source_images``) on prompts without any, or source images for a model that cannot
    take them (``adapter.edits`` false), or prompts without any for a model that needs them
    (``adapter.requires_sources``: Qwen-Image-Edit). ``datasets``: config key -> dataset (None: not configured)."""
    needs = list(getattr(reward, "needs_source_images", None) or [])
    for key, data in datasets.items():
        if data is None:
            continue
        if needs and data.sources is None:
            raise DataError(
                f"{key}: reward(s) {', '.join(needs)} compare each edit with its source image, but {data.path} gives "
                f'none: use an editing prompt file (.jsonl rows with an "{IMAGE_FIELD}" path)'
            )
        if adapter is not None and data.sources is not None and not getattr(adapter, "edits", False):
            raise DataError(
                f"{key}: {data.path} gives each prompt a source image (image editing), but model.pretrained is a "
                f"{adapter.family} text-to-image pipeline: use an editing model (FLUX.1-Kontext, model.kind "
                f'flux-kontext), or prompts without "{IMAGE_FIELD}"'
            )
        if adapter is not None and data.sources is None and getattr(adapter, "requires_sources", False):
            raise DataError(
                f"{key}: {adapter.family} edits images and cannot generate from text alone, but {data.path} gives no "
                f'source images: use an editing prompt file (.jsonl rows with an "{IMAGE_FIELD}" path)'
            )
