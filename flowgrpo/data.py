"""Prompt files and the epoch sampler that puts ``group_size`` copies of each prompt into an epoch.

Image editing: a ``.jsonl`` row may name a source image, ``{"prompt": "make the cat blue", "image": "imgs/cat.png"}``
(``instruction`` is accepted for ``prompt``; the path is relative to the prompt file, as in Flow-GRPO's editing
datasets). A model that takes several images per prompt (Qwen-Image-Edit-Plus) reads a list of paths there,
``{"prompt": "put the cat on the sofa", "image": ["imgs/cat.png", "imgs/sofa.png"]}``, in order (its "Picture 1",
"Picture 2", ...); every row of a file gives the same number, since a batch stacks each prompt's images (a one-path
list is the path). Every image is opened, decoded and converted to 8-bit RGB when the file is read (:func:`to_rgb`
says how each PIL mode is converted: 16-bit and float grayscale are scaled, transparency is composited onto white, CMYK
is converted by formula), so a missing, broken or unconvertible one stops the run before any work, with its file and
line; the conversions that change what a plain ``convert("RGB")`` would give are listed in
:attr:`PromptDataset.notes`. The images are read again at rollout time; one that changed since is reported with the
row that names it (:class:`SourceImage`).

:func:`small_prompt_set_warning`: the presets' prompt files are small samples; a real model trained on one is warned.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .checks import DataError
from .images import (  # noqa: F401  (re-exported: the prompt files' image functions, as before)
    BACKGROUND,
    UnusableImage,
    image_key,
    open_image,
    read_image_file,
    resolved_path,
    to_rgb,
)

IMAGE_FIELD = "image"  # a jsonl row's source image (editing), relative to the prompt file
SMALL_PROMPT_SET = 1000  # fewer training prompts than this on a real model: small_prompt_set_warning


class SourceImage(str):
    """A source image's resolved path (a plain ``str`` to every caller) that remembers the prompt-file row naming it
    (``origin``, e.g. ``"data.train: edits.jsonl:3"``), so that :func:`open_image` names the row when the file
    breaks during the run."""

    origin: str

    def __new__(cls, path: str, origin: str = "") -> SourceImage:
        self = super().__new__(cls, path)
        self.origin = origin
        return self


@dataclass
class PromptDataset:
    """Prompts with per-prompt metadata (passed to rewards, e.g. GenEval's tags / OCR targets).

    sources: editing datasets only — each prompt's source image file (resolved, checked readable and convertible, a
             :class:`SourceImage` that knows its row), or with several images per prompt a tuple of them, the same
             number for every prompt; None otherwise.
    notes:   one line per kind of conversion the source images needed beyond a plain RGB decode (transparency
             composited onto white, 16-bit or float scaled, CMYK converted, EXIF orientation applied), with a count
             and the first row; for the trainer to print. Empty for a text-to-image dataset.
    """

    prompts: list[str]
    metadata: list[dict[str, Any]]
    path: str = ""
    sources: list[str] | list[tuple[str, ...]] | None = None
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def sources_per_prompt(self) -> int:
        """How many source images each prompt gives: 0 (text-to-image), 1, or the length of every row's list."""
        if self.sources is None:
            return 0
        first = self.sources[0]
        return len(first) if isinstance(first, tuple) else 1

    def sources_of(self, indices: Sequence[int]) -> list[str] | list[tuple[str, ...]] | None:
        """The source images of prompts ``indices`` (a rollout batch); None for a text-to-image dataset."""
        return None if self.sources is None else [self.sources[i] for i in indices]

    @classmethod
    def from_file(cls, path: str | Path, key: str = "data.train") -> PromptDataset:
        """``.txt``: one prompt a line (blank lines skipped); ``.jsonl``: ``{"prompt": ..., **metadata}``, for editing
        with an ``"image"`` path (relative to the file), or a list of them, on every row."""
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
        notes: list[str] = []
        sources = _source_images(images, path, key, notes) if any(v is not None for _, v in images) else None
        return cls(prompts, metadata, str(path), sources, notes)


