"""Run a plain-diffusers script in a fresh process: the check that an exported LoRA (and a merged pipeline) loads
outside this project and samples what the trainer's own rollout sampled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import Tensor


def run_plain_diffusers(
    script: str, base: Path, lora: Path, merged: Path, latents: Tensor, prompts: list[str], workdir: Path
) -> dict[str, Tensor]:
    """``script`` reads ``base lora merged latents_file prompts("|"-joined) out`` from argv and saves
    ``{"base", "lora", "merged"}`` outputs to ``out``; returns that dict."""
    torch.save(latents, workdir / "latents.pt")
    path = workdir / "plain.py"
    path.write_text(script)
    out = workdir / "plain_outputs.pt"
    run = subprocess.run(
        [
            sys.executable,
            str(path),
            str(base),
            str(lora),
            str(merged),
            str(workdir / "latents.pt"),
            "|".join(prompts),
            str(out),
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)
