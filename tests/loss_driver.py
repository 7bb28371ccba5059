"""Runs scripts/train.py with the GRPO loss (the clipped and guard objectives') altered on chosen backward passes, the
same ones on every rank.

FLOWGRPO_TEST_LOSS="nan:10"      the 10th loss is NaN
FLOWGRPO_TEST_LOSS="zero:3,10"   the 3rd and 10th losses are multiplied by 0 (they contribute no gradient)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import flowgrpo.objectives.clipped as clipped_module
import flowgrpo.objectives.guard as guard_module

ROOT = Path(__file__).resolve().parent.parent


def install() -> None:
    """Replace the trainer's loss as ``FLOWGRPO_TEST_LOSS`` says (nothing when it is unset)."""
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
