"""``sampler.antithetic``: mirrored window noise. A group's rows of a rollout batch pair up in batch order and a
pair's second takes minus its first's noise at every window step. Each row is still sampled from the step's own
Gaussian (its log-prob exact, the on-policy ratio 1), every pair's first is sampled bit for bit as without pairs,
and with the same initial noise a pair's first steps are mirror images about one mean."""

from __future__ import annotations

import pytest
import rollout_helper as helper
import torch

from flowgrpo.config import ConfigError, load_config, validate
from flowgrpo.data import epoch_plan
from flowgrpo.rollout import antithetic_partners, evaluate_transitions, rollout
from flowgrpo.rollouts import get_rollout

PROMPTS = ["a red circle"] * 4 + ["two blue squares"] * 4
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]
WINDOW = range(1, 4)
MAIN_JOB = ["sampler.antithetic=true", "sampler.same_initial_noise=true", "sampler.batch_size=4"]


def test_pairs_form_within_each_group_in_batch_order_and_an_odd_last_row_stays_alone():
    mirror = antithetic_partners(torch.tensor([0, 0, 1, 0, 1, 2, 0, 1]))
    # group 0: rows 0-1 and 3-6; group 1: rows 2-4, row 7 alone; group 2: row 5 alone
    assert mirror.tolist() == [-1, 0, -1, -1, 2, -1, 3, -1]
    assert antithetic_partners(torch.tensor([5])).tolist() == [-1]


def _rollout(adapter, antithetic: bool, seed: int = 7, kind: str = "euler_maruyama"):
    sampler = helper.sampler(antithetic=antithetic, kind=kind)
    generator = torch.Generator().manual_seed(seed)
    size = {"height": helper.SIZE, "width": helper.SIZE}
    return rollout(adapter, PROMPTS, GROUPS, sampler, WINDOW, generator, decode=False, store_means=True, **size)


@pytest.mark.parametrize("kind", ["euler_maruyama", "cps", "langevin"])
def test_mirrored_rollout_samples_each_pairs_first_as_without_pairs_and_its_second_with_minus_its_noise(kind):
    adapter = helper.adapter()
    plain, mirrored = _rollout(adapter, False, kind=kind), _rollout(adapter, True, kind=kind)
    firsts, seconds = [0, 2, 4, 6], [1, 3, 5, 7]
    for field in helper.STORED + ("means",):
        got, want = getattr(mirrored, field)[firsts], getattr(plain, field)[firsts]
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=field)
    assert not torch.allclose(mirrored.final_latents[seconds], plain.final_latents[seconds], atol=1e-3)
    # z of every window step, from the stored transition: x' = mean + std · z
    std = mirrored.stds.view(len(PROMPTS), len(WINDOW), *[1] * (mirrored.latents.ndim - 2))
    z = (mirrored.next_latents.float() - mirrored.means) / std
    torch.testing.assert_close(z[seconds], -z[firsts], rtol=1e-4, atol=1e-4)
    # same initial noise, no SDE before the window: a pair's first step starts from one latent, one mean
    torch.testing.assert_close(mirrored.latents[seconds, 0], mirrored.latents[firsts, 0], rtol=0, atol=0)
    centre = mirrored.means[firsts, 0]
    torch.testing.assert_close(mirrored.next_latents[seconds, 0] - centre, centre - mirrored.next_latents[firsts, 0])
    torch.testing.assert_close(mirrored.log_probs[seconds, 0], mirrored.log_probs[firsts, 0])  # |z| alike
    assert not torch.allclose(z[seconds, 1:], z[firsts, 1:] * 0)  # later steps are drawn, not zero


