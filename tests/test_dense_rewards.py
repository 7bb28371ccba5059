"""Dense step rewards (issue 29): the dense rollout (flowgrpo/rollouts/dense.py) and the two estimators that credit
window steps from them, TP-GRPO's turning points (flowgrpo/advantages/tp.py) and VGPO's anchored process values
(flowgrpo/advantages/vgpo.py), held to their definitions on the tiny random SD3 pipeline (CFG: two rows per image).

The stage values of the tests' reward are the images' mean pixel, a deterministic function of the decoded image: a
value equal bit for bit means the predicted latents were equal bit for bit.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import rollout_helper as helper
import torch
from rollout_helper import CFG_SCALE, SIZE, STEPS, TINY

from flowgrpo.advantages import AdvantageInputs, group_advantages
from flowgrpo.advantages.tp import (
    TurningPointSettings,
    aggregated_rewards,
    increments,
    turning_point,
    turning_point_rewards,
    turning_points,
)
from flowgrpo.advantages.vgpo import (
    VGPOSettings,
    anchored_advantages,
    instant_rewards,
    process_values,
    timestep_weights,
    vgpo,
)
from flowgrpo.config import ConfigError, load_config
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.rollouts.dense import Dense, one_step_x0

PROMPTS = ["a red cube", "a red cube", "a blue ball", "a blue ball"]
GROUPS = [3, 3, 8, 8]
DENSE = ["sampler.rollout=dense", "sampler.same_initial_noise=true"]


@pytest.fixture(scope="module")
def adapter():
    return helper.adapter()


class Recorder:
    """A reward: each image's mean pixel; keeps every batch of images it was asked to score."""

    def __init__(self) -> None:
        self.images: list[torch.Tensor] = []

    def __call__(self, images, prompts, metadata, sources):
        self.images.append(images.detach().clone())
        return {"total": images.float().mean(dim=(1, 2, 3))}


def _dense(adapter, *overrides, score=None):
    config = load_config(TINY, [*DENSE, *overrides])
    return Dense(helper.rollout_context(config, adapter, score=score if score is not None else Recorder()))


def _sample(dense, window, seed=1):
    dense.context.generator.manual_seed(seed)
    return dense.sample_batch(PROMPTS, GROUPS, [{} for _ in PROMPTS], None, window)


def _mean_pixel(adapter, latents):
    return adapter.decode(latents, SIZE, SIZE).float().mean(dim=(1, 2, 3))


# ------------------------------------------------------------------------------------------------ the rollout
def test_each_stage_is_scored_on_x0_from_the_rollouts_own_velocity(adapter):
    """Stage j's image is decode(x - t·v) with v from a separate velocity call at the stored state (the state before
    window step j; after the last one for j = W), bit for bit; the rollout's velocity was reused: S forwards."""
    score = Recorder()
    dense = _dense(adapter, score=score)
    window = range(1, 4)
    with helper.forward_rows(adapter) as calls:
        traj = _sample(dense, window)
    assert len(calls) == STEPS  # the chain's forwards, none added
    values = traj.extras["step_rewards"]
    assert values.shape == (4, len(window) + 1) and len(score.images) == len(window) + 1
    assert traj.extras["step_indices"].tolist() == [list(window)] * 4
    states = [*(traj.latents[:, j] for j in range(3)), traj.next_latents[:, 2]]
    sigmas = [*(traj.sigmas[0, j] for j in range(3)), traj.sigmas_next[0, 2]]
    for j, (x, t) in enumerate(zip(states, sigmas, strict=True)):
        v = adapter.velocity(x, t, traj.embeds, CFG_SCALE)
        x0 = (x.float() - t.float() * v.float()).to(x.dtype)  # x̂0 = x_t - t·v, written out
        assert torch.equal(one_step_x0(v, x, t), x0)
        expected = adapter.decode(x0, SIZE, SIZE)
        assert torch.equal(score.images[j], expected), j
        assert torch.equal(values[:, j], expected.float().mean(dim=(1, 2, 3)))
    assert not torch.equal(values[:, 0], values[:, -1])


def test_the_last_stage_is_the_final_reward_when_the_window_ends_at_the_last_euler_step(adapter):
    """A window ending at step S-2 leaves one Euler step to t = 0: x̂0 after the last window step IS the final sample,
    so the last stage's reward is the final image's, exactly. A window ending earlier: not."""
    score = Recorder()
    dense = _dense(adapter, score=score)
    traj = _sample(dense, range(2, STEPS - 1))
    assert torch.equal(score.images[-1], traj.images)
    assert torch.equal(traj.extras["step_rewards"][:, -1], traj.images.float().mean(dim=(1, 2, 3)))
    early = _sample(_dense(adapter), range(1, 3))
    assert not torch.equal(early.extras["step_rewards"][:, -1], early.images.float().mean(dim=(1, 2, 3)))


