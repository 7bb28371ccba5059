"""The samplers' maths against independent truth: torch.distributions, closed forms, Gaussian data."""

from __future__ import annotations

import math

import pytest
import torch
from gaussian_data import gaussian_velocity, uniform_sigmas
from torch.distributions import Normal, kl_divergence

import samplers
from samplers import (
    MULTISTEP_SOLVERS,
    SDE_KINDS,
    SOLVERS,
    Transition,
    cps_step,
    euler_maruyama_step,
    flowgrpo_diffusion,
    gaussian_kl,
    gaussian_log_prob,
    integrate_ode,
    langevin_correction,
    langevin_step,
    ode_step,
    register_sde_step,
    register_solver,
    sde_step,
    solver_step,
    transition_kl,
)

M, TAU = 0.5, 0.3


def velocity(x, t):
    return gaussian_velocity(x, t, M, TAU)


# Every stochastic sampler, as a function (v, x, t, t_next, **kw) -> Transition.
SDE_STEPS = {
    "em_flowgrpo": lambda v, x, t, tn, **kw: euler_maruyama_step(v, x, t, tn, noise_level=0.7, t_second=0.9, **kw),
    "em_dance": lambda v, x, t, tn, **kw: euler_maruyama_step(v, x, t, tn, noise_level=0.3, diffusion="dance", **kw),
    "cps": lambda v, x, t, tn, **kw: cps_step(v, x, t, tn, noise_level=0.7, **kw),
    "lc_frozen": lambda v, x, t, tn, **kw: langevin_step(v, x, t, tn, noise_level=0.7, t_second=0.9, **kw),
    "lc_reeval": lambda v, x, t, tn, **kw: langevin_step(
        v, x, t, tn, noise_level=0.7, t_second=0.9, score_eval="reeval", velocity_fn=velocity, **kw
    ),
}
SHAPES = {"sd3_bchw": (3, 4, 8, 8), "flux_packed": (3, 16, 12)}


def _inputs(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    return velocity(x, 0.6).to(dtype), x.to(dtype)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("name", SDE_STEPS)
@pytest.mark.parametrize("per_sample_t", [False, True])
def test_log_prob_matches_torch_normal(name, shape, per_sample_t):
    v, x = _inputs(shape)
    t, t_next = (torch.tensor([0.6, 0.5, 0.8]), torch.tensor([0.5, 0.3, 0.7])) if per_sample_t else (0.6, 0.45)
    for reduce, reducer in [("mean", torch.mean), ("sum", torch.sum)]:
        tr = SDE_STEPS[name](v, x, t, t_next, generator=torch.Generator().manual_seed(1), reduce=reduce)
        assert tr.sample.shape == x.shape and tr.log_prob.shape == (shape[0],)
        per_element = Normal(tr.mean, tr.std.expand_as(tr.mean)).log_prob(tr.sample)
        expected = reducer(per_element.flatten(1), dim=1)
        torch.testing.assert_close(tr.log_prob, expected, rtol=1e-5, atol=1e-5)


def test_gaussian_kl_matches_closed_form():
    g = torch.Generator().manual_seed(0)
    mp, mq = torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 5, generator=g)
    std = torch.rand(4, 1, 1, generator=g) + 0.1
    expected = kl_divergence(Normal(mp, std.expand_as(mp)), Normal(mq, std.expand_as(mq)))
    torch.testing.assert_close(gaussian_kl(mp, mq, std), expected.mean(dim=(1, 2)))
    torch.testing.assert_close(gaussian_kl(mp, mq, std, reduce="sum"), expected.sum(dim=(1, 2)))


