"""E-GRPO (issue 29; arXiv:2601.00423): the merged SDE step (samplers/merge.py), the entropy plan, and the
``entropy_merge`` rollout (flowgrpo/rollouts/merged.py) on the tiny random SD3 pipeline (CFG: two rows per image).

Tolerance as tests/test_tempflow.py: bit for bit where two computations run the same rows through the network,
1e-5 where a forward holds other rows too (a CPU kernel may round differently).
"""

from __future__ import annotations

import math

import pytest
import rollout_helper as helper
import torch
from rollout_helper import CFG_SCALE, SIZE, STEPS, STORED, TINY

from flowgrpo.advantages import AdvantageInputs, compute_advantages
from flowgrpo.config import ConfigError, load_config
from flowgrpo.memory import stored_steps
from flowgrpo.rollout import _velocity_fn, evaluate_transitions
from flowgrpo.rollouts.branch import branch_rollout
from flowgrpo.rollouts.merged import EntropyMerge
from samplers import (
    entropy_merge_plan,
    flowgrpo_diffusion,
    gaussian_entropy,
    merged_sde_step,
    merged_step_std,
    ode_step,
    sde_step,
    static_shift_schedule,
)

MERGE = ["sampler.rollout=entropy_merge", "sampler.same_initial_noise=true"]
PLAN = ["sampler.entropy_merge.steps=[0, 1]", "sampler.entropy_merge.spans=[1, 3]"]
# Three groups: 7 (3 images) merges steps 1..3, 2 (2 images) takes step 3 alone, 5 (1 image) merges 0..1.
PROMPTS = ["a red cube", "a blue ball", "a red cube", "a green cone", "a blue ball", "a red cube"]
GROUPS = [7, 2, 7, 5, 2, 7]
MERGES = {7: (1, 3), 2: (3, 1), 5: (0, 2)}


@pytest.fixture(scope="module")
def adapter():
    return helper.adapter()


def _rollout(adapter, sampler, prompts=PROMPTS, groups=GROUPS, merges=MERGES, seed=1, **kwargs):
    ks, spans = [merges[g][0] for g in groups], [merges[g][1] for g in groups]
    generator = torch.Generator().manual_seed(seed)
    return branch_rollout(
        adapter, prompts, groups, ks, sampler, generator, height=SIZE, width=SIZE, spans=spans, **kwargs
    )


@torch.no_grad()
def _euler(adapter, sampler, prompts, x, sigmas):
    """The Euler ODE ``x + (t' - t)·v(x, t)`` over ``sigmas``, written out."""
    embeds = adapter.encode_conditions(prompts, with_negative=True, sources=None, height=SIZE, width=SIZE)
    velocity = _velocity_fn(adapter, embeds, sampler, sampler.guidance_scale)
    for t, t_next in zip(sigmas[:-1], sigmas[1:], strict=True):
        x = ode_step(velocity(x, t), x, t, t_next)
    return x


# ---------------------------------------------------------------------------------------------- the merged step
SCHEDULE = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.0])


