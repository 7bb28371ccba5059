"""GDRO (grpo.objective: gdro) and the offline experience source (sampler.rollout: offline): the loss by hand on
numbers and on the bare transformer, its reduction to Diffusion-DPO, the store's files and their bit-exact round trip,
the served order and an exact resume, the refusals, and runs that train on a store without sampling."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch
from preference_helper import ROOT, config, draws, errors, shared_draws, term_loss, train_shapes
from safetensors.torch import load_file
from script_helper import load_script
from test_awm import TINY, _setup

import flowgrpo.offline as offline_module
import flowgrpo.rollout as rollout_module
import flowgrpo.rollouts.chain as chain_module
from flowgrpo.advantages import AdvantageInputs, compute_advantages
from flowgrpo.checkpoint import list_checkpoints
from flowgrpo.config import ConfigError, load_config, validate
from flowgrpo.export import run_config
from flowgrpo.objectives import OBJECTIVES, Objective
from flowgrpo.objectives.dpo import pair_loss
from flowgrpo.objectives.gdro import GDRO, gdro_loss, plackett_luce_loss
from flowgrpo.offline import (
    INFO,
    SAMPLES,
    check_store,
    load_latents,
    load_rewards,
    read_info,
    served_groups,
    write_store,
)
from flowgrpo.rollouts.offline import Offline
from flowgrpo.trainer import GRPOTrainer
from rewards import AsyncReward, apply_nan_policy

OFFLINE = ["grpo.objective=gdro", "sampler.noise_level=0", "sampler.rollout=offline", "run.progress=false"]
OFFLINE += ["eval.every=0", "grpo.advantage.estimator=centered", "sampler.offline.groups=6"]


def test_the_loss_on_numbers_by_hand():
    # Group 5: three images; s = -β (d - d_ref) with β = 2: s = (0.5, 0.2, 0.1); rewards (1, 0, 0.5): ranked 0, 2, 1.
    # Group 9: two images, s = (-0.4, 0.3), rewards (0.2, 0.7): ranked 1, 0.
    error = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0])
    reference = torch.tensor([1.25, 1.1, 1.05, 1.8, 2.15])
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.7])
    groups = torch.tensor([5, 5, 5, 9, 9])
    ranking, top1, accuracy = gdro_loss(error, reference, rewards, groups, beta=2.0, tau=0.5)

    def softmax(*x):
        z = sum(math.exp(v) for v in x)
        return [math.exp(v) / z for v in x]

    def term(s, r):  # log Σ exp(s) - Σ q s with q = softmax(r / τ), τ = 0.5, over the images not yet placed
        q = softmax(*(v / 0.5 for v in r))
        return math.log(sum(math.exp(v) for v in s)) - sum(a * b for a, b in zip(q, s, strict=True))

    group5 = term([0.5, 0.1, 0.2], [1.0, 0.5, 0.0]) + term([0.1, 0.2], [0.5, 0.0])
    group9 = term([0.3, -0.4], [0.7, 0.2])
    assert ranking.item() == pytest.approx((group5 + group9) / 2, rel=1e-5)
    assert top1.item() == pytest.approx((1.0 + 2.0) / 2)  # each group's best image: rows 0 and 4
    assert accuracy.item() == pytest.approx(3 / 4)  # pairs (0>2), (0>1), (2>1: 0.1 < 0.2 wrong), (4>3)
    # τ = 0: the ranking only, each position's target one-hot on the image placed there (the paper's L_rank).
    ranking0, _, _ = gdro_loss(error, reference, rewards, groups, beta=2.0, tau=0.0)
    lse = lambda *s: math.log(sum(math.exp(v) for v in s))  # noqa: E731
    by_hand = (lse(0.5, 0.1, 0.2) - 0.5 + lse(0.1, 0.2) - 0.1 + lse(0.3, -0.4) - 0.3) / 2
    assert ranking0.item() == pytest.approx(by_hand, rel=1e-5)


def test_tau_zero_spreads_a_positions_target_over_the_images_tied_with_it():
    # Rewards (1, 1, 0): position 1's target is uniform over the two tied images (the limit τ → 0 of the softmax),
    # not one-hot on whichever was stored first; position 2 is the second tied image against the worst.
    s = torch.tensor([0.3, -0.2, 0.5])
    lse = lambda *v: math.log(sum(math.exp(x) for x in v))  # noqa: E731
    by_hand = lse(0.3, -0.2, 0.5) - (0.3 - 0.2) / 2 + lse(-0.2, 0.5) + 0.2
    assert plackett_luce_loss(s, torch.tensor([1.0, 1.0, 0.0]), tau=0.0).item() == pytest.approx(by_hand, rel=1e-6)
    # The first position's term no longer depends on which of the tied images is stored first.
    swapped = lse(-0.2, 0.3, 0.5) - (0.3 - 0.2) / 2 + lse(0.3, 0.5) - 0.3
    got = plackett_luce_loss(s[[1, 0, 2]], torch.tensor([1.0, 1.0, 0.0]), tau=0.0).item()
    assert got == pytest.approx(swapped, rel=1e-6)


def test_a_group_without_a_ranking_weighs_nothing_so_a_dropped_group_does_not_train():
    # grpo.nan_policy: drop gives a group with a non-finite reward advantage 0 (every estimator, centered here):
    # nothing to rank, so it adds 0 to both of GDRO's terms and no gradient to its images.
    total = torch.tensor([0.2, 0.9, 0.5, 0.7, float("nan"), 0.1])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    keep, dropped = apply_nan_policy({"total": total}, groups, "drop")
    assert dropped == 1
    cfg = load_config(TINY, ["grpo.advantage.estimator=centered"])
    a = compute_advantages(cfg.grpo.advantage, AdvantageInputs({"total": total}, {"b": 1.0}, groups, 0), keep)
    assert torch.equal(a[3:], torch.zeros(3))
    error = torch.tensor([1.0, 1.2, 0.9, 1.1, 0.8, 1.3], requires_grad=True)
    reference = torch.tensor([1.1, 1.0, 1.0, 1.0, 1.0, 1.0])
    ranking, top1, _ = gdro_loss(error, reference, a, groups, beta=2.0, tau=0.05)
    alone, top_alone, _ = gdro_loss(error[:3], reference[:3], a[:3], groups[:3], beta=2.0, tau=0.05)
    torch.testing.assert_close(ranking, alone / 2)  # the mean over both groups, the dropped one adding 0
    torch.testing.assert_close(top1, top_alone / 2)
    (ranking + top1).backward()
    assert torch.equal(error.grad[3:], torch.zeros(3)) and error.grad[:3].abs().sum() > 0


def test_two_images_and_tau_zero_give_diffusion_dpo_with_twice_the_beta():
    g = torch.Generator().manual_seed(0)
    error, reference = torch.rand(8, generator=g), torch.rand(8, generator=g)
    rewards, groups = torch.rand(8, generator=g), torch.arange(8) // 2
    ranking, _, _ = gdro_loss(error, reference, rewards, groups, beta=3.0, tau=0.0)
    dpo, _, _ = pair_loss(error - reference, rewards, beta=6.0)
    torch.testing.assert_close(ranking, dpo)


def test_the_centered_estimator_keeps_the_rewards_units_so_the_targets_are_the_rewards_softmax_within_the_clip():
    rewards = torch.tensor([0.2, 0.9, 0.5, 1.0, 0.0, 0.5, 0.0, 3.0, 12.0])
    groups = torch.tensor([1, 1, 1, 4, 4, 4, 7, 7, 7])
    cfg = load_config(TINY, ["grpo.advantage.estimator=centered", "grpo.advantage.clip=4"])
    inputs = AdvantageInputs({"total": rewards}, {"brightness": 1.0}, groups, 0)
    a = compute_advantages(cfg.grpo.advantage, inputs, torch.ones(9, dtype=torch.bool))
    # R - group mean, clamped to ±clip in the rewards' units: group 7's mean is 5, so -5 and 7 are clamped to -4, 4.
    want = torch.tensor([-0.3333, 0.3667, -0.0333, 0.5, -0.5, 0.0, -4.0, -2.0, 4.0])
    torch.testing.assert_close(a, want, atol=1e-4, rtol=0)
    for g in (slice(0, 3), slice(3, 6)):  # every |R - mean| within the clip: the rewards' softmax exactly
        torch.testing.assert_close(torch.softmax(a[g] / 0.5, 0), torch.softmax(rewards[g] / 0.5, 0))
    clipped, exact = torch.softmax(a[6:] / 2, 0), torch.softmax(rewards[6:] / 2, 0)  # beyond it: flattened targets
    assert clipped.max() < exact.max() - 0.04 and clipped.min() > exact.min() + 0.01


def test_gdro_loss_is_the_ranking_loss_on_the_conditional_model():
    adapter, traj = _setup()
    cfg = config("gdro", *draws("gdro"), "grpo.gdro.beta=40", "grpo.gdro.tau=0.2", "grpo.gdro.gamma=0.7")
    cfg.grpo.kl.beta = 0.5
    rewards = torch.tensor([0.1, 0.9, 0.6, 0.2])
    loss, stats = term_loss(GDRO(cfg), adapter, traj, rewards)
    sigma, noise = shared_draws(traj.final_latents, [0, 0, 1, 1])  # one (σ, ε) per group
    d, d_ref, v, v_ref = errors(adapter, traj, sigma, noise)
    s = -40 * (d - d_ref)

    def pair(best, worst):  # two images: log(e^s_b + e^s_w) - q_b s_b - q_w s_w, q = softmax(r / 0.2)
        q = torch.softmax(rewards[[best, worst]] / 0.2, 0)
        return torch.logsumexp(s[[best, worst]], 0) - (q * s[[best, worst]]).sum()

    ranking = (pair(1, 0) + pair(2, 3)) / 2
    top1 = (d[1] + d[2]) / 2
    kl = ((v - v_ref) ** 2).mean()
    assert kl > 0 and s.abs().max() > 1e-3
    torch.testing.assert_close(stats["policy_loss"], ranking, rtol=1e-5, atol=0)
    torch.testing.assert_close(stats["top1_error"], top1, rtol=1e-5, atol=0)
    torch.testing.assert_close(loss.detach(), ranking + 0.7 * top1 + 0.5 * kl, rtol=1e-5, atol=0)
    # one ordered pair per group (1 over 0, 2 over 3): the share whose implicit rewards agree
    assert stats["implicit_acc"].item() == ((s[1] > s[0]).float() + (s[2] > s[3]).float()).item() / 2


def test_gdro_config_mistakes_name_the_key():
    for override in ("grpo.gdro.beta=0", "grpo.gdro.tau=-1", "grpo.gdro.gamma=-0.5", "grpo.drop_zero_advantage=true"):
        with pytest.raises(ConfigError, match=re.escape(override.split("=")[0])):
            config("gdro", override)
    with pytest.raises(ConfigError, match=r"train\.batch_size=2 must be a multiple of grpo\.group_size=4"):
        config("gdro", "train.batch_size=2")  # groups of 4 cannot be whole in micro-batches of 2


# ---------------------------------------------------------------------------------------------- the offline store
def _trainer(out: Path, *overrides: str) -> GRPOTrainer:
    return GRPOTrainer(load_config(TINY, [f"run.output_dir={out}", *OFFLINE, *overrides]))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A store of 6 groups × 4 images of the tiny model, sampled by scripts/sample_offline.py."""
    script = load_script("sample_offline")
    out = tmp_path_factory.mktemp("store") / "tiny"
    assert script.main(["--config", str(TINY), "--out", str(out), *OFFLINE]) == 0
    return out


