"""Checkpoints that resume exactly, written atomically.

    <run>/checkpoints/epoch-00020/
        adapter.safetensors     LoRA weights (peft names, float32)     adapter_config.json  the LoraConfig
        ema.safetensors         EMA of the adapter weights (if train.ema > 0)
        optimizer.pt            optimizer state (tensors and numbers only: loaded with weights_only=True);
                                under DeepSpeed instead deepspeed/ (its files: trainable weights and every
                                process's optimizer shard), under FSDP optimizer_full.pt (whole, by parameter name)
        state.json              epoch, optimizer steps, best eval reward, … (the sliding window and the
                                epoch's prompt plan are functions of the epoch, so this restores them too)
        rng_rank{r}.pt          torch / numpy / python RNG states of every process

A checkpoint is written under a temporary name and renamed into place, so a crash or a failed write
leaves the previous checkpoints intact; ``keep_last`` newest plus the best-by-eval one are kept.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .parallel import any_process, full_tensor, is_fsdp, is_sharded, load_optimizer, optimizer_state, shard_like

CHECKPOINTS = "checkpoints"
PREFIX = "epoch-"


class CheckpointError(ValueError):
    """A checkpoint or run directory that cannot be resumed from."""


def checkpoint_name(epoch: int) -> str:
    return f"{PREFIX}{epoch:05d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories are ignored)."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(p for p in found if (p / "state.json").is_file())


def resolve_resume(resume: str, output_dir: str, run_name: str) -> Path:
    """A checkpoint directory from ``run.resume``: a checkpoint, a run directory (its newest), or ``latest``."""
    if resume == "latest":
        runs = sorted(Path(output_dir).glob(f"{run_name}-*"), key=lambda p: p.stat().st_mtime)
        runs = [r for r in runs if list_checkpoints(r)]
        if not runs:
            raise CheckpointError(f"run.resume=latest: no run of '{run_name}' with a checkpoint in {output_dir}/")
        return list_checkpoints(runs[-1])[-1]
    path = Path(resume)
    if SUPERSEDED in path.resolve().parts:
        raise CheckpointError(
            f"run.resume={resume!r} lies in a run's {SUPERSEDED}/ folder (output set aside by an earlier resume); "
            f"copy that checkpoint into a run directory of its own (<dir>/checkpoints/epoch-NNNNN) and resume from it"
        )
    if (path / "state.json").is_file():
        return path
    if path.is_dir() and list_checkpoints(path):
        return list_checkpoints(path)[-1]
    raise CheckpointError(
        f"run.resume={resume!r} is neither a checkpoint (a folder with state.json) nor a run directory with "
        f"checkpoints; pass <run>/checkpoints/epoch-NNNNN, <run>, or latest"
    )


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
    """NNNNN of ``epochNNNNN.json`` / ``epochNNNNN.png`` (eval reports, sample grids); -1 for any other name."""
    match = re.fullmatch(r"epoch(\d+)\.(json|png)", path.name)
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


def save_checkpoint(trainer: Any, epoch: int, rng: dict[str, Any] | None = None) -> Path:
    """Write ``<run>/checkpoints/epoch-NNNNN`` atomically (all processes call this; rank 0 writes the shared parts).

    ``rng``: the RNG states to store instead of the current ones (a stop during sampling stores the epoch's
    starting states, so that a resume redoes the epoch exactly)."""
    acc = trainer.accelerator
    folder = trainer.run_dir / CHECKPOINTS
    final = folder / checkpoint_name(epoch)
    tmp = folder / f".tmp-{checkpoint_name(epoch)}"
    from .adapters import unwrap

    failure: BaseException | None = None
    if acc.is_main_process:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        except OSError as err:  # disk full, permissions: every process raises, none waits in a collective
            failure = err
    if any_process(acc, failure is not None):
        _raise(failure, f"rank 0 could not create {tmp}; the previous checkpoints are intact")
    model = unwrap(trainer.adapter.transformer)
    try:
        # First every collective, while all processes are in step (DeepSpeed's save, FSDP's gathers); then the
        # writes, whose failures the processes agree on below.
        optimizer = optimizer_state(acc, model, trainer.optimizer, tmp)
        gather = acc.is_main_process or is_fsdp(acc)
        weights = lora_state(model) if gather else {}
        shadow = [full_tensor(s).cpu() for s in trainer.ema.shadow] if gather and trainer.ema is not None else []
        # RNG states are per process; everything else is replicated and written once.
        torch.save(rng if rng is not None else rng_state(), tmp / f"rng_rank{acc.process_index}.pt")
        if acc.is_main_process:
            if optimizer is not None:
                torch.save(optimizer[1], tmp / optimizer[0])
            save_file(weights, str(tmp / "adapter.safetensors"))
            config = model.peft_config["default"].to_dict()
            config["target_modules"] = sorted(config["target_modules"]) if config.get("target_modules") else None
            (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
            if trainer.ema is not None:
                names = trainable_names(model)
                save_file({n: s.contiguous() for n, s in zip(names, shadow, strict=True)},
                          str(tmp / "ema.safetensors"), metadata={"decay": str(trainer.ema.decay)})  # fmt: skip
            state = {**asdict(trainer.state), "epoch": epoch, "world_size": acc.num_processes}
            (tmp / "state.json").write_text(json.dumps(state, indent=2))
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
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            _prune(folder, trainer.config.checkpoint.keep_last, trainer.state.best_checkpoint)
        except OSError as err:
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
    """Restore weights, optimizer, EMA, counters and this process's RNG states from ``checkpoint``."""
    from .adapters import unwrap

    acc = trainer.accelerator
    model = unwrap(trainer.adapter.transformer)
    load_lora_state(model, load_file(str(checkpoint / "adapter.safetensors")))  # copied onto the device by load
    load_optimizer(acc, model, trainer.optimizer, checkpoint)
    if trainer.ema is not None:
        ema = read_weights(checkpoint, ema=True)
        trainer.ema.shadow = [shard_like(ema[name], p, torch.float32)
                              for name, p in zip(trainable_names(model), trainer.params, strict=True)]  # fmt: skip
    state = json.loads((checkpoint / "state.json").read_text())
    if state.get("world_size", acc.num_processes) != acc.num_processes:
        acc.print(f"warning: checkpoint written by {state['world_size']} processes, resuming on {acc.num_processes}; "
                  "the epoch plan is unchanged but per-process noise differs")  # fmt: skip
    for key in ("epoch", "global_step", "nonfinite_in_a_row", "best_eval", "best_checkpoint"):
        if key in state:
            setattr(trainer.state, key, state[key])
    rng_file = checkpoint / f"rng_rank{acc.process_index}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))  # our own file: numpy/python RNG tuples


def read_weights(checkpoint: Path, *, ema: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's adapter weights (``ema``: their EMA) under peft's saved names."""
    checkpoint = Path(checkpoint)
    file = checkpoint / ("ema.safetensors" if ema else "adapter.safetensors")
    if not file.is_file():
        hint = ": the run had train.ema = 0" if ema else " (not a checkpoint?)"
        raise CheckpointError(f"{file} does not exist{hint}")
    return load_file(str(file))


def load_adapter_weights(model: torch.nn.Module, checkpoint: Path, *, ema: bool = False) -> None:
    """Load a checkpoint's adapter weights (``ema``: its EMA weights) into a model that has the LoRA layers."""
    load_lora_state(model, read_weights(checkpoint, ema=ema))
