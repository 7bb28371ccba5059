"""Checkpoints that resume exactly, written atomically, loaded without running code; run directories.

    <run>/
        .lock                   held (flock) by the training process that owns the run: a second trainer on the
                                same run stops with exit code 2 instead of writing the same files
        config.yaml             the resolved config of the run's first attempt (never overwritten)
        config-resume-<stamp>.yaml   the resolved config of each resumed attempt (stamp: local time it started)
        checkpoints/epoch-00020/
            adapter.safetensors     LoRA weights (peft names, float32)     adapter_config.json  the LoraConfig
            ema.safetensors         EMA of the adapter weights (if train.ema > 0)
            optimizer.pt            optimizer state (tensors and numbers only: loaded with weights_only=True);
                                    under DeepSpeed instead deepspeed/ (its files: trainable weights and every
                                    process's optimizer shard), under FSDP optimizer_full.pt (whole, by parameter
                                    name)
            state.json              epoch, optimizer steps, best eval reward, … (the sliding window and the
                                    epoch's prompt plan are functions of the epoch, so this restores them too);
                                    ``written_at`` (Unix time: what ``run.resume=latest`` orders by) and
                                    ``trained_on`` (base model, model family, LoRA rank / alpha / targets: what the
                                    weights mean; :func:`check_model_matches` compares a config against it)
            config.yaml             the resolved config the checkpoint was trained with
            rng_rank{r}.json        torch / CUDA / numpy / python RNG states of every process (plain JSON)

Nothing in a checkpoint is unpickled into arbitrary objects: weights are safetensors, RNG states JSON, and the
optimizer files are read with ``torch.load(weights_only=True)`` after checking which classes they name (DeepSpeed's
files: a short allow-list of its own data classes). Checkpoints of earlier releases stored the RNG states as
pickles (``rng_rank{r}.pt``); they are still read, under the same restrictions.

A checkpoint is written under a temporary name and renamed into place, so a crash or a failed write
leaves the previous checkpoints intact; ``keep_last`` newest plus the best-by-eval one are kept. Every failure
to read or write one is a :class:`CheckpointError` naming the file and the fix.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import math
import os
import random
import re
import shutil
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .parallel import any_process, full_tensor, is_fsdp, is_sharded, load_optimizer, optimizer_state, shard_like

try:  # POSIX; elsewhere runs are not locked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

CHECKPOINTS = "checkpoints"
PREFIX = "epoch-"
RUN_STAMP = "%Y%m%d-%H%M%S"  # run directories are <run.name>-<stamp>[-<n>]
LOCK_FILE = ".lock"
RNG_FILE = "rng_rank{rank}.json"
LEGACY_RNG_FILE = "rng_rank{rank}.pt"
CONFIG_FILE = "config.yaml"
# Config keys whose change alters what the adapter weights mean: a resume or an export with another value is refused.
WEIGHT_KEYS = ("model.pretrained", "model.lora.rank", "model.lora.alpha", "model.lora.target_modules")
# Keys a resume may change without comment (extending a run, console output, where resume points).
_BOOKKEEPING_KEYS = {"run.resume", "run.epochs", "run.progress", "run.log_every"}


class CheckpointError(ValueError):
    """A checkpoint or run directory that cannot be written, read or resumed from (the message names the file)."""


def checkpoint_name(epoch: int) -> str:
    return f"{PREFIX}{epoch:05d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories are ignored)."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and re.fullmatch(rf"{PREFIX}\d+", p.name)]
    return sorted(p for p in found if (p / "state.json").is_file())


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def resolve_resume(resume: str, output_dir: str, run_name: str, warn: Callable[[str], None] = _warn) -> Path:
    """A checkpoint directory from ``run.resume``: a checkpoint, a run directory, or ``latest``.

    A run directory gives its newest loadable checkpoint; ``latest`` the newest loadable checkpoint of the runs
    named exactly ``<run_name>-<stamp>``, newest by the write time each checkpoint recorded (not by folder times,
    which any reader of a run can change). Damaged checkpoints are skipped with a warning; a checkpoint named
    explicitly must be loadable."""
    if resume == "latest":
        candidates = sorted(((_written_at(c), c) for run in run_dirs(output_dir, run_name)
                             for c in list_checkpoints(run)), reverse=True)  # fmt: skip
        if not candidates:
            raise CheckpointError(f"run.resume=latest: no run named '{run_name}' (<name>-YYYYmmdd-HHMMSS) with a "
                                  f"checkpoint in {output_dir}/; check run.name and run.output_dir")  # fmt: skip
        return _first_loadable([c for _, c in candidates], warn, f"run.resume=latest (runs of '{run_name}')")
    path = Path(resume)
    if SUPERSEDED in path.resolve().parts:
        raise CheckpointError(
            f"run.resume={resume!r} lies in a run's {SUPERSEDED}/ folder (output set aside by an earlier resume); "
            f"copy that checkpoint into a run directory of its own (<dir>/checkpoints/epoch-NNNNN) and resume from it"
        )
    if (path / "state.json").is_file():
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


def run_dirs(output_dir: str | Path, run_name: str) -> list[Path]:
    """The run directories of ``run_name`` in ``output_dir``: exactly ``<run_name>-<YYYYmmdd-HHMMSS>[-<n>]``
    (so ``tiny`` never matches a ``tiny-sd3-...`` run)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    pattern = re.compile(re.escape(run_name) + r"-(\d{8}-\d{6})(-\d+)?")
    found = []
    for path in folder.iterdir():
        match = pattern.fullmatch(path.name)
        if match and path.is_dir():
            try:
                time.strptime(match.group(1), RUN_STAMP)
            except ValueError:  # digits that are not a time, e.g. 20261399-...
                continue
            found.append(path)
    return sorted(found)


