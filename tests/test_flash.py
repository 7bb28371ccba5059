"""Flash-GRPO (arXiv:2605.15980): single-step training (``grpo.objective: flash``, one window step), iso-temporal
grouping (``sampler.rollout: iso_temporal``: a group's images at one step, drawn per group) and temporal gradient
rectification (``w(t) = (1/c(t)) / Z``), each held to its definition: hand-computed draws and factors, the reference
code's own table, autograd on a toy velocity, the plain ODE at noise 0, and the on-policy ratio of 1."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from rollout_helper import ON_POLICY_RATIO_TOL, rescored_equal, rollout_context, train

from flowgrpo.config import ConfigError, SamplerConfig, load_config
from flowgrpo.data import epoch_plan
from flowgrpo.objectives import get_objective
from flowgrpo.objectives.base import MicroBatch
from flowgrpo.objectives.clipped import grpo_loss, timestep_loss
from flowgrpo.objectives.flash import (
    euler_maruyama_gradient_scale,
    gradient_scale,
    rectification_weights,
    schedule_normalizer,
)
from flowgrpo.rollout import evaluate_transitions, rollout, stored_log_probs
from flowgrpo.rollouts import get_rollout
from flowgrpo.rollouts.iso import group_starts
from samplers import sde_step

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_sd3.yaml"
FLASH = [
    "sampler.rollout=iso_temporal",
    "grpo.objective=flash",
    "sampler.window.size=1",
    "sampler.window.strategy=random",
    "sampler.window.max_start=3",  # steps 0..3 of the 6-step schedule
    "sampler.same_initial_noise=true",
]
# From the definition (flowgrpo/rollouts/iso.py), computed once: group g of epoch e starts at the g-th value of
# torch.randint(0, max_start + 1, (4,), generator=manual_seed(SeedSequence([seed, e, 0x150]).generate_state(1)[0]))
# for seed 0, max_start 3, 4 groups.
STEPS_SEED0 = {0: [2, 2, 2, 0], 1: [2, 2, 1, 3]}


def _config(tmp_path: Path, *overrides: str):
    return load_config(TINY, [f"run.output_dir={tmp_path}", "run.progress=false", *FLASH, *overrides])


@pytest.fixture(scope="module")
def adapter():
    from flowgrpo.pipelines import build_adapter

    return build_adapter(load_config(TINY).model)


def _collect(config, adapter, epoch: int, submitted: list | None = None):
    """One epoch of the configured rollout strategy on one process (rewards: the submitted prompts, recorded)."""
    submitted = [] if submitted is None else submitted
    context = rollout_context(config, adapter, seed=7, submit=lambda images, prompts, *_: submitted.extend(prompts))
    return get_rollout(config.sampler.rollout)(context).collect(epoch)


# ---------------------------------------------------------------- rectification: numbers
def test_the_rectification_factor_equals_hand_computed_numbers():
    """c = √Δ/g + g·√Δ·(1 - t)/(2t) on the schedule [1, .75, .5, .25, 0], Flow-GRPO's g = 0.7·sqrt(t/(1 - t)) (at t = 1
    with t_second = 0.75); cps from its own mean; Z and w from those."""
    sampler = SamplerConfig(kind="euler_maruyama", diffusion="flowgrpo", noise_level=0.7, num_steps=4)
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    # g = 1.4, 0.7·√3 = 1.212436, 0.7; Δ = 0.25 each:  0.5/1.4;  0.5/1.212436 + 1.212436·0.5·0.25/1.5;  0.5/0.7 + 0.175
    hand = torch.tensor([0.357143, 0.513429, 0.889286])
    c = gradient_scale(sampler, sigmas[:3], sigmas[1:4], t_second=0.75)
    torch.testing.assert_close(c, hand, rtol=0, atol=2e-6)
    z = schedule_normalizer(sampler, sigmas, range(0, 3))  # mean(2.8, 1.947688, 1.124498)
    assert z == pytest.approx(1.957395, abs=2e-6)
    w = rectification_weights(c, z)
    torch.testing.assert_close(w, torch.tensor([2.8, 1.947688, 1.124498]) / 1.957395, rtol=0, atol=2e-6)
    assert w.mean().item() == pytest.approx(1.0, abs=1e-6)  # the weights average 1 over the draw
    torch.testing.assert_close(rectification_weights(c, None).mean(), torch.tensor(1.0))  # "batch": over the batch
    # cps, a = 0.5, t 0.5 -> 0.25: σ = 0.25·sin(π/4) = 0.176777, ∂μ/∂v = -0.75·0.5 + sqrt(0.0625 - σ²)·0.5 = -0.286612
    cps = SamplerConfig(kind="cps", noise_level=0.5, num_steps=4)
    assert gradient_scale(cps, torch.tensor([0.5]), torch.tensor([0.25]), 0.75).item() == pytest.approx(1.621320, 1e-5)


def test_the_factor_reproduces_the_reference_codes_table():
    """Flash-GRPO's train_wanx2_1_flash.py hard-codes coe = 1/c for the first 10 of Wan2.1's 20 timesteps; Wan's
    UniPC flow sigmas (flow_shift 3, built here by hand) with the flowgrpo_wan SDE (g = σ₁·t, a = 1) give it."""
    reference = {999: 7.4770, 982: 7.0414, 963: 6.6112, 944: 6.1867, 922: 5.7682, 899: 5.3559, 874: 4.9502,
                 847: 4.5513, 817: 4.1596, 785: 3.7754}  # fmt: skip
    shift, steps = 3.0, 20
    s = 1 - torch.linspace(1, 1 / 1000, steps + 1, dtype=torch.float64)
    s = torch.flip(shift * s / (1 + (shift - 1) * s), [0])[:-1]
    sigmas = torch.cat([s, torch.zeros(1, dtype=torch.float64)]).float()
    assert [int(v) for v in (sigmas[:10].double() * 1000).tolist()] == list(reference)
    sampler = SamplerConfig(kind="euler_maruyama", diffusion="flowgrpo_wan", noise_level=1.0, num_steps=steps)
    c = gradient_scale(sampler, sigmas[:10], sigmas[1:11], float(sigmas[1]))
    torch.testing.assert_close(1 / c, torch.tensor(list(reference.values())), rtol=0, atol=1.5e-4)
    closed = euler_maruyama_gradient_scale(sigmas[:10], sigmas[1:11], sigmas[1] * sigmas[:10])
    torch.testing.assert_close(c, closed, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "kind, options",
    [("euler_maruyama", {"diffusion": "flowgrpo"}), ("euler_maruyama", {"diffusion": "dance"}), ("cps", {}),
     ("langevin", {"score_eval": "frozen"})],
)  # fmt: skip
def test_the_rectified_gradient_has_the_same_scale_at_every_step(kind, options):
    """A toy policy, the velocity field v_θ(x, t) = θ (∇_θ v = 1 everywhere), one sample per step drawn with the same
    z: on-policy, the clipped loss's gradient through the step's own log-prob (autograd) is A·c(t)·mean(z) up to
    sign: it changes with t; times w(t) it is the same at every step."""
    sampler = SamplerConfig(kind=kind, noise_level=0.7, num_steps=8, **options)
    sigmas = torch.linspace(1, 0, 9)
    z = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) + 0.5
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    raw, rectified = [], []
    z_scale = schedule_normalizer(sampler, sigmas, range(0, 7))
    for k in range(7):  # every step but the last (into t = 0)
        theta = torch.tensor(0.3, requires_grad=True)
        t, t_next = sigmas[k], sigmas[k + 1]
        common = {"t_second": float(sigmas[1]), "noise": z, "noise_level": 0.7, **options}
        sample = sde_step(kind, torch.full_like(x, 0.3), x, t, t_next, **common).sample  # current weights: on-policy
        log_prob = sde_step(kind, theta.expand_as(x), x, t, t_next, prev_sample=sample, **common).log_prob
        weight = rectification_weights(gradient_scale(sampler, t.view(1), t_next.view(1), float(sigmas[1])), z_scale)
        for out, w in ((raw, 1.0), (rectified, weight.item())):
            loss, stats = grpo_loss(log_prob, log_prob.detach(), torch.tensor([w]), clip_range=1e-3)
            assert stats.ratio_mean.item() == 1.0
            (grad,) = torch.autograd.grad(loss, theta, retain_graph=True)
            out.append(grad.abs().item())
        c = gradient_scale(sampler, t.view(1), t_next.view(1), float(sigmas[1])).item()
        assert raw[-1] == pytest.approx(c * z.mean().abs().item(), rel=2e-5)
    assert max(raw) / min(raw) > 1.5  # the time-dependent scale the rectification removes
    assert max(rectified) / min(rectified) == pytest.approx(1.0, abs=5e-5)
    assert rectified[0] == pytest.approx(z.mean().abs().item() / z_scale, rel=5e-5)


# ---------------------------------------------------------------- iso-temporal rollouts
def test_every_member_of_a_group_is_at_its_groups_seeded_step(tmp_path, adapter):
    """Epochs 0 and 1 (seed 0): each row's stored step is its group's hand-computed draw, the groups of an epoch sit
    at different steps, a group's images share the latent before the step (same noise, shared prefix) and differ
    after it; rewards were submitted in the trajectory's row order."""
    config = _config(tmp_path)
    for epoch, steps in STEPS_SEED0.items():
        submitted: list[str] = []
        collected = _collect(config, adapter, epoch, submitted)
        trajectory = collected.trajectory
        assert trajectory.num_trained_steps == 1 and len(trajectory) == 16 and submitted == trajectory.prompts
        for row, group_id in enumerate(trajectory.group_ids.tolist()):
            step = steps[group_id - 4 * epoch]
            assert trajectory.step_indices[row].tolist() == [step]
            assert trajectory.sigmas[row, 0] > trajectory.sigmas_next[row, 0]
        for group_id in trajectory.group_ids.unique().tolist():
            rows = torch.nonzero(trajectory.group_ids == group_id).flatten()
            assert len(rows) == 4
            before, after = trajectory.latents[rows, 0], trajectory.next_latents[rows, 0]
            assert all(torch.equal(before[0], b) for b in before[1:])
            assert not any(torch.equal(after[0], a) for a in after[1:])
        assert collected.metrics["window/start"] == pytest.approx(sum(steps) / 4)
        metrics = collected.metrics
        assert (metrics["window/start_min"], metrics["window/start_max"]) == (min(steps), max(steps))