def test_mirrored_transitions_keep_exact_log_probs_and_an_on_policy_ratio_of_one():
    adapter = helper.adapter()
    mirrored = _rollout(adapter, True)
    sampler = helper.sampler(antithetic=True)
    for position in range(len(WINDOW)):
        again = evaluate_transitions(adapter, mirrored, position, sampler)
        assert helper.rescored_equal(again.log_prob, mirrored.log_probs[:, position])
        ratio = torch.exp(again.log_prob - mirrored.log_probs[:, position])
        torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=helper.ON_POLICY_RATIO_TOL)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["sampler.noise_level=0", "grpo.objective=nft"], "sampler.noise_level=0 samples the ODE"),
        (["sampler.rollout=branch", "sampler.same_initial_noise=true"], "sampler.rollout=branch draws its own"),
        (["sampler.antithetic=2"], "sampler.antithetic: expected true or false"),
        (["grpo.group_size=3", "grpo.groups_per_epoch=8", "train.batch_size=4"], "grpo.group_size=3 is odd"),
        (["sampler.batch_size=3", "grpo.groups_per_epoch=3", "train.batch_size=4"], "sampler.batch_size=3 is odd"),
    ],
)
def test_antithetic_refuses_settings_where_there_is_no_window_noise_to_mirror(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(helper.TINY, ["sampler.antithetic=true", *overrides])
    config = load_config(helper.TINY)
    config.sampler.antithetic = 1  # built in code: past the loader's type check
    with pytest.raises(ConfigError, match="sampler.antithetic must be true or false"):
        validate(config)


def test_the_epoch_plan_moves_a_groups_copies_two_by_two_keeping_the_prompts():
    plain = epoch_plan(10, 4, 6, seed=3, epoch=2)
    paired = epoch_plan(10, 4, 6, seed=3, epoch=2, pairs=True)
    assert sorted(plain, key=lambda s: s.group_id) == sorted(paired, key=lambda s: s.group_id)
    assert all(paired[i] == paired[i + 1] for i in range(0, len(paired), 2))
    assert paired != plain and paired != epoch_plan(10, 4, 6, seed=3, epoch=3, pairs=True)
    with pytest.raises(ValueError, match="even group_size"):
        epoch_plan(10, 3, 6, seed=3, epoch=2, pairs=True)


def _mirrored_noise(trajectory) -> tuple[torch.Tensor, torch.Tensor]:
    """Each window step's ``z`` of every pair's first and second rows, batch by batch (``x' = mean + std · z``)."""
    std = trajectory.stds.view(*trajectory.stds.shape, *[1] * (trajectory.latents.ndim - 2))
    z = (trajectory.next_latents.float() - trajectory.means) / std
    mirror = antithetic_partners(trajectory.group_ids)  # pairs are within batches: ids are unique per epoch
    seconds = (mirror >= 0).nonzero().flatten()
    return z[mirror[seconds]], z[seconds]


@pytest.mark.parametrize("rollout_kind", ["chain", "dense"])
@pytest.mark.parametrize("processes", [1, 2])
def test_the_rollout_strategies_sample_every_image_in_a_mirrored_pair(processes, rollout_kind):
    # guard keeps each transition's sampling mean, so the noise of every stored step can be read back
    overrides = [*MAIN_JOB, f"sampler.rollout={rollout_kind}", "grpo.objective=guard", "grpo.clip_range=0.2"]
    config = load_config(helper.TINY, ["run.progress=false", *overrides])
    adapter = helper.adapter()
    for rank in range(processes):
        score = lambda images, *_: {"total": images.float().mean(dim=(1, 2, 3))}  # noqa: E731  (dense: stage rewards)
        context = helper.rollout_context(config, adapter, seed=3, rank=rank, processes=processes, score=score)
        trajectory = get_rollout(rollout_kind)(context).collect(0).trajectory
        for batch in trajectory.group_ids.split(config.sampler.batch_size):
            assert antithetic_partners(batch).tolist() == [-1, 0, -1, 2]  # two pairs in every batch of 4
        first, second = _mirrored_noise(trajectory)
        assert len(second) == len(trajectory) // 2 and first.abs().mean() > 0.5
        torch.testing.assert_close(second, -first, rtol=1e-4, atol=1e-4)


def test_the_clipped_loss_trains_an_epoch_on_mirrored_rollouts(tmp_path):
    _, row = helper.train(load_config(helper.TINY, helper.one_epoch(tmp_path, *MAIN_JOB)))
    assert abs(row["train/ratio_mean"] - 1) < 1e-3