def _source_images(
    images: list[tuple[int, Any]], path: Path, key: str, notes: list[str]
) -> list[str] | list[tuple[str, ...]]:
    """Each row's source image (a path, or a list of paths: a tuple of them when rows give several), resolved against
    the prompt file's folder; every problem named by file and line, and rows giving different numbers of images
    refused. Appends to ``notes`` one line per kind of conversion the images needed (with a count and the first
    row)."""
    sources: list[tuple[str, ...]] = []
    problems: list[str] = []
    converted: dict[str, list[str]] = {}  # conversion note -> the rows whose image needed it
    counts: dict[int, list[int]] = {}  # images per row -> the rows giving that many
    for number, value in images:
        if value is None:
            problems.append(
                f'{path}:{number} has no "{IMAGE_FIELD}" field, but other rows do (an editing file gives '
                "every row a source image)"
            )
            continue
        values = value if isinstance(value, list) and value else [value]
        if not all(isinstance(v, str) and v.strip() for v in values):
            problems.append(
                f'{path}:{number}: "{IMAGE_FIELD}" must be an image file path, got {value!r} (or a non-empty list of '
                "paths: several images per prompt)"
            )
            continue
        row: list[str] = []
        for v in values:
            file = path.parent / v
            try:
                _, conversions = read_image_file(file)
            except UnusableImage as err:
                problems.append(f"{path}:{number}: image {v!r} {err}")
                continue
            for note in conversions:
                converted.setdefault(note, []).append(f"{path}:{number}")
            row.append(SourceImage(resolved_path(file), f"{key}: {path}:{number}"))
        counts.setdefault(len(values), []).append(number)
        sources.append(tuple(row))
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise DataError(f"{key}: {len(problems)} editing row(s) without a usable source image: {shown}")
    if len(counts) > 1:
        shown = ", ".join(
            f"{n} at {path}:{rows[0]}" + (f" (+{len(rows) - 1} rows)" if len(rows) > 1 else "")
            for n, rows in sorted(counts.items())
        )
        raise DataError(
            f"{key}: the rows of {path} give different numbers of source images ({shown}): a batch stacks each "
            "prompt's images, so every row gives the same number; split the file by count"
        )
    notes.extend(f"{key}: {len(rows)} source image(s) {note} (first: {rows[0]})" for note, rows in converted.items())
    if counts and next(iter(counts)) > 1:
        return sources
    return [row[0] for row in sources]  # one image per row: its path, as a model taking one source expects


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


