"""TempFlow-GRPO (issue 29): the branch rollout (flowgrpo/rollouts/branch.py) and the noise-aware weights
(flowgrpo/objectives/tempflow.py), held to their definitions on the tiny random SD3 pipeline (CFG: two rows per
image in a forward).

Tolerance: where the forwards of two computations see different rows (a shared trunk against per-image chains) a CPU
kernel may round differently (~1e-7 relative per operation, see tests/test_shared_prefix.py): 1e-5 absolute there.
Where they see the same rows, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import rollout_helper as helper
import torch
from rollout_helper import SIZE, STEPS, STORED, TINY

from flowgrpo.adapters import make_adapter
from flowgrpo.config import ConfigError, load_config
from flowgrpo.objectives import MicroBatch
from flowgrpo.objectives.clipped import grpo_loss
from flowgrpo.objectives.tempflow import TempFlow, noise_aware_weights, schedule_stds
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.rollouts.branch import Branch, branch_points, branch_rollout, branch_step_list
from flowgrpo.tiny import build_tiny_pipeline
from samplers import pipeline_schedule

# Three groups of 3, 2 and 1 images, not sorted, branching at steps 1, 3 and 0.
PROMPTS = ["a red cube", "a blue ball", "a red cube", "a green cone", "a blue ball", "a red cube"]
GROUPS = [7, 2, 7, 5, 2, 7]
POINTS = {7: 1, 2: 3, 5: 0}
BRANCH = [POINTS[g] for g in GROUPS]
BRANCH_OVERRIDES = ["sampler.rollout=branch", "sampler.same_initial_noise=true", "grpo.objective=tempflow"]


@pytest.fixture(scope="module")
def adapter():
    return helper.adapter()


def _branch(adapter, sampler, prompts=PROMPTS, groups=GROUPS, points=BRANCH, seed=1, **kwargs):
    generator = torch.Generator().manual_seed(seed)
    return branch_rollout(adapter, prompts, groups, points, sampler, generator, height=SIZE, width=SIZE, **kwargs)


def _members(groups=GROUPS):
    return {g: [i for i, x in enumerate(groups) if x == g] for g in dict.fromkeys(groups)}


def test_noise_free_branch_rollout_is_the_ode_and_pipe(adapter):
    """With noise 0 the branch step is the Euler step: every image is the plain ODE sample, as pipe() draws it."""
    sampler = helper.sampler(noise_level=0.0)
    x = adapter.initial_noise(
        len(PROMPTS), SIZE, SIZE, group_ids=GROUPS, same_within_group=True, noise_seed=3, generator=None
    )
    got = _branch(adapter, sampler, initial_latents=x)
    ode = rollout(adapter, PROMPTS, GROUPS, sampler, range(0, 0), height=SIZE, width=SIZE, initial_latents=x)
    expected = helper.pipe_images(adapter, PROMPTS, x)
    torch.testing.assert_close(got.final_latents, ode.final_latents, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.images, expected, rtol=0, atol=1e-5)
    assert got.step_indices.flatten().tolist() == BRANCH


def test_one_group_is_the_chain_rollout_with_a_one_step_window_bit_for_bit(adapter):
    """A batch of one group at step k: the same forwards and noise draws as rollout(window=range(k, k + 1))."""
    sampler, prompts, groups = helper.sampler(), ["a red cube"] * 4, [3] * 4
    for k in (0, 2, STEPS - 2):
        got = _branch(adapter, sampler, prompts, groups, [k] * 4)
        chain = rollout(
            adapter,
            prompts,
            groups,
            sampler,
            range(k, k + 1),
            torch.Generator().manual_seed(1),
            height=SIZE,
            width=SIZE,
        )
        for name in (*STORED, "images"):
            assert torch.equal(getattr(got, name), getattr(chain, name)), (k, name)


@pytest.mark.parametrize("kind", ["wan", "flux-kontext"])
def test_video_and_editing_models_branch_too(kind):
    """Nothing in the branch rollout is image- or text-only: a Wan clip and a FLUX.1-Kontext edit (source images in
    the embeddings) branch like the chain rollout's one-step window, bit for bit, and re-score exactly."""
    from PIL import Image

    other = make_adapter(build_tiny_pipeline(kind, seed=0))
    sampler = helper.sampler(num_steps=4, guidance_scale=4.0)
    prompts, groups = ["a red cube", "a red cube", "a blue ball", "a blue ball"], [1, 1, 2, 2]
    sources = {"sources": [Image.new("RGB", (SIZE, SIZE), (200, 30, 30))] * 4} if kind == "flux-kontext" else {}
    got = _branch(other, sampler, prompts, groups, [2] * 4, **sources)
    chain = rollout(
        other,
        prompts,
        groups,
        sampler,
        range(2, 3),
        torch.Generator().manual_seed(1),
        height=SIZE,
        width=SIZE,
        **sources,
    )
    assert all(torch.equal(getattr(got, name), getattr(chain, name)) for name in (*STORED, "images"))
    assert (got.source_images is not None) == (kind == "flux-kontext")
    with torch.no_grad():
        assert torch.equal(evaluate_transitions(other, got, 0, sampler).log_prob, got.log_probs[:, 0])