class Calls:
    """Counts the sampler's calls (the rollout function, wherever it is called from) and keeps their final latents."""

    def __init__(self, monkeypatch) -> None:
        self.latents: list[torch.Tensor] = []
        real = rollout_module.rollout

        def counted(*args, **kwargs):
            trajectory = real(*args, **kwargs)
            self.latents.append(trajectory.final_latents.clone())
            return trajectory

        monkeypatch.setattr(rollout_module, "rollout", counted)
        monkeypatch.setattr(chain_module, "rollout", counted)
        self.scored = 0
        submit = AsyncReward.submit

        def counted_submit(reward, *args, **kwargs):
            self.scored += 1
            return submit(reward, *args, **kwargs)

        monkeypatch.setattr(AsyncReward, "submit", counted_submit)

    @property
    def count(self) -> int:
        return len(self.latents)


def test_the_store_is_safetensors_and_json_and_round_trips_bit_exactly(tmp_path, monkeypatch):
    calls = Calls(monkeypatch)
    trainer = _trainer(tmp_path, "run.epochs=1", "sampler.batch_size=8")
    trainer.fit()
    out = trainer.run_dir / "offline"
    assert sorted(p.name for p in out.iterdir()) == [SAMPLES, INFO]  # nothing else: no pickle anywhere
    info = json.loads((out / INFO).read_text(encoding="utf-8"))
    assert info["groups"] == 6 and info["group_size"] == 4 and len(info["prompts"]) == 6
    assert info["rewards"]["keys"] == ["brightness", "total"] and info["timing"]["sampling_s"] > 0
    raw = (out / SAMPLES).read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])  # safetensors: a u64 header length, a JSON header, then raw tensor bytes
    header = json.loads(raw[8 : 8 + size])
    names = {"final_latents", "group", "prompt_index", "reward/brightness", "reward/total"}
    assert set(header) - {"__metadata__"} == names
    # The sampled latents come back bit for bit (3 rollout batches of 8 = 6 groups × 4, group-major), as do the rewards
    # the trainer scored them with.
    assert calls.count == 3
    stored = read_info(out)
    assert torch.equal(load_latents(stored, list(range(6))), torch.cat(calls.latents).cpu())
    tensors = load_file(str(out / SAMPLES))
    assert torch.equal(tensors["final_latents"], torch.cat(calls.latents).cpu())
    assert torch.equal(load_rewards(stored)["total"], tensors["reward/total"])
    assert tensors["reward/total"].dtype == torch.float32
    assert tensors["group"].tolist() == [g for g in range(6) for _ in range(4)]


