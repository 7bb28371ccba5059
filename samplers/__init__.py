"""ODE-to-SDE samplers for flow matching with exact per-step Gaussian likelihoods. Pure tensor maths.

Conventions (DESIGN.md §3): t = sigma from 1 (noise) to 0 (data), ``x_t = (1 - t) x0 + t eps``,
``v ≈ eps - x0``. Every stochastic step returns a :class:`Transition` ``(sample, mean, std, log_prob)``.
"""

from ._core import (
    KL_CONVENTIONS,
    LOG_PROBS,
    Transition,
    gaussian_kl,
    gaussian_log_prob,
    reduce_per_sample,
    squared_error_log_prob,
    transition_kl,
)
from .schedule import calculate_shift, pipeline_schedule, static_shift_schedule, time_shift, truncated_timesteps
from .solvers import SOLVERS, compress_schedule, dpmpp_2m_step, integrate_ode, mixgrpo_tail_schedule, solver_step
from .steps import (
    DIFFUSIONS,
    SDE_KINDS,
    cps_step,
    dance_diffusion,
    euler_maruyama_step,
    flowgrpo_diffusion,
    langevin_correction,
    langevin_step,
    ode_step,
    sde_step,
)
from .window import STRATEGIES, NoWindow, SlidingWindow

__all__ = [
    "DIFFUSIONS",
    "KL_CONVENTIONS",
    "LOG_PROBS",
    "SDE_KINDS",
    "SOLVERS",
    "STRATEGIES",
    "NoWindow",
    "SlidingWindow",
    "Transition",
    "calculate_shift",
    "compress_schedule",
    "cps_step",
    "dance_diffusion",
    "dpmpp_2m_step",
    "euler_maruyama_step",
    "flowgrpo_diffusion",
    "gaussian_kl",
    "gaussian_log_prob",
    "integrate_ode",
    "langevin_correction",
    "langevin_step",
    "mixgrpo_tail_schedule",
    "ode_step",
    "pipeline_schedule",
    "reduce_per_sample",
    "sde_step",
    "solver_step",
    "squared_error_log_prob",
    "static_shift_schedule",
    "time_shift",
    "transition_kl",
    "truncated_timesteps",
]
