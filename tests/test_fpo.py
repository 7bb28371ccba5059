"""Flow Policy Optimization with the ELBO ratio (grpo.objective: fpo): the surrogate by hand on numbers and on the bare
transformer, the adaptive weighting against the study's formula, the ratio at the old weights (exactly 1, one forward)
with AWM's gradient there, zero gradient for a sample clipped on its advantage's side, the epoch-start snapshot kept
over two inner epochs, the config refusals (one optimizer step per epoch among them), and two epochs of
configs/shapes_fpo.yaml."""

from __future__ import annotations

import copy
import math

import pytest
import rollout_helper as helper
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

from flowgrpo.config import ConfigError, validate
from flowgrpo.objectives.awm import AWM
from flowgrpo.objectives.forward import NoisedPoint
from flowgrpo.objectives.fpo import FPO, FPOConfig, elbo_weight, ratio_surrogate, weighted_error
from flowgrpo.objectives.nft import OldWeights

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


def _study_neg_elbo(v, x0, noise, sigma, method: str) -> torch.Tensor:
    """-compute_elbo(t, v, x_t, x0, noise, method) of the design-space study (jaemoo-choi/rethinking-diffusion-rl
    src/utils/__init__.py, guidance 1), transcribed in float64, per sample."""
    v, x0, noise = (u.detach().double() for u in (v, x0, noise))
    t = sigma.double().view(-1, *[1] * (x0.ndim - 1))
    dims = tuple(range(1, x0.ndim))
    xt = (1 - t) * x0 + t * noise
    if method == "adaptive":
        x0_hat = xt - t * v
        weight = (x0_hat - x0).abs().mean(dim=dims, keepdim=True).clip(min=0.00001)
        return ((x0_hat - x0) ** 2 / weight).mean(dim=dims)
    assert method == "exact"
    return ((1 - t) / (t + 1e-3) * (noise - x0 - v) ** 2).mean(dim=dims)


def _move(params, scale: float = 0.05) -> None:
    """An optimizer-like step: every trainable weight moved by seeded noise."""
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


def test_the_surrogate_on_numbers_by_hand():
    error, old = torch.tensor([1.0, 2.0, 0.5, 0.8]), torch.tensor([1.1, 1.9, 0.5, 0.9])
    advantages = [1.0, -1.0, 2.0, -0.5]
    adv = torch.tensor(advantages)
    # uniform: log r = L_old - L_θ = 0.1, -0.1, 0, 0.1. Samples 0 and 1 are clipped at 1 ± 0.05 (on A's side), sample 2
    # sits at r = 1, sample 3 (A < 0, r > 1) keeps the pessimistic unclipped r·A: clip fraction 3/4 by |r - 1| > ε.
    loss, stats = ratio_surrogate(error, old, adv, FPOConfig(clip_range=0.05))
    expected = (-1.05 + 0.95 - 2.0 + 0.5 * math.exp(0.1)) / 4
    assert expected == pytest.approx(_ppo_by_hand([0.1, -0.1, 0.0, 0.1], advantages, 0.05), rel=1e-12)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats.clip_fraction.item() == 0.75 and stats.ratio_max.item() == pytest.approx(math.exp(0.1), rel=1e-6)

    # elbo: w(σ) = (1 - σ)/(σ + 1e-3) scales each log-ratio; reinforce: -mean(r A), nothing clipped; β_KL · KL added.
    sigma = torch.tensor([0.5, 0.25, 0.9, 0.1])
    w = [(1 - s) / (s + 1e-3) for s in sigma.tolist()]
    torch.testing.assert_close(elbo_weight(sigma, "elbo"), torch.tensor(w))
    log_ratio = [wi * (o - e) for wi, o, e in zip(w, old.tolist(), error.tolist(), strict=True)]
    weight = elbo_weight(sigma, "elbo")
    loss, _ = ratio_surrogate(weight * error, weight * old, adv, FPOConfig(clip_range=0.2, weighting="elbo"))
    assert loss.item() == pytest.approx(_ppo_by_hand(log_ratio, advantages, 0.2), rel=1e-5)
    settings = FPOConfig(weighting="elbo", functional="reinforce")
    loss, stats = ratio_surrogate(weight * error, weight * old, adv, settings, kl=torch.tensor(0.3), beta=0.5)
    reinforce = -sum(math.exp(lr) * a for lr, a in zip(log_ratio, advantages, strict=True)) / 4
    assert loss.item() == pytest.approx(reinforce + 0.5 * 0.3, rel=1e-5) and stats.clip_fraction.item() == 0.0


