"""GRPO-Guard (grpo.objective: guard): RatioNorm against its formula on a hand-computed Gaussian step and its
properties, the 1/Δt step weights on a hand-made schedule, the on-policy ratio and gradient on a tiny pipeline, the
off-policy ratio against the epoch's starting means (the fallback without stored means), the sampling means every
rollout strategy keeps for it and the loss they give (the fallback's, with one forward per term), the clipped
objective reproduced bit for bit without the two corrections, the config checks, and a trainer epoch."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import rollout_helper as helper
import torch

from flowgrpo.adapters import make_adapter
from flowgrpo.config import ConfigError, load_config
from flowgrpo.objectives import MicroBatch
from flowgrpo.objectives.clipped import Clipped
from flowgrpo.objectives.guard import (
    Guard,
    guard_timestep_loss,
    ratio_norm_log_ratio,
    step_weights,
)
from flowgrpo.objectives.nft import OldWeights
from flowgrpo.rollout import Trajectory, evaluate_transitions, rollout, stored_log_probs, stored_means
from flowgrpo.tiny import build_tiny_pipeline
from flowgrpo.trainer import GRPOTrainer
from samplers import gaussian_log_prob

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_sd3.yaml"
PROMPTS = ["a red cube", "a red cube", "a blue ball", "a blue ball"]
ADVANTAGES = torch.tensor([1.5, -0.5, 0.25, -1.25])
GUARD = ["run.progress=false", "grpo.objective=guard", "sampler.num_steps=4", "grpo.clip_range=0.2"]
MEANS = {"store_means": True}


def _config(*overrides):
    return load_config(TINY, [*GUARD, *overrides])


def _setup(cfg):
    """A tiny SD3 pipeline with a LoRA whose B is non-zero, and a rollout of 4 images with SDE steps 0..2 (their
    sampling means kept, as a rollout strategy keeps them for guard)."""
    adapter = make_adapter(build_tiny_pipeline("sd3", seed=0))
    adapter.add_lora(4, 8, "default", "gaussian", 0.0)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    generator = torch.Generator().manual_seed(1)
    traj = rollout(adapter, PROMPTS, [0, 0, 1, 1], cfg.sampler, range(0, 3), generator, height=32, width=32, **MEANS)
    return adapter, traj


def _params(adapter):
    return adapter.trainable_parameters()


def _move(adapter, scale=0.05):
    with torch.no_grad():
        for p in _params(adapter):
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


# ---- RatioNorm and the step weights, as pure functions --------------------------------------------------------------


def test_ratio_norm_on_a_hand_computed_gaussian_step():
    """x' = μ_old + s z with μ_old = (0.1, -0.2), s = 0.5, z = (1, -2); μ_θ = (0.3, 0.1), so Δμ = (0.2, 0.3).
    log r̂ = mean(z Δμ) = (0.2 - 0.6) / 2 = -0.2 (sum: -0.4), while the plain log-ratio is
    mean(z Δμ)/s - mean(Δμ²)/(2 s²) = -0.4 - 0.065/0.5 = -0.53 (sum: -1.06)."""
    old_mean = torch.tensor([[0.1, -0.2]])
    mean = torch.tensor([[0.3, 0.1]])
    s, z = 0.5, torch.tensor([[1.0, -2.0]])
    sample = old_mean + s * z
    for reduce, expected, plain in (("mean", -0.2, -0.53), ("sum", -0.4, -1.06)):
        log_prob = gaussian_log_prob(sample, mean, s, reduce)
        old_log_prob = gaussian_log_prob(sample, old_mean, s, reduce)
        torch.testing.assert_close(log_prob - old_log_prob, torch.tensor([plain]), rtol=0, atol=1e-6)
        for std in (torch.tensor(s), torch.tensor([s]), torch.full((1, 1), s)):  # [], [B], [B, 1]
            got = ratio_norm_log_ratio(log_prob, old_log_prob, mean, old_mean, std, reduce)
            torch.testing.assert_close(got, torch.tensor([expected]), rtol=0, atol=1e-6)


def test_ratio_norm_is_centred_and_the_same_at_every_step_std():
    """The same draws z at two steps whose std differs sevenfold: the plain log-ratio's mean (-mean(Δμ²)/(2s²)) and
    spread (∝ 1/s) change with s, RatioNorm's is the same number, mean(z Δμ), centred on 0."""
    g = torch.Generator().manual_seed(0)
    n, d = 4000, 64
    old_mean = torch.randn(n, d, generator=g)
    delta = 0.05 * torch.randn(1, d, generator=g).expand(n, d)
    z = torch.randn(n, d, generator=g)
    normalised, plain = [], []
    for s in (0.7, 0.1):
        sample = old_mean + s * z
        log_prob = gaussian_log_prob(sample, old_mean + delta, s)
        old_log_prob = gaussian_log_prob(sample, old_mean, s)
        plain.append(log_prob - old_log_prob)
        normalised.append(ratio_norm_log_ratio(log_prob, old_log_prob, old_mean + delta, old_mean, torch.tensor(s)))
    torch.testing.assert_close(normalised[0], normalised[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(normalised[0], (z * delta).mean(dim=1), rtol=0, atol=1e-5)
    bias = (delta[0] ** 2).mean()
    spread = normalised[0].std()
    assert normalised[0].mean().abs() < 4 * spread / n**0.5  # centred
    for s, values in zip((0.7, 0.1), plain, strict=True):
        assert abs(values.mean() + bias / (2 * s**2)) < 4 * values.std() / n**0.5  # left of 0 by mean(Δμ²)/(2s²)
        torch.testing.assert_close(values.std(), spread / s, rtol=1e-3, atol=0)


def test_step_weights_on_a_hand_made_schedule():
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.25])
    sigmas_next = torch.tensor([0.8, 0.5, 0.25, 0.0])
    torch.testing.assert_close(step_weights(sigmas, sigmas_next, "dt"), torch.tensor([5.0, 10 / 3, 4.0, 4.0]))
    assert torch.equal(step_weights(sigmas, sigmas_next, "none"), torch.ones(4))
    with pytest.raises(ValueError, match="t > t_next"):
        step_weights(sigmas_next, sigmas, "dt")
    with pytest.raises(ConfigError, match="grpo.guard.reweight must be one of dt, none"):
        step_weights(sigmas, sigmas_next, "sqrt_dt")