def test_the_served_order_is_a_function_of_seed_and_epoch():
    torch.manual_seed(1)  # whatever the global generator holds: the order comes from (seed, epoch) alone
    epochs = [served_groups(10, 4, seed=3, epoch=e) for e in range(5)]  # 20 draws: exactly two passes over 10 groups
    assert epochs == [[6, 2, 1, 3], [7, 5, 9, 4], [0, 8, 3, 8], [6, 9, 1, 5], [4, 7, 2, 0]]  # an exact resume's order
    torch.manual_seed(2)
    assert epochs == [served_groups(10, 4, seed=3, epoch=e) for e in range(5)]
    flat = [g for e in epochs for g in e]
    assert sorted(flat[:10]) == sorted(flat[10:]) == list(range(10)) and flat[:10] != flat[10:]
    assert served_groups(10, 4, seed=4, epoch=0) != epochs[0]
    assert all(len(e) == 4 for e in epochs)


def test_a_resumed_run_replays_the_same_groups_and_ends_with_the_same_weights(tmp_path, monkeypatch):
    common = ["checkpoint.every=1", "checkpoint.keep_last=2", "sampler.batch_size=8"]
    full = _trainer(tmp_path / "a", "run.epochs=4", *common)
    full.fit()
    part = _trainer(tmp_path / "b", "run.epochs=2", *common)
    part.fit()
    calls = Calls(monkeypatch)
    resumed = _trainer(tmp_path / "b", "run.epochs=4", f"run.resume={part.run_dir}", *common)
    assert resumed.run_dir == part.run_dir and resumed.state.epoch == 2
    resumed.fit()
    assert calls.count == 0 and calls.scored == 0  # the run's own store, read back
    a, b = list_checkpoints(full.run_dir)[-1], list_checkpoints(part.run_dir)[-1]
    assert a.name == b.name == "epoch-00004"
    wa, wb = load_file(str(a / "adapter.safetensors")), load_file(str(b / "adapter.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    rows = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    served = lambda run: [(r["epoch"], r["reward/total/mean"], r["train/loss"]) for r in rows(run)]  # noqa: E731
    assert served(full.run_dir) == served(part.run_dir)


def test_a_store_trains_two_epochs_without_sampling_or_scoring(store, tmp_path, monkeypatch):
    moved = _copy_store(store, tmp_path / "store")
    calls = Calls(monkeypatch)
    hashed = _count_hashes(monkeypatch)
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", *OFFLINE, "run.epochs=2", f"sampler.offline.path={moved}"])
    assert hashed == []  # validation reads the headers only
    trainer = GRPOTrainer(cfg)
    assert len(hashed) == 1  # once, when the strategy opens the store
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    assert len(hashed) == 1 and calls.count == 0 and calls.scored == 0
    assert trainer.state.global_step == 4  # 2 epochs × 2 micro-batches of 8 (2 whole groups each)
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.params, strict=True))
    assert not (trainer.run_dir / "offline").exists()  # the named store is used, nothing copied
    rewards = load_rewards(read_info(store))["total"].view(6, 4)
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # each epoch's rewards are its 4 served groups' stored ones
        served = served_groups(6, 4, seed=cfg.run.seed, epoch=r["epoch"])
        assert r["reward/total/mean"] == pytest.approx(rewards[served].mean().item(), rel=1e-6)
        assert r["offline/built_s"] == 0 and r["offline/sampling_once_s"] > 0
    # Evaluating or exporting the finished run reads its config, not its store, which may have moved since.
    for name in (SAMPLES, INFO):
        (moved / name).unlink()
    checkpoint = list_checkpoints(trainer.run_dir)[-1]
    assert run_config(checkpoint).sampler.offline.path == str(moved)
    assert load_config(trainer.run_dir / "config.yaml", training=False).sampler.offline.path == str(moved)
    with pytest.raises(ConfigError, match=r"holds no offline store"):
        load_config(trainer.run_dir / "config.yaml")  # to train, it must be there


