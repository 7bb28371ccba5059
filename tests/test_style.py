"""The repository keeps one style: ``ruff check`` and ``ruff format --check`` pass (pyproject.toml's settings)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check", "--quiet"], ["format", "--check", "--quiet"]])
def test_ruff(command):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    result = subprocess.run([ruff, *command, str(ROOT)], capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, (
        f"ruff {' '.join(command)} found problems (run `ruff {command[0]} --fix` / "
        f"`ruff format`):\n{result.stdout}{result.stderr}"[:4000]
    )
