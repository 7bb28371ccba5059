"""Sliding windows, the higher-order tail solver, schedule compression, and pipeline-exact schedules."""

from __future__ import annotations

import math

import pytest
import torch
from gaussian_data import gaussian_velocity, uniform_sigmas

from samplers import SlidingWindow, compress_schedule, dpmpp_2m_step, integrate_ode, pipeline_schedule

M, TAU = 0.5, 0.3


def velocity(x, t):
    return gaussian_velocity(x, t, M, TAU)


# ---------------------------------------------------------------- windows
def test_size_zero_trains_every_step_but_the_last():
    window = SlidingWindow(10, 0)
    assert all(window.steps(i) == range(0, 9) for i in (0, 7, 1000))


def test_progressive_moves_by_stride_every_interval_and_shrinks_at_the_end():
    window = SlidingWindow(10, 4, strategy="progressive", shift_interval=3, stride=2)
    assert window.steps(0) == window.steps(2) == range(0, 4)
    assert window.steps(3) == range(2, 6)
    assert window.steps(9) == range(6, 9)  # start 6: shrinks to 3 steps (last index 8 = num_steps - 2)
    assert window.steps(12) == range(8, 9)  # last position: one step
    assert window.steps(10_000) == range(8, 9)  # no roll-back: stays at the end
    for i in range(200):
        steps = window.steps(i)
        assert len(steps) >= 1 and steps.stop <= 9


def test_progressive_roll_back_cycles_to_the_start():
    window = SlidingWindow(10, 4, strategy="progressive", shift_interval=3, stride=2, roll_back=True)
    cycle = 3 * 5  # five starts: 0, 2, 4, 6, 8
    assert window.steps(cycle - 1) == range(8, 9)
    assert window.steps(cycle) == range(0, 4)
    assert [window.start(i) for i in range(cycle)] == [window.start(i + 7 * cycle) for i in range(cycle)]


def test_mixgrpo_defaults():
    window = SlidingWindow(25, 4, shift_interval=25)
    assert window.steps(0) == range(0, 4) and window.steps(24) == range(0, 4) and window.steps(25) == range(1, 5)
    assert window.steps(25 * 20) == range(20, 24)
    assert window.steps(25 * 21) == range(21, 24)  # shrinks: the last step (24) is always ODE


def test_random_is_deterministic_uniform_and_within_bounds():
    window = SlidingWindow(10, 3, strategy="random", seed=4)
    starts = [window.start(i) for i in range(3000)]
    assert starts == [SlidingWindow(10, 3, strategy="random", seed=4).start(i) for i in range(3000)]
    assert starts != [SlidingWindow(10, 3, strategy="random", seed=5).start(i) for i in range(3000)]
    assert set(starts) == set(range(0, 7))  # [0, num_steps - 1 - size]
    counts = torch.bincount(torch.tensor(starts), minlength=7).float()
    assert (counts / counts.sum() - 1 / 7).abs().max() < 0.03
    assert all(len(window.steps(i)) == 3 and window.steps(i).stop <= 9 for i in range(100))
    fast = SlidingWindow(10, 2, strategy="random", max_start=4)  # Flow-GRPO-Fast: first half
    assert max(fast.start(i) for i in range(500)) == 4


@pytest.mark.parametrize("strategy", ["decay", "exp_decay"])
def test_decay_strategies_dwell_less_as_the_window_moves(strategy):
    window = SlidingWindow(25, 4, strategy=strategy, shift_interval=25, decay_rate=0.1, decay_threshold=2)
    dwell = {}
    for i in range(2000):
        dwell[window.start(i)] = dwell.get(window.start(i), 0) + 1
    assert dwell[0] == dwell[1] == dwell[2] == 25  # below the threshold: full interval
    expected_5 = 25 * (1 - 0.1 * 3) if strategy == "decay" else 25 * math.exp(-0.1 * 3)
    assert dwell[5] == round(expected_5)
    assert all(dwell[s] >= dwell[s + 1] for s in range(22))
    assert min(dwell.values()) >= 1 and max(dwell) == 23


def test_window_config_errors():
    with pytest.raises(ValueError, match="exceeds"):
        SlidingWindow(10, 10)
    with pytest.raises(ValueError, match="strategy"):
        SlidingWindow(10, 2, strategy="zigzag")
    with pytest.raises(ValueError, match="max_start"):
        SlidingWindow(10, 2, strategy="random", max_start=8)


