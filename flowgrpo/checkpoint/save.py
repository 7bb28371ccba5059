"""Writing a checkpoint and loading one: every process calls both, with the parts of the training run they save
(:class:`CheckpointParts`), never the trainer itself.

    save_checkpoint(parts, epoch)     <run>/checkpoints/epoch-NNNNN, written atomically
    load_checkpoint(parts, path)      weights, optimizer, EMA, counters and this process's RNG states restored
    resume_run(parts, path, lock)     load_checkpoint, then the run's bookkeeping; a failure undoes open_run_dir

A checkpoint is written under a temporary name and renamed into place, so a crash or a failed write leaves the
previous checkpoints intact; ``checkpoint.keep_last`` newest plus the best-by-eval one are kept. The processes
agree after each phase whether any failed (a collective), so none is left waiting in DeepSpeed's or FSDP's
collectives while another has stopped: collectives first (DeepSpeed's save, FSDP's gathers), then the writes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..parallel import any_process, full_tensor, is_fsdp, shard_like
from .compat import recipe_changes
from .layout import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    CHECKPOINTS,
    CONFIG_FILE,
    EMA_FILE,
    OLD_WEIGHTS_FILE,
    REFERENCE_FILE,
    STATE_FILE,
    checkpoint_name,
    list_checkpoints,
)
from .lora import adapter_config, load_lora_state, lora_state, read_weights, trainable_names
from .optimizer import DEEPSPEED_FOLDER, load_optimizer, optimizer_state
from .resume import set_aside_later
from .rng import read_rng_state, rng_state, set_rng_state, write_rng_state
from .run_dir import RUN_STAMP, RunLock, on_main, read_run_id, write_run_config, write_run_file
from .safe_io import CheckpointError, read_json, reading, write_text, writing

if TYPE_CHECKING:
    from ..config import Config
    from ..ema import EMA
    from ..objectives import Objective
    from ..objectives.reference import KLReference

# TrainState fields a resume restores (state.json holds them all, and the checkpoint's own bookkeeping).
RESTORED = ("epoch", "global_step", "nonfinite_in_a_row", "empty_epochs_in_a_row", "best_eval", "best_checkpoint")


@dataclass(frozen=True)
class CheckpointParts:
    """What a checkpoint saves and restores: references to the training run's live objects (loading changes
    them in place: weights, optimizer, ``ema.shadow``, the fields of ``state``)."""

    accelerator: Accelerator
    transformer: torch.nn.Module  # with the LoRA layers, as prepared (DDP / DeepSpeed / FSDP / compile wrappers)
    params: list[torch.nn.Parameter]  # the trainable parameters in the optimizer's order (the EMA's)
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    state: Any  # the TrainState dataclass: all its fields go to state.json, RESTORED come back
    config: Config  # the resolved config: config.yaml, checkpoint.keep_last, what the weights were trained on
    run_dir: Path
    family: str  # the model family (the adapter's): recorded as trained_on["model.kind"]
    reference: KLReference | None = None  # the KL reference's reset schedule and snapshot (grpo.kl.reset_every)
    objective: Objective | None = None  # the weights it carries across epochs (Objective.checkpoint_weights)

    @property
    def model(self) -> torch.nn.Module:
        """The bare transformer: its parameter names are the checkpoint's."""
        from ..adapters import unwrap

        return unwrap(self.transformer)