def test_the_step_draw_is_its_own_stream():
    """The draw restated (numpy's SeedSequence, then torch.randint), and independent of the epoch plan's prompts: over
    300 epochs of the shapes task's plan (396 prompts, 16 groups, starts 0..4) every (prompt index mod 5, start)
    cell holds 192 ± 60 groups (4.4 standard deviations). The window strategies' random draw, seeded like the plan
    for seed 0, put 372 groups in one cell."""
    state = int(np.random.SeedSequence([0, 1, 0x150]).generate_state(1)[0])
    restated = torch.randint(0, 4, (4,), generator=torch.Generator().manual_seed(state))
    assert group_starts(0, 1, 4, 3).tolist() == restated.tolist() == STEPS_SEED0[1]
    cells: Counter[tuple[int, int]] = Counter()
    for epoch in range(300):
        starts = group_starts(0, epoch, 16, 4)
        for slot in epoch_plan(396, 8, 16, seed=0, epoch=epoch)[::8]:  # any slot of each group
            cells[slot.prompt_index % 5, int(starts[slot.group_id - 16 * epoch])] += 1
    assert sum(cells.values()) > 0 and len(cells) == 25
    assert all(132 <= count <= 252 for count in cells.values()), cells


def test_with_noise_0_the_iso_rollout_is_the_plain_ode(tmp_path, adapter):
    """Noise 0 (the clipped objective; flash refuses it): every SDE step is the Euler step, so the epoch's final
    latents are the plain ODE rollout's from the same initial noise (same_initial_noise: seeded per group)."""
    config = _config(tmp_path, "grpo.objective=clipped", "sampler.noise_level=0")
    trajectory = _collect(config, adapter, 0).trajectory
    ode = rollout(
        adapter,
        trajectory.prompts,
        trajectory.group_ids,
        config.sampler,
        range(0, 0),
        torch.Generator().manual_seed(0),
        height=32,
        width=32,
        decode=False,
        noise_seed=config.run.seed,
    )
    # tolerance: batch composition (shared prefix, sub-batches) only, as tests/test_shared_prefix.py explains
    torch.testing.assert_close(trajectory.final_latents, ode.final_latents, rtol=1e-5, atol=1e-5)