def test_a_group_shares_its_trunk_bit_for_bit_and_differs_after_its_branch_point(adapter):
    sampler = helper.sampler()
    got = _branch(adapter, sampler)
    noise_free = _branch(adapter, helper.sampler(noise_level=0.0))
    # The trunk is deterministic: the same latents entering the branch step whatever the noise level.
    assert torch.equal(got.latents, noise_free.latents)
    for g, rows in _members().items():
        first = rows[0]
        assert all(torch.equal(got.latents[i], got.latents[first]) for i in rows)  # one trunk per group
        assert all(got.step_indices[i, 0] == POINTS[g] for i in rows)
        assert torch.equal(got.sigmas[rows, 0], got.sigmas[first, 0].expand(len(rows)))
        for a in rows:  # each image its own noise from the branch step on
            for b in rows:
                if a < b:
                    assert not torch.equal(got.next_latents[a], got.next_latents[b])
                    assert not torch.equal(got.final_latents[a], got.final_latents[b])
    # Different groups have different trunks (different prompts and initial noise).
    assert not torch.equal(got.latents[0], got.latents[1])


def test_the_trunk_runs_once_per_group_and_every_batch_costs_one_forward_per_step(adapter):
    """Step i runs ONE forward over the groups before their branch point (one row each) and the images at or after
    theirs. Groups 7 (3 images, k = 1), 2 (2 images, k = 3), 5 (1 image, k = 0), 6 steps:
    step 0: trunks 7, 2 + image of 5 = 3; steps 1, 2: trunk 2 + 4 images = 5; steps 3-5: 6 images."""
    sampler = helper.sampler()
    with helper.forward_rows(adapter) as rows:
        _branch(adapter, sampler)
    assert rows == [2 * n for n in (3, 5, 5, 6, 6, 6)]
    per_image = rollout  # each image its own chain: 6 rows at every step
    with helper.forward_rows(adapter) as rows_alone:
        per_image(adapter, PROMPTS, GROUPS, replace(sampler, shared_prefix=False), range(0, 1), height=SIZE, width=SIZE)
    assert rows_alone == [2 * 6] * STEPS
    # Whatever the branch points of a batch, STEPS forwards (the same collectives on every process).
    for points in ([0] * 6, [STEPS - 2] * 6, [2, 0, 2, 4, 0, 2]):
        with helper.forward_rows(adapter) as rows:
            _branch(adapter, sampler, points=points)
        assert len(rows) == STEPS
    # Without sharing (shared_prefix: false) every image runs its own trunk.
    with helper.forward_rows(adapter) as rows:
        _branch(adapter, replace(sampler, shared_prefix=False))
    assert rows == [2 * 6] * STEPS


