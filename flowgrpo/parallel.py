"""What differs between accelerate's distributed back-ends (DDP, DeepSpeed ZeRO, FSDP), kept out of the loop.

The trainer accumulates gradients over timesteps and micro-batches itself: it scales each loss by the number
of backward passes per update and tells accelerate which backward is the last of a cycle
(``accelerator.sync_gradients``). Under DeepSpeed the engine then reduces the gradients and steps (clipping
included) inside that last ``accelerator.backward``; under DDP and FSDP the trainer clips and steps.

Optimizer state is replicated under DDP and sharded under ZeRO-2. Under FSDP2 the LoRA weights are DTensor
shards: every process takes part in gathering full tensors (:func:`full_tensor`; a checkpoint's weights, EMA and
optimizer state) and runs the same number of forwards (they gather weights: collectives). The checkpoint files
each back-end writes are :mod:`flowgrpo.checkpoint.optimizer`'s; this module imports nothing of the checkpoints.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from .config import Config, ConfigError


def cpu_launch_kwargs() -> dict[str, Any]:
    """``Accelerator`` arguments for a multi-process launch on a machine without GPUs (tests, CPU clusters).

    ``accelerate launch --multi_gpu`` (torchrun) there runs DDP on the CPU with gloo; under DeepSpeed, gloo is
    passed as the process-group back-end and DeepSpeed uses its CPU accelerator. (accelerate's own
    ``--cpu --num_processes N`` starts a single process unless given mpirun.)
    """
    if torch.cuda.is_available() or int(os.environ.get("LOCAL_RANK", "-1")) < 0:
        return {}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    return {"cpu": True} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}


def end_process(acc: Accelerator, code: int) -> None:
    """End a process of a multi-process launch with ``code``, skipping Python's interpreter teardown (a no-op
    in a single process: it returns, and the caller exits as usual).

    ``destroy_process_group`` does not stop gloo's C++ threads while anything still references a process group,
    and DeepSpeed keeps references to its groups (module globals, the engine, the ZeRO optimizer, every
    parameter's ``_dp_group``): the threads live on into interpreter teardown. A C++ thread that then touches a
    Python object (a gloo worker dropping a collective's tensor takes the GIL) is stopped by CPython with
    ``pthread_exit``, whose unwinding through a ``noexcept`` destructor calls ``std::terminate``: "terminate
    called without an active exception", SIGABRT (pytorch/pytorch#190489, #38228). After ``end_training`` has
    flushed the trackers nothing is left to tear down, so the process ends here: every file written by then is
    closed, logging and the standard streams are flushed first."""
    if acc.num_processes <= 1:
        return
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_deepspeed(acc: Accelerator) -> bool:
    return acc.distributed_type == DistributedType.DEEPSPEED


def is_fsdp(acc: Accelerator) -> bool:
    return acc.distributed_type == DistributedType.FSDP


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is an FSDP2 shard (a DTensor)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind an FSDP2 shard (a collective: every process must call it); others unchanged."""
    return t.full_tensor() if is_sharded(t) else t


def shard_like(full: torch.Tensor, param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``full`` laid out as ``param`` (this process's shard when ``param`` is an FSDP2 DTensor), in ``dtype``
    (default: the parameter's)."""
    from torch.distributed.tensor import distribute_tensor

    full = full.to(device=param.device, dtype=dtype or param.dtype)
    if is_sharded(param):  # every process holds the same full tensor
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full


def check_launch(acc: Accelerator, config: Config) -> None:
    """Reject launch settings the trainer would silently misuse; configure DeepSpeed before ``prepare``."""
    if acc.gradient_accumulation_steps != 1 and not is_deepspeed(acc):
        raise ConfigError(
            f"accelerate's gradient_accumulation_steps={acc.gradient_accumulation_steps}: the trainer accumulates "
            "over timesteps and micro-batches itself; launch with gradient_accumulation_steps 1 and set "
            "train.gradient_accumulation instead"
        )
    if is_deepspeed(acc):
        _configure_deepspeed(acc, config)
    if is_fsdp(acc) and acc.state.fsdp_plugin.fsdp_version != 2:
        raise ConfigError(
            "FSDP version 1 is not supported (its flat parameters mix frozen and LoRA weights); set fsdp_version: 2 "
            "in the launch config (configs/accelerate/fsdp.yaml) or pass --fsdp_version 2"
        )
    if is_fsdp(acc) and acc.mixed_precision != "no":
        raise ConfigError(_HALF_PRECISION.format(backend="FSDP", precision=acc.mixed_precision))


_HALF_PRECISION = (
    "{backend} with mixed_precision {precision} would accumulate the LoRA gradients in half precision over "
    "every timestep and micro-batch; launch with mixed_precision 'no' (--mixed_precision no, or in the launch "
    "config) and set model.dtype=bf16: frozen weights in bf16, LoRA weights, their gradients and optimizer state "
    "in fp32"
)


def require_deepspeed_boundaries() -> None:
    """The loop needs accelerate's DeepSpeed wrapper to take the accumulation boundary from ``sync_gradients``
    on every backward and to report DeepSpeed's gradient norm; older accelerate releases stepped the engine after
    every backward (here: once per timestep) and returned no norm."""
    import accelerate
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    backward = inspect.signature(DeepSpeedEngineWrapper.backward).parameters
    if "sync_gradients" not in backward or not hasattr(DeepSpeedEngineWrapper, "get_global_grad_norm"):
        raise ConfigError(
            f"accelerate {accelerate.__version__} steps DeepSpeed after every backward pass, which would update the "
            "weights once per timestep; upgrade accelerate (pip install -U accelerate) or launch without DeepSpeed"
        )


def _configure_deepspeed(acc: Accelerator, config: Config) -> None:
    require_deepspeed_boundaries()
    plugin = acc.state.deepspeed_plugin
    ds = plugin.deepspeed_config
    for section in ("optimizer", "scheduler"):
        if section in ds:
            raise ConfigError(
                f"the DeepSpeed config has an '{section}' section: the trainer builds its own optimizer from "
                "train.* (AdamW on the LoRA weights); remove the section from the DeepSpeed config"
            )
    stage = int(ds.get("zero_optimization", {}).get("stage", 0))
    if stage == 3:
        raise ConfigError(
            "DeepSpeed ZeRO-3 shards the frozen base weights, which the trainer's reference forwards "
            "(adapter disabled) and evaluation need whole; use ZeRO-2 (configs/accelerate/deepspeed_zero2.yaml)"
        )
    if stage != 2:
        raise ConfigError(
            f"DeepSpeed ZeRO stage {stage}: the trainer supports stage 2 (configs/accelerate/deepspeed_zero2.yaml); "
            "for replicated optimizer state use DDP (configs/accelerate/multi_gpu.yaml)"
        )
    half = [k for k in ("fp16", "bf16") if str(ds.get(k, {}).get("enabled", False)).lower() == "true"]
    if acc.mixed_precision != "no" or half:
        precision = acc.mixed_precision if acc.mixed_precision != "no" else half[0]
        raise ConfigError(_HALF_PRECISION.format(backend="DeepSpeed", precision=precision))
    # The loop owns accumulation and its 1/N scaling; DeepSpeed must neither count micro-steps nor rescale.
    ds["gradient_accumulation_steps"] = 1
    plugin.gradient_accumulation_steps = 1
    ds["train_micro_batch_size_per_gpu"] = config.train.batch_size  # bookkeeping only: no dataloader is prepared
    ds["train_batch_size"] = config.train.batch_size * acc.num_processes
    ds["gradient_clipping"] = config.train.max_grad_norm
    ds.setdefault("steps_per_print", 10**9)  # keep DeepSpeed's own periodic logging out of the way


def engine(acc: Accelerator) -> Any:
    return acc.deepspeed_engine_wrapped.engine


def any_process(acc: Accelerator, flag: bool) -> bool:
    """Whether ``flag`` holds on any process; every process gets the same answer (a collective), so all take
    the same branch afterwards."""
    flags = torch.tensor([1.0 if flag else 0.0], device=acc.device)
    if acc.num_processes > 1:
        flags = acc.gather(flags)
    return bool(flags.max().item() > 0)


def zero_loss(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """A loss of exactly 0 that reaches every trainable parameter: lets a collective backward happen without
    contributing gradient (DeepSpeed reduces and steps inside the backward that ends an accumulation cycle)."""
    return sum(p.sum() for p in params) * 0.0


def zeroed(loss: torch.Tensor) -> torch.Tensor:
    """A non-finite loss turned into 0 through its own graph: its backward still runs the reduction of the
    cycle's accumulated gradients that the forward armed (DDP's all-reduce, FSDP2's reduce-scatter); the caller
    then drops them (they may hold NaN)."""
    return torch.where(torch.isfinite(loss), loss, torch.zeros_like(loss)) * 0.0