def test_images_are_decoded_from_the_store_only_where_something_reads_them(store, tmp_path):
    trainer = _trainer(tmp_path / "a", "run.epochs=1", f"sampler.offline.path={store}", "run.image_grid_every=2")
    assert trainer.rollouts.collect(0).trajectory.images.shape == (16, 3, 32, 32)  # the image grid's epoch
    assert trainer.rollouts.collect(1).trajectory.images is None
    diversity = "grpo.advantage.diversity.enabled=true"
    shaped = _trainer(tmp_path / "b", "run.epochs=1", f"sampler.offline.path={store}", diversity)
    images = shaped.rollouts.collect(1).trajectory.images  # GARDO's diversity shaping compares them
    latents = shaped.rollouts.collect(1).trajectory.final_latents
    torch.testing.assert_close(images, shaped.adapter.decode(latents, 32, 32).cpu())


def _copy_store(store: Path, to: Path) -> Path:
    to.mkdir()
    for name in (SAMPLES, INFO):
        (to / name).write_bytes((store / name).read_bytes())
    return to


def _rewritten_store(store: Path, to: Path, change) -> Path:
    """A store with the tensors and store.json of ``store`` as ``change(tensors, info)`` left them, its hash
    recomputed: a store that is whole, but holds something else."""
    tensors, info = load_file(str(store / SAMPLES)), json.loads((store / INFO).read_text(encoding="utf-8"))
    info.pop("samples_sha256")
    change(tensors, info)
    write_store(to, tensors, info)
    return to


