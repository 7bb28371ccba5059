"""Runs scripts/train.py under accelerate's FSDP2 on a machine without GPUs (tests only; honours
FLOWGRPO_TEST_LOSS like loss_driver.py).

accelerate selects FSDP only for GPU-like devices; on the CPU a multi-process launch becomes plain MULTI_CPU.
This shim switches that state to FSDP with the launch's FSDP plugin, so the real accelerate/torch FSDP2 code
(fully_shard over gloo, DTensor parameters) runs the trainer.

    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 tests/fsdp_cpu_driver.py \\
        --config configs/tiny_sd3.yaml ...
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import accelerate.state as accelerate_state
from accelerate.utils import DistributedType

ROOT = Path(__file__).resolve().parent.parent


def fsdp_on_cpu_init(*without_gpus: DistributedType) -> Callable[..., None]:
    """An ``AcceleratorState.__init__`` that picks FSDP, with the launch's plugin, where accelerate picks one of
    ``without_gpus`` (a launch: MULTI_CPU; a test inside pytest: NO, one process without a process group)."""
    init = accelerate_state.AcceleratorState.__init__

    def fsdp_on_cpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if os.environ.get("ACCELERATE_USE_FSDP") == "true" and plugin is not None:
            if self.distributed_type in without_gpus:
                # Every later AcceleratorState() copies the process state over its own: switch both.
                accelerate_state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                self.distributed_type = DistributedType.FSDP
                self.fsdp_plugin = plugin

    return fsdp_on_cpu


if __name__ == "__main__":
    accelerate_state.AcceleratorState.__init__ = fsdp_on_cpu_init(DistributedType.MULTI_CPU)
    sys.path.insert(0, str(ROOT / "tests"))
    from loss_driver import install, run_training

    install()  # FLOWGRPO_TEST_LOSS, as in loss_driver.py
    run_training()