def test_rescoring_the_branch_step_gives_ratio_exactly_one(adapter):
    sampler = helper.sampler()
    same_point = _branch(adapter, sampler, points=[2] * 6)  # every group at step 2: the same rows as the rollout
    mixed = _branch(adapter, sampler)
    for traj, exact in ((same_point, True), (mixed, False)):
        assert torch.isfinite(traj.log_probs).all() and traj.num_trained_steps == 1
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, 0, sampler)
        ratio = torch.exp(again.log_prob - traj.log_probs[:, 0])
        if exact:
            assert torch.equal(again.log_prob, traj.log_probs[:, 0]) and torch.equal(ratio, torch.ones(6))
        else:  # the branch forward also held other groups' rows: equal to float tolerance
            torch.testing.assert_close(ratio, torch.ones(6), rtol=0, atol=1e-6)
        torch.testing.assert_close(again.std.reshape(6, -1)[:, 0], traj.stds[:, 0], rtol=0, atol=0)


def test_noise_aware_weights_match_a_hand_computed_case_and_the_references_constants():
    # Schedule 1, .75, .5, .25, 0 at a = 0.7: s_j = 0.7·sqrt(t/(1-t))·sqrt(0.25), t = 1 read as t1 = .75.
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    hand = torch.tensor([0.7 * 2 * 0.5, 0.7 * math.sqrt(3) * 0.5, 0.7 * 1 * 0.5])
    stds = schedule_stds(helper.sampler(num_steps=4), sigmas)
    torch.testing.assert_close(stds, hand)
    c = 3 / (0.7 + 0.7 * math.sqrt(3) * 0.5 + 0.35)
    trained = torch.tensor([0.35, 0.7, 0.5])
    torch.testing.assert_close(noise_aware_weights(trained, stds), c * trained)
    torch.testing.assert_close(noise_aware_weights(stds, stds).mean(), torch.tensor(1.0))  # mean 1 over the schedule
    torch.testing.assert_close(noise_aware_weights(trained, scale=2.25), 2.25 * trained)
    with pytest.raises(ValueError, match="scale or reference stds"):
        noise_aware_weights(trained)
    # The reference types c: 2.25 (SD3.5-M: shift 3, 10 steps, a = 0.7) and 1.73 (FLUX.1-dev, 1024 px, a = 0.9).
    from diffusers import FlowMatchEulerDiscreteScheduler

    sd3, _ = pipeline_schedule(FlowMatchEulerDiscreteScheduler(shift=3.0), 10, family="sd3")
    flux_scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, max_image_seq_len=4096
    )
    flux, _ = pipeline_schedule(flux_scheduler, 10, family="flux", image_seq_len=(1024 // 16) ** 2)
    assert round(1 / schedule_stds(helper.sampler(num_steps=10), sd3).mean().item(), 2) == 2.25
    assert round(1 / schedule_stds(helper.sampler(num_steps=10, noise_level=0.9), flux).mean().item(), 2) == 1.73


def test_the_tempflow_loss_weights_each_samples_policy_term(adapter):
    """Off-policy stored log-probs (ratios inside and outside the clip) and per-sample advantages: the loss is
    mean_i w_i · max(-A_i r_i, -A_i clip(r_i)), w_i = c · s_i with c from the schedule; the KL is not weighted."""
    config = load_config(TINY, [*BRANCH_OVERRIDES, f"sampler.num_steps={STEPS}", "grpo.clip_range=0.05"])
    traj = _branch(adapter, config.sampler)
    traj.log_probs = traj.log_probs + torch.tensor([[0.01], [-0.2], [0.0], [0.3], [-0.02], [0.1]])
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.25, 0.75])
    objective = TempFlow(config)
    positions = torch.zeros(6, dtype=torch.long)
    loss, stats = objective.loss(adapter, MicroBatch(traj, advantages, positions, torch.Generator()))
    sigmas, _ = adapter.schedule(STEPS, SIZE, SIZE)
    c = 1 / schedule_stds(config.sampler, sigmas).mean()
    w = c * traj.stds[:, 0]
    with torch.no_grad():
        new = evaluate_transitions(adapter, traj, 0, config.sampler).log_prob
    r = torch.exp(new - traj.log_probs[:, 0])
    torch.testing.assert_close(loss.detach(), _clipped(advantages * w, r, 0.05), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stats["noise_weight"], w.mean())
    assert stats["clip_fraction"] > 0 and stats["noise_weight_max"] > stats["noise_weight_min"]
    unweighted, _ = grpo_loss(new, traj.log_probs[:, 0], advantages, clip_range=0.05)
    assert not torch.allclose(loss.detach(), unweighted)
    # A set scale replaces c; [B, W] advantages are read at each sample's position.
    scaled = TempFlow(load_config(TINY, [*BRANCH_OVERRIDES, "grpo.clip_range=0.05", "grpo.tempflow.weight_scale=2.25"]))
    loss2, _ = scaled.loss(adapter, MicroBatch(traj, advantages[:, None], positions, torch.Generator()))
    torch.testing.assert_close(loss2.detach(), _clipped(advantages * 2.25 * traj.stds[:, 0], r, 0.05))


