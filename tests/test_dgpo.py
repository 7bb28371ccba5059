"""Direct Group Preference Optimization (grpo.objective: dgpo): the group loss by hand on numbers and on the bare
transformer, its gradient's sign, AWM's gradient at the reference, the whole-group plumbing (dealing, micro-batches,
refusals) and two epochs of configs/shapes_dgpo.yaml."""

from __future__ import annotations

import math

import pytest
import torch
from preference_helper import config, draws, errors, shared_draws, term_loss, toy_step, train_shapes, trainable
from test_awm import _setup

from flowgrpo.batching import group_micro_batches
from flowgrpo.config import ConfigError, validate
from flowgrpo.data import epoch_plan, rank_groups, rank_slice
from flowgrpo.objectives.awm import AWM
from flowgrpo.objectives.dgpo import DGPO, group_preference_loss

ADVANTAGES = torch.tensor([0.8, -0.8, 1.2, -1.2])  # groups [0, 0, 1, 1], as test_awm's trajectory


def test_the_group_loss_on_numbers_by_hand():
    # S_g = β/G Σ A (d - d_ref): group 3: 2/2 (1·(1.0 - 1.5) - 1·(2.0 - 1.0)) = -1.5; group 7: 2/2 (-2·(0.5 - 1.0)) = 1.
    error, reference = torch.tensor([1.0, 2.0, 0.5, 0.5]), torch.tensor([1.5, 1.0, 0.5, 1.0])
    loss, margin = group_preference_loss(
        error, reference, torch.tensor([1.0, -1.0, 2.0, -2.0]), torch.tensor([3, 3, 7, 7]), 2.0
    )
    torch.testing.assert_close(margin, torch.tensor([-1.5, 1.0]))
    expected = (math.log(1 + math.exp(-1.5)) + math.log(1 + math.exp(1.0))) / 2 / 2  # 1/β · mean −log σ(−S)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_dgpo_loss_is_the_group_preference_on_the_conditional_model():
    adapter, traj = _setup()
    cfg = config("dgpo", *draws("dgpo"), "grpo.dgpo.beta=50", "grpo.kl.beta=0.5")
    loss, stats = term_loss(DGPO(cfg), adapter, traj, ADVANTAGES)
    sigma, noise = shared_draws(traj.final_latents, [0, 0, 1, 1])  # one (σ, ε) per group
    d, d_ref, v, v_ref = errors(adapter, traj, sigma, noise)
    margin = torch.stack([50 / 2 * (ADVANTAGES[g] * (d - d_ref)[g]).sum() for g in ([0, 1], [2, 3])])
    policy = -torch.log(torch.sigmoid(-margin)).mean() / 50
    kl = ((v - v_ref) ** 2).mean()
    assert kl > 0 and margin.abs().min() > 1e-3
    torch.testing.assert_close(stats["policy_loss"], policy, rtol=1e-5, atol=0)
    torch.testing.assert_close(stats["kl"], kl, rtol=1e-5, atol=0)
    torch.testing.assert_close(loss.detach(), policy + 0.5 * kl, rtol=1e-5, atol=0)
    assert stats["implicit_acc"] == (margin < 0).float().mean()


def test_a_step_lowers_the_better_images_error_and_raises_the_worse_ones():
    # The toy: each error moved by its own parameter, so the signs are exact (A = 0: untouched).
    groups, advantages = torch.tensor([0, 0, 0]), torch.tensor([1.0, 0.0, -1.0])
    before, after = toy_step(
        lambda e: group_preference_loss(e, torch.ones(3), advantages, groups, 10.0)[0], [1.0, 1.5, 2.0]
    )
    assert after[0] < before[0] and after[1] == before[1] and after[2] > before[2]
    # The transformer, one group of two at the loss's own draws: the better image's error falls, and against the
    # worse one's (the images share most of their gradient, so the guaranteed part is the gap).
    adapter, traj = _setup()
    pair, params = traj.select([0, 1]), trainable(adapter)
    loss, _ = term_loss(DGPO(config("dgpo", *draws("dgpo"))), adapter, pair, ADVANTAGES[:2], 3)
    grads = torch.autograd.grad(loss, params)
    sigma, noise = shared_draws(pair.final_latents, [0, 0], seed=3)
    d_before = errors(adapter, pair, sigma, noise)[0]
    with torch.no_grad():
        for p, grad in zip(params, grads, strict=True):
            p -= 0.5 * grad
    d_after = errors(adapter, pair, sigma, noise)[0]
    assert d_after[0] - d_after[1] < d_before[0] - d_before[1] - 1e-5
    assert d_after[0] < d_before[0]