def _written_at(checkpoint: Path) -> tuple[float, int]:
    """When a checkpoint was written, as it recorded (checkpoints of earlier releases: the run's start stamp),
    and its epoch, for ordering."""
    epoch = int(checkpoint.name[len(PREFIX) :])
    try:
        state = json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))
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
    state = _read_json(checkpoint / "state.json")
    if not isinstance(state, dict) or not isinstance(state.get("epoch"), int):
        raise _damaged(checkpoint / "state.json", "no epoch")
    for name in ("adapter.safetensors", "ema.safetensors"):
        file = checkpoint / name
        if name == "adapter.safetensors" or file.exists():
            with _reading(file):
                with safe_open(str(file), "pt") as handle:  # the header, and that the data covers it
                    handle.keys()
    for rank in range(int(state.get("world_size", 1))):
        read_rng_state(checkpoint, rank, check_only=True)
    for file in _pickled_files(checkpoint):
        check_pickle_globals(file)


def _pickled_files(checkpoint: Path) -> list[Path]:
    files = [checkpoint / name for name in ("optimizer.pt", "optimizer_full.pt")]
    files += sorted((checkpoint / "deepspeed").rglob("*.pt")) if (checkpoint / "deepspeed").is_dir() else []
    return [f for f in files if f.is_file()]


def create_run_dir(output_dir: str | Path, run_name: str, stamp: str | None = None) -> Path:
    """A new run directory ``<output_dir>/<run_name>-<stamp>``, created atomically: if another process created
    that name first (same name, same second), the next free ``-1``, ``-2``, ... suffix."""
    folder = Path(output_dir)
    stamp = stamp or time.strftime(RUN_STAMP)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"run.output_dir={str(output_dir)!r}: cannot create it ({_reason(err)})") from None
    for n in range(10_000):
        path = folder / (f"{run_name}-{stamp}" + (f"-{n}" if n else ""))
        try:
            path.mkdir()  # fails if it exists: no check-then-create race
            return path
        except FileExistsError:
            continue
        except OSError as err:
            raise CheckpointError(f"cannot create the run directory {path}: {_reason(err)}") from None
    raise CheckpointError(f"{folder}: every run directory name {run_name}-{stamp}-N is taken")


class RunLock:
    """An exclusive lock on a run directory (``<run>/.lock``), held while this object holds the file open.

    flock locks belong to the open file: the kernel drops it when the process ends, however it ends (no stale
    lock after a crash or SIGKILL). Two trainers in one process conflict too (each opens the file anew)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._file: Any = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        if self.held or fcntl is None:
            return
        path = self.run_dir / LOCK_FILE
        try:
            handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open while the lock is held
        except OSError as err:
            raise CheckpointError(f"cannot create the run's lock file {path}: {_reason(err)}") from None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            handle.close()
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise CheckpointError(f"cannot lock the run directory {self.run_dir}: {_reason(err)}") from None
            raise CheckpointError(
                f"the run directory {self.run_dir} is in use by another training process (pid {owner}; it holds "
                f"{path}): two trainers would write the same checkpoints and logs. Wait for that one to end, or "
                f"start a new run (no run.resume, or another run.name)"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None


def write_run_config(run_dir: Path, config: Any, stamp: str | None = None) -> Path:
    """Record an attempt's resolved config: ``config.yaml`` for the run's first attempt (never overwritten), then
    ``config-resume-<stamp>.yaml`` for each later one (a resume)."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if path.exists():
        base, n = f"config-resume-{stamp or time.strftime(RUN_STAMP)}", 1
        path = run_dir / f"{base}.yaml"
        while path.exists():  # two attempts within a second
            path, n = run_dir / f"{base}-{n}.yaml", n + 1
    write_text(path, config.to_yaml())
    return path


