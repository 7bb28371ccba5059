"""Every process's RNG states (torch, CUDA, numpy, python) as plain JSON: ``rng_rank{r}.json`` in a checkpoint.

A resume restores them, so that every draw from the global generators after it is the one the uninterrupted
run made (a stop during sampling stores the epoch's starting states instead: the resume redoes the epoch).
Byte states are base64; numpy's MT19937 key and python's Mersenne state are integer lists, checked on reading
(shape, range, types), so a damaged or hostile file is refused rather than half-applied. Checkpoints of earlier
releases pickled the states (``rng_rank{r}.pt``): read with ``weights_only`` and the numpy allow-list, then put
through the same checks.
"""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .safe_io import load_torch_file, numpy_globals, reading, write_text

RNG_FILE = "rng_rank{rank}.json"
LEGACY_RNG_FILE = "rng_rank{rank}.pt"


def rng_state() -> dict[str, Any]:
    """This process's torch / CUDA / numpy / python RNG states (what a checkpoint stores per process)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Make ``state`` (as :func:`rng_state` returns it) this process's RNG states."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def write_rng_state(checkpoint: Path, rank: int, state: dict[str, Any]) -> None:
    """Store process ``rank``'s RNG ``state`` in ``checkpoint`` (``rng_rank{rank}.json``, written whole)."""
    write_text(Path(checkpoint) / RNG_FILE.format(rank=rank), json.dumps(rng_to_json(state)))


def read_rng_state(checkpoint: Path, rank: int, *, check_only: bool = False) -> dict[str, Any] | None:
    """Process ``rank``'s RNG states stored in ``checkpoint`` (None if it stored none), as :func:`rng_state`
    returns them. Reading runs no code: JSON, or a legacy ``rng_rank{r}.pt`` loaded with ``weights_only``."""
    file = Path(checkpoint) / RNG_FILE.format(rank=rank)
    legacy = Path(checkpoint) / LEGACY_RNG_FILE.format(rank=rank)
    if file.is_file():
        with reading(file):
            state = rng_from_json(json.loads(file.read_text(encoding="utf-8")))
    elif legacy.is_file():
        state = load_torch_file(legacy, allow=numpy_globals())
        with reading(legacy):
            state = rng_from_json(rng_to_json(state))  # the same checks as for the JSON files
    else:
        return None
    return None if check_only else state


def rng_to_json(state: dict[str, Any]) -> dict[str, Any]:
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


def rng_from_json(data: Any) -> dict[str, Any]:
    """The inverse of :func:`rng_to_json`; ValueError / KeyError / TypeError for anything malformed."""
    n, p = data["numpy"], data["python"]
    key = np.array(n["key"], dtype=np.int64)
    python_state = p["state"]
    if (
        data.get("format") != 1
        or n["kind"] != "MT19937"
        or key.shape != (624,)
        or key.min() < 0
        or key.max() >= 2**32
        or len(python_state) != 625
        or not all(type(v) is int for v in python_state)
    ):
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
