"""The shipped ``configs/accelerate/multi_node.yaml`` run as two "machines" of one process each on localhost: two
``accelerate launch`` commands (machine_rank 0 and 1) that meet at one address and port, CPU and gloo. One epoch
with a checkpoint, then a second two-machine launch that resumes it for one more epoch. Both machines share the
run directory (as nodes must: a shared filesystem), and rank 0 alone writes the shared files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# Never beside tests/test_distributed.py's two-process launches (their xdist group): one worker runs them in turn.
pytestmark = pytest.mark.xdist_group("tests/test_distributed.py")

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_sd3.yaml"
MULTI_NODE = "configs/accelerate/multi_node.yaml"
# 8 images per epoch, 4 per process: one rollout batch and one micro-batch each, one optimizer step.
SMALL = [
    "run.debug_dump=true",
    "run.progress=false",
    "grpo.groups_per_epoch=2",
    "sampler.batch_size=4",
    "train.batch_size=4",
    "sampler.num_steps=4",
    "eval.every=0",
    "checkpoint.every=1",
]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# What the launcher (accelerate's port check) or the rendezvous (torch's TCPStore) says of a port in use.
PORT_TAKEN = ("another process is utilizing it", "address already in use", "eaddrinuse")
TIMEOUT = 240  # seconds for one two-machine launch; on a 2-core machine each takes about 20


def _free_port() -> int:
    """A port free now on 127.0.0.1 (both machines must be told the same one, so accelerate's port 0 won't do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two_machines(tmp_path: Path, name: str, *overrides: str) -> list[str]:
    """Start machine 1, then machine 0, with the shipped multi-node config and the overrides a user would give
    (2 processes in all, this machine's rank, the main machine's address and port); wait for both. Returns their
    stdouts. On a failure or timeout both process groups (launcher and workers) are killed and their stderr tails
    shown. A port taken between choosing it and binding it (another test's launch) is retried once."""
    for attempt in range(2):
        try:
            return _attempt(tmp_path, f"{name}{attempt}", _free_port(), overrides)
        except _PortTaken:
            continue
    raise AssertionError(f"{name}: the rendezvous port was taken twice")


class _PortTaken(Exception):
    pass


def _attempt(tmp_path: Path, name: str, port: int, overrides: tuple[str, ...]) -> list[str]:
    procs: list[subprocess.Popen] = []
    logs: list[tuple[Path, Path]] = []
    try:
        for rank in (1, 0):  # rank 0 last: machine 1 waits for it at the rendezvous
            cmd = [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                MULTI_NODE,
                "--num_processes",
                "2",
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                "scripts/train.py",
                "--config",
                str(TINY),
                f"run.output_dir={tmp_path / 'out'}",
                *SMALL,
                *overrides,
            ]
            out, err = tmp_path / f"{name}-machine{rank}.out", tmp_path / f"{name}-machine{rank}.err"
            logs.insert(0, (out, err))
            with out.open("w") as stdout, err.open("w") as stderr:
                procs.insert(
                    0,
                    subprocess.Popen(
                        cmd, cwd=ROOT, env=ENV, stdout=stdout, stderr=stderr, text=True, start_new_session=True
                    ),
                )
        start = time.monotonic()
        while time.monotonic() < start + TIMEOUT and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one machine failed: the other would wait for it at its next collective
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if codes != [0, 0]:
            waited = time.monotonic() - start
            raise AssertionError(f"{name}: machines 0, 1 exit codes {codes} after {waited:.0f} s (None: killed)")
        return [out.read_text() for out, _ in logs]
    except BaseException as failure:
        _kill(procs)
        errors = [err.read_text() if err.exists() else "" for _, err in logs]
        if any(marker in e.lower() for e in errors for marker in PORT_TAKEN):  # before any training
            raise _PortTaken from failure
        tails = "\n".join(f"--- machine {rank} stderr (tail) ---\n{e[-3000:]}" for rank, e in enumerate(errors))
        raise AssertionError(f"{failure}\n{tails}") from failure


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each launch's process group (accelerate's launcher, torchrun and its worker: start_new_session)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_machines_train_checkpoint_and_resume_with_the_shipped_multi_node_config(tmp_path):
    out = tmp_path / "out"
    stdouts = _launch_two_machines(tmp_path, "first", "run.epochs=1")
    (run_dir,) = out.iterdir()  # one run directory: machine 1 trained in rank 0's
    for text in stdouts:  # each machine's launcher ran its share of a 2-process job
        assert "1 optimizer steps per epoch at 2 process(es)" in text, text[-2000:]
    assert "epoch 0: reward" in stdouts[0] and "epoch 0: reward" not in stdouts[1]  # rank 0 logs the metrics
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    assert checkpoint.name == "epoch-00001"
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["epoch"] == 1 and state["world_size"] == 2
    assert sorted(p.name for p in checkpoint.glob("rng_rank*.json")) == ["rng_rank0.json", "rng_rank1.json"]
    assert [r["epoch"] for r in _rows(run_dir)] == [0]  # one row: rank 0 alone writes the metrics
    first = load_file(str(checkpoint / "adapter.safetensors"))

    # A second two-machine launch resumes the run for one more epoch (a fresh port: the first may linger).
    stdouts = _launch_two_machines(tmp_path, "resume", "run.epochs=2", f"run.resume={checkpoint}")
    for text in stdouts:  # both machines restored the same checkpoint and continue at epoch 1
        assert f"resumed from {checkpoint} at epoch 1" in text, text[-2000:]
    assert [p.name for p in out.iterdir()] == [run_dir.name]  # continued in place, no second run directory
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["epoch-00001", "epoch-00002"]
    state = json.loads((run_dir / "checkpoints" / "epoch-00002" / "state.json").read_text())
    assert state["epoch"] == 2 and state["world_size"] == 2
    rows = _rows(run_dir)
    assert [r["epoch"] for r in rows] == [0, 1] and [r["global_step"] for r in rows] == [1, 2]
    last = load_file(str(run_dir / "checkpoints" / "epoch-00002" / "adapter.safetensors"))
    assert first.keys() == last.keys() and any(not torch.equal(first[k], last[k]) for k in first)  # it trained
    # DDP across the machines kept the weights equal on both ranks.
    finals = [torch.load(run_dir / "debug" / f"final_rank{r}.pt") for r in range(2)]
    assert finals[0].keys() == finals[1].keys() and finals[0]
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
