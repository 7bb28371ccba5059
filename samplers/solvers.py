"""Higher-order ODE integration for the part of the schedule after the SDE window (MixGRPO-Flash).

DPM-Solver++(2M) (Lu et al., arXiv:2211.01095, Alg. 2) in data-prediction form for the flow
``x_t = (1 - t) x0 + t eps``: ``alpha_t = 1 - t``, ``sigma_t = t``, ``x0_hat = x - t v``,
``λ = log((1 - t) / t)``. Stateless: the caller carries the previous ``x0_hat`` and ``t``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from ._core import TimeLike, as_time, check_step_inputs
from .steps import ode_step

Solver = Literal["euler", "dpmpp_2m"]
SOLVERS = ("euler", "dpmpp_2m")


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


def compress_schedule(sigmas: Tensor, after: int, ratio: float) -> Tensor:
    """MixGRPO-Flash: keep ``sigmas[: after + 1]`` and thin the tail ``sigmas[after:]`` (down to 0).

    The tail of ``T - after`` steps becomes ``n_post = max(int((T - after) · ratio), 1)`` steps whose
    sigmas are taken from the original ones at evenly spaced indices (end points kept), so the compressed
    schedule still ends exactly at 0. ``after`` is the index of the first step after the window
    (``window.stop``); DESIGN.md writes ``T - last - 1`` with ``last = after - 1``.
    """
    if sigmas.ndim != 1:
        raise ValueError(f"sigmas must be 1-D (T + 1 values ending at 0), got shape {tuple(sigmas.shape)}")
    num_steps = sigmas.shape[0] - 1
    if not 0 <= after <= num_steps:
        raise ValueError(f"after must lie in [0, {num_steps}], got {after}")
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must lie in (0, 1], got {ratio}")
    tail_steps = num_steps - after
    if tail_steps == 0:
        return sigmas.clone()
    n_post = max(int(tail_steps * ratio), 1)
    index = torch.linspace(after, num_steps, n_post + 1).round().long()
    return torch.cat([sigmas[:after], sigmas[index]])


SolverHistory = tuple[Tensor, Tensor] | None  # (previous x0_hat, previous t) for multistep solvers


def solver_step(
    solver: Solver, v: Tensor, x: Tensor, t: TimeLike, t_next: TimeLike, history: SolverHistory = None
) -> tuple[Tensor, SolverHistory]:
    """One ODE step with ``solver``; pass the returned history to the next call (None to start)."""
    if solver == "euler":
        return ode_step(v, x, t, t_next), None
    if solver == "dpmpp_2m":
        prev_x0, t_prev = history if history is not None else (None, None)
        x_next, x0 = dpmpp_2m_step(v, x, t, t_next, prev_x0=prev_x0, t_prev=t_prev)
        return x_next, (x0, torch.as_tensor(t))
    raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")


def integrate_ode(
    velocity_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    sigmas: Tensor,
    solver: Solver = "euler",
) -> Tensor:
    """Integrate the probability-flow ODE over ``sigmas`` (decreasing) with one network call per step."""
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    history: SolverHistory = None
    for t, t_next in zip(sigmas[:-1], sigmas[1:], strict=True):
        x, history = solver_step(solver, velocity_fn(x, t), x, t, t_next, history)
    return x
