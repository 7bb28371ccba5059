"""Flow Policy Optimization with the ELBO ratio (grpo.objective: fpo): the surrogate by hand on numbers and on the bare
transformer, the ratio at the old weights (exactly 1) with AWM's gradient there, the config refusals, and two epochs
of configs/shapes_fpo.yaml."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from preference_helper import (
    assert_same_gradients,
    config,
    draws,
    errors,
    shared_draws,
    term_loss,
    train_shapes,
    trainable,
)
from test_awm import _conditional_velocity, _setup

from flowgrpo.config import ConfigError
from flowgrpo.objectives.awm import AWM
from flowgrpo.objectives.fpo import FPO, FPOConfig, elbo_weight, ratio_surrogate

ADVANTAGES = torch.tensor([1.5, -0.5, 0.25, -1.25])  # test_awm's trajectory: groups [0, 0, 1, 1]
SKEWED = torch.tensor([1.5, -0.5, 0.25, 1.25])  # not summing to 0: the loss is no small difference of terms
ROWS = [0, 1, 2, 3]  # one (σ, ε) per sample


def _ppo_by_hand(log_ratio: list[float], advantages: list[float], clip: float) -> float:
    """mean_i -min(r A, clip(r, 1 - ε, 1 + ε) A), r = exp(log_ratio), written out sample by sample."""
    terms = []
    for lr, a in zip(log_ratio, advantages, strict=True):
        r = math.exp(lr)
        terms.append(-min(r * a, min(max(r, 1 - clip), 1 + clip) * a))
    return sum(terms) / len(terms)


def test_the_surrogate_on_numbers_by_hand():
    error, old = torch.tensor([1.0, 2.0, 0.5, 0.8]), torch.tensor([1.1, 1.9, 0.5, 0.9])
    advantages = [1.0, -1.0, 2.0, -0.5]
    adv = torch.tensor(advantages)
    # uniform: log r = L_old - L_θ = 0.1, -0.1, 0, 0.1. Samples 0 and 1 are clipped at 1 ± 0.05 (on A's side), sample 2
    # sits at r = 1, sample 3 (A < 0, r > 1) keeps the pessimistic unclipped r·A: clip fraction 3/4 by |r - 1| > ε.
    loss, stats = ratio_surrogate(error, old, torch.full((4,), 0.5), adv, FPOConfig(clip_range=0.05))
    expected = (-1.05 + 0.95 - 2.0 + 0.5 * math.exp(0.1)) / 4
    assert expected == pytest.approx(_ppo_by_hand([0.1, -0.1, 0.0, 0.1], advantages, 0.05), rel=1e-12)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats.clip_fraction.item() == 0.75 and stats.ratio_max.item() == pytest.approx(math.exp(0.1), rel=1e-6)

    # elbo: w(σ) = (1 - σ)/(σ + 1e-3) scales each log-ratio; reinforce: -mean(r A), nothing clipped; β_KL · KL added.
    sigma = torch.tensor([0.5, 0.25, 0.9, 0.1])
    w = [(1 - s) / (s + 1e-3) for s in sigma.tolist()]
    torch.testing.assert_close(elbo_weight(sigma, "elbo"), torch.tensor(w))
    log_ratio = [wi * (o - e) for wi, o, e in zip(w, old.tolist(), error.tolist(), strict=True)]
    loss, _ = ratio_surrogate(error, old, sigma, adv, FPOConfig(clip_range=0.2, weighting="elbo"))
    assert loss.item() == pytest.approx(_ppo_by_hand(log_ratio, advantages, 0.2), rel=1e-5)
    settings = FPOConfig(weighting="elbo", functional="reinforce")
    loss, stats = ratio_surrogate(error, old, sigma, adv, settings, kl=torch.tensor(0.3), beta=0.5)
    reinforce = -sum(math.exp(lr) * a for lr, a in zip(log_ratio, advantages, strict=True)) / 4
    assert loss.item() == pytest.approx(reinforce + 0.5 * 0.3, rel=1e-5) and stats.clip_fraction.item() == 0.0


def test_fpo_loss_is_the_surrogate_of_the_old_and_current_errors():
    adapter, traj = _setup()
    params = trainable(adapter)
    old_transformer = copy.deepcopy(adapter.transformer)
    objective = FPO(config("fpo", *draws("fpo"), "grpo.fpo.weighting=elbo", "grpo.kl.beta=0.5"))
    objective.begin_epoch(params)
    with torch.no_grad():  # then the weights move: the ratio leaves 1
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    loss, stats = term_loss(objective, adapter, traj, SKEWED)

    sigma, noise = shared_draws(traj.final_latents, ROWS)  # the draws of the loss's generator, by hand
    d, _, v, v_ref = errors(adapter, traj, sigma, noise)
    d_old = errors(adapter, traj, sigma, noise, transformer=old_transformer)[0]
    w = (1 - sigma) / (sigma + 1e-3)
    log_ratio = (w * (d_old - d)).tolist()
    assert min(abs(x) for x in log_ratio) > 1e-4, log_ratio  # the old weights were really used
    policy = _ppo_by_hand(log_ratio, SKEWED.tolist(), 0.05)
    kl = ((v - v_ref) ** 2).mean().item()
    assert stats["policy_loss"].item() == pytest.approx(policy, rel=1e-5)
    assert stats["kl"].item() == pytest.approx(kl, rel=1e-5)
    assert loss.item() == pytest.approx(policy + 0.5 * kl, rel=1e-5)
    assert stats["ratio_mean"].item() == pytest.approx(sum(math.exp(x) for x in log_ratio) / 4, rel=1e-5)


@pytest.mark.parametrize("weighting, functional", [("uniform", "ppo_clip"), ("elbo", "reinforce")])
def test_at_the_old_weights_the_ratio_is_exactly_one_and_the_gradient_is_awms(weighting, functional):
    """Before the first update the old weights are the current ones: L_old = L_θ to the bit, r = 1, nothing clipped,
    and ∇(-r A) = A w(σ) ∇L_θ, the advantage-weighted CFM gradient (AWM's own with w = 1)."""
    adapter, traj = _setup()
    params = trainable(adapter)
    objective = FPO(
        config("fpo", *draws("fpo"), f"grpo.fpo.weighting={weighting}", f"grpo.fpo.functional={functional}")
    )
    objective.begin_epoch(params)
    loss, stats = term_loss(objective, adapter, traj, ADVANTAGES)
    assert stats["ratio_min"].item() == stats["ratio_max"].item() == 1.0
    assert stats["clip_fraction"].item() == 0.0 and stats["approx_kl"].item() == 0.0
    got = torch.autograd.grad(loss, params)

    if weighting == "uniform":
        awm, _ = term_loss(AWM(config("awm", *draws("awm"))), adapter, traj, ADVANTAGES)
    else:  # mean_i A_i w(σ_i) L_θ,i at the loss's draws, by hand
        x0 = traj.final_latents
        sigma, noise = shared_draws(x0, ROWS)
        s = sigma.view(4, 1, 1, 1)
        v = _conditional_velocity(adapter.transformer, traj, (1 - s) * x0 + s * noise, sigma)
        error = ((v - (noise - x0)) ** 2).mean(dim=(1, 2, 3))
        awm = (ADVANTAGES * (1 - sigma) / (sigma + 1e-3) * error).mean()
    assert_same_gradients(got, torch.autograd.grad(awm, params))


def test_the_loss_needs_the_epochs_old_weights_and_sharded_parameters_are_refused():
    adapter, traj = _setup()
    with pytest.raises(RuntimeError, match="begin_epoch"):
        term_loss(FPO(config("fpo")), adapter, traj, ADVANTAGES)
    assert "grpo.objective: awm" in FPO.refuses_sharded


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["sampler.noise_level=0.7"], "sampler.noise_level"),
        (["grpo.fpo.timesteps=0"], "grpo.fpo.timesteps"),
        (["grpo.fpo.logit_std=0"], "grpo.fpo.logit_std"),
        (["grpo.fpo.clip_range=0"], "grpo.fpo.clip_range"),
        (["grpo.fpo.clip_range=1.5"], "grpo.fpo.clip_range"),
        (["grpo.fpo.weighting=snr"], "grpo.fpo.weighting"),
        (["grpo.fpo.functional=epg"], "grpo.fpo.functional"),
        (["grpo.fpo.functional=reinforce", "grpo.fpo.clip_range=0.2"], "does nothing with grpo.fpo.functional"),
        (["grpo.awm.timesteps=2"], "did you mean grpo.fpo.timesteps"),
    ],
)
def test_fpo_config_mistakes_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config("fpo", *overrides)


def test_two_epochs_of_the_shapes_preset(tmp_path):
    rows = train_shapes("shapes_fpo", tmp_path)
    # 4 groups of 8 per epoch in micro-batches of 16: 2 optimizer steps per epoch.
    assert [r["global_step"] for r in rows] == [2, 4]
    # Each epoch's first micro-batch is taken at the old weights: its ratio is exactly 1.
    assert all(r["train/onpolicy_ratio_dev"] == 0.0 for r in rows)
    assert all(0 <= r["train/clip_fraction"] <= 1 and math.isfinite(r["train/loss"]) for r in rows)
    assert all(r["train/ratio_min"] <= 1.0 <= r["train/ratio_max"] for r in rows)
