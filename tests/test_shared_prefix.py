"""Shared-prefix rollouts (issue 13): with same_initial_noise the ODE steps before the window run once per group of
the rollout batch and fan out at the window; the result is the per-image rollout's, with fewer network rows.

Tolerance: sharing changes only the batch size of the prefix's forwards (U unique rows instead of B). In float32 a
CPU kernel may split a differently sized batch differently and so round differently (reassociation: ~1e-7 relative
per operation). Through the remaining steps of a random-weight network these grow: measured up to 1.1e-6 absolute on
the FLUX latents with two threads (4.8e-7 with one), so the bound is rtol 1e-5 / atol 1e-5 (about 100 float32 ulps
at the latents' unit scale), far below what a wrong row, step or noise would change. Where the forwards
see the same rows (every group has one image in the batch) the result is asserted bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_helper import forward_rows

from flowgrpo.adapters import make_adapter
from flowgrpo.config import ConfigError, PostWindowConfig, SamplerConfig, load_config, validate
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline

SIZE = 32
STEPS = 6  # T; windows lie within steps 0..T-2
GUIDANCE = {"sd3": 4.5, "flux": 3.5}  # SD3 with CFG (two rows per image in a forward), FLUX's guidance embedding
# Groups of 3, 2 and 1 images in one rollout batch, not sorted by id: U = 3 unique rows for B = 6.
PROMPTS = ["a red cube", "a blue ball", "a red cube", "a green cone", "a blue ball", "a red cube"]
GROUPS = [7, 2, 7, 5, 2, 7]
STORED = (
    "latents",
    "next_latents",
    "log_probs",
    "stds",
    "sigmas",
    "sigmas_next",
    "step_indices",
    "final_latents",
    "images",
)
WINDOWS = {  # k = window.start
    "k0": range(0, 2),
    "k1": range(1, 3),
    "k_half": range(STEPS // 2, STEPS // 2 + 2),
    "end": range(STEPS - 2, STEPS - 1),  # the last trainable step: every step before it is prefix
}
RTOL, ATOL = 1e-5, 1e-5


@pytest.fixture(scope="module", params=["sd3", "flux"])
def adapter(request):
    return make_adapter(build_tiny_pipeline(request.param, seed=0))


def _sampler(adapter, **kwargs) -> SamplerConfig:
    base = {
        "noise_level": 0.7,
        "num_steps": STEPS,
        "guidance_scale": GUIDANCE[adapter.family],
        "same_initial_noise": True,
    }
    return SamplerConfig(**{**base, **kwargs})


def _run(adapter, sampler, window, prompts=PROMPTS, groups=GROUPS, seed=1, **kwargs):
    with forward_rows(adapter) as rows:
        traj = rollout(
            adapter,
            prompts,
            groups,
            sampler,
            window,
            torch.Generator().manual_seed(seed),
            height=SIZE,
            width=SIZE,
            **kwargs,
        )
    return traj, rows


def _assert_same(got, expected, exact: bool):
    for name in STORED:
        a, b = getattr(got, name), getattr(expected, name)
        if exact:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
def test_shared_prefix_equals_per_image_rollout_with_fewer_rows(adapter, window):
    sampler = _sampler(adapter)
    shared, rows = _run(adapter, sampler, window)
    alone, rows_alone = _run(adapter, replace(sampler, shared_prefix=False), window)
    k, b, u = window.start, len(PROMPTS), len(set(GROUPS))
    cfg = 2 if adapter.needs_negative(sampler.guidance_scale) else 1
    # Per batch: k forwards over the U unique rows, then T - k over the B rows; unshared: T over B.
    assert rows == [cfg * u] * k + [cfg * b] * (STEPS - k)
    assert rows_alone == [cfg * b] * STEPS
    assert sum(rows) == cfg * (k * u + (STEPS - k) * b)
    # k = 0: nothing to share, the same code path, bit for bit.
    _assert_same(shared, alone, exact=k == 0)
    # Every image of a group got the same prefix: identical latents entering the window.
    first = shared.latents[:, 0]
    for g in set(GROUPS):
        members = [i for i, x in enumerate(GROUPS) if x == g]
        assert all(torch.equal(first[i], first[members[0]]) for i in members)


@pytest.mark.parametrize("window", [WINDOWS["k1"], WINDOWS["end"]], ids=["k1", "end"])
def test_one_image_per_group_is_bit_for_bit(adapter, window):
    """U = B (ids unsorted): the prefix's forwards see the same rows in the same order, so the result is exact."""
    prompts, groups = ["a red cube", "a blue ball", "a green cone"], [9, 3, 6]
    sampler = _sampler(adapter)
    shared, rows = _run(adapter, sampler, window, prompts, groups)
    alone, rows_alone = _run(adapter, replace(sampler, shared_prefix=False), window, prompts, groups)
    assert rows == rows_alone
    _assert_same(shared, alone, exact=True)