def test_the_stored_step_rescored_gives_ratio_1_and_the_loss_is_the_clipped_one_rectified(tmp_path, adapter):
    """Unchanged weights, a micro-batch mixing groups at different steps: the re-scored log-probs equal the stored
    ones to a few float32 ulps (bit for bit where the CPU's kernels are batch-invariant), and flash's loss is
    timestep_loss with each advantage times w(t)."""
    config = _config(tmp_path)
    trajectory = _collect(config, adapter, 0).trajectory
    sub = trajectory.select(torch.randperm(16, generator=torch.Generator().manual_seed(3))[:8])
    assert len(set(sub.step_indices[:, 0].tolist())) > 1
    positions = torch.zeros(8, dtype=torch.long)
    with torch.no_grad():
        new = evaluate_transitions(adapter, sub, positions, config.sampler)
    assert rescored_equal(new.log_prob, stored_log_probs(sub, positions))
    advantages = torch.linspace(-1.5, 2.0, 8)
    objective = get_objective("flash")(config)
    batch = MicroBatch(sub, advantages, positions, torch.Generator())
    loss, stats = objective.loss(adapter, batch)
    assert 1 - stats["ratio_min"].item() < ON_POLICY_RATIO_TOL and stats["ratio_max"].item() - 1 < ON_POLICY_RATIO_TOL
    sigmas, _ = adapter.schedule(config.sampler.num_steps, 32, 32)
    z = schedule_normalizer(config.sampler, sigmas, range(0, 4))
    c = gradient_scale(config.sampler, sub.sigmas[:, 0], sub.sigmas_next[:, 0], sub.t_second)
    expected, _ = timestep_loss(adapter, config, sub, positions, advantages * ((1 / c) / z))
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    assert stats["rectify_weight"].item() == pytest.approx(((1 / c) / z).mean().item())
    plain, _ = timestep_loss(adapter, config, sub, positions, advantages)
    none = get_objective("flash")(_config(tmp_path, "grpo.flash.rectify=none")).loss(adapter, batch)[0]
    torch.testing.assert_close(none, plain, rtol=0, atol=0)


