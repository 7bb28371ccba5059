"""Wan2.2's two experts under DDP on two CPU processes (gloo): a micro-batch across the expert boundary on one
process and on one expert on the other still trains in step. DDP broadcasts the module's buffers (the rope tables)
at every training forward, so both processes must enter it equally often whatever their split; the driver,
tests/wan22_ddp_driver.py, checks the velocity and the DDP-averaged LoRA gradients against each process's own
without DDP, and the no-grad forwards that bypass DDP on one process only. A hang fails by the collectives' 30 s
timeout (or this test's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_ddp_trains_when_one_process_straddles_the_expert_boundary(tmp_path):
    driver, rendezvous = str(ROOT / "tests" / "wan22_ddp_driver.py"), str(tmp_path / "rendezvous")
    ranks = [
        subprocess.Popen(
            [sys.executable, driver, str(rank), rendezvous],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [process.communicate(timeout=240) for process in ranks]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    for rank, (process, (stdout, stderr)) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank}:\n{stdout}{stderr[-4000:]}"
        assert f"rank {rank} ok: 3 DDP steps" in stdout, stdout