def test_the_kl_term_is_not_weighted():
    """β·KL is added as the clipped objective adds it (LoRA adapter: the adapter-disabled model differs)."""
    from flowgrpo.objectives.clipped import Clipped
    from flowgrpo.pipelines import build_adapter

    config = load_config(TINY, [*BRANCH_OVERRIDES, "grpo.kl.beta=0.5", "grpo.kl.convention=exact"])
    lora = build_adapter(config.model)
    with torch.no_grad():  # LoRA's B starts at 0: move it so that the adapter-disabled model differs
        for i, param in enumerate(lora.trainable_parameters()):
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(i)))
    traj = _branch(lora, config.sampler)
    batch = MicroBatch(traj, torch.tensor([1.0, -0.5, 2.0, -1.5, 0.25, 0.75]), torch.zeros(6, dtype=torch.long), None)
    loss, stats = TempFlow(config).loss(lora, batch)
    _, plain = Clipped(config).loss(lora, batch)
    assert stats["kl"] > 0 and torch.equal(stats["kl"], plain["kl"])
    torch.testing.assert_close(loss.detach(), stats["policy_loss"] + 0.5 * plain["kl"])
    assert not torch.allclose(stats["policy_loss"], plain["policy_loss"])


def _clipped(weighted_advantages, r, eps):
    """mean_i max(-wA_i r_i, -wA_i clip(r_i, 1 - eps, 1 + eps)), written out."""
    return torch.maximum(-weighted_advantages * r, -weighted_advantages * r.clamp(1 - eps, 1 + eps)).mean()


def test_the_schedule_of_branch_points_is_a_function_of_seed_and_group():
    assert branch_step_list(None, 10) == list(range(9))
    assert branch_step_list([4, 0, 4], 10) == [4, 0, 4]
    # sweep: steps[g mod n]; epoch 2 of 4 groups per epoch holds ids 8..11.
    assert branch_points([8, 9, 10, 11, 9], [0, 2, 4], "sweep", seed=0) == [4, 0, 2, 4, 0]
    assert branch_points(range(18), list(range(9)), "sweep", seed=5) == list(range(9)) * 2
    # random: a CPU generator seeded with seed·1_000_003 + g, the first draw of randint(0, n).
    hand = [
        [0, 2, 4][int(torch.randint(0, 3, (1,), generator=torch.Generator().manual_seed(7 * 1_000_003 + g)))]
        for g in (16, 17, 18, 19)
    ]
    assert branch_points([16, 17, 18, 19], [0, 2, 4], "random", seed=7) == hand == [2, 0, 4, 2]
    assert branch_points([18, 17], [0, 2, 4], "random", seed=7) == [4, 0]  # whatever the order or the batch
    draws = branch_points(range(900), [0, 2, 4], "random", seed=1)
    assert all(250 < draws.count(k) < 350 for k in (0, 2, 4))
    with pytest.raises(ConfigError, match="sampler.branch.schedule"):
        branch_points([1], [0], "cyclic", seed=0)