def test_on_policy_ratio_is_exactly_one(adapter):
    """The stored log-probs come from the window on the full batch: re-scoring gives them back bit for bit."""
    sampler = _sampler(adapter)
    traj, _ = _run(adapter, sampler, WINDOWS["k_half"])
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])
    step = torch.tensor([0, 1, 1, 0, 1, 0])  # per-sample (shuffled) positions too
    with torch.no_grad():
        again = evaluate_transitions(adapter, traj, step, sampler)
    assert torch.equal(again.log_prob, traj.log_probs[torch.arange(len(traj)), step])


def test_off_without_same_initial_noise_or_when_disabled(adapter):
    window, b = WINDOWS["k_half"], len(PROMPTS)
    cfg = 2 if adapter.needs_negative(GUIDANCE[adapter.family]) else 1
    for sampler in (_sampler(adapter, same_initial_noise=False), _sampler(adapter, shared_prefix=False)):
        _, rows = _run(adapter, sampler, window)
        assert rows == [cfg * b] * STEPS


def test_rows_are_checked_on_the_noise_not_the_group_ids(adapter, monkeypatch):
    sampler, window = _sampler(adapter), WINDOWS["k1"]
    b, u = len(PROMPTS), len(set(GROUPS))
    cfg = 2 if adapter.needs_negative(sampler.guidance_scale) else 1
    shape = (b, *adapter.latent_shape(SIZE, SIZE))
    # Caller's latents that differ within a group: no sharing, and exactly the per-image rollout.
    distinct = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    got, rows = _run(adapter, sampler, window, initial_latents=distinct)
    alone, _ = _run(adapter, replace(sampler, shared_prefix=False), window, initial_latents=distinct)
    assert rows == [cfg * b] * STEPS
    _assert_same(got, alone, exact=True)
    # Caller's latents identical within each group: shared.
    same = distinct[[0, 1, 0, 3, 1, 0]]
    got, rows = _run(adapter, sampler, window, initial_latents=same)
    alone, _ = _run(adapter, replace(sampler, shared_prefix=False), window, initial_latents=same)
    assert rows == [cfg * u] + [cfg * b] * (STEPS - 1)
    _assert_same(got, alone, exact=False)
    # A group id with two prompts: one prefix per (group, prompt).
    prompts = ["a red cube", "a blue ball", "a red cube", "a green cone", "a blue ball", "a blue ball"]
    _, rows = _run(adapter, sampler, window, prompts=prompts)
    assert rows[0] == cfg * 4
    # Noise drawn here that differs within a group would be a bug: refused rather than silently shared.
    real = adapter.initial_noise
    monkeypatch.setattr(
        adapter, "initial_noise", lambda n, h, w, **kw: real(n, h, w, **{**kw, "same_within_group": False})
    )
    with pytest.raises(RuntimeError, match="different noise"):
        _run(adapter, sampler, window)


def test_recipe_options_share_the_prefix_too(adapter):
    """MixGRPO-Flash's tail (DPM-Solver++(2M) with the history carried from before the window, static time shift
    with integer timesteps) and Flow-GRPO's SDE last step."""
    window = WINDOWS["k_half"]
    flash = _sampler(
        adapter, time_shift=3.0, post_window=PostWindowConfig(solver="dpmpp_2m", ratio=0.5, carry_history=True)
    )
    for sampler in (flash, _sampler(adapter, last_step="sde")):
        shared, rows = _run(adapter, sampler, window)
        alone, rows_alone = _run(adapter, replace(sampler, shared_prefix=False), window)
        assert sum(rows) < sum(rows_alone)
        _assert_same(shared, alone, exact=False)


def test_config_field():
    assert SamplerConfig().shared_prefix is True
    assert load_config("configs/shapes.yaml", ["sampler.shared_prefix=false"]).sampler.shared_prefix is False
    with pytest.raises(ConfigError, match="shared_prefix"):
        load_config("configs/shapes.yaml", ["sampler.shared_prefix=maybe"])
    config = load_config("configs/shapes.yaml")
    config.sampler.shared_prefix = "no"  # built in code: validate catches it
    with pytest.raises(ConfigError, match="shared_prefix"):
        validate(config)