def _count_hashes(monkeypatch) -> list[Path]:
    """The samples files whose sha256 is computed from now on (prompt files are hashed too: not counted)."""
    hashed: list[Path] = []
    real = offline_module.file_sha256

    def counted(path):
        if Path(path).name == SAMPLES:
            hashed.append(Path(path))
        return real(path)

    monkeypatch.setattr(offline_module, "file_sha256", counted)
    return hashed


def _train_script():
    return load_script("train")


# The usable list names every registered objective that fits: plugins other test modules register at import
# (tests/test_seams.py's throwaway, alive in a worker until that module's teardown) may be listed too: (, \w+)*.
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["grpo.objective=clipped", "sampler.noise_level=0.7"],
            r"sampler\.rollout=offline .* grpo\.objective=clipped re-scores the SDE window's transitions .*; set "
            r"grpo\.objective to one that trains on samples from another model \(awm, dgpo, dpo, gdro, sft(, \w+)*\)",
        ),
        (
            ["grpo.objective=nft"],
            r"grpo\.objective=nft compares with old weights that stand for the weights the epoch's samples were drawn "
            r"with .*; set grpo\.objective to one that trains on samples from another model "
            r"\(awm, dgpo, dpo, gdro, sft(, \w+)*\)",
        ),
        (
            ["grpo.objective=fpo"],
            r"grpo\.objective=fpo compares with old weights .*\(awm, dgpo, dpo, gdro, sft(, \w+)*\), or "
            r"sampler\.rollout: chain",
        ),
        (
            ["grpo.group_size=2", "train.batch_size=4", "sampler.batch_size=4"],
            r"sampler\.offline\.path=\S+ holds groups of 4 images, but grpo\.group_size=2; set grpo\.group_size: 4, or "
            r"sample a store .*scripts/sample_offline\.py",
        ),
        (
            ["model.resolution=64"],
            r"model\.resolution=32 .* this config has model\.resolution=64; set model\.resolution"
            r": 32",
        ),
        (["rewards.brightness=2.0"], r"was scored with rewards .*; set rewards to the store's"),
        (["grpo.groups_per_epoch=8", "sampler.batch_size=8"], r"holds 6 groups, fewer than .*grpo\.groups_per_epoch=8"),
        (["data.train=configs/prompts/tiny_test.txt"], r"data\.train=\S+ holds other prompts .*; set data\.train"),
    ],
    ids=["sde-objective", "nft", "fpo", "group-size", "resolution", "rewards", "too-few-groups", "prompts"],
)
def test_a_store_that_does_not_fit_is_refused_before_the_run_directory_exists(store, tmp_path, overrides, message):
    args = [f"run.output_dir={tmp_path / 'runs'}", *OFFLINE, f"sampler.offline.path={store}", *overrides]
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, args)
    assert _train_script().main(["--config", str(TINY), *args]) == 2
    assert not (tmp_path / "runs").exists()


