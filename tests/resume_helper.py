"""What the family tests' "train, resume and export" checks share (tests/test_wan22.py, test_wan_i2v.py,
test_zimage.py, test_flux2.py, ...): two epochs in one run against one epoch, a resume and the second, compared weight
for weight."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rollout_helper import ON_POLICY_RATIO_TOL
from safetensors.torch import load_file


def train_and_resume(config: Path, out: Path, overrides: list[str]) -> tuple[Path, dict[str, torch.Tensor]]:
    """Train ``config`` (with ``overrides``) for 2 epochs, and for 1 epoch then resumed for the 2nd, under ``out``.
    Asserts that both end with the same adapter weights and that every epoch trained exactly on-policy (the ratio
    before the first update exactly 1). Returns the 2-epoch run's last checkpoint and its adapter weights."""
    from flowgrpo.checkpoint import list_checkpoints
    from flowgrpo.config import load_config
    from flowgrpo.trainer import GRPOTrainer

    def trainer(name: str, *more: str) -> GRPOTrainer:
        return GRPOTrainer(load_config(config, [f"run.output_dir={out / name}", *overrides, *more]))

    full = trainer("a", "run.epochs=2")
    full.fit()
    part = trainer("b", "run.epochs=1")
    part.fit()
    resumed = trainer("b", "run.epochs=2", f"run.resume={part.run_dir}")
    assert resumed.state.epoch == 1
    resumed.fit()
    checkpoint = list_checkpoints(full.run_dir)[-1]
    weights = load_file(str(checkpoint / "adapter.safetensors"))
    again = load_file(str(list_checkpoints(part.run_dir)[-1] / "adapter.safetensors"))
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
    rows = [json.loads(line) for line in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["train/onpolicy_ratio_dev"] < ON_POLICY_RATIO_TOL for r in rows)
    return checkpoint, weights


def export_and_sample(checkpoint: Path, out: Path, prompts: list[str], steps: int, height: int = 32, width: int = 32):
    """Export ``checkpoint``'s LoRA to ``out / "lora"`` and merged into ``out / "merged"``, and sample ``prompts`` with
    the checkpoint's own adapter noise-free (its evaluation sampler at ``steps`` steps, no window) from seeded noise.
    Returns ``(adapter, initial latents, clips or images)``, to compare with plain diffusers loading the export."""
    from flowgrpo.config import WindowConfig
    from flowgrpo.evaluation import ode_sampler
    from flowgrpo.export import adapter_from_checkpoint, export_checkpoint, run_config
    from flowgrpo.rollout import rollout

    export_checkpoint(checkpoint, out / "lora")
    export_checkpoint(checkpoint, out / "merged", merge=True)
    config = run_config(checkpoint)
    adapter = adapter_from_checkpoint(config, checkpoint)
    latents = adapter.initial_noise(len(prompts), height, width, generator=torch.Generator().manual_seed(0))
    sampler = ode_sampler(config.eval)
    sampler.num_steps, sampler.window = steps, WindowConfig(size=0)
    groups = list(range(len(prompts)))
    traj = rollout(adapter, prompts, groups, sampler, range(0, 0), height=height, width=width, initial_latents=latents)
    return adapter, latents, traj.images