# ---- on a tiny pipeline ---------------------------------------------------------------------------------------------


class CountedWeights(OldWeights):
    swaps = 0

    def swapped_in(self):
        CountedWeights.swaps += 1
        return super().swapped_in()


@pytest.fixture(scope="module")
def tiny():
    cfg = _config("grpo.kl.beta=0")
    adapter, traj = _setup(cfg)
    return cfg, adapter, traj


def test_on_policy_the_ratio_is_exactly_one_and_the_gradient_is_the_reference_formulas(tiny):
    """Unmoved weights: r̂ = 1 exactly (and no second forward), with the stored sampling means as with the fallback
    that recomputes them, and the gradient is the score-function one, ∇L = -mean_i w_i A_i red(z_i ∇μ_i) with
    z = (x' - μ)/s and w = 1/(t - t_next); at one shared step that is s·w times the clipped objective's gradient."""
    cfg, adapter, stored = tiny
    params = _params(adapter)
    for positions, traj in (
        (torch.tensor([0, 1, 2, 0]), stored),
        (torch.tensor([0, 1, 2, 0]), replace(stored, means=None)),
        (torch.full((4,), 1), stored),
    ):
        CountedWeights.swaps = 0
        loss, stats = guard_timestep_loss(adapter, cfg, traj, positions, ADVANTAGES, CountedWeights(params))
        assert CountedWeights.swaps == 0  # the stored mean, or the current forward's: the same number
        assert stats["ratio_min"].item() == 1.0 and stats["ratio_max"].item() == 1.0
        assert stats["raw_ratio_mean"].item() == 1.0 and stats["mean_shift"].item() == 0.0
        grads = torch.autograd.grad(loss, params)

        new = evaluate_transitions(adapter, traj, positions, cfg.sampler)
        rows = torch.arange(4)
        s = new.std.reshape(4, -1)[:, 0] if new.std.ndim else new.std.expand(4)
        z = (traj.next_latents[rows, positions] - new.mean.detach()) / s.view(4, 1, 1, 1)
        w = 1 / (traj.sigmas[rows, positions] - traj.sigmas_next[rows, positions])
        surrogate = -(w * ADVANTAGES * (z * new.mean).mean(dim=(1, 2, 3))).mean()
        expected = torch.autograd.grad(surrogate, params)
        for got, want in zip(grads, expected, strict=True):
            # The same forward, the chain rule taken in another order (s·∇log p + ∇red(Δμ²)/(2s) against z·∇μ):
            # fp32 rounding, relative to the largest entry.
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert any(g.abs().sum() > 0 for g in grads)

    # one shared step: ∇ log r̂ = s ∇ log r on-policy, so the gradient is s·w × clipped's (w, s the same for all)
    batch = MicroBatch(traj, ADVANTAGES, positions, torch.Generator())
    clipped_grads = torch.autograd.grad(Clipped(cfg).loss(adapter, batch)[0], params)
    factor = s[0] * w[0]
    assert factor != 1.0 and torch.equal(s, s[:1].expand(4)) and torch.equal(w, w[:1].expand(4))
    for got, plain in zip(grads, clipped_grads, strict=True):
        torch.testing.assert_close(got, factor * plain, rtol=1e-4, atol=1e-4 * got.abs().max().item())


