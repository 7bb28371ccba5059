"""Online SFT / reward-filtered fine-tuning (grpo.objective: sft): which images are kept, the loss by hand on the
bare transformer, AWM's loss when every image is kept, its gradient's sign, the refusals and two epochs of
configs/shapes_sft.yaml."""

from __future__ import annotations

import math

import pytest
import torch
from preference_helper import config, draws, errors, shared_draws, term_loss, toy_step, train_shapes, trainable
from test_awm import _setup

from flowgrpo.config import ConfigError
from flowgrpo.objectives.awm import AWM
from flowgrpo.objectives.sft import SFT, kept_weights, top_k_per_group

ADVANTAGES = torch.tensor([0.3, 1.1, -0.4, -1.6])  # groups [0, 0, 1, 1]; group 1 has no better-than-average image


def test_the_kept_images_and_their_weights_by_hand():
    advantages = torch.tensor([0.5, 2.0, -1.0, 1.0, 1.0, -2.0])
    group_ids = torch.tensor([0, 0, 0, 5, 5, 5])
    assert top_k_per_group(advantages, group_ids, 2).tolist() == [1, 0, 3, 4]  # best first, ties in order
    # top_k: a kept group trains all its kept rows, one whose best is not above average none.
    kept = kept_weights(torch.tensor([2.0, 0.5, 0.0, -0.3]), torch.tensor([0, 0, 5, 5]), "top_k")
    assert kept.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert kept_weights(torch.tensor([2.0, -0.5, 0.0]), torch.tensor([0, 0, 1]), "positive").tolist() == [1, 0, 0]
    # positive: those with A > 0, and random others (weight 0) up to a multiple of the micro-batches.
    objective = SFT(config("sft", "grpo.sft.select=positive"))
    picked = objective.select_samples(torch.tensor([0.5, -0.5, 0.0, 1.0, -1.0, 0.0]), 4, torch.Generator())
    assert len(picked) == 4 and {0, 3} <= set(picked.tolist())


def test_sft_loss_is_the_flow_matching_loss_of_the_kept_images():
    adapter, traj = _setup()
    objective = SFT(config("sft", *draws("sft"), "grpo.kl.beta=0.5"))
    index = objective.select_samples(ADVANTAGES, 1, torch.Generator(), traj.group_ids)
    assert index.tolist() == [1, 2]  # each group's best
    sub = traj.select(index)
    loss, stats = term_loss(objective, adapter, sub, ADVANTAGES[index])
    sigma, noise = shared_draws(sub.final_latents, [0, 1])  # one (σ, ε) per image
    d, _, v, v_ref = errors(adapter, sub, sigma, noise)
    kl = ((v - v_ref) ** 2).mean()  # over the forwarded rows
    assert kl > 0 and stats["kept"] == 1  # group 1's best is below its mean: weight 0
    torch.testing.assert_close(stats["policy_loss"], d[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(loss.detach(), d[0] + 0.5 * kl, rtol=1e-5, atol=0)


def test_with_every_image_kept_sft_is_awm_at_advantage_one():
    """select: positive with every advantage > 0 keeps all images at weight 1: the plain flow-matching loss, AWM's
    with A = 1 on the same draws (and the same KL)."""
    adapter, traj = _setup()
    ones = torch.ones(4)
    sft, _ = term_loss(SFT(config("sft", "grpo.sft.select=positive", "grpo.kl.beta=0.5")), adapter, traj, ones + 1)
    awm, _ = term_loss(AWM(config("awm", "grpo.kl.beta=0.5")), adapter, traj, ones)
    torch.testing.assert_close(sft, awm, rtol=1e-6, atol=0)


def test_a_step_lowers_the_kept_images_error():
    before, after = toy_step(lambda e: (kept_weights(torch.tensor([1.0, -1.0]), None, "positive") * e).sum(), [1, 1])
    assert after[0] < before[0] and after[1] == before[1]
    adapter, traj = _setup()
    one, params = traj.select([1]), trainable(adapter)
    grads = torch.autograd.grad(term_loss(SFT(config("sft", *draws("sft"))), adapter, one, torch.ones(1), 3)[0], params)
    sigma, noise = shared_draws(one.final_latents, [0], seed=3)
    d_before = errors(adapter, one, sigma, noise)[0]
    with torch.no_grad():
        for p, grad in zip(params, grads, strict=True):
            p -= 0.5 * grad
    assert errors(adapter, one, sigma, noise)[0] < d_before - 1e-5


def test_only_top_k_needs_whole_groups():
    assert SFT.needs_whole_groups(config("sft"))
    assert not SFT.needs_whole_groups(config("sft", "grpo.sft.select=positive"))
    config("sft", "grpo.sft.select=positive", "train.batch_size=2")  # micro-batches of any size


@pytest.mark.parametrize(
    "override, key",
    [
        ("sampler.last_step=sde", "sampler.last_step"),  # the ODE rollout has no SDE step
        ("grpo.sft.select=best", "grpo.sft.select"),
        ("grpo.sft.top_k=4", "grpo.sft.top_k"),  # the whole group of 4
        ("grpo.sft.top_k=0", "grpo.sft.top_k"),
        ("grpo.drop_zero_advantage=true", "grpo.drop_zero_advantage"),
        ("train.batch_size=2", "train.batch_size"),
    ],
)
def test_sft_config_mistakes_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config("sft", override)


def test_two_epochs_of_the_shapes_preset(tmp_path):
    rows = train_shapes("shapes_sft", tmp_path)
    # 4 groups of 8 per epoch, each group's best trained, in micro-batches of 2 groups: 2 optimizer steps per epoch.
    assert [r["global_step"] for r in rows] == [2, 4] and all(r["train/trained_samples"] == 4 for r in rows)
    assert all(math.isfinite(r["train/loss"]) for r in rows)