def test_the_adaptive_weighting_is_the_studys_adaptive_elbo():
    """weighting: adaptive is -compute_elbo(..., "adaptive") of the study: mean (x̂0 - x0)² / mean |x̂0 - x0| with
    x̂0 = x_σ - σ v, i.e. σ·mean e² / mean |e| (e = v - (ε - x0)), the floor 1e-5 on the normaliser (third sample),
    each velocity normalised by its own error, and no gradient through the normaliser."""
    g = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(3, 2, 2, 2, generator=g), torch.randn(3, 2, 2, 2, generator=g)
    x0[2], noise[2] = 0.0, 0.0  # target 0 and a tiny velocity: σ·mean |e| ≈ 4e-6, under the floor
    sigma = torch.tensor([0.7, 0.2, 0.05])
    v = torch.randn(3, 2, 2, 2, generator=g)
    v[2] *= 1e-4
    v.requires_grad_(True)
    s = sigma.view(3, 1, 1, 1)
    noisy = (1 - s) * x0 + s * noise
    point = NoisedPoint(sigma, noise, noisy, x0, noisy, 1.0)
    ell = weighted_error(v, point, "adaptive")

    study = _study_neg_elbo(v, x0, noise, sigma, "adaptive")
    torch.testing.assert_close(ell.double(), study, rtol=1e-5, atol=0)
    e = (v.detach() - (noise - x0)).flatten(1).double()
    n = e.shape[1]
    assert sigma[2].item() * e[2].abs().mean().item() < 1e-5
    by_hand = [sigma[i].item() * e[i].pow(2).mean().item() / e[i].abs().mean().item() for i in (0, 1)]
    by_hand.append(sigma[2].item() ** 2 * e[2].pow(2).mean().item() / 1e-5)
    assert ell.tolist() == pytest.approx(by_hand, rel=1e-5)
    # ∂ℓ/∂v = 2σ e / (n · mean |e|), and 2σ² e / (n · 1e-5) under the floor: the normaliser is a constant
    (grad,) = torch.autograd.grad(ell.sum(), v)
    scale = [2 * sigma[i].item() / (n * e[i].abs().mean().item()) for i in (0, 1)]
    scale.append(2 * sigma[2].item() ** 2 / (n * 1e-5))
    want = torch.stack([scale[i] * e[i] for i in range(3)]).view_as(v)
    torch.testing.assert_close(grad.double(), want, rtol=1e-4, atol=0)
    # two velocities at one point: each divided by its own mean error (the study's ELBO_θ - ELBO_old), not by one
    # shared normaliser times the difference of squared errors
    other = v.detach() + 0.1
    log_ratio = weighted_error(other, point, "adaptive") - ell.detach()
    want = _study_neg_elbo(other, x0, noise, sigma, "adaptive") - study
    torch.testing.assert_close(log_ratio.double(), want, rtol=1e-4, atol=1e-6)
    e_other = (other - (noise - x0)).flatten(1).double()[:2]
    shared = sigma[:2].double() * (e_other.pow(2).mean(1) - e[:2].pow(2).mean(1)) / e[:2].abs().mean(1)
    assert (log_ratio[:2].double() - shared).abs().min() > 1e-3