def test_off_policy_the_ratio_is_normalised_against_the_epochs_starting_means(tiny):
    """The fallback for a trajectory without sampling means: after the weights moved, μ_old comes from the snapshot
    (one forward without gradient), and the loss is the reference's: r̂ = exp(s (log p - log p_old + mean(Δμ²)/(2 s²))),
    loss = mean(w max(-A r̂, -A clip(r̂))) (verl-omni's GRPOGuardLoss with a per-sample w)."""
    cfg, adapter, traj = tiny
    traj = replace(traj, means=None)
    params = _params(adapter)
    positions = torch.tensor([0, 1, 2, 1])
    with torch.no_grad():
        old_mean = evaluate_transitions(adapter, traj, positions, cfg.sampler).mean
    snapshot = CountedWeights(params)
    saved = [p.detach().clone() for p in params]
    _move(adapter)
    try:
        CountedWeights.swaps = 0
        loss, stats = guard_timestep_loss(adapter, cfg, traj, positions, ADVANTAGES, snapshot)
        assert CountedWeights.swaps == 1
        with torch.no_grad():
            new = evaluate_transitions(adapter, traj, positions, cfg.sampler)
            rows = torch.arange(4)
            s = new.std.reshape(4, -1)[:, 0]
            bias = ((new.mean - old_mean) ** 2).mean(dim=(1, 2, 3)) / (2 * s**2)
            log_ratio = new.log_prob - stored_log_probs(traj, positions)
            ratio = torch.exp((log_ratio + bias) * s)
            w = 1 / (traj.sigmas[rows, positions] - traj.sigmas_next[rows, positions])
            eps = cfg.grpo.clip_range
            policy = (w * torch.maximum(-ADVANTAGES * ratio, -ADVANTAGES * ratio.clamp(1 - eps, 1 + eps))).mean()
        assert (ratio - 1).abs().max() > 1e-6 and bias.min() > 0  # really off-policy (on-policy it is exactly 1)
        torch.testing.assert_close(stats["ratio_mean"], ratio.mean(), rtol=1e-5, atol=0)
        torch.testing.assert_close(stats["ratio_max"], ratio.max(), rtol=1e-5, atol=0)
        torch.testing.assert_close(stats["mean_shift"], bias.mean(), rtol=1e-4, atol=0)
        torch.testing.assert_close(stats["raw_ratio_mean"], torch.exp(log_ratio).mean(), rtol=1e-5, atol=0)
        torch.testing.assert_close(loss.detach(), policy, rtol=1e-5, atol=0)
        torch.testing.assert_close(stats["step_weight"], w.mean(), rtol=1e-6, atol=0)
    finally:
        with torch.no_grad():
            for p, old in zip(params, saved, strict=True):
                p.copy_(old)


