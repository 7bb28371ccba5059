"""Runs scripts/train.py with the GRPO loss (the clipped and guard objectives') altered on chosen backward passes, the
same ones on every rank.

FLOWGRPO_TEST_LOSS="nan:10"      the 10th loss is NaN
FLOWGRPO_TEST_LOSS="zero:3,10"   the 3rd and 10th losses are multiplied by 0 (they contribute no gradient)
FLOWGRPO_TEST_DEEPSPEED_SHM=off  DeepSpeed's collectives on the CPU go through torch.distributed (gloo), as they do
                                 where its shared-memory kernel cannot be built: DeepSpeed compiles that kernel on a
                                 machine's first CPU launch (about 50 CPU-seconds, every fresh CI machine), and no
                                 check reads it (on GPUs DeepSpeed uses NCCL through torch.distributed)
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import flowgrpo.objectives.clipped as clipped_module
import flowgrpo.objectives.guard as guard_module

ROOT = Path(__file__).resolve().parent.parent


def install() -> None:
    """Replace the trainer's loss as ``FLOWGRPO_TEST_LOSS`` says (nothing when it is unset); keep DeepSpeed off its
    shared-memory kernel when ``FLOWGRPO_TEST_DEEPSPEED_SHM=off``."""
    if os.environ.get("FLOWGRPO_TEST_DEEPSPEED_SHM") == "off":
        # (deepspeed.comm's attribute "torch" is torch itself: the module is reached by name.) None is what it
        # returns where the kernel is not compatible.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    spec = os.environ.get("FLOWGRPO_TEST_LOSS")
    if not spec:
        return
    mode, _, calls = spec.partition(":")
    chosen = {int(c) for c in calls.split(",")}
    factor = {"nan": float("nan"), "zero": 0.0}[mode]
    real_loss = clipped_module.grpo_loss
    count = 0

    def altered_loss(*args, **kwargs):
        nonlocal count
        count += 1
        loss, stats = real_loss(*args, **kwargs)
        return (loss * factor, stats) if count in chosen else (loss, stats)

    for module in (clipped_module, guard_module):  # guard imports grpo_loss by name
        module.grpo_loss = altered_loss


def run_training() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from train import main

    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    install()
    run_training()