def write_text(path: Path, text: str) -> None:
    """Write a file whole or not at all (a temporary file renamed into place); failures name the file."""
    tmp = path.with_name(f".tmp-{path.name}")
    with _writing(path):
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()


def check_model_matches(checkpoint: Path, config: Any) -> None:
    """Raise :class:`CheckpointError` when ``config`` describes another model than the one ``checkpoint`` was
    trained on: another ``model.pretrained``, LoRA rank, alpha or target modules (the weights would mean something
    else, or not fit). The message names each key with the checkpoint's and the config's value, and the fix.

    The record is the checkpoint's ``trained_on`` (state.json); for checkpoints of earlier releases, its
    adapter_config.json and the run's config.yaml. Nothing to compare: no error."""
    recorded = trained_on(checkpoint)
    given = _model_keys(config, recorded.get("model.kind"))
    wrong = [(k, recorded[k], given[k]) for k in WEIGHT_KEYS if k in recorded and not _same(k, recorded[k], given[k])]
    if wrong:
        listed = "; ".join(f"{k}: checkpoint {old!r}, config {new!r}" for k, old, new in wrong)
        fix = " ".join(f"{k}={_override(old)}" for k, old, _ in wrong)
        raise CheckpointError(
            f"{checkpoint} was trained on another model than this config describes ({listed}). These settings "
            f"decide what the adapter weights mean: use the config the checkpoint was trained with (its "
            f"{CONFIG_FILE}), or pass {fix}; to train with new ones, start a new run"
        )


def trained_on(checkpoint: Path) -> dict[str, Any]:
    """What a checkpoint's weights were trained on: ``WEIGHT_KEYS`` (and ``model.kind``, the family) to values."""
    checkpoint = Path(checkpoint)
    state = _read_json(checkpoint / "state.json") if (checkpoint / "state.json").is_file() else {}
    if isinstance(state, dict) and isinstance(state.get("trained_on"), dict):
        return dict(state["trained_on"])
    record: dict[str, Any] = {}
    model = (recorded_config(checkpoint) or {}).get("model") or {}
    if "pretrained" in model:
        record["model.pretrained"] = model["pretrained"]
    if model.get("kind") not in (None, "auto"):
        record["model.kind"] = model["kind"]
    adapter = checkpoint / "adapter_config.json"
    lora = _read_json(adapter) if adapter.is_file() else {}
    if isinstance(lora, dict):
        for key, name in (("model.lora.rank", "r"), ("model.lora.alpha", "lora_alpha")):
            if name in lora:
                record[key] = lora[name]
        if lora.get("target_modules"):
            record["model.lora.target_modules"] = sorted(lora["target_modules"])
    return record