def _forwards_per_loss(adapter, objective, batch):
    """``objective.loss(adapter, batch)`` and the number of transformer forwards it ran."""
    with helper.forward_rows(adapter) as rows:
        loss, stats = objective.loss(adapter, batch)
    return loss, stats, len(rows)


def test_with_stored_means_a_moved_term_is_one_forward_and_the_fallbacks_loss(tiny):
    """The same micro-batch through two Guard objectives, one with the rollout's sampling means, one without (the
    fallback: the epoch-start snapshot, taken at the first term). On-policy both run one forward and agree bit for
    bit; after an optimizer-like move the stored means still cost one forward where the fallback runs two (the
    snapshot's), and the loss, its gradient and every statistic agree (μ_old is the same tensor but for the rows its
    forward saw: CPU rounding)."""
    cfg, adapter, stored = tiny
    params = _params(adapter)
    positions = torch.tensor([0, 1, 2, 1])
    batches = {
        name: MicroBatch(traj, ADVANTAGES, positions, torch.Generator())
        for name, traj in (("stored", stored), ("recomputed", replace(stored, means=None)))
    }
    objectives = {name: Guard(cfg) for name in batches}
    for objective in objectives.values():
        objective.begin_epoch(params)
    on_policy = {name: _forwards_per_loss(adapter, objectives[name], batch) for name, batch in batches.items()}
    assert on_policy["stored"][2] == on_policy["recomputed"][2] == 1
    assert objectives["stored"].old_weights is None  # stored means: no snapshot at all
    assert isinstance(objectives["recomputed"].old_weights, OldWeights)
    assert torch.equal(on_policy["stored"][0], on_policy["recomputed"][0])
    saved = [p.detach().clone() for p in params]
    _move(adapter)
    try:
        moved = {name: _forwards_per_loss(adapter, objectives[name], batch) for name, batch in batches.items()}
        (loss, stats, forwards), (want, want_stats, want_forwards) = moved["stored"], moved["recomputed"]
        assert forwards == 1 and want_forwards == 2
        assert (stats["ratio_max"] - 1).abs() > 1e-6 and stats["mean_shift"] > 0  # really off-policy
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
        assert stats.keys() == want_stats.keys()
        for key, value in want_stats.items():
            torch.testing.assert_close(stats[key], value, rtol=1e-5, atol=1e-9, msg=key)
        for got, expected in zip(torch.autograd.grad(loss, params), torch.autograd.grad(want, params), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    finally:
        with torch.no_grad():
            for p, old in zip(params, saved, strict=True):
                p.copy_(old)


def test_without_its_corrections_guard_is_the_clipped_objective_bit_for_bit(tiny):
    """ratio_norm: false and reweight: none leave Flow-GRPO's loss: the same loss, statistics and gradients as
    grpo.objective: clipped (with a KL term, off-policy), to the bit."""
    _, adapter, traj = tiny
    params = _params(adapter)
    saved = [p.detach().clone() for p in params]
    _move(adapter)
    try:
        base = ["grpo.kl.beta=0.5", "grpo.guard.ratio_norm=false", "grpo.guard.reweight=none"]
        guard_cfg = _config(*base)
        clipped_cfg = _config("grpo.objective=clipped", "grpo.kl.beta=0.5")
        batch = MicroBatch(traj, ADVANTAGES, torch.tensor([0, 1, 2, 1]), torch.Generator())
        objective = Guard(guard_cfg)
        objective.begin_epoch(params)
        assert objective.old_weights is None  # no RatioNorm: no snapshot, no extra forward
        got, got_stats = objective.loss(adapter, batch)
        want, want_stats = Clipped(clipped_cfg).loss(adapter, batch)
        assert torch.equal(got, want) and want_stats["ratio_max"] != 1.0
        for key, value in want_stats.items():
            assert torch.equal(got_stats[key], value), key
        for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params), strict=True):
            assert torch.equal(a, b)
    finally:
        with torch.no_grad():
            for p, old in zip(params, saved, strict=True):
                p.copy_(old)