def test_flowgrpo_kl_convention_drops_the_sqrt_dt_factor():
    v, x = _inputs((2, 4, 4, 4))
    t, t_next = 0.6, 0.45
    policy = euler_maruyama_step(v, x, t, t_next, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    reference = euler_maruyama_step(v * 0.9, x, t, t_next, noise_level=0.7, prev_sample=policy.sample)
    exact = transition_kl(policy, reference.mean, "exact")
    flowgrpo = transition_kl(policy, reference.mean, "flowgrpo")
    torch.testing.assert_close(flowgrpo, exact * (t - t_next))
    # CPS never had the sqrt(Δ) factor: both conventions agree.
    policy = cps_step(v, x, t, t_next, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    reference = cps_step(v * 0.9, x, t, t_next, noise_level=0.7, prev_sample=policy.sample)
    torch.testing.assert_close(transition_kl(policy, reference.mean, "flowgrpo"), transition_kl(policy, reference.mean))
    with pytest.raises(ValueError, match="KL convention"):
        transition_kl(policy, reference.mean, "other")


def test_euler_maruyama_formula():
    v, x = _inputs((2, 3, 4))
    t, t_next = 0.7, 0.55
    tr = euler_maruyama_step(v, x, t, t_next, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    g = 0.7 * math.sqrt(t / (1 - t))
    dt = t_next - t
    score = -(x + (1 - t) * v) / t
    torch.testing.assert_close(tr.mean, x + dt * (v - g**2 / 2 * score))
    torch.testing.assert_close(tr.std, torch.tensor(g * math.sqrt(-dt)))


@pytest.mark.parametrize("name", ["em_flowgrpo", "em_dance", "lc_frozen", "lc_reeval"])
def test_noise_level_zero_is_exactly_the_ode_step(name):
    v, x = _inputs((2, 4, 8, 8))
    kw = {"diffusion": "dance"} if name == "em_dance" else {}
    if name.startswith("em"):
        tr = euler_maruyama_step(v, x, 0.6, 0.45, noise_level=0.0, t_second=0.9, **kw)
    else:
        score_eval = name.split("_")[1]
        tr = langevin_step(v, x, 0.6, 0.45, noise_level=0.0, score_eval=score_eval, velocity_fn=velocity)
    assert torch.equal(tr.sample, ode_step(v, x, 0.6, 0.45))


def test_cps_noise_level_zero_is_the_ode_step():
    v, x = _inputs((2, 4, 8, 8))
    tr = cps_step(v, x, 0.6, 0.45, noise_level=0.0)
    torch.testing.assert_close(tr.sample, ode_step(v, x, 0.6, 0.45), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", SDE_STEPS)
def test_single_step_empirical_moments_match_mean_and_std(name):
    n = 200_000
    v, x = _inputs((1, 8))
    v, x = v.expand(n, 8), x.expand(n, 8)
    tr = SDE_STEPS[name](v, x, 0.6, 0.45, generator=torch.Generator().manual_seed(3))
    residual = (tr.sample.float() - tr.mean) / tr.std
    assert residual.mean().abs() < 0.005
    assert (residual.std() - 1).abs() < 0.005
    empirical_std = tr.sample.float().std(dim=0)
    torch.testing.assert_close(empirical_std, tr.std.expand(8), rtol=0.01, atol=0)


def _rollout(step, num_steps, n=8000, tau=TAU):
    sigmas = uniform_sigmas(num_steps)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    for t, t_next in zip(sigmas[:-1], sigmas[1:], strict=True):
        v = gaussian_velocity(x, t, M, tau)
        x = step(v, x, t, t_next, t_second=sigmas[1], generator=g, tau=tau)
    return x


ROLLOUT_STEPS = {
    "em_flowgrpo": lambda v, x, t, tn, tau, **kw: euler_maruyama_step(v, x, t, tn, noise_level=0.7, **kw).sample,
    "em_dance": lambda v, x, t, tn, tau, **kw: (
        euler_maruyama_step(v, x, t, tn, noise_level=0.3, diffusion="dance", **kw).sample
    ),
    "lc_frozen": lambda v, x, t, tn, tau, **kw: langevin_step(v, x, t, tn, noise_level=0.7, **kw).sample,
    "lc_reeval": lambda v, x, t, tn, tau, **kw: (
        langevin_step(
            v,
            x,
            t,
            tn,
            noise_level=0.7,
            score_eval="reeval",
            velocity_fn=lambda y, s: gaussian_velocity(y, s, M, tau),
            **kw,
        ).sample
    ),
}


@pytest.mark.parametrize("name", ROLLOUT_STEPS)
def test_full_rollout_reaches_the_data_distribution(name):
    x = _rollout(ROLLOUT_STEPS[name], num_steps=400)
    # Monte-Carlo error of the std over 32k draws is ~0.0012; discretisation bias at 400 steps is smaller.
    assert abs(x.mean().item() - M) < 0.01
    assert abs(x.std().item() - TAU) < 0.006, x.std().item()


def test_cps_is_exact_for_point_mass_data_but_not_for_spread_data():
    def cps(v, x, t, tn, tau, **kw):
        kw.pop("t_second")
        return cps_step(v, x, t, tn, noise_level=0.7, **kw).sample

    point = _rollout(cps, num_steps=50, tau=0.0)
    assert (point - M).abs().max() < 1e-4
    spread = _rollout(cps, num_steps=400)
    assert abs(spread.std().item() - 0.25) < 0.01  # shrinks: not marginal-preserving for τ = 0.3


def test_langevin_with_score_at_x_t_is_euler_maruyama():
    v, x = _inputs((2, 4, 8, 8))
    t, t_next, a = 0.6, 0.45, 0.7
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    em = euler_maruyama_step(v, x, t, t_next, noise_level=a, noise=noise)
    step_std = flowgrpo_diffusion(torch.tensor(t), a) * math.sqrt(t - t_next)
    score_at_x_t = -(x + (1 - t) * v) / t
    lc = langevin_correction(x, x + (t_next - t) * v, score_at_x_t, step_std, step_std, noise=noise)
    torch.testing.assert_close(lc.mean, em.mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lc.sample, em.sample, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lc.log_prob, em.log_prob, rtol=1e-5, atol=1e-5)


def test_langevin_frozen_closed_form_and_kappa_cap():
    v, x = _inputs((2, 4, 4))
    t, t_next = 0.3, 0.2
    tr = langevin_step(v, x, t, t_next, noise_level=0.9, kappa=0.5, generator=torch.Generator().manual_seed(0))
    sigma = min(0.9 * math.sqrt(t / (1 - t)) * math.sqrt(t - t_next), 0.5 * t_next)
    assert sigma == 0.5 * t_next  # the cap is active here
    delta = sigma**2 / 2
    x0_hat, eps_hat = x - t * v, x + (1 - t) * v
    expected_mean = (1 - t_next) * x0_hat + (t_next - delta / t_next) * eps_hat
    torch.testing.assert_close(tr.mean, expected_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tr.std, torch.tensor(math.sqrt(2 * delta)))


def test_langevin_reeval_calls_the_network_once_more_with_gradients_through_both():
    v_param = torch.nn.Parameter(torch.tensor(1.0))
    calls = []

    def velocity_fn(y, s):
        calls.append(float(s))
        return v_param * velocity(y, s)

    x = torch.randn(2, 4, 4)
    v = velocity_fn(x, 0.6)
    tr = langevin_step(v, x, 0.6, 0.45, noise_level=0.7, score_eval="reeval", velocity_fn=velocity_fn)
    assert calls == [0.6, 0.45]
    tr.mean.sum().backward()
    assert v_param.grad is not None and torch.isfinite(v_param.grad)
    # Gradient through the second call only would differ: check against finite differences of the mean.
    eps = 1e-3
    with torch.no_grad():
        means = []
        for delta in (eps, -eps):
            v_param.data = torch.tensor(1.0 + delta)
            tr2 = langevin_step(
                velocity_fn(x, 0.6),
                x,
                0.6,
                0.45,
                noise_level=0.7,
                score_eval="reeval",
                velocity_fn=velocity_fn,
                prev_sample=tr.sample,
            )
            means.append(tr2.mean.sum())
    torch.testing.assert_close(v_param.grad, (means[0] - means[1]) / (2 * eps), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("name", SDE_STEPS)
def test_gradients_flow_to_velocity_and_not_through_std(name):
    _, x = _inputs((2, 4, 4, 4))
    v = velocity(x, 0.6).requires_grad_(True)
    tr = SDE_STEPS[name](v, x, 0.6, 0.45, generator=torch.Generator().manual_seed(0))
    assert not tr.std.requires_grad and not tr.sample.requires_grad
    tr.log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


@pytest.mark.parametrize("name", SDE_STEPS)
def test_prev_sample_rescoring_and_reproducible_draws(name):
    v, x = _inputs((2, 4, 4, 4))
    step = SDE_STEPS[name]
    first = step(v, x, 0.6, 0.45, generator=torch.Generator().manual_seed(7))
    again = step(v, x, 0.6, 0.45, generator=torch.Generator().manual_seed(7))
    assert torch.equal(first.sample, again.sample)
    rescored = step(v, x, 0.6, 0.45, prev_sample=first.sample)
    assert torch.equal(rescored.log_prob, first.log_prob)  # PPO ratio exactly 1
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    given = step(v, x, 0.6, 0.45, noise=noise)
    torch.testing.assert_close(given.sample, given.mean + given.std * noise)


@pytest.mark.parametrize("name", SDE_STEPS)
def test_bf16_input_is_finite_and_float32_accurate(name):
    v, x = _inputs((2, 4, 8, 8), dtype=torch.bfloat16)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    low = SDE_STEPS[name](v, x, 0.6, 0.45, noise=noise)
    full = SDE_STEPS[name](v.float(), x.float(), 0.6, 0.45, noise=noise)
    assert low.sample.dtype == torch.bfloat16
    assert low.mean.dtype == torch.float32 and low.log_prob.dtype == torch.float32
    assert torch.isfinite(low.log_prob).all()
    if name != "lc_reeval":  # reeval's second network call sees a bf16-rounded x'
        torch.testing.assert_close(low.mean, full.mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(low.sample.float(), full.sample, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", SDE_STEPS)
def test_first_and_last_steps_are_finite(name):
    v, x = _inputs((2, 4, 4, 4))
    first = SDE_STEPS[name](v, x, 1.0, 0.9, generator=torch.Generator().manual_seed(0))
    last = SDE_STEPS[name](v, x, 0.1, 0.0, generator=torch.Generator().manual_seed(0))
    for tr in (first, last):
        assert torch.isfinite(tr.sample).all() and torch.isfinite(tr.log_prob).all() and torch.isfinite(tr.mean).all()
    if name.startswith(("cps", "lc")):  # deterministic last step (std = 0): the sample is the mean
        assert torch.equal(last.sample, last.mean) and torch.equal(last.log_prob, torch.zeros(2))


def test_flowgrpo_guard_at_t_equal_one():
    g = flowgrpo_diffusion(torch.tensor([1.0, 0.5]), 0.7, t_second=torch.tensor([0.9, 0.9]))
    torch.testing.assert_close(g, torch.tensor([0.7 * math.sqrt(1 / 0.1), 0.7]))
    v, x = _inputs((2, 4))
    with pytest.raises(ValueError, match="t_second"):
        euler_maruyama_step(v, x, 1.0, 0.9, noise_level=0.7)


def test_bad_inputs_raise_clear_errors():
    v, x = _inputs((2, 4, 4))
    with pytest.raises(ValueError, match="t_next < t"):
        euler_maruyama_step(v, x, 0.5, 0.5, noise_level=0.7)
    with pytest.raises(ValueError, match="t_next < t"):
        ode_step(v, x, torch.tensor([0.5, 0.4]), torch.tensor([0.4, 0.6]))
    with pytest.raises(ValueError, match="noise_level"):
        cps_step(v, x, 0.5, 0.4, noise_level=-0.1)
    with pytest.raises(ValueError, match="shape"):
        euler_maruyama_step(v[:, :2], x, 0.5, 0.4, noise_level=0.7)
    with pytest.raises(ValueError, match="velocity_fn"):
        langevin_step(v, x, 0.5, 0.4, noise_level=0.7, score_eval="reeval")
    with pytest.raises(ValueError, match="diffusion"):
        euler_maruyama_step(v, x, 0.5, 0.4, noise_level=0.7, diffusion="ddpm")
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        ode_step(v, x, torch.tensor([0.5, 0.5, 0.5]), 0.4)
    with pytest.raises(ValueError, match="reduce"):
        gaussian_log_prob(x, x, 1.0, reduce="max")


# ------------------------------------------------------------------ registries: a new kind is one registered function
def noisy_euler_step(v, x, t, t_next, *, noise_level, noise=None, generator=None, prev_sample=None, reduce="mean"):
    """A step kind written in a test file: the Euler step plus Brownian noise, ``x + dt · v + a · sqrt(Δ) · z``.
    Times are floats or per-sample ``[B]`` tensors (re-scoring a batch passes each sample's)."""
    t, t_next = (torch.as_tensor(s, dtype=torch.float32).reshape(-1, *[1] * (x.ndim - 1)) for s in (t, t_next))
    mean = x.float() + (t_next - t) * v.float()
    std = noise_level * torch.sqrt(t - t_next)
    if prev_sample is None:
        z = noise if noise is not None else torch.randn(x.shape, generator=generator)
        prev_sample = mean + std * z
    sample = prev_sample.to(x.dtype)
    return Transition(sample, mean, std, gaussian_log_prob(sample, mean, std, reduce), std)


def test_a_step_kind_registered_in_a_test_file_is_dispatched_by_sde_step():
    v, x = _inputs((3, 4, 4))
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    register_sde_step("test_noisy_euler")(noisy_euler_step)
    try:
        assert "test_noisy_euler" in SDE_KINDS  # a live view: config validation accepts it while registered
        # Options it does not take (diffusion, kappa, velocity_fn...) are not passed to it.
        got = sde_step(
            "test_noisy_euler",
            v,
            x,
            0.6,
            0.4,
            noise_level=0.5,
            noise=z,
            diffusion="dance",
            kappa=0.1,
            t_second=0.9,
            velocity_fn=velocity,
            reduce="sum",
        )
        direct = noisy_euler_step(v, x, 0.6, 0.4, noise_level=0.5, noise=z, reduce="sum")
        assert torch.equal(got.sample, direct.sample) and torch.equal(got.log_prob, direct.log_prob)
        again = sde_step("test_noisy_euler", v, x, 0.6, 0.4, noise_level=0.5, prev_sample=got.sample, reduce="sum")
        assert torch.equal(again.log_prob, got.log_prob)
        torch.testing.assert_close(got.log_prob, Normal(got.mean, got.std).log_prob(got.sample).sum(dim=(1, 2)))
        with pytest.raises(ValueError, match="convention for the cps step only"):  # it takes no log_prob
            sde_step("test_noisy_euler", v, x, 0.6, 0.4, noise_level=0.5, log_prob="squared_error")
        with pytest.raises(ValueError, match="already registered"):
            register_sde_step("test_noisy_euler")(lambda *a, **k: None)
    finally:
        del samplers.SDE_STEPS["test_noisy_euler"]
    assert "test_noisy_euler" not in SDE_KINDS
    with pytest.raises(ValueError, match="test_noisy_euler"):
        sde_step("test_noisy_euler", v, x, 0.6, 0.4, noise_level=0.5)


def test_an_unknown_step_kind_is_refused_with_the_registered_names():
    v, x = _inputs((2, 4))
    with pytest.raises(ValueError, match="got 'ddim'") as error:
        sde_step("ddim", v, x, 0.6, 0.4, noise_level=0.7)
    assert all(name in str(error.value) for name in ("euler_maruyama", "cps", "langevin"))
    assert list(SDE_KINDS) == ["euler_maruyama", "cps", "langevin"]  # registration order: the config's message


def test_a_step_without_the_draw_keywords_is_refused_at_registration():
    def no_prev_sample(v, x, t, t_next, *, noise_level, noise=None, generator=None, reduce="mean"):
        return None

    with pytest.raises(TypeError, match="prev_sample"):
        register_sde_step("test_incomplete")(no_prev_sample)
    assert "test_incomplete" not in SDE_KINDS


def test_a_solver_registered_in_a_test_file_is_dispatched_by_solver_step_and_integrate_ode():
    def counting_euler(v, x, t, t_next, history=None):  # Euler, counting its steps in the history
        return ode_step(v, x, t, t_next), (history or 0) + 1

    v, x = _inputs((2, 4))
    sigmas = torch.tensor([1.0, 0.7, 0.3, 0.0])
    register_solver("test_euler", multistep=True)(counting_euler)
    try:
        assert "test_euler" in SOLVERS and "test_euler" in MULTISTEP_SOLVERS
        assert solver_step("test_euler", v, x, 0.6, 0.4, history=2)[1] == 3
        fn = lambda y, s: 0.5 * y  # noqa: E731
        assert torch.equal(integrate_ode(fn, x, sigmas, "test_euler"), integrate_ode(fn, x, sigmas, "euler"))
    finally:
        del samplers.SOLVER_STEPS["test_euler"]
        samplers.MULTISTEP_SOLVERS.discard("test_euler")
    with pytest.raises(ValueError, match="euler, dpmpp_2m .*got 'test_euler'"):
        solver_step("test_euler", v, x, 0.6, 0.4)