def test_the_dense_rollout_samples_what_the_chain_samples_and_rescores_with_ratio_exactly_one(adapter):
    """The hook only reads: latents, log-probs and images are the chain rollout's bit for bit, and re-scoring each
    stored transition under the unchanged model gives the stored log-prob exactly (ratio 1 on-policy)."""
    dense = _dense(adapter)
    window = range(1, 4)
    traj = _sample(dense, window)
    config = dense.context.config
    plain = rollout(
        adapter,
        PROMPTS,
        GROUPS,
        config.sampler,
        window,
        torch.Generator().manual_seed(1),
        height=SIZE,
        width=SIZE,
        noise_seed=config.run.seed,
        log_prob_reduce=config.grpo.log_prob_reduce,
    )
    for name in ("latents", "next_latents", "log_probs", "final_latents", "images"):
        assert torch.equal(getattr(traj, name), getattr(plain, name)), name
    for j in range(len(window)):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, config.sampler, log_prob_reduce=config.grpo.log_prob_reduce)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])
        assert torch.equal(torch.exp(again.log_prob - traj.log_probs[:, j]), torch.ones(4))


def test_ode_values_complete_each_stage_with_the_ode(adapter):
    """value: ode. Stage 0 is the pure ODE sample from the same noise; the last stage is the final image's reward;
    with noise 0 the chain IS the ODE, so every stage's completion is the same image (float tolerance). The extra
    forwards: S - k - j for each stage j < W."""
    window = range(0, 3)
    dense = _dense(adapter, "sampler.dense.value=ode")
    with helper.forward_rows(adapter) as calls:
        traj = _sample(dense, window)
    assert len(calls) == STEPS + sum(STEPS - j for j in range(3)) == dense.counts["extra_forwards"] + STEPS
    values = traj.extras["step_rewards"]
    assert torch.equal(values[:, -1], traj.images.float().mean(dim=(1, 2, 3)))
    config = dense.context.config
    noise = adapter.initial_noise(4, SIZE, SIZE, group_ids=GROUPS, same_within_group=True, noise_seed=0)
    ode = rollout(adapter, PROMPTS, GROUPS, config.sampler, range(0), None, height=SIZE, width=SIZE,
                  initial_latents=noise)  # fmt: skip
    assert torch.equal(traj.latents[:, 0], noise)
    torch.testing.assert_close(values[:, 0], ode.images.float().mean(dim=(1, 2, 3)), rtol=0, atol=0)
    assert not torch.allclose(values[:, 0], values[:, 1], rtol=0, atol=1e-6)  # the SDE steps moved it
    still = _sample(_dense(adapter, "sampler.dense.value=ode", "sampler.noise_level=0"), window)
    spread = still.extras["step_rewards"] - still.extras["step_rewards"][:, :1]
    torch.testing.assert_close(spread, torch.zeros_like(spread), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ TP-GRPO
# Stage values chosen dyadic (exact in binary): a rising trajectory with two dips, a falling one, and one whose
# first step already goes the trajectory's way.
V = torch.tensor(
    [
        [0.5, 0.25, 0.75, 1.0, 0.875, 1.25],  # d = -.25 .5 .25 -.125 .375, Δ = .75
        [1.0, 1.25, 0.5, 0.25, 0.5, 0.0],  # d = .25 -.75 -.25 .25 -.5,   Δ = -1
        [0.0, 0.5, 0.25, 0.5, 0.75, 1.0],  # d = .5 -.25 .25 .25 .25,     Δ = 1
    ],
    dtype=torch.float64,
)


def test_turning_points_of_a_hand_computed_increment_sequence():
    d = increments(V)
    assert d.tolist() == [
        [-0.25, 0.5, 0.25, -0.125, 0.375],
        [0.25, -0.75, -0.25, 0.25, -0.5],
        [0.5, -0.25, 0.25, 0.25, 0.25],
    ]
    assert aggregated_rewards(V)[:, 0].tolist() == [0.75, -1.0, 1.0]  # agg_0 = Δ
    # s = sign(d)·sign(Δ): row 0 - + + - +, row 1 - + + - +, row 2 + - + + +
    points = turning_points(V)
    assert points.tolist() == [
        [False, True, False, False, True],
        [False, True, False, False, True],
        [True, False, True, False, False],
    ]
    assert turning_points(V, first_step=False)[:, 0].tolist() == [False, False, False]
    # consistent: sign(d_j) = sign(V_W - V_{j+1}); row 0 step 4: V_W - V_5 = 0, not a turning point any more
    assert turning_points(V, consistent=True).tolist() == [
        [False, True, False, False, False],
        [False, True, False, False, False],
        [True, False, True, False, False],
    ]
    # paper: agg_j = V_W - V_j replaces d_j at turning points (at the last step agg = d: nothing follows it)
    assert turning_point_rewards(V).tolist() == [
        [-0.25, 1.0, 0.25, -0.125, 0.375],
        [0.25, -1.25, -0.25, 0.25, -0.5],
        [1.0, -0.25, 0.75, 0.25, 0.25],
    ]
    # reference (its op3 configs): Δ + 1[turning point]·d_j
    assert turning_point_rewards(V, form="reference").tolist() == [
        [0.75, 1.25, 0.75, 0.75, 1.125],
        [-1.0, -1.75, -1.0, -1.0, -1.5],
        [1.5, 1.0, 1.25, 1.0, 1.0],
    ]
    # consistent applies to the first step too: d_0 = 2 moves with Δ = 1.5 but the rest of the trajectory falls
    overshoot = torch.tensor([[0.0, 2.0, 1.5]], dtype=torch.float64)
    assert turning_points(overshoot)[0, 0] and not turning_points(overshoot, consistent=True)[0, 0]
    flat = torch.tensor([[0.5, 0.75, 0.25, 0.5]], dtype=torch.float64)  # Δ = 0: no trend, no turning point
    assert not turning_points(flat).any() and torch.equal(turning_point_rewards(flat), increments(flat))


def _inputs(values, groups, steps=None):
    extras = {"step_rewards": values}
    if steps is not None:
        extras["step_indices"] = steps
    total = values[:, -1].float()
    return AdvantageInputs({"total": total}, {"r": 1.0}, torch.tensor(groups), values.shape[1] - 1, extras)


def test_the_turning_point_estimator_normalises_each_step_within_its_group():
    values = torch.cat([V, V.flip(0) * 0.5, torch.full((2, 6), 0.25, dtype=torch.float64)])
    values[7, 2] = math.nan  # a failed intermediate reward: its row gets 0 and stays out, its group is left with 1
    groups = [0, 0, 0, 1, 1, 1, 2, 2]
    settings = SimpleNamespace(clip=5.0, std_eps=1e-4, turning_point=TurningPointSettings())
    got = turning_point(_inputs(values, groups), settings)
    rewards = turning_point_rewards(values)
    ids = torch.tensor(groups)
    for j in range(5):
        expected = group_advantages(rewards[:6, j], ids[:6], std="group", clip=5.0, eps=1e-4)
        torch.testing.assert_close(got[:6, j], expected, rtol=0, atol=0)
    assert got.shape == (8, 5) and torch.equal(got[6:], torch.zeros(2, 5))
    assert got[:3].abs().sum() > 0


# ------------------------------------------------------------------------------------------------ VGPO
def test_vgpo_values_weights_and_anchored_normalisation_on_a_hand_made_group():
    """Two groups, W = 2, γ = 0.5, k = 0.5. Group 0: V = [0 1 2], [0 3 0] -> Q = [2 2], [3 0]; group 1 all equal:
    V = [1 1 1] twice -> Q = [1.5 1]. The plain group advantages of group 1 are 0; VGPO's anchor keeps k·ω·Q."""
    values = torch.tensor([[0, 1, 2], [0, 3, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.float64)
    q = process_values(instant_rewards(values), 0.5)
    assert q.tolist() == [[2.0, 2.0], [3.0, 0.0], [1.5, 1.0], [1.5, 1.0]]
    omega = timestep_weights(q)
    assert omega.tolist() == [[1.0, 1.0], [2.0, 0.0], [1.2, 0.8], [1.2, 0.8]]
    eps, k = 1e-4, 0.5
    s0, s1 = math.sqrt(0.5), math.sqrt(2.0)  # unbiased stds of group 0's columns (2, 3) and (2, 0)
    expected = torch.tensor(
        [
            [1.0 * (-0.5 / (s0 + eps) + k * 2.0), 1.0 * (1.0 / (s1 + eps) + k * 2.0)],
            [2.0 * (0.5 / (s0 + eps) + k * 3.0), 0.0],
            [1.2 * k * 1.5, 0.8 * k * 1.0],
            [1.2 * k * 1.5, 0.8 * k * 1.0],
        ]
    )
    groups = torch.tensor([4, 4, 9, 9])
    got = anchored_advantages(q, groups, anchor=k, weights=omega, clip=5.0, eps=eps)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # the registered estimator from the rollout's extras; the anchor only on schedule steps < anchor_steps
    steps = torch.tensor([[3, 4]] * 4)
    settings = SimpleNamespace(clip=5.0, std_eps=eps, vgpo=VGPOSettings(gamma=0.5, anchor=k, anchor_steps=None))
    torch.testing.assert_close(vgpo(_inputs(values, [4, 4, 9, 9], steps), settings), expected, rtol=1e-6, atol=1e-6)
    settings.vgpo.anchor_steps = 4
    early = vgpo(_inputs(values, [4, 4, 9, 9], steps), settings)
    torch.testing.assert_close(early[:, 0], expected[:, 0], rtol=1e-6, atol=1e-6)
    assert early[2:, 1].tolist() == [0.0, 0.0]  # step 4 not anchored: the all-equal group has no signal there
    # without the anchor the all-equal group's signal is gone (the plain group estimator's 0)
    settings.vgpo.anchor, settings.vgpo.anchor_steps = 0.0, None
    assert vgpo(_inputs(values, [4, 4, 9, 9], steps), settings)[2:].abs().sum() == 0
    assert group_advantages(values[2:, -1], groups[2:]).abs().sum() == 0


def test_process_values_are_the_discounted_sums():
    rewards = torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float64)
    assert process_values(rewards, 1.0).tolist() == [[7.0, 6.0, 4.0]]
    assert process_values(rewards, 0.5).tolist() == [[1.0 + 1.0 + 1.0, 2.0 + 2.0, 4.0]]
    negative = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    assert timestep_weights(negative).tolist() == [[1.0, 1.0]]  # mean Q <= 0: no weighting


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "overrides, match",
    [
        (["sampler.rollout=chain", "grpo.advantage.estimator=turning_point"], r"only sampler.rollout: dense computes"),
        (["sampler.rollout=chain", "grpo.advantage.estimator=vgpo"], r"set sampler.rollout: dense"),
        (["sampler.dense.value=ode", "sampler.post_window.solver=dpmpp_2m"], r"set sampler.post_window.solver: euler"),
        (["sampler.dense.value=ode", "sampler.last_step=sde"], r"set sampler.last_step: ode"),
        (["sampler.dense.value=final"], r"sampler.dense.value must be one of x0, ode"),
        (["grpo.advantage.estimator=turning_point", "grpo.advantage.turning_point.form=both"], r"form must be one"),
        (["grpo.advantage.estimator=turning_point", "grpo.advantage.turning_point.std=batch"], r"std must be one"),
        (["grpo.advantage.estimator=vgpo", "grpo.advantage.vgpo.gamma=0"], r"vgpo.gamma must lie in \(0, 1\]"),
        (["grpo.advantage.estimator=vgpo", "grpo.advantage.vgpo.anchor=-1"], r"vgpo.anchor must be >= 0"),
        (["grpo.advantage.estimator=vgpo", "grpo.advantage.vgpo.anchor_steps=-2"], r"anchor_steps must be >= 0"),
        (["sampler.rollout=chain", "sampler.dense.value=ode"], r"is a setting of sampler.rollout=dense"),
    ],
)
def test_bad_settings_are_refused_naming_the_key_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, [*DENSE, *overrides])