def save_checkpoint(parts: CheckpointParts, epoch: int, rng: dict[str, Any] | None = None) -> Path:
    """Write ``<run>/checkpoints/epoch-NNNNN`` atomically (all processes call this; rank 0 writes the shared parts).

    ``rng``: the RNG states to store instead of the current ones (a stop during sampling stores the epoch's
    starting states, so that a resume redoes the epoch exactly). Failures are CheckpointErrors naming the file."""
    acc = parts.accelerator
    folder = parts.run_dir / CHECKPOINTS
    final = folder / checkpoint_name(epoch)
    tmp = folder / f".tmp-{checkpoint_name(epoch)}"

    failure: BaseException | None = None
    if acc.is_main_process:
        try:
            with writing(tmp):
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
        except CheckpointError as err:  # disk full, permissions: every process raises, none waits in a collective
            failure = err
    if any_process(acc, failure is not None):
        _raise(failure, f"rank 0 could not create {tmp}; the previous checkpoints are intact")
    model = parts.model
    try:
        # First every collective, while all processes are in step (DeepSpeed's save, FSDP's gathers); then the
        # writes, whose failures the processes agree on below.
        with writing(tmp / DEEPSPEED_FOLDER):
            optimizer = optimizer_state(acc, model, parts.optimizer, tmp)
        gather = acc.is_main_process or is_fsdp(acc)
        weights = lora_state(model) if gather else {}
        shadow = [full_tensor(s).cpu() for s in parts.ema.shadow] if gather and parts.ema is not None else []
        snapshot = parts.reference.snapshot if parts.reference is not None else None
        carried = parts.objective.checkpoint_weights() if parts.objective is not None else None
        # RNG states are per process; everything else is replicated and written once.
        write_rng_state(tmp, acc.process_index, rng if rng is not None else rng_state())
        if acc.is_main_process:
            if optimizer is not None:
                with writing(tmp / optimizer[0]):
                    torch.save(optimizer[1], tmp / optimizer[0])
            with writing(tmp / ADAPTER_FILE):
                save_file(weights, str(tmp / ADAPTER_FILE))
            lora = adapter_config(model)
            write_text(tmp / ADAPTER_CONFIG_FILE, json.dumps(lora, indent=2, default=str))
            names = trainable_names(model)
            if parts.ema is not None:
                _save_named(tmp / EMA_FILE, names, shadow, {"decay": str(parts.ema.decay)})
            if snapshot is not None:  # whole tensors on every process (a reset refuses sharded parameters)
                saved = [s.detach().float().cpu() for s in snapshot.saved]
                _save_named(tmp / REFERENCE_FILE, names, saved, {"epoch": str(parts.reference.epoch)})
            if carried is not None:  # whole tensors on every process (the objective refuses sharded parameters)
                _save_named(tmp / OLD_WEIGHTS_FILE, names, [w.detach().float().cpu() for w in carried], {})
            write_text(tmp / CONFIG_FILE, parts.config.to_yaml())
            trained = {
                "model.pretrained": parts.config.model.pretrained,
                "model.kind": parts.family,
                "model.lora.rank": lora["r"],
                "model.lora.alpha": lora["lora_alpha"],
                "model.lora.target_modules": lora["target_modules"],
            }
            state = {
                **asdict(parts.state),
                "epoch": epoch,
                "world_size": acc.num_processes,
                "written_at": time.time(),
                "trained_on": trained,
                "run_id": read_run_id(parts.run_dir),  # which run it belongs to (resume_run_dir compares)
            }
            write_text(tmp / STATE_FILE, json.dumps(state, indent=2))
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
            with writing(final):
                if final.exists():
                    shutil.rmtree(old, ignore_errors=True)
                    os.replace(final, old)
                os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            _prune(folder, parts.config.checkpoint.keep_last, parts.state.best_checkpoint)
        except CheckpointError as err:
            failure = err
    if any_process(acc, failure is not None):
        _raise(failure, f"rank 0 could not move {final.name} into place (rank 0's error says why)")
    return final


def load_checkpoint(parts: CheckpointParts, checkpoint: Path) -> None:
    """Restore weights, optimizer, EMA, counters (``parts.state``) and this process's RNG states from ``checkpoint``.

    Every file is read first, then the processes agree that all could read theirs, then the state is applied (a
    process that cannot read its files must not leave the others waiting in DeepSpeed's or FSDP's collectives)."""
    acc = parts.accelerator
    model = parts.model
    failure: BaseException | None = None
    try:
        adapter_file = checkpoint / ADAPTER_FILE
        with reading(adapter_file):
            weights = load_file(str(adapter_file))
        ema = read_weights(checkpoint, ema=True) if parts.ema is not None else None
        reference = _read_reference(checkpoint) if parts.reference is not None else None
        carried = _read_carried(checkpoint) if parts.objective is not None else None
        state = read_json(checkpoint / STATE_FILE)
        rng = read_rng_state(checkpoint, acc.process_index)
    except CheckpointError as err:
        failure = err
    if any_process(acc, failure is not None):
        _raise(failure, f"another process could not read its part of {checkpoint} (its error says which file)")
    load_lora_state(model, weights)  # copied onto the device by load
    load_optimizer(acc, model, parts.optimizer, checkpoint)
    names = trainable_names(model)  # the order of parts.params, and of every saved list of trainable weights
    if ema is not None:
        parts.ema.shadow = [
            shard_like(ema[name], p, torch.float32) for name, p in zip(names, parts.params, strict=True)
        ]
    if state.get("world_size", acc.num_processes) != acc.num_processes:
        acc.print(
            f"warning: checkpoint written by {state['world_size']} processes, resuming on {acc.num_processes}; "
            "the epoch plan is unchanged but per-process noise differs"
            + (
                "; train.lr_schedule_steps counts this run's optimizer steps per epoch (set train.updates_per_epoch "
                "to keep them)"
                if parts.config.train.lr_schedule_steps
                else ""
            )
        )
    if parts.reference is not None:
        saved, epoch = reference or ({}, None)
        parts.reference.load([saved[n] for n in names] if saved else None, epoch, parts.params)
    if parts.objective is not None:
        warning = parts.objective.restore_weights([carried[n] for n in names] if carried else None, parts.params)
        if warning:
            acc.print(f"warning: {warning}")
    for key in RESTORED:
        if key in state:
            setattr(parts.state, key, state[key])
    if rng is not None:
        set_rng_state(rng)


