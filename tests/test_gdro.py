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
from test_awm import TINY, _setup

import flowgrpo.rollout as rollout_module
import flowgrpo.rollouts.chain as chain_module
from flowgrpo.advantages import AdvantageInputs, compute_advantages
from flowgrpo.checkpoint import list_checkpoints
from flowgrpo.config import ConfigError, load_config
from flowgrpo.objectives.dpo import pair_loss
from flowgrpo.objectives.gdro import GDRO, gdro_loss
from flowgrpo.offline import INFO, SAMPLES, check_store, load_latents, load_rewards, read_info, served_groups
from flowgrpo.trainer import GRPOTrainer
from rewards import AsyncReward

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


def test_two_images_and_tau_zero_give_diffusion_dpo_with_twice_the_beta():
    g = torch.Generator().manual_seed(0)
    error, reference = torch.rand(8, generator=g), torch.rand(8, generator=g)
    rewards, groups = torch.rand(8, generator=g), torch.arange(8) // 2
    ranking, _, _ = gdro_loss(error, reference, rewards, groups, beta=3.0, tau=0.0)
    dpo, _, _ = pair_loss(error - reference, rewards, beta=6.0)
    torch.testing.assert_close(ranking, dpo)


def test_the_centered_estimator_keeps_the_rewards_units_so_the_targets_are_the_rewards_softmax():
    rewards = torch.tensor([0.2, 0.9, 0.5, 1.0, 0.0, 0.5])
    groups = torch.tensor([1, 1, 1, 4, 4, 4])
    cfg = load_config(TINY, ["grpo.advantage.estimator=centered"])
    inputs = AdvantageInputs({"total": rewards}, {"brightness": 1.0}, groups, 0)
    a = compute_advantages(cfg.grpo.advantage, inputs, torch.ones(6, dtype=torch.bool))
    torch.testing.assert_close(a, torch.tensor([-0.3333, 0.3667, -0.0333, 0.5, -0.5, 0.0]), atol=1e-4, rtol=0)
    for g in (slice(0, 3), slice(3, 6)):
        torch.testing.assert_close(torch.softmax(a[g] / 0.05, 0), torch.softmax(rewards[g] / 0.05, 0))


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
    import importlib.util

    spec = importlib.util.spec_from_file_location("sample_offline", ROOT / "scripts" / "sample_offline.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
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
    epochs = [served_groups(10, 4, seed=3, epoch=e) for e in range(5)]  # 20 draws: exactly two passes over 10 groups
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
    calls = Calls(monkeypatch)
    trainer = _trainer(tmp_path, "run.epochs=2", f"sampler.offline.path={store}")
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    assert calls.count == 0 and calls.scored == 0
    assert trainer.state.global_step == 4  # 2 epochs × 2 micro-batches of 8 (2 whole groups each)
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.params, strict=True))
    assert not (trainer.run_dir / "offline").exists()  # the named store is used, nothing copied
    rewards = load_rewards(read_info(store))["total"]
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # each epoch's rewards are 4 of the stored groups' (16 of the 24 stored values)
        assert min(rewards.tolist()) <= r["reward/total/mean"] <= max(rewards.tolist())
        assert r["offline/built_s"] == 0 and r["offline/sampling_once_s"] > 0


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


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["grpo.objective=clipped", "sampler.noise_level=0.7"],
            r"sampler\.rollout=offline .* grpo\.objective=clipped"
            r" re-scores .*; set grpo\.objective to one that trains the final samples \(awm, dgpo, dpo, fpo, gdro",
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
    ids=["sde-objective", "group-size", "resolution", "rewards", "too-few-groups", "prompts"],
)
def test_a_store_that_does_not_fit_is_refused_before_the_run_directory_exists(store, tmp_path, overrides, message):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    args = [f"run.output_dir={tmp_path / 'runs'}", *OFFLINE, f"sampler.offline.path={store}", *overrides]
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, args)
    assert train.main(["--config", str(TINY), *args]) == 2
    assert not (tmp_path / "runs").exists()


def test_a_missing_or_corrupt_store_is_refused_with_the_command_that_makes_one(store, tmp_path):
    with pytest.raises(ConfigError, match=r"sampler\.offline\.path=\S+ holds no offline store .*sample_offline\.py"):
        load_config(TINY, [*OFFLINE, f"sampler.offline.path={tmp_path / 'none'}"])
    broken = _copy_store(store, tmp_path / "broken")
    data = bytearray((broken / SAMPLES).read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the last tensor
    (broken / SAMPLES).write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"sampler\.offline\.path=\S+: the offline store is corrupt .*sha256"):
        load_config(TINY, [*OFFLINE, f"sampler.offline.path={broken}"])
    unfinished = _copy_store(store, tmp_path / "unfinished")
    (unfinished / INFO).write_text("{", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"corrupt or unfinished"):
        check_store(load_config(TINY, OFFLINE), unfinished)


def test_two_epochs_of_the_shapes_preset_sample_once(tmp_path, monkeypatch):
    calls = Calls(monkeypatch)
    rows = train_shapes("shapes_gdro", tmp_path, "sampler.offline.groups=8")
    # The store's 8 groups × 8 images in rollout batches of 16, all in epoch 0; then 4 stored groups per epoch.
    assert calls.count == 4 and calls.scored == 0
    assert [r["global_step"] for r in rows] == [2, 4] and all(r["train/trained_samples"] == 32 for r in rows)
    assert rows[0]["offline/built_s"] > 0 and rows[1]["offline/built_s"] == 0
    # At the reference every s is 0: each group's loss is Σ_i log(k - i + 1) = log 8!, whatever the rewards.
    assert rows[0]["train/policy_loss"] == pytest.approx(math.log(math.factorial(8)), rel=0.02)
    assert all(0 <= r["train/implicit_acc"] <= 1 and math.isfinite(r["train/loss"]) for r in rows)
