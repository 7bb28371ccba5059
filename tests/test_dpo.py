"""Online Diffusion-DPO (grpo.objective: dpo): the pairing, the loss by hand on numbers and on the bare transformer
against either reference, its gradient's sign, AWM's gradient at the reference, the refusals and two epochs of
configs/shapes_dpo.yaml."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from preference_helper import config, draws, errors, shared_draws, term_loss, toy_step, train_shapes, trainable
from test_awm import _conditional_velocity, _setup

from flowgrpo.config import ConfigError
from flowgrpo.objectives.dpo import DPO, best_and_worst, pair_loss

ADVANTAGES = torch.tensor([0.3, 1.1, -0.4, -1.6])  # groups [0, 0, 1, 1]: pairs (1, 0) and (2, 3)


def _pairs(objective, traj, advantages=ADVANTAGES):
    """The micro-batch the trainer builds: each group's best and worst sample, in that order."""
    index = objective.select_samples(advantages, 1, torch.Generator(), traj.group_ids)
    return traj.select(index), advantages[index]


def test_each_groups_best_and_worst_sample_pair_up():
    advantages = torch.tensor([0.2, -1.0, 0.0, 0.0, 1.5, 0.7, 0.0])
    group_ids = torch.tensor([4, 4, 9, 9, 4, 4, 9])
    assert best_and_worst(advantages, group_ids).tolist() == [4, 1, 2, 3]  # group 9 all equal: its first two


def test_the_pair_loss_on_numbers_by_hand():
    # Pair 0: row 0 wins, inside = -10/2 (0.1 - 0.3) = 1; pair 1: row 3 wins, inside = -5 (0.2 - 0.2) = 0;
    # pair 2: a tie, weight 0.
    delta = torch.tensor([0.1, 0.3, 0.2, 0.2, 0.5, -0.5])
    loss, inside, weight = pair_loss(delta, torch.tensor([1.0, -1.0, -0.5, 0.5, 0.0, 0.0]), 10.0)
    torch.testing.assert_close(inside, torch.tensor([1.0, 0.0, -5.0]))
    assert weight.tolist() == [1.0, 1.0, 0.0]
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1.0)) + math.log(2)) / 3, rel=1e-6)


@pytest.mark.parametrize("reference", ["base", "epoch"])
def test_dpo_loss_is_diffusion_dpos_on_the_conditional_model(reference):
    adapter, traj = _setup()
    cfg = config("dpo", *draws("dpo"), "grpo.dpo.beta=50", f"grpo.dpo.reference={reference}", "grpo.kl.beta=0.5")
    objective = DPO(cfg)
    old_transformer = copy.deepcopy(adapter.transformer)
    objective.begin_epoch(trainable(adapter))
    with torch.no_grad():  # the weights move after the epoch began: the epoch reference is the old weights
        for p in trainable(adapter):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    sub, advantages = _pairs(objective, traj)
    loss, stats = term_loss(objective, adapter, sub, advantages)
    sigma, noise = shared_draws(sub.final_latents, [0, 0, 1, 1])  # one (σ, ε) per pair
    d, d_base, v, v_base = errors(adapter, sub, sigma, noise)
    d_ref = d_base if reference == "base" else errors(adapter, sub, sigma, noise, old_transformer)[0]
    delta = d - d_ref  # rows (winner, loser) per pair
    inside = -50 / 2 * (delta[[0, 2]] - delta[[1, 3]])
    policy = -torch.log(torch.sigmoid(inside)).mean()
    kl = ((v - v_base) ** 2).mean()  # the KL's reference is the base model either way
    assert kl > 0 and inside.abs().min() > 1e-3
    assert (reference == "base") == torch.equal(d_ref, d_base)  # the epoch's weights are not the base model
    torch.testing.assert_close(stats["policy_loss"], policy, rtol=1e-5, atol=0)
    torch.testing.assert_close(stats["kl"], kl, rtol=1e-5, atol=0)
    torch.testing.assert_close(loss.detach(), policy + 0.5 * kl, rtol=1e-5, atol=0)
    assert stats["implicit_acc"] == (inside > 0).float().mean()


