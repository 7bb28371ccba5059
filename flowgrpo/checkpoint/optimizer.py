"""The optimizer's part of a checkpoint, per back-end.

    DDP        optimizer.pt          replicated state, written by rank 0 (``optimizer.state_dict()``)
    DeepSpeed  deepspeed/state/...   DeepSpeed's own files: trainable weights (fp32 masters) and every process's
                                     ZeRO-2 optimizer shard (a resume needs the same number of processes)
    FSDP2      optimizer_full.pt     the whole state gathered onto rank 0, keyed by parameter name

Every file is read without running code: ``weights_only`` after checking the names its pickle holds (DeepSpeed's
files: its checkpoint engine reads them the same way while it loads). Which back-end is running is asked of
:mod:`flowgrpo.parallel`; nothing there knows these files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from ..parallel import engine, is_deepspeed, is_fsdp
from .safe_io import CheckpointError, deepspeed_safe_globals, load_torch_file

OPTIMIZER_FILE = "optimizer.pt"  # DDP / one process
DEEPSPEED_FOLDER = "deepspeed"  # inside a checkpoint: DeepSpeed's own files (trainable weights, optimizer shards)
DEEPSPEED_TAG = "state"
FSDP_OPTIMIZER = "optimizer_full.pt"  # FSDP2: whole optimizer state keyed by parameter name


def optimizer_files(checkpoint: Path) -> list[Path]:
    """The pickled optimizer files a checkpoint holds (whichever back-end wrote it)."""
    checkpoint = Path(checkpoint)
    files = [checkpoint / name for name in (OPTIMIZER_FILE, FSDP_OPTIMIZER)]
    deepspeed = checkpoint / DEEPSPEED_FOLDER
    files += sorted(deepspeed.rglob("*.pt")) if deepspeed.is_dir() else []
    return [f for f in files if f.is_file()]


def optimizer_state(
    acc: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path
) -> tuple[str, dict[str, Any]] | None:
    """What rank 0 writes for the optimizer: ``(file name, state)``, or None. Every process calls this first in
    a checkpoint, while all are in step: DeepSpeed writes its own sharded files here (a collective), FSDP2
    gathers the whole state onto rank 0 (keyed by parameter name), DDP's is replicated."""
    if is_deepspeed(acc):
        with _buffers_not_saved(engine(acc).module):
            engine(acc).save_checkpoint(
                str(folder / DEEPSPEED_FOLDER), tag=DEEPSPEED_TAG, save_latest=False, exclude_frozen_parameters=True
            )
        return None
    if is_fsdp(acc):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if not _inner(optimizer).state:  # no step yet: torch would initialise the state with a dummy step
            return FSDP_OPTIMIZER, {}
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return FSDP_OPTIMIZER, get_optimizer_state_dict(model, _inner(optimizer), options=options)
    return OPTIMIZER_FILE, optimizer.state_dict() if acc.is_main_process else {}


@contextlib.contextmanager
def _buffers_not_saved(model: torch.nn.Module) -> Iterator[None]:
    """Leave the module's buffers out of its state dict for a while. DeepSpeed saves persistent buffers with the
    trainable weights even under ``exclude_frozen_parameters``; nothing trains them, the pipeline rebuilds them,
    and they can be large (SD3.5's ``pos_embed``: 384² × 1536 floats, 0.9 GB in every checkpoint)."""
    hidden = [
        (m, name)
        for m in model.modules()
        for name, b in m._buffers.items()
        if b is not None and name not in m._non_persistent_buffers_set
    ]
    for m, name in hidden:
        m._non_persistent_buffers_set.add(name)
    try:
        yield
    finally:
        for m, name in hidden:
            m._non_persistent_buffers_set.discard(name)


def load_optimizer(
    acc: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path
) -> None:
    """Restore what :func:`optimizer_state` saved (after the adapter weights have been loaded). Files are read
    without running code (``weights_only``); failures are CheckpointErrors naming the file."""
    if is_deepspeed(acc):
        folder = checkpoint / DEEPSPEED_FOLDER
        if not folder.is_dir():
            raise CheckpointError(
                f"{checkpoint} was not written under DeepSpeed (no {DEEPSPEED_FOLDER}/): resume "
                "it with the launch it was trained with"
            )
        # Trainable weights come back from DeepSpeed's file too (fp32 master weights included).
        try:
            with _deepspeed_reads_safely(engine(acc)):
                path, _ = engine(acc).load_checkpoint(
                    str(folder),
                    tag=DEEPSPEED_TAG,
                    load_module_strict=False,
                    load_optimizer_states=True,
                    load_lr_scheduler_states=False,
                )
        except CheckpointError:
            raise
        except (OSError, RuntimeError, KeyError, ValueError, AssertionError) as err:
            raise CheckpointError(
                f"DeepSpeed could not load {folder}: {err}; resume with the launch (and number of "
                "processes) the checkpoint was written with"
            ) from None
        if path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint in {folder}")
        return
    file = checkpoint / (FSDP_OPTIMIZER if is_fsdp(acc) else OPTIMIZER_FILE)
    if not file.is_file():
        raise CheckpointError(
            f"{file} does not exist: resume with the back-end (DDP, DeepSpeed, FSDP) the checkpoint was written with"
        )
    # Loaded on the CPU (accelerate names a multi-process CPU device "cpu:N", which torch.load rejects);
    # loading moves the state next to the parameters.
    state = load_torch_file(file)
    if is_fsdp(acc):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if state:  # empty: saved before the first step
            set_optimizer_state_dict(model, _inner(optimizer), state, options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state)


@contextlib.contextmanager
def _deepspeed_reads_safely(ds_engine: Any) -> Iterator[None]:
    """DeepSpeed reads its checkpoint files with ``torch.load(weights_only=False)``, which runs whatever code a
    file's pickle names. Meanwhile its checkpoint engine reads them as :func:`load_torch_file` does: tensors,
    containers and DeepSpeed's few data classes only."""
    reader = ds_engine.checkpoint_engine
    allowed = deepspeed_safe_globals()

    def safe_load(path: str, map_location: Any = None) -> Any:  # noqa: ARG001 - on the CPU; DeepSpeed moves it
        return load_torch_file(Path(path), allow=allowed)

    reader.load = safe_load  # this instance only
    try:
        yield
    finally:
        del reader.load  # back to the class's method


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # under accelerate's AcceleratedOptimizer