def test_the_merged_step_is_the_closed_form_computed_by_hand():
    """Steps 1..2 of 1, .8, .55, .3, 0 merged at a = 0.7: t = .8, t' = .3, Δ = .5, g = .7·sqrt(.8/.2) = 1.4."""
    gen = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(3, 4, 5, generator=gen) for _ in range(3))
    step = merged_sde_step("euler_maruyama", v, x, SCHEDULE, 1, 2, noise_level=0.7, t_second=0.8, noise=z)
    g, delta = 1.4, 0.5
    mean = x - delta * (v + g**2 / (2 * 0.8) * (x + 0.2 * v))
    std = g * math.sqrt(delta)
    torch.testing.assert_close(step.mean, mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(step.std, torch.tensor(std), rtol=1e-7, atol=0)
    torch.testing.assert_close(step.sample, mean + std * z, rtol=1e-6, atol=1e-6)
    log_prob = (-((step.sample - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean((1, 2))
    torch.testing.assert_close(step.log_prob, log_prob, rtol=1e-6, atol=1e-6)
    # The reference's formula (VisualGRPO flux_sampler.py _flow_grpo_step, merge_step = 2), written as it is there.
    dt = 0.3 - 0.8
    reference = x * (1 + g**2 / (2 * 0.8) * dt) + v * (1 + g**2 * (1 - 0.8) / (2 * 0.8)) * dt
    torch.testing.assert_close(step.mean, reference, rtol=1e-6, atol=1e-6)
    # Scoring a given sample: the same density, no draw.
    again = merged_sde_step(
        "euler_maruyama", v, x, SCHEDULE, 1, 2, noise_level=0.7, t_second=0.8, prev_sample=step.sample
    )
    assert torch.equal(again.log_prob, step.log_prob)
    # Per-sample spans: each row its own t_{i+m}, as the row's own call.
    spans = torch.tensor([1, 2, 3])
    rows = merged_sde_step("euler_maruyama", v, x, SCHEDULE, 1, spans, noise_level=0.7, t_second=0.8, noise=z)
    for r, m in enumerate(spans.tolist()):
        alone = merged_sde_step("euler_maruyama", v[r : r + 1], x[r : r + 1], SCHEDULE, 1, m, noise_level=0.7,
                                t_second=0.8, noise=z[r : r + 1])  # fmt: skip
        torch.testing.assert_close(rows.sample[r : r + 1], alone.sample, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rows.log_prob[r : r + 1], alone.log_prob, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["euler_maruyama", "cps", "langevin"])
def test_a_span_of_one_is_the_ordinary_step_bit_for_bit(kind):
    gen = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
    for i in range(len(SCHEDULE) - 1):
        options = {"noise_level": 0.5, "t_second": 0.8, "reduce": "mean"}
        merged = merged_sde_step(kind, v, x, SCHEDULE, i, 1, generator=torch.Generator().manual_seed(i), **options)
        plain = sde_step(
            kind, v, x, SCHEDULE[i], SCHEDULE[i + 1], generator=torch.Generator().manual_seed(i), **options
        )
        for name in ("sample", "mean", "std", "log_prob"):
            assert torch.equal(getattr(merged, name), getattr(plain, name)), (kind, i, name)


def test_noise_level_zero_is_the_euler_jump_over_the_merged_interval():
    x, v = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    step = merged_sde_step("euler_maruyama", v, x, SCHEDULE, 0, 3, noise_level=0.0, t_second=0.8)
    assert torch.equal(step.sample, ode_step(v, x, SCHEDULE[0], SCHEDULE[3]))


def test_merged_steps_past_the_schedule_are_refused():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="runs past the schedule's last step"):
        merged_sde_step("euler_maruyama", x, x, SCHEDULE, 2, 3, noise_level=0.7)
    with pytest.raises(ValueError, match="at least 1 step"):
        merged_sde_step("euler_maruyama", x, x, SCHEDULE, 2, 0, noise_level=0.7)


# ---------------------------------------------------------------------------------------------- the entropy plan
def test_step_entropy_and_std_are_the_gaussian_ones():
    torch.testing.assert_close(gaussian_entropy(1.0), torch.tensor(0.5 * math.log(2 * math.pi * math.e)).double())
    torch.testing.assert_close(gaussian_entropy(0.25), torch.tensor(0.5 * math.log(2 * math.pi * math.e / 16)).double())
    # Euler–Maruyama: g(t_i)·sqrt(t_i - t_{i+m}); at t = 1 the diffusion reads t_second (= .8 here): g = .7·sqrt(1/.2).
    assert merged_step_std("euler_maruyama", SCHEDULE, 0, 2, noise_level=0.7, t_second=0.8) == pytest.approx(
        0.7 * math.sqrt(1 / 0.2) * math.sqrt(0.45), rel=1e-6
    )
    g = float(flowgrpo_diffusion(torch.tensor(0.55), 0.7))
    assert merged_step_std("euler_maruyama", SCHEDULE, 2, 1, noise_level=0.7) == pytest.approx(g * 0.5, rel=1e-6)


def test_the_plan_tiles_a_made_up_schedule_by_entropy():
    """Constant diffusion g = 1 on 8 uniform steps: std(i, m) = sqrt(m / 8), h(m) = ½ log(2πe·m/8) = 0.379, 0.726,
    0.929, 1.072 for m = 1..4; τ = 0.7 merges pairs, τ = 0.9 triples, τ = 0.3 nothing."""
    sigmas = torch.linspace(1, 0, 9)
    h = [0.5 * math.log(2 * math.pi * math.e * m / 8) for m in range(1, 5)]
    assert [round(v, 3) for v in h] == [0.379, 0.726, 0.929, 1.072]
    plan = lambda tau, **kw: entropy_merge_plan(sigmas, tau, noise_level=1.0, diffusion="dance", **kw)  # noqa: E731
    assert plan(0.7) == [(0, 2), (2, 2), (4, 2)]  # from step 6 only m = 1 ends by step 7: stop
    assert plan(0.9) == [(0, 3), (3, 3)]
    assert plan(0.3) == [(i, 1) for i in range(7)]
    assert plan(0.7, max_end=4) == [(0, 2), (2, 2)]
    with pytest.raises(ValueError, match="lower the threshold"):
        plan(2.0)
    # The flowgrpo diffusion decreases with t: early steps stay single, later ones merge.
    shifted = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.0])
    got = entropy_merge_plan(shifted, 0.6, noise_level=0.7)
    entropy = lambda i, m: float(  # noqa: E731
        gaussian_entropy(merged_step_std("euler_maruyama", shifted, i, m, noise_level=0.7, t_second=0.9))
    )
    start = 0
    for k, m in got:  # each the shortest reaching τ, consecutive from step 0
        assert k == start and entropy(k, m) >= 0.6 and (m == 1 or entropy(k, m - 1) < 0.6)
        start = k + m
    assert got[0] == (0, 1) and max(m for _, m in got) > 1


def test_the_reference_plan_is_a_threshold_plan_on_its_flux_schedule():
    """VisualGRPO's launch script (16 steps, static shift 3, a = 0.7): steps 0 1 2 4 merging 1 1 2 3, ending at step
    7. Any τ in (h(4, 2), h(4, 3)] = (0.807, 1.037] nats gives it with max_end 8 (the first half)."""
    sigmas, _ = static_shift_schedule(16, 3.0)
    reference = [(0, 1), (1, 1), (2, 2), (4, 3)]
    for tau in (0.81, 0.9, 1.0, 1.03):
        assert entropy_merge_plan(sigmas, tau, noise_level=0.7, max_end=8) == reference, tau
    assert entropy_merge_plan(sigmas, 0.80, noise_level=0.7, max_end=8) != reference
    assert entropy_merge_plan(sigmas, 1.04, noise_level=0.7, max_end=8) != reference
    # without max_end the tiling goes on past step 7: the reference's four merged steps, then steps 7..11 merged
    assert entropy_merge_plan(sigmas, 1.0, noise_level=0.7) == [*reference, (7, 5)]


# ---------------------------------------------------------------------------------------------- the rollout
def test_noise_free_merged_rollout_is_the_ode_on_the_merged_schedule(adapter):
    """With noise 0 each group's merged step is one Euler jump t_k → t_{k+m}: the Euler ODE on the schedule without
    t_{k+1} .. t_{k+m-1}."""
    sampler = helper.sampler(noise_level=0.0)
    x = adapter.initial_noise(len(PROMPTS), SIZE, SIZE, group_ids=GROUPS, same_within_group=True, noise_seed=3,
                              generator=None)  # fmt: skip
    got = _rollout(adapter, sampler, initial_latents=x)
    sigmas, _ = adapter.schedule(STEPS, SIZE, SIZE)
    for g, (k, m) in MERGES.items():
        rows = [i for i, gid in enumerate(GROUPS) if gid == g]
        keep = [i for i in range(STEPS + 1) if not k < i < k + m]
        expected = _euler(adapter, sampler, [PROMPTS[r] for r in rows], x[rows], sigmas[keep])
        torch.testing.assert_close(got.final_latents[rows], expected, rtol=1e-5, atol=1e-5)
    # Spans of 1: the plain ODE, as the branch rollout's.
    ones = _rollout(adapter, sampler, merges={g: (k, 1) for g, (k, _) in MERGES.items()}, initial_latents=x)
    torch.testing.assert_close(ones.final_latents, _euler(adapter, sampler, PROMPTS, x, sigmas), rtol=1e-5, atol=1e-5)


def test_spans_of_one_are_the_branch_rollout_bit_for_bit(adapter):
    sampler = helper.sampler()
    points = {g: (k, 1) for g, (k, _) in MERGES.items()}
    merged = _rollout(adapter, sampler, merges=points)
    generator = torch.Generator().manual_seed(1)
    plain = branch_rollout(adapter, PROMPTS, GROUPS, [points[g][0] for g in GROUPS], sampler, generator, height=SIZE,
                           width=SIZE)  # fmt: skip
    for name in (*STORED, "images"):
        assert torch.equal(getattr(merged, name), getattr(plain, name)), name


def test_the_stored_transition_is_the_merged_step_and_the_ode_resumes_after_it(adapter):
    sampler = helper.sampler()
    got = _rollout(adapter, sampler)
    sigmas, _ = adapter.schedule(STEPS, SIZE, SIZE)
    ks = torch.tensor([MERGES[g][0] for g in GROUPS])
    ends = ks + torch.tensor([MERGES[g][1] for g in GROUPS])
    assert got.step_indices[:, 0].tolist() == ks.tolist()
    assert torch.equal(got.sigmas[:, 0], sigmas[ks]) and torch.equal(got.sigmas_next[:, 0], sigmas[ends])
    embeds = adapter.encode_conditions(PROMPTS, with_negative=True, sources=None, height=SIZE, width=SIZE)
    with torch.no_grad():
        v = _velocity_fn(adapter, embeds, sampler, CFG_SCALE)(got.latents[:, 0], got.sigmas[:, 0])
    for r, g in enumerate(GROUPS):
        k, m = MERGES[g]
        x, after = got.latents[r : r + 1, 0], got.next_latents[r : r + 1, 0]
        options = {"noise_level": 0.7, "t_second": float(sigmas[1]), "prev_sample": after}
        step = merged_sde_step("euler_maruyama", v[r : r + 1], x, sigmas, k, m, **options)
        torch.testing.assert_close(step.log_prob, got.log_probs[r : r + 1, 0], rtol=0, atol=1e-5)
        torch.testing.assert_close(got.stds[r, 0], step.std.flatten()[0], rtol=1e-6, atol=0)
        # From t_{k+m} on, the image's own Euler ODE.
        ode = _euler(adapter, sampler, [PROMPTS[r]], after, sigmas[k + m :])
        torch.testing.assert_close(got.final_latents[r : r + 1], ode, rtol=1e-5, atol=1e-5)
    # A group shares its trunk, and its images differ after the merged step.
    for g in MERGES:
        rows = [i for i, gid in enumerate(GROUPS) if gid == g]
        assert all(torch.equal(got.latents[i], got.latents[rows[0]]) for i in rows)
        assert all(not torch.equal(got.next_latents[a], got.next_latents[b]) for a in rows for b in rows if a < b)


def test_rescoring_gives_ratio_exactly_one_on_policy(adapter):
    sampler = helper.sampler()
    same = _rollout(adapter, sampler, merges={g: (1, 3) for g in MERGES})  # every group the same merged step
    mixed = _rollout(adapter, sampler)
    for traj, exact in ((same, True), (mixed, False)):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, 0, sampler)
        ratio = torch.exp(again.log_prob - traj.log_probs[:, 0])
        if exact:  # the same rows through the network as at the rollout's merged step
            assert torch.equal(again.log_prob, traj.log_probs[:, 0]) and torch.equal(ratio, torch.ones(6))
        else:
            torch.testing.assert_close(ratio, torch.ones(6), rtol=0, atol=1e-6)
        torch.testing.assert_close(again.std.reshape(6, -1)[:, 0], traj.stds[:, 0], rtol=0, atol=0)


