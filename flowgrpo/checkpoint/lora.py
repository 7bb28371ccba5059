"""The adapter's weights in a checkpoint: ``adapter.safetensors`` (and its EMA, ``ema.safetensors``) under peft's
saved names, float32, with the LoraConfig beside them (``adapter_config.json``).

peft's saved names drop the adapter's name (``...lora_A.default.weight`` -> ``...lora_A.weight``): the same names
diffusers' ``load_lora_weights`` reads, and the order of :func:`trainable_names` is the EMA's. Under FSDP2 the
weights are DTensor shards: saving gathers them whole (every process takes part), loading keeps each process's
shard of the full tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..parallel import full_tensor, is_sharded, shard_like
from .compat import lora_mismatch
from .layout import ADAPTER_FILE, EMA_FILE
from .safe_io import CheckpointError, reading


def lora_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights under peft's saved names (no adapter name), float32 on the CPU.

    Under FSDP2 the weights are gathered whole: every process must call this.
    """
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    return {k: full_tensor(v.detach()).float().cpu().contiguous() for k, v in state.items()}


def adapter_config(model: torch.nn.Module) -> dict[str, Any]:
    """The model's LoraConfig as ``adapter_config.json`` stores it: target modules sorted, every other set
    (``exclude_modules``, see ``PipelineAdapter.lora_exclude``) a sorted list, as ``load_lora_weights`` reads them."""
    config = model.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"]) if config.get("target_modules") else None
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def load_lora_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load adapter weights; every LoRA weight of the model must be in ``state``, in its shape, and nothing else
    (the check export makes before loading a model: :func:`flowgrpo.checkpoint.compat.lora_mismatch`)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    problems = lora_mismatch(expected, {k: tuple(v.shape) for k, v in state.items()})
    if problems:
        raise CheckpointError(
            f"the checkpoint's adapter weights do not fit this model ({'; '.join(problems)}): "
            "was it trained with other model.lora settings?"
        )
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if any(is_sharded(p) for _, p in params):
        # FSDP2 shards: each process keeps its part of the (identical) full tensors.
        with torch.no_grad():
            for name, p in params:
                p.copy_(shard_like(state[saved_name(name)], p))
        return
    set_peft_model_state_dict(model, state)


def trainable_names(model: torch.nn.Module) -> list[str]:
    """Saved (peft) names of the trainable LoRA parameters, in ``parameters()`` order — the EMA's order."""
    return [saved_name(name) for name, p in model.named_parameters() if p.requires_grad]


def saved_name(parameter_name: str, adapter: str = "default") -> str:
    """A parameter's name as peft saves it: ``...lora_A.default.weight`` -> ``...lora_A.weight``."""
    return parameter_name.replace(f".{adapter}.", ".")


def read_weights(checkpoint: Path, *, ema: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's adapter weights (``ema``: their EMA) under peft's saved names."""
    checkpoint = Path(checkpoint)
    file = checkpoint / (EMA_FILE if ema else ADAPTER_FILE)
    if not file.is_file():
        hint = ": the run had train.ema = 0" if ema else " (not a checkpoint?)"
        raise CheckpointError(f"{file} does not exist{hint}")
    with reading(file):
        return load_file(str(file))


def load_adapter_weights(model: torch.nn.Module, checkpoint: Path, *, ema: bool = False) -> None:
    """Load a checkpoint's adapter weights (``ema``: its EMA weights) into a model that has the LoRA layers."""
    load_lora_state(model, read_weights(checkpoint, ema=ema))