def recorded_config(checkpoint: Path) -> dict[str, Any] | None:
    """The resolved config a checkpoint was trained with, as a dict: its own config.yaml, or for checkpoints of
    earlier releases the run's; None when neither exists."""
    checkpoint = Path(checkpoint)
    for path in (checkpoint / CONFIG_FILE, checkpoint.parent.parent / CONFIG_FILE):
        if path.is_file():
            with _reading(path):
                data = yaml.safe_load(path.read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else None
    return None


def recipe_changes(checkpoint: Path, config: Any) -> list[str]:
    """``key: old -> new`` for each setting that differs from the checkpoint's config, besides the bookkeeping
    ones (run.epochs, run.resume, ...): what a resume warns about."""
    old = recorded_config(checkpoint)
    if old is None:
        return []
    before, now = _flat(old), _flat(config.to_dict())
    defaults = _flat(type(config)().to_dict())
    # A key newer than the checkpoint, at its default, changes nothing (e.g. grpo.objective on an older run).
    new_at_default = {k for k in set(now) - set(before) if k in defaults and now[k] == defaults[k]}
    keys = sorted((set(before) | set(now)) - _BOOKKEEPING_KEYS - new_at_default)
    return [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in keys if before.get(k) != now.get(k)]


def _model_keys(config: Any, family: str | None) -> dict[str, Any]:
    m = config.model
    targets = m.lora.target_modules
    if targets == "default" and family is not None:
        from .adapters import ADAPTERS

        targets = list(ADAPTERS[family].default_lora_targets) if family in ADAPTERS else targets
    return {"model.pretrained": m.pretrained, "model.lora.rank": m.lora.rank, "model.lora.alpha": m.lora.alpha,
            "model.lora.target_modules": sorted(targets) if isinstance(targets, list | tuple) else targets}  # fmt: skip


def _same(key: str, old: Any, new: Any) -> bool:
    if key == "model.pretrained" and old != new:
        a, b = Path(str(old)).expanduser(), Path(str(new)).expanduser()
        return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()  # one local directory, spelled two ways
    if key == "model.lora.alpha":
        return isinstance(old, int | float) and isinstance(new, int | float) and math.isclose(old, new)
    if key == "model.lora.target_modules" and isinstance(old, list | tuple) and isinstance(new, list | tuple):
        return sorted(old) == sorted(new)
    return old == new


def _override(value: Any) -> str:
    return json.dumps(value) if isinstance(value, list | tuple) else str(value)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


SUPERSEDED = "superseded"


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
    log = run_dir / "metrics.jsonl"
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
    for path in later + files:
        target = dest / path.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    if dropped:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "metrics.jsonl").write_text("".join(dropped), encoding="utf-8")
        tmp = log.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, log)
    return dest


def _epoch_of(path: Path) -> int:
    """NNNNN of ``epochNNNNN.json`` / ``.png`` / ``.gif`` (eval reports, sample grids, video previews); -1 for any
    other name."""
    match = re.fullmatch(r"epoch(\d+)\.(json|png|gif)", path.name)
    return int(match.group(1)) if match else -1


def lora_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights under peft's saved names (no adapter name), float32 on the CPU.

    Under FSDP2 the weights are gathered whole: every process must call this.
    """
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    return {k: full_tensor(v.detach()).float().cpu().contiguous() for k, v in state.items()}


def load_lora_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load adapter weights; every LoRA weight of the model must be in ``state`` and nothing else."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = set(get_peft_model_state_dict(model))
    missing = sorted(expected - set(state))
    if missing:
        raise CheckpointError(f"the checkpoint lacks adapter weights of this model (e.g. {missing[0]}): "
                              "was it trained with other model.lora settings?")  # fmt: skip
    unexpected = sorted(set(state) - expected)
    if unexpected:
        raise CheckpointError(f"adapter weights do not fit this model (unexpected keys such as {unexpected[0]})")
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if any(is_sharded(p) for _, p in params):
        # FSDP2 shards: each process keeps its part of the (identical) full tensors.
        with torch.no_grad():
            for name, p in params:
                p.copy_(shard_like(state[_saved_name(name)], p))
        return
    set_peft_model_state_dict(model, state)


def trainable_names(model: torch.nn.Module) -> list[str]:
    """Saved (peft) names of the trainable LoRA parameters, in ``parameters()`` order — the EMA's order."""
    return [_saved_name(name) for name, p in model.named_parameters() if p.requires_grad]


def _saved_name(parameter_name: str, adapter: str = "default") -> str:
    # peft's state dict drops the adapter name: "...lora_A.default.weight" -> "...lora_A.weight".
    return parameter_name.replace(f".{adapter}.", ".")


