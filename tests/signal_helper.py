"""Pre-emption in tests: start a training command, let it log some epochs, send SIGTERM, collect its output."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def sigterm_after_epochs(
    cmd: list[str], output_dir: Path, epochs: int, *, cwd: Path, env: dict[str, str], timeout: float = 300
) -> tuple[subprocess.Popen, str, str]:
    """Run ``cmd``; once ``epochs`` rows are in the run's metrics.jsonl (or it exits), SIGTERM it and wait."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        logs = list(output_dir.glob("*/metrics.jsonl"))
        if logs and logs[0].read_text().count("\n") >= epochs:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=timeout)
    return proc, out, err