def resume_run(
    parts: CheckpointParts,
    checkpoint: Path,
    lock: RunLock | None,
    *,
    new_run: bool,
    warn: Callable[[str], None],
) -> None:
    """Resume ``checkpoint`` into ``parts.run_dir`` (all processes call this; ``lock``: rank 0's from open_run_dir).

    Loads it (:func:`load_checkpoint`), then on rank 0: in the checkpoint's own run, moves what the run wrote after
    it aside (:func:`flowgrpo.checkpoint.resume.set_aside_later`) and records this attempt's config
    (``config-resume-<stamp>.yaml``); in a ``new_run``, records in its ``run.json`` which checkpoint it continues
    (its config.yaml is already this attempt's). If anything fails, rank 0 abandons the run directory
    (:meth:`RunLock.abandon`: a new run is removed, a lock file it made is deleted) and every process raises."""
    acc = parts.accelerator
    try:
        changes = recipe_changes(checkpoint, parts.config)
        if changes:
            warn(f"resuming with settings that differ from the checkpoint's: {'; '.join(changes)}")
        load_checkpoint(parts, checkpoint)
        where = f" in a new run directory, {parts.run_dir}" if new_run else ""
        acc.print(f"resumed from {checkpoint} at epoch {parts.state.epoch}{where}")
        stamp = time.strftime(RUN_STAMP)

        def record() -> None:
            if new_run:
                write_run_file(parts.run_dir, resumed_from=str(checkpoint))
                return
            moved = set_aside_later(parts.run_dir, parts.state.epoch, stamp)
            if moved is not None:
                print(f"the run's output after {checkpoint.name} moved to {moved}")
            write_run_config(parts.run_dir, parts.config, stamp)  # config.yaml stays the first attempt's

        on_main(acc, record)
    except BaseException:
        if lock is not None:
            lock.abandon()
        raise


def _save_named(file: Path, names: list[str], tensors: list[torch.Tensor], metadata: dict[str, str]) -> None:
    """``tensors`` under the trainable parameters' saved ``names`` (the EMA's, the reference's), with ``metadata``."""
    with writing(file):
        save_file({n: t.contiguous() for n, t in zip(names, tensors, strict=True)}, str(file), metadata=metadata)


def _read_reference(checkpoint: Path) -> tuple[dict[str, torch.Tensor], int] | None:
    """The KL reference's snapshot in ``checkpoint`` and the epoch it was taken at, or None: it holds none."""
    file = checkpoint / REFERENCE_FILE
    if not file.is_file():
        return None
    with reading(file):
        with safe_open(str(file), "pt") as handle:
            epoch = int((handle.metadata() or {})["epoch"])
        return load_file(str(file)), epoch


def _read_carried(checkpoint: Path) -> dict[str, torch.Tensor] | None:
    """The weights the objective carried across epochs (``old_weights.safetensors``), or None: it holds none."""
    file = checkpoint / OLD_WEIGHTS_FILE
    if not file.is_file():
        return None
    with reading(file):
        return load_file(str(file))


def _raise(failure: BaseException | None, elsewhere: str) -> None:
    """This process's own failure, or a CheckpointError saying that another process failed."""
    raise failure if failure is not None else CheckpointError(elsewhere)


def _prune(folder: Path, keep_last: int, best: str | None) -> None:
    """Delete all but the ``keep_last`` newest checkpoints, keeping ``best`` (the best-by-eval one) too."""
    checkpoints = list_checkpoints(folder.parent)
    for old in checkpoints[: max(len(checkpoints) - keep_last, 0)]:
        if old.name != best:
            shutil.rmtree(old, ignore_errors=True)
