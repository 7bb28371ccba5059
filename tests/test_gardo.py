"""GARDO's three parts (arXiv 2512.24138) with any objective: the gated KL (grpo.kl.gate) against its definition on a
made-up reward table, the KL zero for ungated samples and the formula for gated ones (velocity and transition KL),
the reference reset (grpo.kl.reset_every: the KL exactly 0 at the reset point, the reference the snapshot, its
gradient none), an exact resume across a reset, the diversity-aware advantages (grpo.advantage.diversity) against
their formula, the config checks, and the presets."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_awm import _setup, awm_loss
from test_guard import _setup as _sde_setup

import flowgrpo.objectives.clipped as clipped_module
import flowgrpo.trainer as trainer_module
from flowgrpo.advantages import AdvantageInputs, compute_advantages
from flowgrpo.advantages.diversity import FEATURES, amplify_diverse, diversity_features
from flowgrpo.checkpoint import list_checkpoints
from flowgrpo.config import AdvantageConfig, ConfigError, load_config
from flowgrpo.objectives.clipped import timestep_loss
from flowgrpo.objectives.forward import noised_point, reference_velocity, velocity, velocity_kl
from flowgrpo.objectives.kl import GATE, gated_samples, kl_sample_weights, uncertainty, win_rates
from flowgrpo.objectives.reference import KLReference
from flowgrpo.rollout import evaluate_transitions
from flowgrpo.trainer import GRPOTrainer
from samplers import transition_kl

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_sd3.yaml"
AWM = ["run.progress=false", "grpo.objective=awm", "sampler.noise_level=0"]
# A reward table of 6 samples in 2 groups: the trained total, two auxiliaries (b binary: ties).
TOTAL = torch.tensor([0.9, 0.9, 0.5, 0.1, 0.3, 0.7])
AUX_A = torch.tensor([0.2, 0.8, 0.5, 0.9, 0.3, 0.7])
AUX_B = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])


def _gate(fraction, direction="over", keep=None):
    settings = load_config(
        None,
        [
            "rewards={t: 1.0, a: 0.0, b: 0.0}",
            "grpo.kl.beta=0.1",
            "grpo.kl.gate.auxiliary=[a, b]",
            f"grpo.kl.gate.fraction={fraction}",
            f"grpo.kl.gate.direction={direction}",
        ],
    ).grpo.kl
    inputs = AdvantageInputs({"total": TOTAL, "a": AUX_A, "b": AUX_B}, {"t": 1.0, "a": 0.0, "b": 0.0}, GROUPS, 0)
    keep = torch.ones(6, dtype=torch.bool) if keep is None else keep
    return kl_sample_weights(settings, inputs, keep)[GATE]


# ---- the gate --------------------------------------------------------------------------------------------------------


def test_the_gate_holds_the_samples_the_trained_reward_ranks_above_the_auxiliaries():
    # Win rates among the 6, (below + ties/2) / 5, by hand:
    #   total 0.9 0.9 0.5 0.1 0.3 0.7 -> 4.5/5 4.5/5 2/5 0 1/5 3/5
    #   a     0.2 0.8 0.5 0.9 0.3 0.7 -> 0 4/5 2/5 1 1/5 3/5
    #   b     1   0   1   0   1   0   -> (3 + 1)/5 = 0.8 for the ones, (0 + 1)/5 = 0.2 for the zeros
    torch.testing.assert_close(win_rates(TOTAL), torch.tensor([0.9, 0.9, 0.4, 0.0, 0.2, 0.6], dtype=torch.float64))
    torch.testing.assert_close(win_rates(AUX_B), torch.tensor([0.8, 0.2, 0.8, 0.2, 0.8, 0.2], dtype=torch.float64))
    u = uncertainty({"total": TOTAL, "a": AUX_A, "b": AUX_B}, ["a", "b"])
    # U = w(total) - (w(a) + w(b)) / 2 = [0.9 - 0.4, 0.9 - 0.5, 0.4 - 0.6, 0 - 0.6, 0.2 - 0.5, 0.6 - 0.4]
    torch.testing.assert_close(u, torch.tensor([0.5, 0.4, -0.2, -0.6, -0.3, 0.2], dtype=torch.float64))
    # The count is a share of the M = 3 samples of U >= 0 (GARDO: a percentile of those): fraction 0.3 gates
    # ceil(0.9) = 1 sample, the one of largest U; 0.5: ceil(1.5) = 2; 1.0: every sample with U > 0 (three).
    assert _gate(0.3).tolist() == [1, 0, 0, 0, 0, 0]
    assert _gate(0.5).tolist() == [1, 1, 0, 0, 0, 0]
    assert _gate(1.0).tolist() == [1, 1, 0, 0, 0, 1]
    # under (the sign of GARDO's code): -U = [-0.5, -0.4, 0.2, 0.6, 0.3, -0.2], the auxiliaries rank them higher.
    assert _gate(0.3, "under").tolist() == [0, 0, 0, 1, 0, 0]
    assert _gate(0.5, "under").tolist() == [0, 0, 0, 1, 1, 0]
    assert _gate(1.0, "under").tolist() == [0, 0, 1, 1, 1, 0]
    # A group the NaN policy dropped is never gated, and the others are ranked among themselves (3 samples, / 2):
    # total 0.75 0.75 0; a 0 1 0.5; b 0.75 0 0.75 -> U = 0.375, 0.25, -0.625: M = 2, fraction 0.5 gates ceil(1) = 1.
    assert _gate(0.5, keep=GROUPS == 0).tolist() == [1, 0, 0, 0, 0, 0]
    assert _gate(1.0, keep=GROUPS == 0).tolist() == [1, 1, 0, 0, 0, 0]
    # U = 0 counts in M but is never gated; ties of U: the earlier first; 0.1 x 30 is 3 (not the float's 4).
    assert gated_samples(torch.tensor([0.0, 0.0, 0.3, -0.1]), 0.5).tolist() == [0, 0, 1, 0]
    assert gated_samples(torch.tensor([0.2, 0.1, 0.2, 0.2]), 0.5).tolist() == [1, 0, 1, 0]
    assert gated_samples(torch.linspace(1, 30, 30), 0.1).sum().item() == 3
    with pytest.raises(ValueError, match="'a/typo', which the rewards did not return"):
        uncertainty({"total": TOTAL, "a": AUX_A}, ["a/typo"])


def test_non_finite_auxiliary_scores_count_as_missing():
    # A reward's extra score (key/sub) may be NaN or inf on some images, and the NaN policy does not look at it: the
    # other images are ranked among themselves, and the image's U is against the auxiliaries that scored it.
    assert torch.equal(
        win_rates(torch.tensor([0.3, math.nan, 0.1, 0.3, math.inf])).isnan(), torch.tensor([0, 1, 0, 0, 1]).bool()
    )
    torch.testing.assert_close(  # among 0.3, 0.1, 0.3: (1 + ½) / 2 and 0
        win_rates(torch.tensor([0.3, math.nan, 0.1, 0.3]))[[0, 2, 3]], torch.tensor([0.75, 0, 0.75]).double()
    )
    b = AUX_B.clone()
    b[3] = math.nan
    rates = win_rates(b)  # the five finite: ones (2 below + 2 ties / 2) / 4, zeros (0 + 1 / 2) / 4
    torch.testing.assert_close(rates[[0, 1, 2, 4, 5]], torch.tensor([0.75, 0.125, 0.75, 0.75, 0.125]).double())
    u = uncertainty({"total": TOTAL, "a": AUX_A, "b": b}, ["a", "b"])
    # w(total) = [0.9, 0.9, 0.4, 0, 0.2, 0.6], w(a) = [0, 0.8, 0.4, 1, 0.2, 0.6]; sample 3 against a alone.
    expected = [0.9 - 0.375, 0.9 - 0.4625, 0.4 - 0.575, 0 - 1.0, 0.2 - 0.475, 0.6 - 0.3625]
    torch.testing.assert_close(u, torch.tensor(expected, dtype=torch.float64))
    # No auxiliary scored the sample: no U, never gated, not counted among the U >= 0.
    u = uncertainty({"total": TOTAL, "b": b}, ["b"])
    assert u.isnan().tolist() == [False, False, False, True, False, False]
    assert gated_samples(u, 1.0).tolist() == (u > 0).float().tolist()
    assert gated_samples(torch.tensor([math.nan, 0.5, 0.2, -0.1]), 0.5).tolist() == [0, 1, 0, 0]


def test_without_a_gate_there_are_no_per_sample_weights():
    settings = load_config(None, ["grpo.kl.beta=0.1"]).grpo.kl
    inputs = AdvantageInputs({"total": TOTAL}, {"jpeg_compressibility": 1.0}, GROUPS, 0)
    assert kl_sample_weights(settings, inputs, torch.ones(6, dtype=torch.bool)) == {}


def test_the_velocity_kl_is_zero_for_ungated_samples_and_the_formula_for_gated_ones():
    torch.manual_seed(0)
    v = torch.randn(4, 3, 2, 2, requires_grad=True)
    ref = torch.randn(4, 3, 2, 2)
    per_sample = ((v.detach() - ref) ** 2).mean(dim=(1, 2, 3))
    gated = SimpleNamespace(extras={GATE: torch.tensor([1.0, 0.0, 1.0, 0.0])})
    kl = velocity_kl(None, 0.5, None, gated, v, ref)
    torch.testing.assert_close(kl.detach(), (per_sample[0] + per_sample[2]) / 2)
    kl.backward()
    # d/dv of mean over the gated of mean |v - ref|²: 2 (v - ref) / (elements · gated) for them, 0 for the others.
    expected = 2 * (v.detach() - ref) / (12 * 2)
    expected[[1, 3]] = 0
    torch.testing.assert_close(v.grad, expected)
    # No gate: the mean over all samples, as before. A micro-batch without a gated sample: 0, with no forward at all
    # (no reference given, no adapter to run it on).
    torch.testing.assert_close(velocity_kl(None, 0.5, None, SimpleNamespace(extras={}), v, ref), per_sample.mean())
    none = SimpleNamespace(extras={GATE: torch.zeros(4)})
    assert velocity_kl(None, 0.5, None, none, v, None).item() == 0.0


def test_the_transition_kl_of_the_clipped_objective_is_gated_too(monkeypatch):
    cfg = load_config(
        TINY, ["run.progress=false", "sampler.num_steps=4", "grpo.kl.beta=0.5", "grpo.kl.convention=exact"]
    )
    adapter, traj = _sde_setup(cfg)
    positions = torch.tensor([0, 1, 2, 1])
    advantages = torch.tensor([1.5, -0.5, 0.25, -1.25])
    with torch.no_grad():
        new = evaluate_transitions(adapter, traj, positions, cfg.sampler)
        with adapter.adapter_disabled():
            ref = evaluate_transitions(adapter, traj, positions, cfg.sampler)
    per_sample = transition_kl(new, ref.mean, "exact", "mean")
    assert (per_sample > 0).all()
    traj.extras[GATE] = torch.tensor([0.0, 1.0, 0.0, 1.0])
    _, stats = timestep_loss(adapter, cfg, traj, positions, advantages)
    torch.testing.assert_close(stats.kl, (per_sample[1] + per_sample[3]) / 2, rtol=1e-6, atol=0)
    traj.extras[GATE] = torch.zeros(4)  # none gated: 0, and the reference model is never run
    monkeypatch.setattr(type(adapter), "reference", lambda self: pytest.fail("reference forward without a gate"))
    _, stats = timestep_loss(adapter, cfg, traj, positions, advantages)
    assert stats.kl.item() == 0.0


# ---- the reset of the reference --------------------------------------------------------------------------------------


def test_a_reset_makes_the_reference_the_current_weights_and_the_kl_exactly_zero():
    adapter, traj = _setup()  # LoRA B non-zero: the policy differs from the adapter-disabled model
    cfg = load_config(TINY, [*AWM, "grpo.kl.beta=0.5", "grpo.kl.reset_every=2"])
    params = adapter.trainable_parameters()
    reference = KLReference(cfg, adapter)

    def kl_now():
        point = noised_point(adapter, cfg.grpo.awm, traj, torch.Generator().manual_seed(3))
        with torch.no_grad():
            return velocity_kl(adapter, 0.5, point, traj, velocity(adapter, point, traj)), point

    reference.begin_epoch(1, params)  # before the first reset: the adapter-disabled model
    assert reference.snapshot is None and kl_now()[0] > 0
    reference.begin_epoch(2, params)  # epoch 2 = 1 × reset_every: the reference becomes the weights
    assert reference.epoch == 2
    assert all(torch.equal(s, p) and s is not p for s, p in zip(reference.snapshot.saved, params, strict=True))
    kl, point = kl_now()
    assert torch.equal(kl, torch.zeros(()))  # exactly 0 at the reset point
    torch.testing.assert_close(reference_velocity(adapter, point, traj), velocity(adapter, point, traj), rtol=0, atol=0)
    # At the reset point the KL adds no gradient: awm's with β > 0 is its gradient with β = 0.
    grads = []
    for beta in (0.5, 0.0):
        settings = load_config(TINY, [*AWM, f"grpo.kl.beta={beta}"])
        loss, _ = awm_loss(
            adapter,
            settings,
            traj,
            torch.zeros(4, dtype=torch.long),
            torch.tensor([1.0, -1, 0.5, 2]),
            torch.Generator().manual_seed(5),
        )
        loss.backward()
        grads.append([p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    # The weights move on; the reference stays the snapshot: the velocity of a copy of the model taken at the reset.
    at_reset = copy.deepcopy(adapter.transformer)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    assert kl_now()[0] > 0
    with torch.no_grad():
        live, adapter.transformer = adapter.transformer, at_reset
        expected = velocity(adapter, point, traj)
        adapter.transformer = live
    torch.testing.assert_close(reference_velocity(adapter, point, traj), expected, rtol=0, atol=0)
    # The KL's gradient, its reference forward (the snapshot swapped in) run after the forward that builds the graph,
    # is the gradient against a frozen copy of the model at the reset: the swap leaves the graph's parameters alone.
    at_reset.requires_grad_(False)
    grads = []
    for frozen in (False, True):
        v = velocity(adapter, point, traj)
        reference_v = None
        if frozen:
            with torch.no_grad():
                live, adapter.transformer = adapter.transformer, at_reset
                reference_v = velocity(adapter, point, traj)
                adapter.transformer = live
        velocity_kl(adapter, 0.5, point, traj, v, reference_v).backward()
        grads.append([p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    assert any(g.abs().sum() > 0 for g in grads[0])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    reference.begin_epoch(3, params)  # not a reset epoch: unchanged
    assert reference.epoch == 2 and not torch.equal(reference.snapshot.saved[0], params[0])
    reference.begin_epoch(4, params)
    assert reference.epoch == 4 and all(
        torch.equal(s, p) for s, p in zip(reference.snapshot.saved, params, strict=True)
    )


GARDO_TINY = [
    "run.progress=false",
    "eval.every=0",
    "rewards={brightness: 1.0, jpeg_compressibility: 0.0}",
    "grpo.kl.beta=0.5",
    "grpo.kl.gate.auxiliary=[jpeg_compressibility]",
    "grpo.kl.gate.fraction=0.25",
    "grpo.kl.reset_every=2",
    "grpo.advantage.diversity.enabled=true",
    "grpo.advantage.diversity.size=8",
    "checkpoint.every=1",
    "checkpoint.keep_last=4",
]


def _trainer(tmp_path, *overrides):
    return GRPOTrainer(load_config(TINY, [f"run.output_dir={tmp_path}", *GARDO_TINY, *overrides]))


def test_a_resume_across_a_reset_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, monkeypatch):
    # The reset at epoch 2; a run stopped after epoch 3 resumes epoch 3 against the snapshot its checkpoint holds.
    gates = []
    kl_of = clipped_module.reference_kl

    def recorded(adapter, cfg, sub, positions, new):
        gates.append(sub.extras[GATE].clone())
        return kl_of(adapter, cfg, sub, positions, new)

    monkeypatch.setattr(clipped_module, "reference_kl", recorded)
    full = _trainer(tmp_path / "a", "run.epochs=4")
    full.fit()
    # Every term saw its samples' gate; per epoch ceil(0.25 · 16) = 4 samples at most, 5 terms per micro-batch.
    per_epoch = [torch.cat(gates[i : i + 10 : 5]).sum().item() for i in range(0, len(gates), 10)]
    assert len(gates) == 4 * 2 * 5 and all(0 < n <= 4 for n in per_epoch)
    # The run as it stood after epoch 3 (a copy without epoch 4's checkpoint; the resume sets its metrics row aside).
    stopped = tmp_path / "b" / full.run_dir.name
    shutil.copytree(full.run_dir, stopped)
    shutil.rmtree(stopped / "checkpoints" / "epoch-00004")
    resumed = _trainer(tmp_path / "b", "run.epochs=4", f"run.resume={stopped}")
    assert resumed.state.epoch == 3 and resumed.kl_reference.epoch == 2
    resumed.fit()
    a, b = list_checkpoints(full.run_dir), list_checkpoints(stopped)
    assert [c.name for c in a] == [c.name for c in b] == ["epoch-00001", "epoch-00002", "epoch-00003", "epoch-00004"]
    final_a, final_b = (load_file(str(c[-1] / "adapter.safetensors")) for c in (a, b))
    assert final_a.keys() == final_b.keys() and all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    # The checkpoint after epoch 3 holds the reference taken when epoch 2 began: the weights after 2 epochs.
    with safe_open(str(b[2] / "reference.safetensors"), "pt") as handle:
        assert handle.metadata() == {"epoch": "2"}
    snapshot, after_two = load_file(str(b[2] / "reference.safetensors")), load_file(str(b[1] / "adapter.safetensors"))
    assert snapshot.keys() == after_two.keys() and all(torch.equal(snapshot[k], after_two[k]) for k in snapshot)
    assert not (b[0] / "reference.safetensors").exists()  # epoch 1: no reset yet
    rows = [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]


# ---- diversity-aware advantages --------------------------------------------------------------------------------------


def test_positive_advantages_grow_with_the_distance_to_the_groups_nearest_image():
    # Group 0: unit features at 0°, 60° and 90° (scaled: the cosine ignores length). Nearest-neighbour cosine
    # distances: d0 = 1 - cos 60° = 0.5, d1 = d2 = 1 - cos 30°. Group 1: three equal images, every d = 0: unchanged.
    angles = torch.tensor([0.0, 60.0, 90.0]) * math.pi / 180
    group0 = torch.stack([angles.cos(), angles.sin()], dim=1) * torch.tensor([[1.0], [3.0], [0.5]])
    features = torch.cat([group0, torch.ones(3, 2)])
    groups = GROUPS
    total = torch.tensor([3.0, 2.0, 1.0, 5.0, 4.0, 6.0])
    inputs = AdvantageInputs({"total": total}, {"r": 1.0}, groups, 0, {FEATURES: features})
    settings = AdvantageConfig(estimator="group", clip=1.5)
    settings.diversity.enabled = True
    out = compute_advantages(settings, inputs, torch.ones(6, dtype=torch.bool))
    d = torch.tensor([0.5, 1 - math.sqrt(3) / 2, 1 - math.sqrt(3) / 2], dtype=torch.float64)
    m = d / d.mean()
    # group: A = (R - group mean) / (std 1 + 1e-4) = ±a or 0, a = 1 / 1.0001; positives × m (then clipped to 1.5).
    a = 1 / (1 + 1e-4)
    expected = torch.tensor([min(a * m[0].item(), 1.5), 0.0, -a, 0.0, -a, a])
    torch.testing.assert_close(out, expected)
    assert m[0] * a > 1.5  # the clip did act
    # Per-step advantages [N, W]: every positive entry of a row by its sample's factor.
    steps = torch.tensor([[0.5, -0.5], [0.2, 0.4], [-1.0, 0.1], [1.0, 1.0], [-1.0, 0.0], [0.3, -0.3]])
    got = amplify_diverse(steps, {FEATURES: features}, groups, clip=10.0)
    factor = torch.cat([m.float(), torch.ones(3)]).view(-1, 1)
    torch.testing.assert_close(got, torch.where(steps > 0, steps * factor, steps))
    settings.diversity.enabled = False  # off: the estimator's own advantages
    torch.testing.assert_close(
        compute_advantages(settings, inputs, torch.ones(6, dtype=torch.bool)), torch.tensor([a, 0, -a, 0, -a, a])
    )


def test_the_diversity_features_are_the_averaged_images_minus_their_mean():
    images = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).view(2, 3, 4, 4) / 96
    settings = AdvantageConfig()
    assert diversity_features(settings, SimpleNamespace(images=images)) == {}
    settings.diversity.enabled, settings.diversity.size = True, 2
    got = diversity_features(settings, SimpleNamespace(images=images))[FEATURES]
    pooled = images.view(2, 3, 2, 2, 2, 2).mean(dim=(3, 5)).reshape(2, 12)  # 2 × 2 blocks averaged
    torch.testing.assert_close(got, pooled - pooled.mean(dim=1, keepdim=True))
    clips = images.view(1, 2, 3, 4, 4)  # a video: its frames side by side
    assert diversity_features(settings, SimpleNamespace(images=clips))[FEATURES].shape == (1, 24)


# ---- config checks and presets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["grpo.kl.gate.auxiliary=[jpeg_compressibility]"], "grpo.kl.beta=0 adds none"),
        (["grpo.kl.beta=0.1", "grpo.kl.gate.auxiliary=[aesthetic]"], "'aesthetic', which is not a reward"),
        (["grpo.kl.beta=0.1", "grpo.kl.gate.auxiliary=[jpeg_compressibility]"], "holds every reward the advantages"),
        (["grpo.kl.beta=0.1", "grpo.kl.gate.fraction=0.2"], "do nothing without grpo.kl.gate.auxiliary"),
        (["grpo.kl.gate.fraction=0"], r"grpo.kl.gate.fraction must lie in \(0, 1\]"),
        (["grpo.kl.gate.direction=overr"], "did you mean 'over'"),
        (["grpo.kl.reset_every=-1"], "grpo.kl.reset_every must be >= 0"),
        (["grpo.kl.reset_every=16"], "grpo.kl.reset_every=16 acts on the KL term"),
        (["grpo.advantage.diversity.size=0"], "grpo.advantage.diversity.size must be >= 1"),
        (["grpo.advantage.diversity.size=8"], "does nothing while grpo.advantage.diversity.enabled=false"),
    ],
)
def test_config_mistakes_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_an_auxiliary_may_be_a_rewards_extra_score():
    config = load_config(
        None, ["rewards={shapes: 1.0}", "grpo.kl.beta=0.1", "grpo.kl.gate.auxiliary=[shapes/accuracy/exact]"]
    )
    assert config.grpo.kl.gate.auxiliary == ["shapes/accuracy/exact"]


def test_the_presets_turn_on_all_three_parts():
    # The values docs/recipes.md cites: beta, the gate's auxiliaries, share and sign (sd35m_gardo: GARDO's code's
    # under; shapes_gardo: this project's over), the estimator, the reset every 16 epochs.
    cited = {
        "shapes_gardo": (0.1, ["shapes_strict"], 0.1, "over", "group"),
        "sd35m_gardo": (0.04, ["aesthetic", "imagereward"], 0.1, "under", "centered"),
    }
    for name, (beta, auxiliary, fraction, direction, estimator) in cited.items():
        config = load_config(ROOT / "configs" / f"{name}.yaml")
        kl = config.grpo.kl
        assert (kl.beta, kl.gate.auxiliary, kl.gate.fraction, kl.gate.direction) == (
            beta,
            auxiliary,
            fraction,
            direction,
        ), name
        assert kl.reset_every == 16 and config.grpo.advantage.estimator == estimator, name
        assert config.grpo.advantage.diversity.enabled, name


def test_reset_every_is_refused_under_deepspeed_or_fsdp_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(GRPOTrainer, "fsdp", property(lambda self: True))
    monkeypatch.setattr(trainer_module, "build_reward", lambda *a, **k: pytest.fail("loaded before the refusal"))
    config = load_config(TINY, [f"run.output_dir={tmp_path}", *AWM, "grpo.kl.beta=0.1", "grpo.kl.reset_every=2"])
    with pytest.raises(ConfigError, match="grpo.kl.reset_every=2 swaps a snapshot .* under DeepSpeed or FSDP"):
        GRPOTrainer(config)
    assert not list(tmp_path.iterdir())  # refused before the run directory was made
