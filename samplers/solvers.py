"""Higher-order ODE integration for the part of the schedule after the SDE window (MixGRPO-Flash).

DPM-Solver++(2M) (Lu et al., arXiv:2211.01095, Alg. 2) in data-prediction form for the flow
``x_t = (1 - t) x0 + t eps``: ``alpha_t = 1 - t``, ``sigma_t = t``, ``x0_hat = x - t v``,
``λ = log((1 - t) / t)``. Stateless: the caller carries the previous ``x0_hat`` and ``t``. The post-window solvers
(``sampler.post_window.solver``) are a registry: ``@register_solver("name")``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._core import TimeLike, add_to_registry, as_time, check_step_inputs
from .schedule import time_shift
from .steps import ode_step

Solver = str  # a name in SOLVER_STEPS: euler | dpmpp_2m, or one registered with register_solver


def _log_snr(t: Tensor) -> Tensor:
    return torch.log(1 - t) - torch.log(t)


def dpmpp_2m_step(
    v: Tensor,
    x: Tensor,
    t: TimeLike,
    t_next: TimeLike,
    *,
    prev_x0: Tensor | None = None,
    t_prev: TimeLike | None = None,
) -> tuple[Tensor, Tensor]:
    """One DPM-Solver++(2M) step; returns ``(x_next, x0_hat)`` — pass ``x0_hat`` and ``t`` to the next call.

    First order (= DDIM) without history or when ``t_next = 0`` (diffusers' ``lower_order_final``).
    """
    t_, t_next_ = check_step_inputs(v, x, t, t_next)
    x32 = x.float()
    x0 = x32 - t_ * v.float()
    if bool((t_next_ == 0).all()):
        return x0.to(x.dtype), x0
    lam, lam_next = _log_snr(t_), _log_snr(t_next_)
    h = lam_next - lam
    denoised = x0
    if prev_x0 is not None and t_prev is not None:
        t_prev_ = as_time(t_prev, x, "t_prev")
        r = (lam - _log_snr(t_prev_)) / h
        denoised = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * prev_x0.float()
    x_next = (t_next_ / t_) * x32 - (1 - t_next_) * torch.expm1(-h) * denoised
    return x_next.to(x.dtype), x0


def _check_tail_args(sigmas: Tensor, after: int, ratio: float) -> int:
    """The number of steps ``T`` of ``sigmas``, after checking the arguments of a tail compression."""
    if sigmas.ndim != 1:
        raise ValueError(f"sigmas must be 1-D (T + 1 values ending at 0), got shape {tuple(sigmas.shape)}")
    num_steps = sigmas.shape[0] - 1
    if not 0 <= after <= num_steps:
        raise ValueError(f"after must lie in [0, {num_steps}], got {after}")
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must lie in (0, 1], got {ratio}")
    return num_steps


def compress_schedule(sigmas: Tensor, after: int, ratio: float) -> Tensor:
    """MixGRPO-Flash: keep ``sigmas[: after + 1]`` and thin the tail ``sigmas[after:]`` (down to 0).

    The tail of ``T - after`` steps becomes ``n_post = max(int((T - after) · ratio), 1)`` steps whose
    sigmas are taken from the original ones at evenly spaced indices (end points kept), so the compressed
    schedule still ends exactly at 0. ``after`` is the index of the first step after the window
    (``window.stop``); docs/design.md §3.4 writes ``T - last - 1`` with ``last = after - 1``.

    This is the rule for the pipelines' own schedules (no ``sampler.time_shift``), which MixGRPO never uses;
    for the static shifted schedule the rollout follows MixGRPO's construction, :func:`mixgrpo_tail_schedule`.
    """
    num_steps = _check_tail_args(sigmas, after, ratio)
    tail_steps = num_steps - after
    if tail_steps == 0:
        return sigmas.clone()
    n_post = max(int(tail_steps * ratio), 1)
    index = torch.linspace(after, num_steps, n_post + 1).round().long()
    return torch.cat([sigmas[:after], sigmas[index]])


def mixgrpo_tail_schedule(sigmas: Tensor, after: int, ratio: float, shift: float) -> Tensor:
    """MixGRPO-Flash's tail for the static shifted schedule (:func:`samplers.static_shift_schedule`).

    As MixGRPO ``fastvideo/utils/sampling_utils.py::run_sample_step`` (``dpm_apply_strategy="post"``), with
    ``last = after - 1`` the window's last step::

        num_post_steps = int(max((T - last) * ratio, 1))                      # POINTS, not steps
        post_time_step = linspace(1, 0, T + 1)[last + 1]                       # the UNshifted t
        post = sd3_time_shift(shift, linspace(post_time_step, 0, num_post_steps))
        sigmas = cat([sigmas[: last + 1], post])

    i.e. ``num_post_steps - 1`` steps from ``σ_after`` to 0, uniform in the unshifted time and re-shifted.
    ``post[0] = σ_after`` bit for bit, so the window's steps keep their sigmas; only the tail changes.

    Deviation: where the reference gets ``num_post_steps = 1`` (``(T - last) · ratio < 2``) its schedule ends
    at ``σ_after`` and never reaches 0; here the tail keeps at least 2 points (one step into 0). ``after = T``
    (no tail) returns ``sigmas`` unchanged, and ``after = 0`` (no window; the reference would fail) starts the
    tail at t = 1. For the pipelines' own schedules (no time shift) :func:`compress_schedule` applies instead.
    """
    num_steps = _check_tail_args(sigmas, after, ratio)
    if after == num_steps:
        return sigmas.clone()
    last = after - 1
    num_post_points = max(int(max((num_steps - last) * ratio, 1)), 2)
    post_time = torch.linspace(1, 0, num_steps + 1)[last + 1].item()
    # time_shift on CPU float32, as static_shift_schedule computes the sigmas, so post[0] == sigmas[after] exactly
    post = time_shift(torch.linspace(post_time, 0, num_post_points), shift).to(sigmas.device, sigmas.dtype)
    if not torch.allclose(post[0], sigmas[after], rtol=1e-5, atol=1e-6):
        raise ValueError(
            f"sigmas[{after}] = {float(sigmas[after]):.6g} is not the static shifted schedule's "
            f"{float(post[0]):.6g} (shift {shift}): mixgrpo_tail_schedule needs static_shift_schedule's sigmas"
        )
    return torch.cat([sigmas[:after], post])


SolverHistory = tuple[Tensor, Tensor] | None  # (previous x0_hat, previous t) for multistep solvers
SolverStep = Callable[[Tensor, Tensor, TimeLike, TimeLike, SolverHistory], tuple[Tensor, SolverHistory]]

SOLVER_STEPS: dict[str, SolverStep] = {}
SOLVERS = SOLVER_STEPS.keys()  # a live view: config validation accepts every registered solver
MULTISTEP_SOLVERS: set[str] = set()  # solvers that carry a history between steps (see register_solver)


def register_solver(name: str, *, multistep: bool = False) -> Callable[[SolverStep], SolverStep]:
    """Register ``step(v, x, t, t_next, history) -> (x_next, history)`` as ``sampler.post_window.solver: name``.

    ``history`` is None at the first step; the step returns what the next one needs. ``multistep``: the solver keeps
    one (a higher order from past steps), and the rollout then integrates a thinned tail, ``post_window.ratio`` of the
    steps after the window, and may seed the history from the window's steps (MixGRPO-Flash).
    """

    def register(step: SolverStep) -> SolverStep:
        add_to_registry(SOLVER_STEPS, name, step, "ODE solver")
        if multistep:
            MULTISTEP_SOLVERS.add(name)
        return step

    return register


@register_solver("euler")
def euler_solver_step(
    v: Tensor, x: Tensor, t: TimeLike, t_next: TimeLike, history: SolverHistory = None
) -> tuple[Tensor, SolverHistory]:
    """Euler step of the probability-flow ODE, ``x + dt · v`` (:func:`ode_step`); no history."""
    return ode_step(v, x, t, t_next), None


@register_solver("dpmpp_2m", multistep=True)
def dpmpp_2m_solver_step(
    v: Tensor, x: Tensor, t: TimeLike, t_next: TimeLike, history: SolverHistory = None
) -> tuple[Tensor, SolverHistory]:
    """:func:`dpmpp_2m_step` from the previous step's ``(x0_hat, t)``; returns this step's as the next history."""
    prev_x0, t_prev = history if history is not None else (None, None)
    x_next, x0 = dpmpp_2m_step(v, x, t, t_next, prev_x0=prev_x0, t_prev=t_prev)
    return x_next, (x0, torch.as_tensor(t))


def get_solver(solver: Solver) -> SolverStep:
    """The solver step registered as ``solver``; an unknown name is refused with the registered ones."""
    if solver not in SOLVER_STEPS:
        raise ValueError(f"solver must be one of {', '.join(SOLVER_STEPS)} (registered ODE solvers), got {solver!r}")
    return SOLVER_STEPS[solver]


def solver_step(
    solver: Solver, v: Tensor, x: Tensor, t: TimeLike, t_next: TimeLike, history: SolverHistory = None
) -> tuple[Tensor, SolverHistory]:
    """One ODE step with the solver registered as ``solver``; pass the returned history to the next call (None to
    start)."""
    return get_solver(solver)(v, x, t, t_next, history)


def integrate_ode(
    velocity_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    sigmas: Tensor,
    solver: Solver = "euler",
) -> Tensor:
    """Integrate the probability-flow ODE over ``sigmas`` (decreasing) with one network call per step."""
    step = get_solver(solver)
    history: SolverHistory = None
    for t, t_next in zip(sigmas[:-1], sigmas[1:], strict=True):
        x, history = step(velocity_fn(x, t), x, t, t_next, history)
    return x