@pytest.mark.parametrize("weighting, method", [("elbo", "exact"), ("adaptive", "adaptive")])
def test_fpo_loss_is_the_surrogate_of_the_old_and_current_errors(weighting, method):
    adapter, traj = _setup()
    params = trainable(adapter)
    old_transformer = copy.deepcopy(adapter.transformer)
    objective = FPO(config("fpo", *draws("fpo"), f"grpo.fpo.weighting={weighting}", "grpo.kl.beta=0.5"))
    objective.begin_epoch(params)
    _move(params)  # then the weights move: the ratio leaves 1
    loss, stats = term_loss(objective, adapter, traj, SKEWED)

    x0 = traj.final_latents
    sigma, noise = shared_draws(x0, ROWS)  # the draws of the loss's generator, by hand
    _, _, v, v_ref = errors(adapter, traj, sigma, noise)
    v_old = errors(adapter, traj, sigma, noise, transformer=old_transformer)[2]
    neg_elbo = lambda u: _study_neg_elbo(u, x0, noise, sigma, method)  # noqa: E731
    log_ratio = (neg_elbo(v_old) - neg_elbo(v)).tolist()
    # the old weights were really used: with the current ones every log-ratio is exactly 0 (one of them may be near 0
    # by chance, as on one CI CPU: -7.7e-7 beside -3.2e-4)
    assert max(abs(x) for x in log_ratio) > 1e-5, log_ratio
    policy = _ppo_by_hand(log_ratio, SKEWED.tolist(), 0.05)
    kl = ((v - v_ref) ** 2).mean().item()
    assert stats["policy_loss"].item() == pytest.approx(policy, rel=1e-5)
    assert stats["kl"].item() == pytest.approx(kl, rel=1e-5)
    assert loss.item() == pytest.approx(policy + 0.5 * kl, rel=1e-5)
    assert stats["ratio_mean"].item() == pytest.approx(sum(math.exp(x) for x in log_ratio) / 4, rel=1e-5)