def rng_state() -> dict[str, Any]:
    """This process's torch / CUDA / numpy / python RNG states (what a checkpoint stores per process)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _rng_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """RNG states as plain JSON: byte states in base64, numpy's MT19937 key and python's state as integers."""
    kind, key, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss = state["python"]
    return {
        "format": 1,
        "torch": _b64(state["torch"]),
        "cuda": [_b64(t) for t in state["cuda"]],
        "numpy": {
            "kind": kind,
            "key": [int(k) for k in key],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "state": list(internal), "gauss": gauss},
    }


def _rng_from_json(data: Any) -> dict[str, Any]:
    """The inverse of :func:`_rng_to_json`; ValueError / KeyError / TypeError for anything malformed."""
    n, p = data["numpy"], data["python"]
    key = np.array(n["key"], dtype=np.int64)
    python_state = p["state"]
    if (
        data.get("format") != 1 or n["kind"] != "MT19937" or key.shape != (624,) or key.min() < 0
        or key.max() >= 2**32 or len(python_state) != 625 or not all(type(v) is int for v in python_state)
    ):  # fmt: skip
        raise ValueError("not the RNG states flowgrpo writes")
    gauss = p["gauss"]
    return {
        "torch": _unb64(data["torch"]),
        "cuda": [_unb64(t) for t in data["cuda"]],
        "numpy": ("MT19937", key.astype(np.uint32), int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"])),
        "python": (int(p["version"]), tuple(python_state), None if gauss is None else float(gauss)),
    }


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8).clone()


def read_rng_state(checkpoint: Path, rank: int, *, check_only: bool = False) -> dict[str, Any] | None:
    """Process ``rank``'s RNG states stored in ``checkpoint`` (None if it stored none), as :func:`rng_state`
    returns them. Reading runs no code: JSON, or a legacy ``rng_rank{r}.pt`` loaded with ``weights_only``."""
    file = Path(checkpoint) / RNG_FILE.format(rank=rank)
    legacy = Path(checkpoint) / LEGACY_RNG_FILE.format(rank=rank)
    if file.is_file():
        with _reading(file):
            state = _rng_from_json(json.loads(file.read_text(encoding="utf-8")))
    elif legacy.is_file():
        state = load_torch_file(legacy, allow=_numpy_globals())
        with _reading(legacy):
            state = _rng_from_json(_rng_to_json(state))  # the same checks as for the JSON files
    else:
        return None
    return None if check_only else state


def _numpy_globals() -> list[Any]:
    """What a pickled numpy array needs (numpy 1 and 2 name its module differently); data only, no code."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct

    uint32 = type(np.dtype(np.uint32))  # the dtype class the array's BUILD step instantiates
    return [np.ndarray, np.dtype, uint32, _reconstruct, (_reconstruct, "numpy.core.multiarray._reconstruct")]


def load_torch_file(path: Path, allow: Iterable[Any] = ()) -> Any:
    """``torch.load`` that runs no code: the file's pickle may name only tensors, containers, numbers and the
    classes in ``allow`` (checked before loading, and enforced by ``weights_only=True`` while loading)."""
    allowed = list(allow)
    check_pickle_globals(path, allowed)
    with _reading(path), torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def check_pickle_globals(path: Path, allow: Iterable[Any] | None = None) -> None:
    """Refuse a torch file that is no whole zip archive or whose pickle names a class or function outside what
    ``weights_only`` loading accepts plus ``allow`` (default: numpy arrays and DeepSpeed's data classes), without
    unpickling it."""
    allowed = {_qualified(g) for g in (_numpy_globals() + _deepspeed_globals() if allow is None else allow)}
    with _reading(path):
        if not zipfile.is_zipfile(path):
            raise ValueError("not a torch zip archive (truncated, or not written by torch.save)")
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - allowed
    if unsafe:
        raise CheckpointError(
            f"{path} refers to {', '.join(sorted(unsafe))}, which loading a checkpoint never needs: loading it "
            f"could run code. Do not use this checkpoint unless you know who made it and why it holds that"
        )


def _deepspeed_globals() -> list[Any]:
    """The classes DeepSpeed's ZeRO-2 files pickle besides tensors (plain data: an enum, a loss scaler's numbers,
    fragment offsets); empty without DeepSpeed."""
    found: list[Any] = []
    for module, names in (("deepspeed.runtime.zero.config", ["ZeroStageEnum"]),
                          ("deepspeed.runtime.fp16.loss_scaler", ["LossScaler", "DynamicLossScaler"]),
                          ("deepspeed.utils.tensor_fragment", ["fragment_address"])):  # fmt: skip
        with contextlib.suppress(ImportError):
            imported = __import__(module, fromlist=names)
            found += [getattr(imported, n) for n in names if hasattr(imported, n)]
    return found


def deepspeed_safe_globals() -> list[Any]:
    """What :func:`load_torch_file` must allow for DeepSpeed's checkpoint files."""
    return _deepspeed_globals()