def test_epoch_start_weights_notice_the_first_step_and_keep_the_snapshot(tiny):
    _, adapter, _ = tiny
    params = _params(adapter)
    snapshot = OldWeights(params)
    assert not snapshot.moved()
    saved = [p.detach().clone() for p in params]
    _move(adapter, 1e-3)
    try:
        assert snapshot.moved()
        with snapshot.swapped_in():
            assert all(torch.equal(p, s) for p, s in zip(params, saved, strict=True))
        assert any(not torch.equal(p, s) for p, s in zip(params, saved, strict=True))
    finally:
        with torch.no_grad():
            for p, old in zip(params, saved, strict=True):
                p.copy_(old)


# ---- the rollout strategies keep the sampling means ------------------------------------------------------------------

STRATEGIES = {  # every strategy guard accepts, set up as its own tests do (tests/test_*.py of each)
    "chain": [],
    "dense": ["sampler.rollout=dense"],
    "iso_temporal": [
        "sampler.rollout=iso_temporal",
        "sampler.window.size=1",
        "sampler.window.strategy=random",
        "sampler.window.max_start=3",
    ],
    "branch": ["sampler.rollout=branch"],
    "entropy_merge": [
        "sampler.rollout=entropy_merge",
        "sampler.entropy_merge.steps=[0, 1]",
        "sampler.entropy_merge.spans=[1, 3]",
    ],
    "tree": ["sampler.rollout=tree", "grpo.advantage.estimator=tree", "sampler.tree.split_steps=[0, 2]"],
}
STRATEGY = ["run.progress=false", "sampler.same_initial_noise=true", "grpo.groups_per_epoch=2"]


def _collect(overrides: list[str]):
    """One epoch of the strategy on the tiny SD3 pipeline (no LoRA: the sampling weights are the adapter's)."""
    from flowgrpo.rollouts import get_rollout

    config = load_config(helper.TINY, [*STRATEGY, *overrides])
    adapter = helper.adapter()
    score = lambda images, *_: {"total": images.float().mean(dim=(1, 2, 3))}  # noqa: E731  (dense's stage values)
    strategy = get_rollout(config.sampler.rollout)(helper.rollout_context(config, adapter, score=score))
    return config, adapter, strategy.collect(0).trajectory


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_keeps_the_sampling_mean_that_re_scoring_computes(name):
    """Guard's trajectory holds, for every stored transition (tree: every slot, padding included), the mean the
    transition was sampled with: float32, equal to the mean :func:`evaluate_transitions` computes under the same
    weights (bit for bit where the forward saw the same rows, else up to CPU rounding, 1e-5 with |μ| up to 4: a
    shared trunk, a tree's nodes or a batch split by window against one row per image, as tests/test_tempflow.py
    says; this CPU gave 0 everywhere)."""
    config, adapter, traj = _collect(["grpo.objective=guard", *STRATEGIES[name]])
    means = traj.means
    assert means is not None and means.dtype == torch.float32 and means.shape == traj.latents.shape
    assert traj.num_trained_steps >= 1
    with torch.no_grad():
        for j in range(traj.num_trained_steps):
            step = torch.full((len(traj),), j)
            recomputed = evaluate_transitions(adapter, traj, step, config.sampler).mean
            if name in ("chain", "dense"):  # the window's forwards saw the same rows (the batch's 8 images)
                assert torch.equal(means[:, j], recomputed)
            torch.testing.assert_close(means[:, j], recomputed, rtol=0, atol=1e-5)
            assert torch.equal(stored_means(traj, step), means[:, j])
    picked = traj.select([2, 0])  # a micro-batch keeps its rows' means; joined batches theirs
    assert torch.equal(picked.means, means[[2, 0]])
    assert torch.equal(Trajectory.cat([picked, traj]).means, torch.cat([means[[2, 0]], means]))


