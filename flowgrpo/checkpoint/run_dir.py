"""Run directories: ``<run.output_dir>/<run.name>-<YYYYmmdd-HHMMSS>[-<n>]``, created atomically, locked by the
one training process that owns them, with the resolved config of every attempt and the run's identity
(``run.json``: a random ``run_id`` that each of its checkpoints records, so that a resume writes only into the run a
checkpoint proves it belongs to: :func:`flowgrpo.checkpoint.resume.resume_run_dir`).

Rank 0 does the file work; the other processes wait in a collective and get the same path, or the same error
(:func:`on_main`): no process is left waiting in a collective while another has stopped.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from ..parallel import any_process
from .layout import CONFIG_FILE, RUN_FILE
from .safe_io import CheckpointError, reason, write_text

if TYPE_CHECKING:
    from ..config import Config

try:  # POSIX; elsewhere runs are not locked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

RUN_STAMP = "%Y%m%d-%H%M%S"  # run directories are <run.name>-<stamp>[-<n>]
LOCK_FILE = ".lock"


def open_run_dir(accelerator: Accelerator, config: Config, run_dir: Path | None) -> tuple[Path, RunLock | None]:
    """The run directory every process trains in, and rank 0's lock on it (None on the other ranks).

    ``run_dir`` None: a new ``<run.output_dir>/<run.name>-<stamp>`` with the config in its config.yaml, removed
    again if that fails (a full disk leaves no empty run behind). Given (a resumed run, or a caller's choice): it
    is created if missing and locked. Either way it gets a ``run.json`` (its identity) if it has none. A second
    trainer on a locked run stops with a CheckpointError naming the holder's pid. Every process gets the same path,
    or the same error. :meth:`RunLock.abandon` undoes what this did (a resume refused after it)."""
    run = config.run
    lock: RunLock | None = None
    path: Path | None = run_dir

    def create_and_lock() -> None:
        nonlocal path, lock
        created = path is None
        path = create_run_dir(run.output_dir, run.name) if created else Path(path)
        existed = path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)  # an explicit run_dir may not exist yet
            lock = RunLock(path, made_run=created or not existed)
            lock.acquire()
            if created:
                write_run_config(path, config)
            if read_run_id(path) is None:
                write_run_file(path)
        except (CheckpointError, OSError) as err:
            if lock is not None:
                lock.abandon()
            elif created or not existed:
                shutil.rmtree(path, ignore_errors=True)
            raise err if isinstance(err, CheckpointError) else CheckpointError(f"{path}: {err}") from err

    on_main(accelerator, create_and_lock)
    holder = [str(path) if path is not None else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(holder)
    return Path(holder[0]), lock


def on_main(accelerator: Accelerator, work: Callable[[], Any]) -> None:
    """Run ``work`` on rank 0; if it raises a CheckpointError, every process raises (none is left waiting in a
    collective): rank 0 its own error, the others one saying rank 0 failed."""
    failure: CheckpointError | None = None
    if accelerator.is_main_process:
        try:
            work()
        except CheckpointError as err:
            failure = err
    if any_process(accelerator, failure is not None):
        raise failure or CheckpointError("rank 0 could not set up the run directory (its error says why)")


def create_run_dir(output_dir: str | Path, run_name: str, stamp: str | None = None) -> Path:
    """A new run directory ``<output_dir>/<run_name>-<stamp>``, created atomically: if another process created
    that name first (same name, same second), the next free ``-1``, ``-2``, ... suffix."""
    folder = Path(output_dir)
    stamp = stamp or time.strftime(RUN_STAMP)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"run.output_dir={str(output_dir)!r}: cannot create it ({reason(err)})") from None
    for n in range(10_000):
        path = folder / (f"{run_name}-{stamp}" + (f"-{n}" if n else ""))
        try:
            path.mkdir()  # fails if it exists: no check-then-create race
            return path
        except FileExistsError:
            continue
        except OSError as err:
            raise CheckpointError(f"cannot create the run directory {path}: {reason(err)}") from None
    raise CheckpointError(f"{folder}: every run directory name {run_name}-{stamp}-N is taken")


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


class RunLock:
    """An exclusive lock on a run directory (``<run>/.lock``), held while this object holds the file open.

    flock locks belong to the open file: the kernel drops it when the process ends, however it ends (no stale
    lock after a crash or SIGKILL). Two trainers in one process conflict too (each opens the file anew).

    ``made_run``: this trainer created the run directory (:meth:`abandon` removes it whole)."""

    def __init__(self, run_dir: Path, *, made_run: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.made_run = made_run
        self.made_file = False  # acquire() created the lock file (abandon() removes it)
        self._file: Any = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        if self.held or fcntl is None:
            return
        path = self.run_dir / LOCK_FILE
        existed = path.exists()
        try:
            handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open while the lock is held
        except OSError as err:
            raise CheckpointError(f"cannot create the run's lock file {path}: {reason(err)}") from None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            handle.close()
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise CheckpointError(f"cannot lock the run directory {self.run_dir}: {reason(err)}") from None
            raise CheckpointError(
                f"the run directory {self.run_dir} is in use by another training process (pid {owner}; it holds "
                f"{path}): two trainers would write the same checkpoints and logs. Wait for that one to end, or "
                f"start a new run (no run.resume, or another run.name)"
            ) from None
        self.made_file = self.made_file or not existed
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None

    def abandon(self) -> None:
        """Setting up the run failed (a refused resume): release the lock and remove what this trainer created,
        the run directory whole if it made it, else the lock file if it made that (nothing else is touched)."""
        lock_file = self.run_dir / LOCK_FILE
        if self.made_run:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        elif self.made_file and self.held:
            lock_file.unlink(missing_ok=True)  # while still holding it: no other trainer holds this file
        self.release()


def write_run_config(run_dir: Path, config: Config, stamp: str | None = None) -> Path:
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


def read_run_id(run_dir: Path) -> str | None:
    """The identity ``run.json`` records (None: no such file, or no ``run_id`` in it, as runs of earlier releases)."""
    try:
        data = json.loads((Path(run_dir) / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    run_id = data.get("run_id") if isinstance(data, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def write_run_file(run_dir: Path, **extra: Any) -> str:
    """Give a run its identity: ``run.json`` with a new random ``run_id`` (and ``extra``: e.g. ``resumed_from``,
    the checkpoint a new run continues); keeps an existing ``run_id``. Returns the id."""
    path = Path(run_dir) / RUN_FILE
    run_id = read_run_id(run_dir) or uuid.uuid4().hex
    try:
        old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        old = {}
    record = {**(old if isinstance(old, dict) else {}), "run_id": run_id, **extra}
    write_text(path, json.dumps(record, indent=2) + "\n")
    return run_id