def _qualified(obj: Any) -> str:
    """The name a pickle gives ``obj`` (``(obj, name)``: registered under another name, as torch's safe_globals)."""
    return obj[1] if isinstance(obj, tuple) else f"{obj.__module__}.{obj.__qualname__}"


def _read_json(path: Path) -> Any:
    with _reading(path):
        return json.loads(path.read_text(encoding="utf-8"))


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Turn any failure to read ``path`` into a CheckpointError naming it (safetensors', torch's, JSON's own
    errors name no file)."""
    try:
        yield
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; resume from another one (a run "
                              "directory or run.resume=latest picks the newest complete one)") from None  # fmt: skip
    except Exception as err:  # noqa: BLE001 - every library raises its own type; all mean "unreadable"
        raise _damaged(path, _reason(err)) from None


def _damaged(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"cannot read {path} ({why}): the checkpoint is damaged (an interrupted copy, a full disk?). Resume from "
        f"another one: a run directory or run.resume=latest picks the newest loadable checkpoint"
    )


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Turn a failure to write ``path`` (disk full, permissions; torch reports a full disk as a RuntimeError
    from its zip writer) into a CheckpointError naming it and the fix."""
    try:
        yield
    except CheckpointError:
        raise
    except (OSError, RuntimeError) as err:
        full = isinstance(err, OSError) and err.errno == errno.ENOSPC or "inline_container" in str(err)
        hint = "the disk is full: free space on it" if full else "check the folder's permissions and free space"
        raise CheckpointError(f"cannot write {path}: {_reason(err)}; {hint}") from err


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) < 300 else text[:300] + "..."


def save_checkpoint(trainer: Any, epoch: int, rng: dict[str, Any] | None = None) -> Path:
    """Write ``<run>/checkpoints/epoch-NNNNN`` atomically (all processes call this; rank 0 writes the shared parts).

    ``rng``: the RNG states to store instead of the current ones (a stop during sampling stores the epoch's
    starting states, so that a resume redoes the epoch exactly). Failures are CheckpointErrors naming the file."""
    acc = trainer.accelerator
    folder = trainer.run_dir / CHECKPOINTS
    final = folder / checkpoint_name(epoch)
    tmp = folder / f".tmp-{checkpoint_name(epoch)}"
    from .adapters import unwrap

    failure: BaseException | None = None
    if acc.is_main_process:
        try:
            with _writing(tmp):
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
        except CheckpointError as err:  # disk full, permissions: every process raises, none waits in a collective
            failure = err
    if any_process(acc, failure is not None):
        _raise(failure, f"rank 0 could not create {tmp}; the previous checkpoints are intact")
    model = unwrap(trainer.adapter.transformer)
    current: Path = tmp
    try:
        # First every collective, while all processes are in step (DeepSpeed's save, FSDP's gathers); then the
        # writes, whose failures the processes agree on below.
        current = tmp / "deepspeed"
        with _writing(current):
            optimizer = optimizer_state(acc, model, trainer.optimizer, tmp)
        gather = acc.is_main_process or is_fsdp(acc)
        weights = lora_state(model) if gather else {}
        shadow = [full_tensor(s).cpu() for s in trainer.ema.shadow] if gather and trainer.ema is not None else []
        # RNG states are per process; everything else is replicated and written once.
        states = _rng_to_json(rng if rng is not None else rng_state())
        write_text(tmp / RNG_FILE.format(rank=acc.process_index), json.dumps(states))
        if acc.is_main_process:
            if optimizer is not None:
                with _writing(tmp / optimizer[0]):
                    torch.save(optimizer[1], tmp / optimizer[0])
            with _writing(tmp / "adapter.safetensors"):
                save_file(weights, str(tmp / "adapter.safetensors"))
            peft = model.peft_config["default"]
            config = peft.to_dict()
            config["target_modules"] = sorted(config["target_modules"]) if config.get("target_modules") else None
            # Other sets (exclude_modules, see PipelineAdapter.lora_exclude) as lists: load_lora_weights reads them.
            config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
            write_text(tmp / "adapter_config.json", json.dumps(config, indent=2, default=str))
            if trainer.ema is not None:
                names = trainable_names(model)
                with _writing(tmp / "ema.safetensors"):
                    save_file({n: s.contiguous() for n, s in zip(names, shadow, strict=True)},
                              str(tmp / "ema.safetensors"), metadata={"decay": str(trainer.ema.decay)})  # fmt: skip
            write_text(tmp / CONFIG_FILE, trainer.config.to_yaml())
            trained = {"model.pretrained": trainer.config.model.pretrained, "model.kind": trainer.adapter.family,
                       "model.lora.rank": peft.r, "model.lora.alpha": peft.lora_alpha,
                       "model.lora.target_modules": config["target_modules"]}  # fmt: skip
            state = {**asdict(trainer.state), "epoch": epoch, "world_size": acc.num_processes,
                     "written_at": time.time(), "trained_on": trained}  # fmt: skip
            write_text(tmp / "state.json", json.dumps(state, indent=2))
    except BaseException as err:  # noqa: BLE001 - re-raised below, after cleaning up
        failure = err
    if any_process(acc, failure is not None):
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise(failure, f"another process failed to write its part of {final.name}; the previous ones are intact")
    if acc.is_main_process:
        try:
            # Re-saving an epoch: move the old copy aside first, so some complete copy exists at every moment.
            old = folder / f".old-{final.name}"
            with _writing(final):
                if final.exists():
                    shutil.rmtree(old, ignore_errors=True)
                    os.replace(final, old)
                os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            _prune(folder, trainer.config.checkpoint.keep_last, trainer.state.best_checkpoint)
        except CheckpointError as err:
            failure = err
    if any_process(acc, failure is not None):
        _raise(failure, f"rank 0 could not move {final.name} into place (rank 0's error says why)")
    return final