def test_the_objectives_offline_serves_are_those_whose_loss_is_not_tied_to_the_sampling_weights():
    tied = {name for name, cls in OBJECTIVES.items() if cls.samples_from_current_weights}
    assert {"clipped", "guard", "flash", "tempflow", "nft", "fpo", "lagged"} <= tied
    assert not {"awm", "dgpo", "dpo", "sft", "gdro"} & tied
    recipes = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    assert "`awm`, `dgpo`, `dpo`, `sft` and `gdro` train on it" in recipes

    class Window(Objective):  # an SDE-window objective re-scores stored log-probs: tied, unless it says otherwise
        rollout = "sde_window"

    class Untied(Window):
        samples_from_current_weights = False

    class Child(Untied):
        pass

    assert Window.samples_from_current_weights and not Untied.samples_from_current_weights
    assert not Child.samples_from_current_weights

    class Ode(Window):  # the flag Window got from its rollout is no choice of Window's: an ode subclass is untied
        rollout = "ode"

    class WindowAgain(Ode):
        rollout = "sde_window"

    assert not Ode.samples_from_current_weights and WindowAgain.samples_from_current_weights


def test_an_sde_window_objective_is_refused_offline_even_when_it_says_its_samples_may_come_from_another_model():
    from flowgrpo.objectives import register_objective

    @register_objective("untied_window")
    class UntiedWindow(Objective):  # out of tree: re-scores stored transitions, yet sets the flag False
        rollout = "sde_window"
        samples_from_current_weights = False

    @register_objective("untied_ode")
    class UntiedOde(Objective):
        rollout = "ode"

    try:
        cfg = load_config(TINY, OFFLINE)  # path: null: nothing to read
        Offline.validate(cfg)
        cfg.grpo.objective = "untied_ode"
        Offline.validate(cfg)
        cfg.grpo.objective = "untied_window"
        message = r"grpo\.objective=untied_window re-scores the SDE window's transitions .*"
        with pytest.raises(ConfigError, match=message + r"\(awm, dgpo, dpo, gdro, sft(, \w+)*, untied_ode(, \w+)*\)"):
            Offline.validate(cfg)
    finally:
        OBJECTIVES.pop("untied_window")
        OBJECTIVES.pop("untied_ode")


def test_a_store_sampled_in_the_run_is_refused_with_several_processes_before_anything_loads():
    cfg = load_config(TINY, OFFLINE)  # path: null, one process
    message = r"sampler\.offline\.path=null samples the store inside the run on one process, and this run has 2; .*"
    with pytest.raises(ConfigError, match=message + r"set sampler\.offline\.path: DIR"):
        Offline.validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=2)  # what the trainer runs first, with the launch's process count


