"""Which checkpoint ``run.resume`` means, whether it can be loaded (checked without loading it), which run directory
the resumed run writes into, and what a resume from an older checkpoint sets aside.

``run.resume`` is a checkpoint, a run directory (its newest loadable checkpoint) or ``latest`` (the newest loadable
checkpoint of the runs named exactly ``<run.name>-<stamp>``, by the write time each checkpoint recorded). Damaged
checkpoints are skipped with a warning; a checkpoint named explicitly must be loadable.

A resume continues in the checkpoint's own run only when the checkpoint proves it belongs there
(:func:`resume_run_dir`); any other checkpoint (a copy in some folder, one dropped into another run) starts a new run
under ``run.output_dir``, and nothing around the checkpoint is touched.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from .compat import check_lora_fits, check_model_matches, model_lora_shapes, saved_lora_shapes
from .layout import (
    ADAPTER_FILE,
    CHECKPOINTS,
    CONFIG_FILE,
    EMA_FILE,
    METRICS_FILE,
    OLD_WEIGHTS_FILE,
    PREFIX,
    REFERENCE_FILE,
    RUN_FILE,
    STATE_FILE,
    checkpoint_epoch,
    checkpoint_name,
    list_checkpoints,
)
from .optimizer import optimizer_files
from .rng import read_rng_state
from .run_dir import RUN_STAMP, read_run_id, run_dirs
from .safe_io import CheckpointError, check_pickle_globals, damaged, read_json, reading, writing

if TYPE_CHECKING:
    import torch

    from ..config import Config

SUPERSEDED = "superseded"  # <run>/superseded/after-epoch-NNNNN-<stamp>/: what a resume from an older one set aside


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def resolve_resume(resume: str, output_dir: str, run_name: str, warn: Callable[[str], None] = _warn) -> Path:
    """A checkpoint directory from ``run.resume``: a checkpoint, a run directory, or ``latest``.

    A run directory gives its newest loadable checkpoint; ``latest`` the newest loadable checkpoint of the runs
    named exactly ``<run_name>-<stamp>``, newest by the write time each checkpoint recorded (not by folder times,
    which any reader of a run can change). Damaged checkpoints are skipped with a warning; a checkpoint named
    explicitly must be loadable."""
    if resume == "latest":
        candidates = sorted(
            ((_written_at(c), c) for run in run_dirs(output_dir, run_name) for c in list_checkpoints(run)), reverse=True
        )
        if not candidates:
            raise CheckpointError(
                f"run.resume=latest: no run named '{run_name}' (<name>-YYYYmmdd-HHMMSS) with a "
                f"checkpoint in {output_dir}/; check run.name and run.output_dir"
            )
        return _first_loadable([c for _, c in candidates], warn, f"run.resume=latest (runs of '{run_name}')")
    path = Path(resume)
    if SUPERSEDED in path.resolve().parts:
        raise CheckpointError(
            f"run.resume={resume!r} lies in a run's {SUPERSEDED}/ folder (output set aside by an earlier resume); "
            f"copy that checkpoint into a run directory of its own (<dir>/checkpoints/epoch-NNNNN) and resume from it"
        )
    if (path / STATE_FILE).is_file():
        verify_checkpoint(path)
        return path
    if path.is_dir() and list_checkpoints(path):
        return _first_loadable(list_checkpoints(path)[::-1], warn, f"run.resume={resume!r}")
    raise CheckpointError(
        f"run.resume={resume!r} is neither a checkpoint (a folder with state.json) nor a run directory with "
        f"checkpoints; pass <run>/checkpoints/epoch-NNNNN, <run>, or latest"
    )


def _first_loadable(checkpoints: list[Path], warn: Callable[[str], None], what: str) -> Path:
    """The first of ``checkpoints`` (newest first) that :func:`verify_checkpoint` accepts; a warning per skip."""
    problems = []
    for checkpoint in checkpoints:
        try:
            verify_checkpoint(checkpoint)
        except CheckpointError as err:
            problems.append(str(err))
            warn(f"skipping a damaged checkpoint: {err}")
            continue
        if problems:
            warn(f"resuming from {checkpoint}, the newest complete and loadable checkpoint")
        return checkpoint
    raise CheckpointError(f"{what}: no loadable checkpoint ({len(problems)} damaged: {'; '.join(problems)})")


def _written_at(checkpoint: Path) -> tuple[float, int]:
    """When a checkpoint was written, as it recorded (checkpoints of earlier releases: the run's start stamp),
    and its epoch, for ordering."""
    epoch = checkpoint_epoch(checkpoint)
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))
        return float(state["written_at"]), epoch
    except (OSError, ValueError, KeyError, TypeError):
        pass
    match = re.search(r"-(\d{8}-\d{6})(-\d+)?$", checkpoint.parent.parent.name)
    try:
        return time.mktime(time.strptime(match.group(1), RUN_STAMP)) if match else 0.0, epoch
    except ValueError:
        return 0.0, epoch


def verify_checkpoint(checkpoint: Path) -> None:
    """Check, without loading any tensor data or running any code, that ``checkpoint`` is complete and readable:
    state.json parses, the safetensors files are whole, the RNG states parse, the optimizer files are whole zip
    archives naming only allowed classes. Raises :class:`CheckpointError` naming the first bad file."""
    checkpoint = Path(checkpoint)
    state = read_json(checkpoint / STATE_FILE)
    if not isinstance(state, dict) or not isinstance(state.get("epoch"), int):
        raise damaged(checkpoint / STATE_FILE, "no epoch")
    for name in (ADAPTER_FILE, EMA_FILE, REFERENCE_FILE, OLD_WEIGHTS_FILE):
        file = checkpoint / name
        if name == ADAPTER_FILE or file.exists():
            with reading(file):
                with safe_open(str(file), "pt") as handle:  # the header, and that the data covers it
                    handle.keys()
    for rank in range(int(state.get("world_size", 1))):
        read_rng_state(checkpoint, rank, check_only=True)
    for file in optimizer_files(checkpoint):
        check_pickle_globals(file)


def check_resume(checkpoint: Path, config: Config, transformer: torch.nn.Module, *, ema: bool) -> None:
    """Everything about ``checkpoint`` that can refuse a resume, checked before the run directory is chosen or
    locked (a refusal leaves nothing behind): its weights mean what the config says (model, LoRA rank, alpha,
    targets) and have exactly the model's LoRA names and shapes; with ``ema`` (train.ema > 0) it has their EMA."""
    from ..adapters import unwrap

    checkpoint = Path(checkpoint)
    check_model_matches(checkpoint, config)
    expected = model_lora_shapes(unwrap(transformer))
    check_lora_fits(checkpoint, config, expected, saved_lora_shapes(checkpoint))
    if ema:
        if not (checkpoint / EMA_FILE).is_file():
            raise CheckpointError(
                f"{checkpoint / EMA_FILE} does not exist: the checkpoint was trained with train.ema: 0, and this "
                f"config sets train.ema: {config.train.ema}. Resume with train.ema: 0, or start a new run"
            )
        check_lora_fits(checkpoint, config, expected, saved_lora_shapes(checkpoint, ema=True))


def owning_run(checkpoint: Path) -> tuple[Path | None, str]:
    """The run directory ``checkpoint`` proves it belongs to, or None and why not.

    It does when it sits at ``<run>/checkpoints/epoch-NNNNN`` (no symbolic link out of it) with NNNNN its recorded
    epoch, ``<run>`` has its ``config.yaml``, and the ``run_id`` in the checkpoint's state.json is the one in
    ``<run>/run.json``. Checkpoints of earlier releases recorded no run id: ``<run>`` must have the run's marker
    files, ``config.yaml`` and ``metrics.jsonl``."""
    checkpoint = Path(checkpoint)
    run = checkpoint.parent.parent
    where = f"{CHECKPOINTS}/{PREFIX}NNNNN"
    if checkpoint.parent.name != CHECKPOINTS or not re.fullmatch(rf"{PREFIX}\d+", checkpoint.name):
        return None, f"it does not sit in a run directory's {where}"
    if checkpoint.resolve().parent.parent != run.resolve():
        return None, f"it is a link to a folder elsewhere, not a run's {where}"
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = None
    if not isinstance(state, dict) or state.get("epoch") != checkpoint_epoch(checkpoint):
        return None, f"its {STATE_FILE} records another epoch than its name says (a renamed copy)"
    if not (run / CONFIG_FILE).is_file():
        return None, f"{run} has no {CONFIG_FILE}, so it is no run directory"
    recorded = state.get("run_id")
    if recorded is not None:
        if read_run_id(run) != recorded:
            return None, f"it was written by another run than {run} (the run_id of its {STATE_FILE} and {RUN_FILE})"
    elif not (run / METRICS_FILE).is_file():
        return None, f"{run} has no {METRICS_FILE}, so it is no run directory"
    return run, ""


def resume_run_dir(checkpoint: Path, warn: Callable[[str], None] = _warn) -> Path | None:
    """The run directory a resume from ``checkpoint`` continues in: the checkpoint's own run when it proves it
    belongs there (:func:`owning_run`), else None, a new run under ``run.output_dir`` (with a warning saying why);
    a resume never writes anywhere else."""
    run, why = owning_run(checkpoint)
    if run is None:
        warn(
            f"{checkpoint} is not a checkpoint of the folder around it ({why}): the resumed run starts a new run "
            f"directory under run.output_dir, and nothing beside the checkpoint is written"
        )
    return run


def set_aside_later(run_dir: Path, epoch: int, stamp: str) -> Path | None:
    """Resuming from an older checkpoint of a run: move what the run wrote after ``epoch`` (later checkpoints,
    their metrics rows, eval reports and sample grids) to ``<run>/superseded/after-epoch-NNNNN-<stamp>/``.

    Left in place, a later ``run.resume=latest`` would pick the abandoned run's newest checkpoint, pruning would
    interleave both runs' checkpoints, and the metrics log would hold every epoch twice. Nothing is deleted.
    Returns the folder, or None when the resumed checkpoint was the run's newest output. Rank 0 only.
    """
    run_dir = Path(run_dir)
    later = [c for c in list_checkpoints(run_dir) if c.name > checkpoint_name(epoch)]
    # Sample grids are named by the epoch that sampled them, eval reports by the epochs done before them.
    files = [p for p in sorted((run_dir / "samples").glob("epoch*.png")) if _epoch_of(p) >= epoch]
    files += [p for p in sorted((run_dir / "eval").glob("epoch*.*")) if _epoch_of(p) > epoch]
    log = run_dir / METRICS_FILE
    kept: list[str] = []
    dropped: list[str] = []
    for row in log.read_text(encoding="utf-8").splitlines(keepends=True) if log.is_file() else []:
        try:
            keep = json.loads(row)["epoch"] < epoch
        except (ValueError, KeyError, TypeError):  # a line cut short by a crash
            keep = False
        (kept if keep else dropped).append(row)
    if not later and not files and not dropped:
        return None
    base = run_dir / SUPERSEDED / f"after-{checkpoint_name(epoch)}-{stamp}"
    dest, n = base, 1
    while dest.exists():  # two resumes within the same second
        dest, n = base.with_name(f"{base.name}-{n}"), n + 1
    with writing(dest):
        for path in later + files:
            target = dest / path.relative_to(run_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        if dropped:
            dest.mkdir(parents=True, exist_ok=True)
            (dest / METRICS_FILE).write_text("".join(dropped), encoding="utf-8")
            tmp = log.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, log)
    return dest


def _epoch_of(path: Path) -> int:
    """NNNNN of ``epochNNNNN.json`` / ``.png`` / ``.gif`` (eval reports, sample grids, video previews); -1 for any
    other name."""
    match = re.fullmatch(r"epoch(\d+)\.(json|png|gif)", path.name)
    return int(match.group(1)) if match else -1