def test_an_epoch_of_the_strategy_sweeps_the_points_and_keeps_groups_whole(adapter):
    config = load_config(
        TINY,
        [
            *BRANCH_OVERRIDES,
            "sampler.num_steps=4",
            "sampler.batch_size=4",
            "grpo.group_size=2",
            "grpo.groups_per_epoch=6",
            "train.batch_size=4",
        ],
    )
    submitted = []
    context = helper.rollout_context(config, adapter, submit=lambda images, *_: submitted.append(len(images)))
    collected = Branch(context).collect(epoch=1)
    traj = collected.trajectory
    assert submitted == [4, 4, 4] and len(traj) == 12
    ids = traj.group_ids.tolist()
    assert ids == sorted(ids) == [6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11]
    assert traj.step_indices.flatten().tolist() == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]  # ids 6..11 mod 3
    assert collected.metrics == {"branch/step_mean": 1.0, "branch/step_min": 0.0, "branch/step_max": 2.0}


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["sampler.same_initial_noise=false"], "sampler.same_initial_noise: true"),
        (["sampler.noise_level=0"], "sampler.noise_level=0"),
        (["grpo.objective=awm", "sampler.noise_level=0"], "grpo.objective=awm"),  # awm's own checks refuse first
        (["sampler.window.size=2"], r"sampler.window.\* places the chain"),
        (["sampler.last_step=sde"], "sampler.last_step=sde adds noise after the branch point"),
        (["sampler.post_window.solver=dpmpp_2m"], r"sampler.post_window.\*"),
        (["sampler.kind=langevin", "sampler.score_eval=reeval"], "sampler.score_eval=reeval"),
        (["sampler.branch.steps=[0, 5]"], r"sampler.branch.steps \[5\] lie outside 0..4"),
        (["sampler.branch.steps=[]"], "sampler.branch.steps is an empty list"),
        (["sampler.branch.schedule=cyclic"], "sampler.branch.schedule must be one of sweep, random"),
        (["grpo.tempflow.weight_scale=0"], "grpo.tempflow.weight_scale must be > 0"),
        (["sampler.rollout=chain", "sampler.branch.steps=[1]"], "sampler.branch.* places the branch rollout's"),
        (["sampler.rollout=chain", "sampler.noise_level=0"], "grpo.objective=tempflow weights each step"),
        (["grpo.objective=clipped", "grpo.tempflow.weight_scale=2"], "is a setting of grpo.objective=tempflow"),
    ],
)
def test_bad_settings_are_refused_naming_the_key_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, [*BRANCH_OVERRIDES, *overrides])


def test_objectives_that_train_final_samples_are_refused_by_the_rollout_itself():
    helper.check_refuses_awm(Branch, BRANCH_OVERRIDES, "grpo.objective=awm trains the final samples of ODE rollouts")


def test_refused_before_the_run_directory_exists_and_one_tiny_epoch_trains(tmp_path):
    from flowgrpo.trainer import GRPOTrainer

    overrides = helper.one_epoch(tmp_path, *BRANCH_OVERRIDES)
    config = load_config(TINY, overrides)
    config.sampler.same_initial_noise = False  # built in code: the trainer's validation catches it
    with pytest.raises(ConfigError, match="same_initial_noise"):
        GRPOTrainer(config)
    assert not any(tmp_path.iterdir())
    _, row = helper.train(load_config(TINY, overrides))  # the weights move
    assert row["train/onpolicy_ratio_dev"] < 1e-5 and row["train/noise_weight"] > 0
    assert 0 <= row["branch/step_min"] <= row["branch/step_mean"] <= row["branch/step_max"] <= 4