def test_every_batch_runs_one_forward_per_step_even_inside_a_merged_step(adapter):
    """One group of 3 merging steps 1..3 of 6: step 0 the trunk (1 row), step 1 its 3 branches, steps 2 and 3 nothing
    needs the network (one row runs anyway, discarded), steps 4 and 5 the 3 images. CFG doubles every row."""
    sampler = helper.sampler()
    with helper.forward_rows(adapter) as rows:
        _rollout(adapter, sampler, ["a red cube"] * 3, [4] * 3, {4: (1, 3)})
    assert rows == [2 * n for n in (1, 3, 1, 1, 3, 3)]
    with helper.forward_rows(adapter) as rows:
        _rollout(adapter, sampler)
    assert len(rows) == STEPS


# ---------------------------------------------------------------------------------------------- strategy, config
def _context(adapter, config):
    submitted: list[int] = []
    context = helper.rollout_context(config, adapter, submit=lambda images, *_: submitted.append(len(images)))
    return context, submitted


def test_an_epoch_sweeps_the_plan_and_group_advantages_compare_samples_of_one_merged_step(adapter):
    config = load_config(
        TINY,
        [*MERGE, *PLAN, "sampler.batch_size=4", "grpo.group_size=2", "grpo.groups_per_epoch=4", "train.batch_size=4"],
    )
    context, submitted = _context(adapter, config)
    collected = EntropyMerge(context).collect(epoch=1)
    traj = collected.trajectory
    assert submitted == [4, 4] and traj.group_ids.tolist() == [4, 4, 5, 5, 6, 6, 7, 7]
    sigmas, _ = adapter.schedule(STEPS, SIZE, SIZE)
    assert traj.step_indices.flatten().tolist() == [0, 0, 1, 1, 0, 0, 1, 1]  # ids 4..7 mod 2: (0, 1), (1, 3)
    assert torch.equal(traj.sigmas_next.flatten(), sigmas[[1, 1, 4, 4, 1, 1, 4, 4]])
    assert collected.metrics == {
        "merge/step_mean": 0.5,
        "merge/step_min": 0.0,
        "merge/step_max": 1.0,
        "merge/span_mean": 2.0,
        "merge/span_max": 3.0,
        "merge/plan_size": 2.0,
    }
    # "group" is the multi-step group-normalised advantage: (R - mean) / (std + eps) among the samples that share
    # one merged step; here a group's samples share (k, m) and its trunk.
    for g in traj.group_ids.unique():
        rows = traj.group_ids == g
        assert len(set(traj.step_indices[rows, 0].tolist())) == 1 and len(set(traj.sigmas_next[rows, 0].tolist())) == 1
        assert all(torch.equal(traj.latents[i], traj.latents[rows.nonzero()[0, 0]]) for i in rows.nonzero().flatten())
    rewards = torch.tensor([0.1, 0.4, 2.0, 1.0, -1.0, 0.0, 3.0, 3.5])
    config.grpo.advantage.std_eps = 1e-8
    inputs = AdvantageInputs({"total": rewards}, {"total": 1.0}, traj.group_ids, 1)
    got = compute_advantages(config.grpo.advantage, inputs, torch.ones(8, dtype=torch.bool))
    hand = []
    for a, b in rewards.view(4, 2).tolist():  # the reference's rollout_buffer: torch.std (unbiased) + 1e-8
        mean, std = (a + b) / 2, abs(a - b) / math.sqrt(2)
        hand += [(a - mean) / (std + 1e-8), (b - mean) / (std + 1e-8)]
    torch.testing.assert_close(got, torch.tensor(hand).clamp(-5, 5))