@pytest.mark.parametrize(
    "weighting, functional", [("uniform", "ppo_clip"), ("elbo", "reinforce"), ("adaptive", "ppo_clip")]
)
def test_at_the_old_weights_the_ratio_is_exactly_one_and_the_gradient_is_awms(weighting, functional):
    """Before the first update the old weights are the current ones: the old forward is skipped (one forward per
    term), ℓ_old = ℓ_θ to the bit, r = 1, nothing clipped, and ∇(-r A) = A ∇ℓ_θ with the weight held fixed, the
    advantage-weighted CFM gradient (AWM's own with w = 1)."""
    adapter, traj = _setup()
    params = trainable(adapter)
    objective = FPO(
        config("fpo", *draws("fpo"), f"grpo.fpo.weighting={weighting}", f"grpo.fpo.functional={functional}")
    )
    objective.begin_epoch(params)
    with helper.forward_rows(adapter) as forwards:
        loss, stats = term_loss(objective, adapter, traj, ADVANTAGES)
    assert len(forwards) == 1  # grpo.kl.beta = 0: the current forward only
    assert stats["ratio_min"].item() == stats["ratio_max"].item() == 1.0
    assert stats["clip_fraction"].item() == 0.0 and stats["approx_kl"].item() == 0.0
    got = torch.autograd.grad(loss, params)

    if weighting == "uniform":
        awm, _ = term_loss(AWM(config("awm", *draws("awm"))), adapter, traj, ADVANTAGES)
    else:  # mean_i A_i ℓ_θ,i at the loss's draws, by hand, the weight held fixed
        x0 = traj.final_latents
        sigma, noise = shared_draws(x0, ROWS)
        s = sigma.view(4, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        v = _conditional_velocity(adapter.transformer, traj, noisy, sigma)
        if weighting == "elbo":
            ell = (1 - sigma) / (sigma + 1e-3) * ((v - (noise - x0)) ** 2).mean(dim=(1, 2, 3))
        else:  # mean (x̂0 - x0)² / sg(mean |x̂0 - x0|), x̂0 = x_σ - σ v
            miss = noisy - s * v - x0
            ell = (miss**2).mean(dim=(1, 2, 3)) / miss.detach().abs().mean(dim=(1, 2, 3)).clamp_min(1e-5)
        awm = (ADVANTAGES * ell).mean()
    assert_same_gradients(got, torch.autograd.grad(awm, params))


def test_once_the_weights_move_a_term_runs_the_old_forward_on_the_epoch_start_snapshot():
    """The first term of an epoch is one forward; once an optimizer-like step moved the weights, two (the old one on
    the snapshot, without gradient), and the ratio leaves 1. The snapshot stays the epoch's start after further
    steps (a second inner epoch reads the same old weights): the ratio is against it, not the weights one step
    earlier."""
    adapter, traj = _setup()
    params = trainable(adapter)
    start = copy.deepcopy(adapter.transformer)
    objective = FPO(config("fpo", *draws("fpo")))
    objective.begin_epoch(params)
    with helper.forward_rows(adapter) as forwards:
        term_loss(objective, adapter, traj, ADVANTAGES)
    assert len(forwards) == 1 and not objective.old_weights.moved()
    _move(params)
    after_one = copy.deepcopy(adapter.transformer)
    _move(params, 0.03)  # a second step: the weights a second pass over the samples runs at
    with helper.forward_rows(adapter) as forwards:
        _, stats = term_loss(objective, adapter, traj, SKEWED)
    assert len(forwards) == 2

    sigma, noise = shared_draws(traj.final_latents, ROWS)
    d = errors(adapter, traj, sigma, noise)[0]
    d_start = errors(adapter, traj, sigma, noise, transformer=start)[0]
    d_one = errors(adapter, traj, sigma, noise, transformer=after_one)[0]
    against_start, against_one = torch.exp(d_start - d), torch.exp(d_one - d)
    # The two hypotheses must be told apart by the reported statistics (means alone can nearly coincide: they did,
    # to 5e-6, on another CPU), so the check compares mean, min and max together.
    got = torch.stack([stats[k].detach().reshape(()) for k in ("ratio_mean", "ratio_min", "ratio_max")])
    start_stats = torch.stack([against_start.mean(), against_start.min(), against_start.max()])
    one_stats = torch.stack([against_one.mean(), against_one.min(), against_one.max()])
    assert (start_stats - one_stats).abs().max().item() > 1e-3  # the setup separates them
    torch.testing.assert_close(got, start_stats, rtol=1e-6, atol=0)
    assert stats["ratio_max"].item() > 1.0 or stats["ratio_min"].item() < 1.0


def test_a_sample_clipped_on_its_advantages_side_gets_no_gradient():
    """After the weights moved: with ε under every |r - 1|, a sample with r > 1 + ε and A > 0, or r < 1 - ε and A < 0,
    sits on the clipped (constant) branch: all four so gives a gradient of exactly zero. Flipping one advantage puts
    that sample on the unclipped branch, and the gradient is its -r A / B alone."""
    adapter, traj = _setup()
    params = trainable(adapter)
    old_transformer = copy.deepcopy(adapter.transformer)
    x0 = traj.final_latents
    sigma, noise = shared_draws(x0, ROWS)
    snapshot = OldWeights(params)  # the epoch's start, as begin_epoch takes it
    _move(params)
    d, d_old = errors(adapter, traj, sigma, noise)[0], errors(adapter, traj, sigma, noise, old_transformer)[0]
    log_ratio = d_old - d
    clip = 0.5 * (log_ratio.exp() - 1).abs().min().item()
    objective = FPO(config("fpo", *draws("fpo"), f"grpo.fpo.clip_range={clip}"))
    objective.old_weights = snapshot

    clipped = torch.sign(log_ratio) * torch.tensor([1.5, 0.5, 0.25, 1.25])
    loss, stats = term_loss(objective, adapter, traj, clipped)
    assert stats["clip_fraction"].item() == 1.0
    assert all(torch.count_nonzero(g) == 0 for g in torch.autograd.grad(loss, params))

    flipped = clipped.clone()
    flipped[0] = -flipped[0]
    loss, _ = term_loss(objective, adapter, traj, flipped)
    s = sigma.view(4, 1, 1, 1)
    v = _conditional_velocity(adapter.transformer, traj, (1 - s) * x0 + s * noise, sigma)
    error = ((v[0] - (noise[0] - x0[0])) ** 2).mean()
    alone = -torch.exp(d_old[0] - error) * flipped[0] / 4
    assert_same_gradients(torch.autograd.grad(loss, params), torch.autograd.grad(alone, params))


def test_the_loss_needs_the_epochs_old_weights_and_sharded_parameters_are_refused():
    adapter, traj = _setup()
    with pytest.raises(RuntimeError, match="begin_epoch"):
        term_loss(FPO(config("fpo")), adapter, traj, ADVANTAGES)
    assert "grpo.objective: awm" in FPO.refuses_sharded


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["grpo.fpo.timesteps=0"], "grpo.fpo.timesteps"),
        (["grpo.fpo.logit_std=0"], "grpo.fpo.logit_std"),
        (["grpo.fpo.clip_range=0"], "grpo.fpo.clip_range"),
        (["grpo.fpo.clip_range=1.5"], "grpo.fpo.clip_range"),
        (["grpo.fpo.weighting=snr"], "grpo.fpo.weighting"),
        (["grpo.fpo.functional=epg"], "grpo.fpo.functional"),
        (["grpo.fpo.functional=reinforce", "grpo.fpo.clip_range=0.2"], "does nothing with grpo.fpo.functional"),
        (["grpo.awm.timesteps=2"], "did you mean grpo.fpo.timesteps"),
        (["train.updates_per_epoch=1"], "train.updates_per_epoch=1"),  # 1 step per epoch: r = 1 throughout
        (["train.gradient_accumulation=2"], "train.gradient_accumulation=2"),
    ],
)
def test_fpo_config_mistakes_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config("fpo", *overrides)