def epoch_plan(
    num_prompts: int, group_size: int, groups_per_epoch: int, *, seed: int, epoch: int, pairs: bool = False
) -> list[EpochSample]:
    """All ``group_size × groups_per_epoch`` slots of an epoch, shuffled; deterministic in (seed, epoch).

    Group ids are ``epoch × groups_per_epoch + g``, unique across epochs. Prompts are drawn without
    replacement while the file has enough (with replacement otherwise); copies of a prompt land anywhere
    in the shuffled list, so a group may span processes — advantages are computed after gathering.
    ``pairs`` (``sampler.antithetic``; an even ``group_size``): the shuffle moves two copies of a prompt at a time, so
    each lands at an even position beside its partner (the same prompts are drawn).
    """
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    if num_prompts >= groups_per_epoch:
        chosen = torch.randperm(num_prompts, generator=generator)[:groups_per_epoch]
    else:
        chosen = torch.randint(0, num_prompts, (groups_per_epoch,), generator=generator)
    first_id = epoch * groups_per_epoch
    slots = [EpochSample(int(chosen[g]), first_id + g) for g in range(groups_per_epoch) for _ in range(group_size)]
    if pairs:
        if group_size % 2:
            raise ValueError(f"pairs need an even group_size, got {group_size}")
        order = torch.randperm(len(slots) // 2, generator=generator)
        return [slots[2 * i + k] for i in order.tolist() for k in (0, 1)]
    order = torch.randperm(len(slots), generator=generator)
    return [slots[i] for i in order.tolist()]


def rank_slice(plan: list[EpochSample], rank: int, world_size: int) -> list[EpochSample]:
    """This process's contiguous share of the epoch (the config guarantees an even split)."""
    per_rank = len(plan) // world_size
    return plan[rank * per_rank : (rank + 1) * per_rank]


def rank_groups(plan: list[EpochSample], rank: int, world_size: int) -> list[EpochSample]:
    """This process's share of the epoch in whole groups, for objectives whose loss compares a group's images
    (``Objective.needs_whole_groups``): the groups in order of first appearance in the plan, dealt to the processes
    in contiguous runs of ``groups / world_size``, each process's slots in plan order. One process: the plan as is
    (what :func:`rank_slice` gives). The config guarantees the groups split evenly."""
    order = list(dict.fromkeys(s.group_id for s in plan))
    per_rank = len(order) // world_size
    mine = set(order[rank * per_rank : (rank + 1) * per_rank])
    return [s for s in plan if s.group_id in mine]


def check_editing(datasets: dict[str, PromptDataset | None], *, reward: Any = None, adapter: Any = None) -> None:
    """Refuse, before any work, prompt files that do not fit image editing: a reward that compares edits with their
    source images (``reward.needs_source_images``) on prompts without any, or source images for a model that cannot
    take them (``adapter.edits`` false), or prompts without any for a model that needs them
    (``adapter.requires_sources``: Qwen-Image-Edit), or more images per prompt than the model takes
    (``adapter.max_sources``; None: any number). ``datasets``: config key -> dataset (None: not configured)."""
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
            video, editors = _family_facts(adapter.family)
            raise DataError(
                f"{key}: {data.path} gives each prompt a source image (image editing), but model.pretrained is a "
                f"{adapter.family} text-to-{'video' if video else 'image'} pipeline: it takes no "
                f'"{IMAGE_FIELD}" and generates from the prompt alone. Use an editing model (model.kind '
                f'{" or ".join(editors)}), or prompts without "{IMAGE_FIELD}"'
            )
        if adapter is not None and data.sources is None and getattr(adapter, "requires_sources", False):
            raise DataError(
                f"{key}: {adapter.family} edits images and cannot generate from text alone, but {data.path} gives no "
                f'source images: use an editing prompt file (.jsonl rows with an "{IMAGE_FIELD}" path)'
            )
        most = getattr(adapter, "max_sources", 1)
        if adapter is not None and most is not None and data.sources_per_prompt > most:
            from .adapters.registry import families

            several = " or ".join(spec.name for spec in families() if spec.adapter.max_sources != 1)
            raise DataError(
                f"{key}: {data.path} gives {data.sources_per_prompt} source images per prompt (a list in "
                f'"{IMAGE_FIELD}"), but {adapter.family} takes {most}: use a model that reads several (model.kind '
                f'{several or "qwenimage-edit-plus"}), or one "{IMAGE_FIELD}" path per row'
            )


def _family_facts(name: str) -> tuple[bool, list[str]]:
    """Whether the registered family ``name`` generates video, and the families that edit images (the registry's
    ``FamilySpec.video`` / ``edits``; an unregistered name counts as an image family)."""
    from .adapters.registry import families  # the adapters are loaded: check_editing is given one

    specs = families()
    video = any(spec.name == name and spec.video for spec in specs)
    return video, [spec.name for spec in specs if spec.edits] or ["flux-kontext"]


def small_prompt_set_warning(
    num_prompts: int,
    pretrained: str,
    path: str | os.PathLike,
    *,
    key: str = "data.train",
    groups_per_epoch: int | None = None,
    threshold: int = SMALL_PROMPT_SET,
) -> str | None:
    """A one-paragraph warning when a real model (``model.pretrained`` anything but the shipped ``shapes-sd3`` or a
    ``tiny-<kind>`` test pipeline built in code) would train on fewer than ``threshold`` prompts (``path``, given as
    ``key``, holds ``num_prompts``); None otherwise.

    The presets' ``configs/prompts/pickscore_*`` and ``edit_tiny_*`` files are 4–12-prompt samples standing in for the
    recipes' datasets, and an epoch draws its groups from the file (with replacement when it holds fewer prompts than
    ``groups_per_epoch``): a real run left pointing at one fits those few prompts and learns nothing general."""
    if num_prompts >= threshold or _built_in_model(pretrained):
        return None
    draws = (
        f"each epoch draws its {groups_per_epoch} groups from these {num_prompts} prompts"
        + (" (with replacement)" if num_prompts < groups_per_epoch else "")
        if groups_per_epoch
        else f"every epoch draws its groups from these {num_prompts} prompts"
    )
    return (
        f"{key}: {os.fspath(path)} holds only {num_prompts} prompt(s) (fewer than {threshold}), but model.pretrained="
        f"{pretrained} is a real model: {draws}, so the run fits these prompts and nothing else. The presets' prompt "
        "files under configs/prompts/ (pickscore_*, edit_tiny_*) are small samples standing in for the recipes' "
        f"datasets: point {key} at the recipe's own prompt set (docs/recipes.md says where each comes from: "
        "Flow-GRPO's dataset/pickscore, dataset/counting_edit, HPDv2's prompts, ...; scripts/make_prompts.py "
        "generates the OCR and GenEval ones). A deliberately small prompt set may ignore this warning."
    )


def _built_in_model(pretrained: str) -> bool:
    """Whether ``pretrained`` names a model built into the package: ``shapes-sd3`` or a ``tiny-<kind>[-taesd]``."""
    from .pipelines import SHIPPED_MODELS, tiny_sources

    return pretrained in SHIPPED_MODELS or pretrained in tiny_sources()