def test_a_flash_epoch_trains_through_the_trainer(tmp_path):
    """One epoch of tiny_sd3 with flash + iso_temporal: one term per sample, on-policy ratio 1 at the first update,
    the weights move, and the run logs the steps and weights."""
    trainer, row = train(_config(tmp_path, "run.epochs=1", "eval.every=0", "checkpoint.every=0"))  # weights move
    assert row["train/onpolicy_ratio_dev"] < ON_POLICY_RATIO_TOL
    assert row["global_step"] == 2  # 16 samples in micro-batches of 8
    assert row["window/start"] == pytest.approx(sum(STEPS_SEED0[0]) / 4) and row["window/size"] == 1
    assert row["train/trained_step"] == pytest.approx(row["window/start"]) and row["train/rectify_weight"] > 0
    assert yaml.safe_load((trainer.run_dir / "config.yaml").read_text())["grpo"]["flash"] == {"rectify": "schedule"}


# ---------------------------------------------------------------- presets and refusals
def test_the_presets_load_and_shapes_flash_keeps_shapes_task():
    shapes, flash = (yaml.safe_load((ROOT / "configs" / f"{n}.yaml").read_text()) for n in ("shapes", "shapes_flash"))
    for section in ("model", "data", "rewards", "eval", "train", "checkpoint"):
        assert flash[section] == shapes[section], section
    for key in ("group_size", "groups_per_epoch", "clip_range", "kl"):
        assert flash["grpo"][key] == shapes["grpo"][key], key
    for name in ("shapes_flash", "sd35m_flash"):
        config = load_config(ROOT / "configs" / f"{name}.yaml")
        assert (config.grpo.objective, config.sampler.rollout) == ("flash", "iso_temporal")
        assert (config.sampler.window.size, config.grpo.flash.rectify) == (1, "schedule")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sampler.window.size=2"], r"flash trains each sample at one step.*window\.size: 1, got 2"),
        (["sampler.window.strategy=progressive"], r"flash draws each group's step.*strategy: random"),
        (["sampler.noise_level=0"], r"sampler\.noise_level must be > 0"),
        (["sampler.kind=langevin", "sampler.score_eval=reeval"], r"calls the network a second time"),
        (["sampler.kind=cps", "sampler.noise_level=0.5", "sampler.log_prob=squared_error"], r"set log_prob: exact"),
        (["grpo.flash.rectify=always"], r"grpo\.flash\.rectify must be one of schedule, batch, none"),
        (
            ["grpo.objective=awm", "sampler.noise_level=0", "sampler.same_initial_noise=false"],
            r"iso_temporal places each group's SDE step, but grpo\.objective=awm",
        ),
        (["grpo.objective=clipped", "sampler.window.size=0"], r"window\.size: 0 means every step"),
        (["grpo.objective=clipped", "sampler.window.per_batch=true"], r"draws one per group; set per_batch: false"),
    ],
)
def test_settings_it_cannot_use_are_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, *overrides)


def test_fsdp_is_refused_before_the_run_directory_exists(tmp_path, monkeypatch):
    """Processes whose batches split at different steps run different numbers of forwards: FSDP's are collectives."""
    from flowgrpo.trainer import GRPOTrainer

    config = _config(tmp_path / "runs")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match=r"iso_temporal cannot run under FSDP"):
        GRPOTrainer(config)
    assert not (tmp_path / "runs").exists()
    assert math.isfinite(config.sampler.noise_level)  # the config itself is untouched