def test_a_threshold_plan_is_resolved_from_the_models_schedule(adapter):
    config = load_config(TINY, [*MERGE, "sampler.entropy_merge.threshold=0.0", "sampler.entropy_merge.max_end=4"])
    context, _ = _context(adapter, config)
    sigmas, _ = adapter.schedule(STEPS, SIZE, SIZE)
    assert EntropyMerge(context).merges == entropy_merge_plan(sigmas, 0.0, noise_level=0.7, max_end=4)
    config = load_config(TINY, [*MERGE, "sampler.entropy_merge.threshold=5.0"])  # the pipeline schedule: at start-up
    context, _ = _context(adapter, config)
    with pytest.raises(ConfigError, match="sampler.entropy_merge.threshold=5.0: no merged step"):
        EntropyMerge(context)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ([], "needs its merged steps one way"),
        ([*PLAN, "sampler.entropy_merge.threshold=1.0"], "needs its merged steps one way"),
        (["sampler.entropy_merge.steps=[2]", "sampler.entropy_merge.spans=[4]"], r"\(start, span\) \[\(2, 4\)\]"),
        (["sampler.entropy_merge.steps=[-1]"], r"\(start, span\) \[\(-1, 1\)\]"),
        (["sampler.entropy_merge.steps=[0, 1]", "sampler.entropy_merge.spans=[1]"], "one entry per step"),
        (["sampler.entropy_merge.steps=[0]", "sampler.entropy_merge.spans=[0]"], r"\(start, span\) \[\(0, 0\)\]"),
        (["sampler.entropy_merge.steps=[]"], "is an empty list"),
        ([*PLAN, "sampler.entropy_merge.max_end=3"], "max_end bounds the threshold's plan"),
        (["sampler.entropy_merge.threshold=1.0", "sampler.entropy_merge.spans=[1]"], "spans goes with"),
        (["sampler.entropy_merge.threshold=1.0", "sampler.entropy_merge.max_end=6"], "max_end must lie in 1..5"),
        (["sampler.entropy_merge.threshold=9.0", "sampler.time_shift=3.0"], "threshold=9.0: no merged step"),
        ([*PLAN, "sampler.entropy_merge.schedule=cyclic"], "sampler.entropy_merge.schedule must be one of"),
        ([*PLAN, "sampler.kind=cps"], "sampler.kind=cps would take another step"),
        ([*PLAN, "sampler.same_initial_noise=false"], "sampler.rollout=entropy_merge needs sampler.same_initial"),
        ([*PLAN, "sampler.noise_level=0"], "sampler.noise_level=0"),
        ([*PLAN, "sampler.window.size=2"], r"branch point \(sampler.entropy_merge.\*\): remove sampler.window"),
        ([*PLAN, "sampler.last_step=sde"], "sampler.last_step: ode with sampler.rollout: entropy_merge"),
        ([*PLAN, "sampler.branch.steps=[1]"], "sampler.branch.* places the branch rollout's"),
        (["sampler.rollout=chain", "sampler.entropy_merge.steps=[1]"], "sampler.entropy_merge"),
    ],
)
def test_bad_settings_are_refused_naming_the_key_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, [*MERGE, *overrides])


def test_objectives_that_store_nothing_are_refused():
    helper.check_refuses_awm(
        EntropyMerge, [*MERGE, *PLAN], "sampler.rollout=entropy_merge stores each image's branch step"
    )


def test_a_threshold_set_in_code_must_be_finite():  # the YAML loader refuses .inf itself
    config = load_config(TINY, [*MERGE, "sampler.entropy_merge.threshold=1.0"])
    config.sampler.entropy_merge.threshold = math.inf
    with pytest.raises(ConfigError, match="finite number of nats"):
        EntropyMerge.validate(config)


def test_memory_counts_one_stored_step_per_image():
    config = load_config(TINY, [*MERGE, *PLAN])
    assert stored_steps(config, True) == 1 and stored_steps(config, False) == 0


def test_one_tiny_epoch_trains_on_policy(tmp_path):
    _, row = helper.train(load_config(TINY, helper.one_epoch(tmp_path, *MERGE, *PLAN)))  # the weights move
    assert row["train/onpolicy_ratio_dev"] < 1e-5
    assert 0 <= row["merge/step_min"] <= row["merge/step_max"] <= 1 and row["merge/span_max"] == 3