def test_a_step_lowers_the_winners_error_and_raises_the_losers():
    before, after = toy_step(lambda e: pair_loss(e, torch.tensor([1.0, -1.0]), 10.0)[0], [1.0, 1.0])
    assert after[0] < before[0] and after[1] > before[1]
    adapter, traj = _setup()
    objective = DPO(config("dpo", *draws("dpo")))
    sub, advantages = _pairs(objective, traj.select([0, 1]), ADVANTAGES[:2])
    params = trainable(adapter)
    grads = torch.autograd.grad(term_loss(objective, adapter, sub, advantages, seed=3)[0], params)
    sigma, noise = shared_draws(sub.final_latents, [0, 0], seed=3)
    d_before = errors(adapter, sub, sigma, noise)[0]
    with torch.no_grad():
        for p, grad in zip(params, grads, strict=True):
            p -= 1e-3 * grad  # β = 100: the gradient is about 25× AWM's
    d_after = errors(adapter, sub, sigma, noise)[0]
    assert d_after[0] - d_after[1] < d_before[0] - d_before[1] - 1e-5
    assert d_after[0] < d_before[0]


def test_at_the_reference_the_dpo_gradient_is_awms_on_the_pair_times_beta_over_2():
    """With the epoch reference taken and no step yet, v_θ = v_ref: the inside term is 0, σ(0) = 1/2, and the
    gradient is β/4 ∇(d_w - d_l) = β/2 · ∇ mean(A d) at A = ±1 (AWM's loss on the pair's shared draws)."""
    adapter, traj = _setup()
    objective = DPO(config("dpo", *draws("dpo"), "grpo.dpo.beta=20", "grpo.dpo.reference=epoch"))
    params = trainable(adapter)
    objective.begin_epoch(params)
    sub, advantages = _pairs(objective, traj)
    got = torch.autograd.grad(term_loss(objective, adapter, sub, advantages)[0], params)
    sigma, noise = shared_draws(sub.final_latents, [0, 0, 1, 1])
    x0, s = sub.final_latents, sigma.view(4, 1, 1, 1)
    v = _conditional_velocity(adapter.transformer, sub, (1 - s) * x0 + s * noise, sigma)
    awm = (torch.tensor([1.0, -1.0, 1.0, -1.0]) * ((v - (noise - x0)) ** 2).mean(dim=(1, 2, 3))).mean()
    want = torch.autograd.grad(awm, params)
    for a, b in zip(got, want, strict=True):
        # The same forward, differenced and summed in another order: fp32 rounding, relative to the largest entry
        # (an entry cancelling in the sums can differ by ~3e-5 of it: seen with another LoRA A draw).
        torch.testing.assert_close(a, 10 * b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    assert any(b.abs().sum() > 0 for b in want)


def test_only_the_epoch_reference_refuses_sharded_parameters():
    assert DPO(config("dpo")).refuses_sharded is None
    assert "grpo.dpo.reference: base" in DPO(config("dpo", "grpo.dpo.reference=epoch")).refuses_sharded


@pytest.mark.parametrize(
    "override, key",
    [
        ("sampler.last_step=sde", "sampler.last_step"),  # the ODE rollout has no SDE step
        ("grpo.dpo.beta=0", "grpo.dpo.beta"),
        ("grpo.dpo.reference=old", "grpo.dpo.reference"),
        ("grpo.drop_zero_advantage=true", "grpo.drop_zero_advantage"),
        ("train.batch_size=2", "train.batch_size"),
    ],
)
def test_dpo_config_mistakes_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config("dpo", override)


def test_two_epochs_of_the_shapes_preset(tmp_path):
    rows = train_shapes("shapes_dpo", tmp_path)
    # 4 groups of 8 per epoch, 2 images each trained, in micro-batches of 2 pairs: 2 optimizer steps per epoch.
    assert [r["global_step"] for r in rows] == [2, 4] and all(r["train/trained_samples"] == 8 for r in rows)
    assert all(math.isfinite(r["train/loss"]) and 0 <= r["train/implicit_acc"] <= 1 for r in rows)
