"""What the tests of the objectives that compare images share (tests/test_dgpo.py, test_dpo.py, test_sft.py, and
test_fpo.py, which compares each image with itself under the old weights): the config on the tiny SD3 model, (σ, ε)
drawn once per pair or group as flowgrpo.objectives.forward draws them, the trained and reference velocities by hand,
two gradients compared, a toy of errors that move with one parameter each, and a two-epoch run of a shapes preset
through scripts/train.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from script_helper import load_script
from test_awm import TINY, _conditional_velocity

from flowgrpo.config import load_config
from flowgrpo.objectives import MicroBatch

ROOT = Path(__file__).resolve().parents[1]


def config(name: str, *overrides: str):
    """The tiny SD3 config with ``grpo.objective: name`` on the ODE rollout."""
    return load_config(TINY, ["run.progress=false", f"grpo.objective={name}", "sampler.noise_level=0", *overrides])


def draws(name: str) -> list[str]:
    """Overrides of ``grpo.<name>``'s σ distribution: logit-normal (0.3, 0.7), time shift 3."""
    return [f"grpo.{name}.logit_mean=0.3", f"grpo.{name}.logit_std=0.7", f"grpo.{name}.time_shift=3"]


def shared_draws(x0: torch.Tensor, rows: list[int], seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """σ [B] and ε for :func:`draws`, one of each per distinct id of ``rows`` (in increasing order), by hand:
    σ = sigmoid(0.3 + 0.7 z) shifted by 3 (s σ / (1 + (s - 1) σ)), then ε, from one generator."""
    g = torch.Generator().manual_seed(seed)
    index = torch.unique(torch.tensor(rows), return_inverse=True)[1]
    n = int(index.max()) + 1
    sigma = torch.sigmoid(0.3 + 0.7 * torch.randn(n, generator=g))
    sigma = 3 * sigma / (1 + 2 * sigma)
    return sigma[index], torch.randn((n, *x0.shape[1:]), generator=g)[index]


def errors(adapter, traj, sigma: torch.Tensor, noise: torch.Tensor, transformer=None):
    """Per sample, the flow-matching errors mean |v - (ε - x0)|² of the conditional velocity with the adapter on
    (of ``transformer`` when given) and off, without gradient; and the two velocities."""
    x0 = traj.final_latents
    s = sigma.view(-1, 1, 1, 1)
    noisy = (1 - s) * x0 + s * noise
    with torch.no_grad():
        v = _conditional_velocity(transformer or adapter.transformer, traj, noisy, sigma)
        adapter.transformer.disable_adapters()
        v_ref = _conditional_velocity(adapter.transformer, traj, noisy, sigma)
        adapter.transformer.enable_adapters()
    error = lambda u: ((u - (noise - x0)) ** 2).mean(dim=(1, 2, 3))  # noqa: E731
    return error(v), error(v_ref), v, v_ref


def term_loss(objective, adapter, sub, advantages: torch.Tensor, seed: int = 7):
    """One loss term of ``objective`` on the micro-batch ``sub``, its draws from a generator seeded ``seed``."""
    positions = torch.zeros(len(sub), dtype=torch.long)
    return objective.loss(adapter, MicroBatch(sub, advantages, positions, torch.Generator().manual_seed(seed)))


def trainable(adapter) -> list[torch.nn.Parameter]:
    return [p for p in adapter.transformer.parameters() if p.requires_grad]


def assert_same_gradients(got, want) -> None:
    """Two gradients of the same forwards on the same tensors, reduced in another order: equal up to fp32 rounding
    of a few ulp relative to each parameter's largest entry; and not all zero."""
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * b.abs().max().item())
    assert any(b.abs().sum() > 0 for b in want)


def toy_step(loss_of_errors, targets: list[float], lr: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """A toy where sample i's error is (θ_i - t_i)², each moved by its own parameter: the errors before and after one
    gradient step of ``loss_of_errors(errors)``."""
    theta = torch.zeros(len(targets), requires_grad=True)
    target = torch.tensor(targets)
    (grad,) = torch.autograd.grad(loss_of_errors((theta - target) ** 2), theta)
    before = target**2
    after = (theta.detach() - lr * grad - target) ** 2
    return before, after


def train_shapes(preset: str, tmp_path: Path, *overrides: str) -> list[dict]:
    """Two epochs of ``configs/<preset>.yaml`` through scripts/train.py, made small (4 groups of 8, 4 sampling steps,
    micro-batches of 2 groups, no evaluation); the metrics rows that trained."""
    train = load_script("train")
    small = ["run.epochs=2", "eval.every=0", "run.progress=false", "grpo.groups_per_epoch=4", "sampler.num_steps=4"]
    small += ["sampler.batch_size=16", "train.batch_size=16", f"run.output_dir={tmp_path}"]
    assert train.main(["--config", str(ROOT / "configs" / f"{preset}.yaml"), *small, *overrides]) == 0
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "train/loss" in r]
