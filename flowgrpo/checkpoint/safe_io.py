"""Reading and writing checkpoint files safely: every failure a :class:`CheckpointError` naming the file and the fix,
text written whole or not at all, torch files loaded without running code.

A torch file's pickle may name only tensors, containers, numbers and an allow-list of plain data classes (numpy
arrays for the RNG states of earlier releases, DeepSpeed's few data classes); the names are checked before
unpickling, and ``torch.load(weights_only=True)`` enforces the same while loading. The leaf of the package: it
imports nothing of flowgrpo.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch


class CheckpointError(ValueError):
    """A checkpoint or run directory that cannot be written, read or resumed from (the message names the file)."""


def reason(err: BaseException) -> str:
    """The first line of an error's message (at most 300 characters), or its type's name."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) < 300 else text[:300] + "..."


def damaged(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"cannot read {path} ({why}): the checkpoint is damaged (an interrupted copy, a full disk?). Resume from "
        f"another one: a run directory or run.resume=latest picks the newest loadable checkpoint"
    )


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Turn any failure to read ``path`` into a CheckpointError naming it (safetensors', torch's, JSON's own
    errors name no file)."""
    try:
        yield
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: the checkpoint is incomplete; resume from another one (a run "
            "directory or run.resume=latest picks the newest complete one)"
        ) from None
    except Exception as err:  # noqa: BLE001 - every library raises its own type; all mean "unreadable"
        raise damaged(path, reason(err)) from None


# What a failed write's errno means, and the fix (any other errno: its strerror, and the generic hint).
WRITE_ERRORS = {
    errno.ENOSPC: "the disk is full: free space on it, or set run.output_dir to another disk",
    errno.EDQUOT: "the disk quota is exceeded: free space within the quota, raise it, or set run.output_dir elsewhere",
    errno.EFBIG: (
        "the file is larger than the filesystem allows (FAT32: 4 GiB) or than this process's file-size limit "
        "(ulimit -f): raise the limit, or set run.output_dir to another filesystem"
    ),
    errno.EACCES: "permission denied: make the folder writable, or set run.output_dir elsewhere",
    errno.EPERM: "the operation is not permitted: make the folder writable, or set run.output_dir elsewhere",
    errno.EROFS: "the filesystem is read-only: set run.output_dir to a writable one",
}
# torch's zip writer reports any failed write (full disk, quota, file-size limit) as a RuntimeError naming this
TORCH_WRITER = "inline_container"


def write_error(path: Path, err: BaseException) -> str:
    """``cannot write <path>: <what the error says>; <what it means and the fix>``, by the error's errno."""
    code = getattr(err, "errno", None) if isinstance(err, OSError) else None
    if code is not None:
        what = err.strerror or os.strerror(code)
        hint = WRITE_ERRORS.get(code, "check the folder's permissions and free space")
    elif TORCH_WRITER in str(err):
        what = reason(err)
        hint = (
            "the write stopped short: the disk is full, a disk quota is exceeded, or the file is larger than the "
            "filesystem or this process's file-size limit (ulimit -f) allow; free space or raise the limit, or set "
            "run.output_dir elsewhere"
        )
    else:
        what, hint = reason(err), "check the folder's permissions and free space"
    return f"cannot write {path}: {what}; {hint}"


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn a failure to write ``path`` into a CheckpointError naming it, what the error means and the fix
    (:func:`write_error`: a full disk, an exceeded quota, a file over the file-size limit, permissions; torch
    reports each of the first three as a RuntimeError from its zip writer)."""
    try:
        yield
    except CheckpointError:
        raise
    except (OSError, RuntimeError) as err:
        raise CheckpointError(write_error(path, err)) from err


def read_json(path: Path) -> Any:
    with reading(path):
        return json.loads(path.read_text(encoding="utf-8"))


def write_text(path: Path, text: str) -> None:
    """Write a file whole or not at all (a temporary file renamed into place); failures name the file."""
    tmp = path.with_name(f".tmp-{path.name}")
    with writing(path):
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()


def load_torch_file(path: Path, allow: Iterable[Any] = ()) -> Any:
    """``torch.load`` that runs no code: the file's pickle may name only tensors, containers, numbers and the
    classes in ``allow`` (checked before loading, and enforced by ``weights_only=True`` while loading)."""
    allowed = list(allow)
    check_pickle_globals(path, allowed)
    with reading(path), torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def check_pickle_globals(path: Path, allow: Iterable[Any] | None = None) -> None:
    """Refuse a torch file that is no whole zip archive or whose pickle names a class or function outside what
    ``weights_only`` loading accepts plus ``allow`` (default: numpy arrays and DeepSpeed's data classes), without
    unpickling it."""
    allowed = {_qualified(g) for g in (numpy_globals() + deepspeed_safe_globals() if allow is None else allow)}
    with reading(path):
        if not zipfile.is_zipfile(path):
            raise ValueError("not a torch zip archive (truncated, or not written by torch.save)")
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - allowed
    if unsafe:
        raise CheckpointError(
            f"{path} refers to {', '.join(sorted(unsafe))}, which loading a checkpoint never needs: loading it "
            f"could run code. Do not use this checkpoint unless you know who made it and why it holds that"
        )


def numpy_globals() -> list[Any]:
    """What a pickled numpy array needs (numpy 1 and 2 name its module differently); data only, no code."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct

    uint32 = type(np.dtype(np.uint32))  # the dtype class the array's BUILD step instantiates
    return [np.ndarray, np.dtype, uint32, _reconstruct, (_reconstruct, "numpy.core.multiarray._reconstruct")]


def deepspeed_safe_globals() -> list[Any]:
    """The classes DeepSpeed's ZeRO-2 files pickle besides tensors (plain data: an enum, a loss scaler's numbers,
    fragment offsets): what :func:`load_torch_file` must allow for them; empty without DeepSpeed."""
    found: list[Any] = []
    for module, names in (
        ("deepspeed.runtime.zero.config", ["ZeroStageEnum"]),
        ("deepspeed.runtime.fp16.loss_scaler", ["LossScaler", "DynamicLossScaler"]),
        ("deepspeed.utils.tensor_fragment", ["fragment_address"]),
    ):
        with contextlib.suppress(ImportError):
            imported = __import__(module, fromlist=names)
            found += [getattr(imported, n) for n in names if hasattr(imported, n)]
    return found


def _qualified(obj: Any) -> str:
    """The name a pickle gives ``obj`` (``(obj, name)``: registered under another name, as torch's safe_globals)."""
    return obj[1] if isinstance(obj, tuple) else f"{obj.__module__}.{obj.__qualname__}"