def _raise(failure: BaseException | None, elsewhere: str) -> None:
    """This process's own failure, or a CheckpointError saying that another process failed."""
    raise failure if failure is not None else CheckpointError(elsewhere)


def _prune(folder: Path, keep_last: int, best: str | None) -> None:
    checkpoints = list_checkpoints(folder.parent)
    for old in checkpoints[: max(len(checkpoints) - keep_last, 0)]:
        if old.name != best:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(trainer: Any, checkpoint: Path) -> None:
    """Restore weights, optimizer, EMA, counters and this process's RNG states from ``checkpoint``.

    Every file is read first, then the processes agree that all could read theirs, then the state is applied (a
    process that cannot read its files must not leave the others waiting in DeepSpeed's or FSDP's collectives)."""
    from .adapters import unwrap

    acc = trainer.accelerator
    model = unwrap(trainer.adapter.transformer)
    failure: BaseException | None = None
    try:
        adapter_file = checkpoint / "adapter.safetensors"
        with _reading(adapter_file):
            weights = load_file(str(adapter_file))
        ema = read_weights(checkpoint, ema=True) if trainer.ema is not None else None
        state = _read_json(checkpoint / "state.json")
        rng = read_rng_state(checkpoint, acc.process_index)
    except CheckpointError as err:
        failure = err
    if any_process(acc, failure is not None):
        _raise(failure, f"another process could not read its part of {checkpoint} (its error says which file)")
    load_lora_state(model, weights)  # copied onto the device by load
    load_optimizer(acc, model, trainer.optimizer, checkpoint)
    if ema is not None:
        trainer.ema.shadow = [shard_like(ema[name], p, torch.float32)
                              for name, p in zip(trainable_names(model), trainer.params, strict=True)]  # fmt: skip
    if state.get("world_size", acc.num_processes) != acc.num_processes:
        acc.print(f"warning: checkpoint written by {state['world_size']} processes, resuming on {acc.num_processes}; "
                  "the epoch plan is unchanged but per-process noise differs")  # fmt: skip
    for key in ("epoch", "global_step", "nonfinite_in_a_row", "best_eval", "best_checkpoint"):
        if key in state:
            setattr(trainer.state, key, state[key])
    if rng is not None:
        _set_rng_state(rng)


def read_weights(checkpoint: Path, *, ema: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's adapter weights (``ema``: their EMA) under peft's saved names."""
    checkpoint = Path(checkpoint)
    file = checkpoint / ("ema.safetensors" if ema else "adapter.safetensors")
    if not file.is_file():
        hint = ": the run had train.ema = 0" if ema else " (not a checkpoint?)"
        raise CheckpointError(f"{file} does not exist{hint}")
    with _reading(file):
        return load_file(str(file))


def load_adapter_weights(model: torch.nn.Module, checkpoint: Path, *, ema: bool = False) -> None:
    """Load a checkpoint's adapter weights (``ema``: its EMA weights) into a model that has the LoRA layers."""
    load_lora_state(model, read_weights(checkpoint, ema=ema))