# ---------------------------------------------------------------- tail solver
def test_dpmpp_2m_matches_diffusers_dpm_solver_multistep():
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        algorithm_type="dpmsolver++",
        solver_order=2,
        flow_shift=3.0,
    )
    scheduler.set_timesteps(8)
    x1 = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    x = x1.clone()
    for i, timestep in enumerate(scheduler.timesteps):
        x = scheduler.step(velocity(x, scheduler.sigmas[i]), timestep, x).prev_sample
    ours = integrate_ode(velocity, x1.clone(), scheduler.sigmas.float(), solver="dpmpp_2m")
    torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_steps", [6, 10, 20])
def test_dpmpp_2m_beats_euler_at_equal_network_calls(num_steps):
    x1 = torch.randn(4000, 4, generator=torch.Generator().manual_seed(0))
    exact = M + TAU * x1  # the Gaussian probability-flow map from t = 1 to t = 0
    sigmas = uniform_sigmas(num_steps)
    calls = {"euler": 0, "dpmpp_2m": 0}

    def counted(solver):
        def fn(x, t):
            calls[solver] += 1
            return velocity(x, t)

        return fn

    errors = {s: (integrate_ode(counted(s), x1.clone(), sigmas, s) - exact).abs().mean().item() for s in calls}
    assert calls["euler"] == calls["dpmpp_2m"] == num_steps
    assert errors["dpmpp_2m"] < 0.75 * errors["euler"], errors


def test_dpmpp_2m_first_step_is_first_order_and_last_step_returns_x0():
    x = torch.randn(2, 4)
    v = velocity(x, 0.6)
    x_next, x0 = dpmpp_2m_step(v, x, 0.6, 0.0)
    torch.testing.assert_close(x_next, x - 0.6 * v)
    # First order = DDIM with the flow's coefficients.
    x_next, x0 = dpmpp_2m_step(v, x, 0.6, 0.4)
    eps_hat = x + 0.4 * v
    torch.testing.assert_close(x_next, 0.6 * x0 + 0.4 * eps_hat, rtol=1e-5, atol=1e-6)


def test_compress_schedule_keeps_the_head_and_thins_the_tail():
    sigmas = uniform_sigmas(25)
    compressed = compress_schedule(sigmas, after=8, ratio=0.4)
    n_post = max(int((25 - 8) * 0.4), 1)
    assert len(compressed) == 8 + n_post + 1
    assert torch.equal(compressed[:9], sigmas[:9])
    assert compressed[-1] == 0 and bool((compressed[1:] < compressed[:-1]).all())
    assert set(compressed.tolist()) <= set(sigmas.tolist())
    assert torch.equal(compress_schedule(sigmas, after=24, ratio=0.4), sigmas)  # one tail step: nothing to thin
    assert torch.equal(compress_schedule(sigmas, after=8, ratio=1.0), sigmas)


# ---------------------------------------------------------------- schedules
def test_sd3_schedule_matches_the_scheduler_with_static_shift():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sigmas, timesteps = pipeline_schedule(scheduler, 10, family="sd3")

    # diffusers: evenly spaced between the (shifted) training sigmas' ends, then σ' = sσ / (1 + (s - 1)σ)
    def shift(s):
        return 3 * s / (1 + 2 * s)

    raw = torch.linspace(1.0, shift(1 / 1000), 10).double()
    expected = shift(raw)
    torch.testing.assert_close(sigmas[:-1].double(), expected, rtol=1e-6, atol=1e-6)
    assert sigmas[-1] == 0 and len(timesteps) == 10
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000)
    assert scheduler.timesteps is None or len(scheduler.timesteps) != 10  # caller's scheduler untouched


def test_flux_schedule_uses_the_dynamic_shift_of_the_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    seq_len = 4096  # 1024x1024 FLUX
    sigmas, _ = pipeline_schedule(scheduler, 6, family="flux", image_seq_len=seq_len)
    mu = calculate_shift(seq_len, 256, 4096, 0.5, 1.15)
    raw = torch.linspace(1.0, 1 / 6, 6).double()
    expected = math.exp(mu) / (math.exp(mu) + (1 / raw - 1))
    torch.testing.assert_close(sigmas[:-1].double(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="image_seq_len"):
        pipeline_schedule(scheduler, 6, family="flux")