def test_a_store_for_another_latent_shape_is_refused_before_the_run_directory_exists(store, tmp_path):
    def other_shape(tensors, info):  # one more latent channel than the tiny model makes
        latents = tensors["final_latents"]
        tensors["final_latents"] = torch.cat([latents, latents[:, :1]], dim=1).contiguous()
        info["model"]["latent_shape"] = list(tensors["final_latents"].shape[1:])

    other = _rewritten_store(store, tmp_path / "other", other_shape)
    args = [f"run.output_dir={tmp_path / 'runs'}", *OFFLINE, f"sampler.offline.path={other}"]
    load_config(TINY, args)  # the headers agree with each other and with the config's model and resolution
    with pytest.raises(
        ConfigError, match=r"holds latents of shape \[17, 16, 16\], and this model makes \[16, 16, 16\]"
    ):
        _trainer(tmp_path / "runs", "run.epochs=1", f"sampler.offline.path={other}")
    assert _train_script().main(["--config", str(TINY), *args]) == 2
    assert not (tmp_path / "runs").exists()


def test_non_finite_stored_rewards_are_refused_under_nan_policy_error(store, tmp_path):
    def nan_in_group_2(tensors, info):  # noqa: ARG001
        for key in ("reward/brightness", "reward/total"):
            tensors[key][9] = float("nan")  # group 2 holds rows 8 … 11

    nans = _rewritten_store(store, tmp_path / "nans", nan_in_group_2)
    args = [*OFFLINE, f"sampler.offline.path={nans}"]
    message = r"holds non-finite rewards in 1 of its 6 groups \(first: group 2, .*set grpo\.nan_policy: drop"
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, args)
    load_config(TINY, [*args, "grpo.nan_policy=drop"])  # each epoch drops the group (advantage 0, GDRO weight 0)


def test_a_missing_or_corrupt_store_is_refused_with_the_command_that_makes_one(store, tmp_path):
    with pytest.raises(ConfigError, match=r"sampler\.offline\.path=\S+ holds no offline store .*sample_offline\.py"):
        load_config(TINY, [*OFFLINE, f"sampler.offline.path={tmp_path / 'none'}"])
    broken = _copy_store(store, tmp_path / "broken")
    data = bytearray((broken / SAMPLES).read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the last tensor: only the hash sees it
    (broken / SAMPLES).write_bytes(bytes(data))
    args = [f"run.output_dir={tmp_path / 'runs'}", *OFFLINE, "run.epochs=1", f"sampler.offline.path={broken}"]
    load_config(TINY, args)  # validation reads the headers only
    with pytest.raises(ConfigError, match=r"sampler\.offline\.path=\S+: the offline store is corrupt .*sha256"):
        GRPOTrainer(load_config(TINY, args))  # opening it checks the hash, before the run directory exists
    assert not (tmp_path / "runs").exists()
    unfinished = _copy_store(store, tmp_path / "unfinished")
    (unfinished / INFO).write_text("{", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"corrupt or unfinished"):
        check_store(load_config(TINY, OFFLINE), unfinished)

    def half_precision(tensors, info):  # noqa: ARG001  (store.json still says float32)
        tensors["final_latents"] = tensors["final_latents"].half()

    mislabelled = _rewritten_store(store, tmp_path / "mislabelled", half_precision)
    with pytest.raises(ConfigError, match=r"corrupt or unfinished .*'final_latents': \(\(24, 16, 16, 16\), 'F16'\)"):
        read_info(mislabelled)


def test_two_epochs_of_the_shapes_preset_sample_once(tmp_path, monkeypatch):
    calls = Calls(monkeypatch)
    rows = train_shapes("shapes_gdro", tmp_path, "sampler.offline.groups=8")
    # The store's 8 groups × 8 images in rollout batches of 16, all in epoch 0; then 4 stored groups per epoch.
    assert calls.count == 4 and calls.scored == 0
    assert [r["global_step"] for r in rows] == [2, 4] and all(r["train/trained_samples"] == 32 for r in rows)
    assert rows[0]["offline/built_s"] > 0 and rows[1]["offline/built_s"] == 0
    # At the reference every s is 0: each group's loss is Σ_i log(k - i + 1) = log 8!, whatever the rewards.
    assert rows[0]["train/policy_loss"] == pytest.approx(math.log(math.factorial(8)), rel=0.02)
    assert all(math.isfinite(r["train/loss"]) for r in rows)  # implicit_acc: exactly, in the loss's test above