def test_objectives_that_train_final_samples_are_refused_by_the_rollout():
    helper.check_refuses_awm(Dense, DENSE)


def test_ode_values_with_per_batch_windows_are_refused_under_fsdp(monkeypatch):
    overrides = ["sampler.dense.value=ode", "sampler.window.size=2", "sampler.window.strategy=random"]
    load_config(TINY, [*DENSE, *overrides, "sampler.window.per_batch=true"])  # fine under DDP
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    load_config(TINY, [*DENSE, *overrides])  # one window per epoch: the same forwards everywhere
    with pytest.raises(ConfigError, match="cannot run under FSDP"):
        load_config(TINY, [*DENSE, *overrides, "sampler.window.per_batch=true"])


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("estimator", ["turning_point", "vgpo"])
def test_one_tiny_epoch_trains_with_each_estimator(tmp_path, estimator):
    _, row = helper.train(
        load_config(TINY, helper.one_epoch(tmp_path, *DENSE, f"grpo.advantage.estimator={estimator}"))
    )
    assert row["train/onpolicy_ratio_dev"] < 1e-6  # the stored log-probs re-score exactly before the first update
    batches, stages = 2, STEPS  # 16 images in batches of 8; W = 5 window steps -> 6 stages
    assert row["dense/decodes"] == row["dense/reward_calls"] == batches * stages and row["dense/extra_forwards"] == 0
    assert row["dense/value_last"] == pytest.approx(row["reward/total/mean"], abs=1e-6)  # window ends at S-2
    assert row["advantage/abs_mean"] > 0  # and the weights moved