@pytest.mark.parametrize(
    "overrides",
    [
        ["grpo.objective=clipped"],
        ["grpo.objective=tempflow", *STRATEGIES["branch"]],
        ["grpo.objective=clipped", *STRATEGIES["tree"]],
        ["grpo.objective=guard", "grpo.guard.ratio_norm=false"],  # no RatioNorm: no mean is read
    ],
)
def test_objectives_that_do_not_ask_get_no_means(overrides):
    _, _, traj = _collect(overrides)
    assert traj.means is None and traj.select([1, 0]).means is None and Trajectory.cat([traj, traj]).means is None
    assert stored_means(traj, 0) is None


# ---- config and trainer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.guard.reweight=dtt"], r"grpo\.guard\.reweight must be one of dt, none, got 'dtt'; did you mean 'dt'"),
        (["grpo.guard.ratio_norm=maybe"], r"grpo\.guard\.ratio_norm: expected true or false"),
        (["sampler.noise_level=0"], r"grpo\.objective=guard .* sampler\.noise_level=0\.0 .* set sampler\.noise_level"),
        (
            ["sampler.kind=cps", "sampler.log_prob=squared_error"],
            r"grpo\.guard\.ratio_norm=true needs sampler\.log_prob: exact, got 'squared_error'",
        ),
        (["grpo.objective=clipped", "grpo.guard.reweight=none"], r"is a setting of grpo\.objective=guard"),
    ],
)
def test_bad_settings_are_refused_with_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(*overrides)


def test_the_squared_error_log_prob_is_allowed_without_ratio_norm():
    cfg = _config("sampler.kind=cps", "sampler.log_prob=squared_error", "grpo.guard.ratio_norm=false")
    assert cfg.grpo.guard.ratio_norm is False and cfg.grpo.guard.reweight == "dt"


def test_a_trainer_epoch_with_guard(tmp_path, monkeypatch):
    """Two micro-batches of 3 trained steps: the first trains on-policy (ratio exactly 1), the second after the first
    optimizer step; every term runs exactly one forward, the rollout having kept the sampling means (no snapshot, no
    swap; the fallback ran a second forward per term of the second micro-batch)."""
    import flowgrpo.objectives.guard as guard

    CountedWeights.swaps = 0
    monkeypatch.setattr(guard, "OldWeights", CountedWeights)
    forwards: list[tuple[bool, int]] = []  # (the trajectory had means, forwards) per term

    def counted(adapter, cfg, sub, *args):
        with helper.forward_rows(adapter) as rows:
            out = guard_timestep_loss(adapter, cfg, sub, *args)
        forwards.append((sub.means is not None, len(rows)))
        return out

    monkeypatch.setattr(guard, "guard_timestep_loss", counted)
    config = _config(f"run.output_dir={tmp_path}", "run.epochs=1", "eval.every=0", "train.weight_decay=0")
    trainer = GRPOTrainer(config)
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "train/loss" in r)
    assert row["global_step"] == 2 and row["train/onpolicy_ratio_dev"] == 0.0
    assert {"train/raw_ratio_mean", "train/mean_shift", "train/step_weight", "train/clip_fraction"} <= set(row)
    assert row["train/step_weight"] > 1.0  # 1/Δt on a 4-step schedule
    assert forwards == [(True, 1)] * 6 and CountedWeights.swaps == 0
    assert any(not torch.equal(p.detach(), b) for p, b in zip(trainer.params, before, strict=True))
