"""The clipped loss on lagged rollouts (grpo.objective: lagged): decoupled PPO's loss against its formula on made-up
numbers, one term on a tiny pipeline against the proximal and current log-probs computed by hand, the trainer's
rollouts from the soft-updated weights with the clip around the epoch's starting weights, the clipped objective
reproduced before the schedule starts, and the config checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import rollout_helper as helper
import torch
from test_guard import _move, _setup  # a tiny SD3 with a moved LoRA, a rollout of 4 images with SDE steps 0..2

from flowgrpo.config import ConfigError, load_config
from flowgrpo.objectives.clipped import grpo_loss
from flowgrpo.objectives.lagged import decoupled_grpo_loss, lagged_timestep_loss
from flowgrpo.objectives.nft import OldWeights, old_decay
from flowgrpo.rollout import evaluate_transitions, stored_log_probs
from flowgrpo.trainer import GRPOTrainer

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_sd3.yaml"
ADVANTAGES = torch.tensor([1.5, -0.5, 0.25, -1.25])
LAGGED = ["run.progress=false", "grpo.objective=lagged", "sampler.num_steps=4", "grpo.clip_range=0.2"]


def _config(*overrides):
    return load_config(TINY, [*LAGGED, *overrides])


def test_decoupled_loss_is_its_formula_on_made_up_numbers():
    log_prob = torch.tensor([0.30, -0.20, 0.05, 0.00], requires_grad=True)
    proximal = torch.tensor([0.00, 0.00, 0.10, 0.40])
    behaviour = torch.tensor([0.10, -0.30, 0.10, 0.20])
    advantages = torch.tensor([1.0, -2.0, 0.5, -1.0])
    loss, stats, weight = decoupled_grpo_loss(log_prob, proximal, behaviour, advantages, clip_range=0.2)
    # By hand: r = exp(logp - logp_prox), w = exp(logp_prox - logp_behav), per sample w·max(-A r, -A clip(r))
    r = [torch.exp(torch.tensor(x)) for x in (0.30, -0.20, -0.05, -0.40)]
    w = [torch.exp(torch.tensor(x)) for x in (-0.10, 0.30, 0.00, 0.20)]
    terms = []
    for a, ri, wi in zip(advantages.tolist(), r, w, strict=True):
        terms.append(wi * max(-a * ri, -a * ri.clamp(0.8, 1.2)))
    assert loss.item() == pytest.approx(float(sum(terms) / 4), rel=1e-6)
    assert weight.tolist() == pytest.approx([x.item() for x in w], rel=1e-6)
    assert stats.clip_fraction.item() == pytest.approx(0.5)  # r = e^0.3 and e^-0.4 leave [0.8, 1.2]
    loss.backward()
    # Gradient: -A w r where the clip does not bind (or binds on the pessimistic side), 0 where it does.
    # Sample 0: A > 0, r = 1.35 > 1.2: the clipped term is the max, no gradient. Sample 3: A < 0, r = 0.67 < 0.8:
    # -A·r < -A·0.8, the clipped term is the max, no gradient. Samples 1 and 2: inside the clip.
    expected = [0.0, 2.0 * w[1] * r[1] / 4, -0.5 * w[2] * r[2] / 4, 0.0]
    assert log_prob.grad.tolist() == pytest.approx([float(x) for x in expected], rel=1e-6, abs=1e-12)
    # With the behaviour policy the proximal one (no lag), w = 1: Flow-GRPO's clipped loss exactly
    same, _, ones = decoupled_grpo_loss(log_prob, proximal, proximal, advantages, clip_range=0.2)
    plain, _ = grpo_loss(log_prob, proximal, advantages, clip_range=0.2)
    assert torch.equal(ones, torch.ones(4)) and torch.equal(same, plain)


def test_one_term_clips_around_the_proximal_weights_and_weights_by_their_ratio_to_the_sampling_ones():
    cfg = _config()
    adapter, traj = _setup(cfg)  # sampled by θ0: the behaviour weights
    params = adapter.trainable_parameters()
    _move(adapter)  # the epoch's training starts at θ1 (the weights moved on since θ0 sampled)
    proximal = OldWeights(params)
    positions = torch.tensor([0, 1, 2, 1])
    with torch.no_grad():
        at_start = evaluate_transitions(adapter, traj, positions, cfg.sampler).log_prob
    _move(adapter)  # an optimizer step later: θ2
    advantages = torch.tensor([1.5, -0.5, 2.0, 1.0])  # not centred: the loss is not a cancellation of its terms
    loss, stats = lagged_timestep_loss(adapter, cfg, traj, positions, advantages, proximal)
    with torch.no_grad():
        now = evaluate_transitions(adapter, traj, positions, cfg.sampler).log_prob
    behaviour = stored_log_probs(traj, positions)
    r, w = torch.exp(now - at_start), torch.exp(at_start - behaviour)
    expected = (w * torch.maximum(-advantages * r, -advantages * r.clamp(0.8, 1.2))).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)  # without w it would be 2.7e-4 off
    assert stats["behaviour_weight"].item() == pytest.approx(w.mean().item(), rel=1e-6)
    assert (w - 1).abs().max() > 1e-4 and (r - 1).abs().max() > 1e-4  # both ratios are really off 1 here
    # Before any step of the epoch the proximal weights are the current ones: ratio exactly 1, no second forward.
    fresh = OldWeights(params)
    with helper.forward_rows(adapter) as rows:
        _, first = lagged_timestep_loss(adapter, cfg, traj, positions, ADVANTAGES, fresh)
    assert len(rows) == 1 and first["ratio_min"].item() == first["ratio_max"].item() == 1.0


def _rows(trainer):
    return [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_each_epoch_samples_with_the_soft_updated_weights_and_clips_around_the_live_ones(tmp_path):
    # 2 optimizer steps an epoch, η grows by 0.25 a step up to 0.9: 0.5 before epoch 1's rollout, 0.9 before epoch 2's
    decay = ["grpo.lagged.old_decay_rate=0.25", "grpo.lagged.old_decay_max=0.9"]
    config = _config(f"run.output_dir={tmp_path}", "run.epochs=3", "eval.every=0", "train.weight_decay=0", *decay)
    trainer = GRPOTrainer(config)
    record = helper.record_epoch_weights(trainer, lambda: trainer.objective.proximal.saved)
    trainer.fit()
    assert trainer.state.global_step == 6
    sampled, trained_from, trained_to = record["sampled"], record["trained_from"], record["trained_to"]
    proximal = record["after"]

    def close(a, b):
        return all(torch.allclose(x, y, rtol=0, atol=1e-7) for x, y in zip(a, b, strict=True))

    assert close(sampled[0], trained_from[0])
    for epoch, eta in ((1, 0.5), (2, 0.9)):
        assert old_decay(2 * epoch, 0.25, 0.9) == eta
        mixed = [eta * o + (1 - eta) * c for o, c in zip(sampled[epoch - 1], trained_to[epoch - 1], strict=True)]
        assert close(sampled[epoch], mixed)  # the rollout ran on η old + (1 - η) current
        assert close(trained_from[epoch], trained_to[epoch - 1])  # the live weights came back for training
        assert close(proximal[epoch], trained_from[epoch])  # and the clip is around them, not the sampling ones
    assert all(close(p, f) for p, f in zip(proximal, trained_from, strict=True))
    rows = [r for r in _rows(trainer) if "train/loss" in r]
    # Epoch 0 sampled with the live weights: w = 1 up to re-scoring's rounding; later epochs with lagged ones.
    assert abs(rows[0]["train/behaviour_weight"] - 1) < helper.ON_POLICY_RATIO_TOL
    assert all(abs(r["train/behaviour_weight"] - 1) > 1e-5 for r in rows[1:])
    assert all(r["train/onpolicy_ratio_dev"] == 0.0 for r in rows)  # before each epoch's first step r = 1 exactly


def test_before_the_schedule_starts_lagged_trains_as_clipped(tmp_path):
    """η = 0 until step 10⁶: the rollout samples with the live weights and behaviour = proximal, so two epochs end
    where grpo.objective=clipped ends (w = 1 within the re-scoring's few ulps)."""
    common = [f"run.output_dir={tmp_path}", "run.epochs=2", "eval.every=0", "train.weight_decay=0"]
    clipped = GRPOTrainer(_config(*common, "grpo.objective=clipped"))
    clipped.fit()
    lagged = GRPOTrainer(_config(*common, "grpo.lagged.old_decay_start=1000000"))
    lagged.fit()
    assert lagged.state.global_step == clipped.state.global_step == 4
    for a, b in zip(lagged.params, clipped.params, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.lagged.old_decay_max=0", "grpo.lagged.old_decay_rate=0"], r"grpo\.objective: clipped"),
        (["grpo.lagged.old_decay_rate=0"], r"grpo\.lagged\.old_decay_max=0\.5 needs grpo\.lagged\.old_decay_rate"),
        (["grpo.lagged.old_decay_max=1"], r"grpo\.lagged\.old_decay_max"),
        (["sampler.noise_level=0"], r"grpo\.objective=lagged trains stochastic transitions"),
        (["grpo.log_prob_reduce=sum"], r"set grpo\.log_prob_reduce: mean"),
        (["sampler.rollout=offline"], r"grpo\.objective=lagged"),
    ],
)
def test_bad_settings_are_refused_with_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(*overrides)


def test_sharded_parameters_are_refused_for_the_swaps():
    from flowgrpo.objectives.lagged import Lagged

    assert "grpo.objective: clipped" in Lagged.refuses_sharded