def test_at_the_reference_the_dgpo_gradient_is_half_awms():
    """With v_θ = v_ref (LoRA B zero: the adapter adds nothing) every S_g is 0 and σ(S_g) = 1/2; with one image per
    group DGPO draws (σ, ε) per image in AWM's order, so its gradient is half AWM's on the same advantages."""
    adapter, traj = _setup()
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.zero_()
    singles = traj.select([0, 1, 2, 3])
    singles.group_ids = torch.tensor([10, 11, 12, 13])
    params = trainable(adapter)
    dgpo, _ = term_loss(DGPO(config("dgpo", *draws("dgpo"))), adapter, singles, ADVANTAGES)
    awm_cfg = config("awm", *draws("awm"))
    awm, _ = term_loss(AWM(awm_cfg), adapter, singles, ADVANTAGES)
    got, want = torch.autograd.grad(dgpo, params), torch.autograd.grad(awm, params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, 0.5 * b, rtol=1e-4, atol=1e-6 * b.abs().max().item())
    assert any(b.abs().sum() > 0 for b in want)


def test_whole_groups_are_dealt_to_one_process_and_kept_in_one_micro_batch():
    plan = epoch_plan(10, group_size=4, groups_per_epoch=6, seed=3, epoch=2)
    assert rank_groups(plan, 0, 1) == plan == rank_slice(plan, 0, 1)
    shards = [rank_groups(plan, r, 3) for r in range(3)]
    assert sorted(s.group_id for shard in shards for s in shard) == sorted(s.group_id for s in plan)
    owners = [{s.group_id for s in shard} for shard in shards]
    assert all(len(o) == 2 and len(shard) == 8 for o, shard in zip(owners, shards, strict=True))
    assert not (owners[0] & owners[1] or owners[1] & owners[2] or owners[0] & owners[2])
    group_ids = torch.tensor([5, 7, 5, 9, 7, 9, 5, 7, 9, 5, 7, 9])
    samples = torch.tensor([6, 2, 0, 1, 4, 3, 5, 8, 9, 11, 10, 7])
    batches = group_micro_batches(samples, group_ids, 3, torch.Generator().manual_seed(0))
    assert sorted(torch.cat(batches).tolist()) == list(range(12))
    for mb in batches:  # one group each, its samples in the order given
        assert len(set(group_ids[mb].tolist())) == 1
        assert mb.tolist() == [i for i in samples.tolist() if group_ids[i] == group_ids[mb[0]]]
    with pytest.raises(ValueError, match="3 groups do not split into 2"):
        group_micro_batches(samples, group_ids, 2, torch.Generator())


@pytest.mark.parametrize(
    "override, key",
    [
        ("sampler.last_step=sde", "sampler.last_step"),  # the ODE rollout has no SDE step
        ("grpo.dgpo.beta=0", "grpo.dgpo.beta"),
        ("grpo.dgpo.timesteps=0", "grpo.dgpo.timesteps"),
        ("grpo.drop_zero_advantage=true", "grpo.drop_zero_advantage"),
        ("train.batch_size=2", "train.batch_size"),  # groups of 4 cannot be whole in micro-batches of 2
    ],
)
def test_dgpo_config_mistakes_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config("dgpo", override)


def test_the_groups_must_split_over_the_processes():
    cfg = config("dgpo", "grpo.groups_per_epoch=3", "sampler.batch_size=2", "train.batch_size=4")  # fine on one
    validate(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"grpo\.groups_per_epoch=3 must be a multiple of the 2 processes"):
        validate(cfg, world_size=2)


def test_two_epochs_of_the_shapes_preset(tmp_path):
    rows = train_shapes("shapes_dgpo", tmp_path)
    # 4 groups of 8 per epoch in micro-batches of 2 whole groups: 2 optimizer steps per epoch.
    assert [r["global_step"] for r in rows] == [2, 4] and all(r["train/trained_samples"] == 32 for r in rows)
    # The first step is taken at the reference (S_g = 0: ln 2 / β), the second one step away from it.
    assert rows[0]["train/policy_loss"] == pytest.approx(math.log(2) / 100, rel=0.05)
    assert all(0 <= r["train/implicit_acc"] <= 1 and math.isfinite(r["train/loss"]) for r in rows)