def test_one_optimizer_step_per_epoch_is_refused_at_the_validated_process_count():
    """The tiny config trains 2 micro-batches of 8 per epoch at one process (2 steps), 1 at two processes: refused
    there with the fix; a second inner epoch, or 2 updates per pass, make it 2 steps again."""
    with pytest.raises(ConfigError, match=r"ratio is always 1.*train\.inner_epochs: 2 or more.*grpo\.objective: awm"):
        validate(config("fpo"), world_size=2)
    validate(config("fpo", "train.inner_epochs=2"), world_size=2)
    config("fpo", "train.updates_per_epoch=1", "train.inner_epochs=2")
    config("fpo", "train.updates_per_epoch=2")


def test_two_epochs_of_the_shapes_preset_with_two_inner_epochs(tmp_path, monkeypatch):
    """configs/shapes_fpo.yaml with train.inner_epochs=2: the snapshot is taken once per epoch and stays the epoch's
    start through both passes over the samples; only the first term runs at r = 1 without the old forward."""
    begin_epoch, loss = FPO.begin_epoch, FPO.loss
    terms: list[list[tuple[bool, bool, bool]]] = []  # per epoch: (moved, r == 1, snapshot == the epoch's start)
    starts: list[list[torch.Tensor]] = []

    def recorded_begin(self, params):
        begin_epoch(self, params)
        starts.append([p.detach().clone() for p in params])
        terms.append([])

    def recorded_loss(self, adapter, batch):
        moved = self.old_weights.moved()
        out = loss(self, adapter, batch)
        at_one = out[1]["ratio_min"].item() == out[1]["ratio_max"].item() == 1.0
        kept = all(torch.equal(a, b) for a, b in zip(self.old_weights.saved, starts[-1], strict=True))
        terms[-1].append((moved, at_one, kept))
        return out

    monkeypatch.setattr(FPO, "begin_epoch", recorded_begin)
    monkeypatch.setattr(FPO, "loss", recorded_loss)
    rows = train_shapes("shapes_fpo", tmp_path, "train.inner_epochs=2")
    # 4 groups of 8 per epoch in micro-batches of 16, two passes: 4 optimizer steps per epoch, one term each.
    assert [r["global_step"] for r in rows] == [4, 8]
    assert terms == [[(False, True, True)] + [(True, False, True)] * 3] * 2
    assert all(r["train/onpolicy_ratio_dev"] == 0.0 and math.isfinite(r["train/loss"]) for r in rows)
