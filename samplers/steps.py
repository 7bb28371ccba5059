"""ODE and SDE steps for flow matching, each a pure function that returns its likelihood.

Notation (docs/design.md §3): time t is the scheduler's sigma (1 = noise, 0 = data),
``x_t = (1 - t) x0 + t eps``, the network predicts ``v ≈ eps - x0``, ``dt = t_next - t < 0``,
``Δ = -dt``. From ``(x, t, v)``: ``x0_hat = x - t v``, ``eps_hat = x + (1 - t) v``,
score ``s = -eps_hat / t``.

Step kinds (``sampler.kind``) and diffusions (``sampler.diffusion``) are registries filled by decorators: a new kind is
one function ``@register_sde_step("name")``, dispatched by :func:`sde_step` with the options its signature names.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from ._core import (
    LogProb,
    Reduce,
    TimeLike,
    Transition,
    add_to_registry,
    check_noise_level,
    check_step_inputs,
    make_transition,
)

Diffusion = str  # a name in DIFFUSIONS: flowgrpo | dance | flowgrpo_wan, or one registered with register_diffusion
DiffusionFn = Callable[..., Tensor]  # g(t, noise_level, t_second=None) -> Tensor
VelocityFn = Callable[[Tensor, TimeLike], Tensor]
SdeStep = Callable[..., Transition]  # step(v, x, t, t_next, *, noise_level, noise, generator, prev_sample, reduce, ...)

DIFFUSIONS: dict[str, DiffusionFn] = {}


def register_diffusion(name: str) -> Callable[[DiffusionFn], DiffusionFn]:
    """Register ``g(t, noise_level, t_second=None)`` as ``sampler.diffusion: name`` (euler_maruyama and langevin)."""
    return lambda fn: add_to_registry(DIFFUSIONS, name, fn, "diffusion")


def ode_step(v: Tensor, x: Tensor, t: TimeLike, t_next: TimeLike) -> Tensor:
    """Euler step of the probability-flow ODE, ``x + dt · v`` — what diffusers' FlowMatchEuler does."""
    t_, t_next_ = check_step_inputs(v, x, t, t_next)
    return (x.float() + (t_next_ - t_) * v.float()).to(x.dtype)


@register_diffusion("flowgrpo")
def flowgrpo_diffusion(t: Tensor, noise_level: float, t_second: TimeLike | None = None) -> Tensor:
    """Flow-GRPO's diffusion ``g(t) = a · sqrt(t / (1 - t))`` (arXiv:2505.05470, eq. 9; paper's σ_t).

    At ``t = 1`` the denominator uses ``1 - t_second`` (the schedule's second sigma), as the reference code.
    """
    t = torch.as_tensor(t, dtype=torch.float32)
    at_one = t >= 1
    if bool(at_one.any()):
        if t_second is None:
            raise ValueError("the Flow-GRPO diffusion at t = 1 needs t_second (the schedule's second sigma)")
        t_second = torch.as_tensor(t_second, dtype=torch.float32, device=t.device)
        if t_second.ndim == 1:
            t_second = t_second.view_as(t) if t.ndim else t_second
        denominator = 1 - torch.where(at_one, t_second, t)
    else:
        denominator = 1 - t
    return noise_level * torch.sqrt(t / denominator)


@register_diffusion("dance")
def dance_diffusion(t: Tensor, noise_level: float, t_second: TimeLike | None = None) -> Tensor:
    """DanceGRPO's constant diffusion ``g = η`` (arXiv:2505.07818)."""
    return torch.full_like(torch.as_tensor(t, dtype=torch.float32), noise_level)


@register_diffusion("flowgrpo_wan")
def flowgrpo_wan_diffusion(t: Tensor, noise_level: float, t_second: TimeLike | None = None) -> Tensor:
    """Flow-GRPO's Wan2.1 diffusion ``g(t) = a · t_second · t``: linear in t, scaled by the schedule's second sigma.

    Its ``wan_pipeline_with_logprob.py`` sets ``std_dev_t = sigma_min + (sigma_max - sigma_min) · sigma`` with
    ``sigma_max = sigmas[1]`` and ``sigma_min = sigmas[-1] = 0`` (no noise-level knob): ``a = 1`` here.
    """
    if t_second is None:
        raise ValueError("the flowgrpo_wan diffusion needs t_second (the schedule's second sigma)")
    t = torch.as_tensor(t, dtype=torch.float32)
    t_second = torch.as_tensor(t_second, dtype=torch.float32, device=t.device)
    if t_second.ndim == 1 and t.ndim:
        t_second = t_second.view_as(t)
    return noise_level * t_second * t


def _diffusion(name: str) -> DiffusionFn:
    if name not in DIFFUSIONS:
        raise ValueError(f"diffusion must be one of {sorted(DIFFUSIONS)}, got {name!r}")
    return DIFFUSIONS[name]


SDE_STEPS: dict[str, SdeStep] = {}
SDE_KINDS = SDE_STEPS.keys()  # a live view: config validation accepts every registered kind, in registration order

# Keywords every step takes: the rollout draws with noise / generator, re-scoring passes prev_sample.
_DRAW_KEYWORDS = ("noise_level", "noise", "generator", "prev_sample", "reduce")


def register_sde_step(name: str) -> Callable[[SdeStep], SdeStep]:
    """Register ``step`` as the SDE step kind ``name`` (``sampler.kind: name``, dispatched by :func:`sde_step`).

    ``step(v, x, t, t_next, *, noise_level, noise, generator, prev_sample, reduce, ...) -> Transition``: a pure
    function that draws ``sample`` (or takes ``prev_sample``) and scores it; ``t`` / ``t_next`` are floats, 0-d or
    per-sample ``[B]`` tensors (re-scoring a micro-batch passes each sample's). It may take any other option of
    :func:`sde_step` by name (``diffusion``, ``t_second``, ``score_eval``, ``velocity_fn``, ``kappa``, ``log_prob``);
    sde_step passes it those its signature names. A step without one of the draw keywords is refused here.
    """

    def register(step: SdeStep) -> SdeStep:
        takes = _keywords(step)
        missing = [] if takes is None else [k for k in _DRAW_KEYWORDS if k not in takes]
        if missing:
            raise TypeError(f"SDE step {name!r} ({step.__qualname__}) must take the keywords {', '.join(missing)}")
        return add_to_registry(SDE_STEPS, name, step, "SDE step")

    return register


@functools.cache
def _keywords(step: SdeStep) -> frozenset[str] | None:
    """The keyword arguments ``step`` takes (None: any, it has ``**kwargs``)."""
    params = inspect.signature(step).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _takes(step: SdeStep, keyword: str) -> bool:
    takes = _keywords(step)
    return takes is None or keyword in takes


def get_sde_step(kind: str, log_prob: LogProb = "exact") -> SdeStep:
    """The step registered as ``kind``; refuses an unknown kind (naming the registered ones) and ``log_prob`` other
    than ``"exact"`` for a kind that does not take it (Flow-GRPO's squared error is a cps convention)."""
    if kind not in SDE_STEPS:
        raise ValueError(f"sampler kind must be one of {', '.join(SDE_STEPS)} (the registered SDE steps), got {kind!r}")
    step = SDE_STEPS[kind]
    if log_prob != "exact" and not _takes(step, "log_prob"):
        able = " / ".join(name for name, other in SDE_STEPS.items() if _takes(other, "log_prob"))
        raise ValueError(
            f"log_prob={log_prob!r} is Flow-GRPO's convention for the {able} step only; "
            f"use log_prob='exact' with {kind!r}"
        )
    return step


@register_sde_step("euler_maruyama")
def euler_maruyama_step(
    v: Tensor,
    x: Tensor,
    t: TimeLike,
    t_next: TimeLike,
    *,
    noise_level: float,
    diffusion: Diffusion = "flowgrpo",
    t_second: TimeLike | None = None,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
    reduce: Reduce = "mean",
) -> Transition:
    """Euler–Maruyama step of the reverse SDE with the flow's marginals (Flow-GRPO, DanceGRPO).

    ``mean = x + dt · (v + g²/(2t) · (x + (1 - t) v))`` (= ``x + dt · (v - g²/2 · s)``),
    ``std = g · sqrt(Δ)``. ``noise_level = 0`` is exactly :func:`ode_step`.
    """
    check_noise_level(noise_level)
    t_, t_next_ = check_step_inputs(v, x, t, t_next)
    x32, v32 = x.float(), v.float()
    dt = t_next_ - t_
    g = _diffusion(diffusion)(t_, noise_level, t_second)
    mean = x32 + dt * (v32 + g**2 / (2 * t_) * (x32 + (1 - t_) * v32))
    std = g * torch.sqrt(-dt)
    return make_transition(x, mean, std, g, noise=noise, generator=generator, prev_sample=prev_sample, reduce=reduce)


@register_sde_step("cps")
def cps_step(
    v: Tensor,
    x: Tensor,
    t: TimeLike,
    t_next: TimeLike,
    *,
    noise_level: float,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
    reduce: Reduce = "mean",
    log_prob: LogProb = "exact",
) -> Transition:
    """Coefficients-preserving step (Flow-GRPO-Fast / FlowCPS, arXiv:2509.05952).

    ``std = t_next · sin(a π / 2)``, ``mean = (1 - t_next) x0_hat + sqrt(t_next² - std²) eps_hat``: the
    re-noised sample keeps the ``(1 - t, t)`` coefficients of the schedule. Exact for point-mass data only.
    ``log_prob="squared_error"`` scores the sample as Flow-GRPO's code does for CPS, ``-(x' - mean)²`` reduced
    (no ``1 / (2 std²)``, no constants); ``"exact"`` is the Gaussian log-density. At ``t_next = 0`` the step is
    deterministic (``std = 0``, ``mean = x0_hat``, the Euler step).
    """
    check_noise_level(noise_level)
    if noise_level > 1:
        raise ValueError(f"cps noise_level must lie in [0, 1] (it is a fraction of t_next), got {noise_level}")
    t_, t_next_ = check_step_inputs(v, x, t, t_next)
    x32, v32 = x.float(), v.float()
    x0_hat = x32 - t_ * v32
    eps_hat = x32 + (1 - t_) * v32
    std = t_next_ * math.sin(noise_level * math.pi / 2)
    mean = (1 - t_next_) * x0_hat + torch.sqrt(torch.clamp(t_next_**2 - std**2, min=0)) * eps_hat
    return make_transition(
        x, mean, std, std, noise=noise, generator=generator, prev_sample=prev_sample, reduce=reduce, log_prob=log_prob
    )


@register_sde_step("langevin")
def langevin_step(
    v: Tensor,
    x: Tensor,
    t: TimeLike,
    t_next: TimeLike,
    *,
    noise_level: float,
    score_eval: Literal["frozen", "reeval"] = "frozen",
    velocity_fn: VelocityFn | None = None,
    diffusion: Diffusion = "flowgrpo",
    t_second: TimeLike | None = None,
    kappa: float = 0.95,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
    reduce: Reduce = "mean",
) -> Transition:
    """Inference-aligned ODE Euler step, then one Langevin correction toward the marginal at ``t_next``.

    ``x' = x + dt · v``; ``σ = min(g(t) · sqrt(Δ), κ · t_next)`` (randomness matched to Euler–Maruyama);
    ``δ = σ² / 2``; ``x_next = x' + δ · score + sqrt(2δ) · z``.
    ``score_eval="frozen"`` re-times the same velocity, ``score = -(x' + (1 - t_next) v) / t_next``
    (one network call); ``"reeval"`` calls ``velocity_fn(x', t_next)`` for a true corrector on
    ``p_{t_next}`` (two calls, gradients through both). ``δ = 0`` when ``t_next = 0``.
    """
    check_noise_level(noise_level)
    if score_eval not in ("frozen", "reeval"):
        raise ValueError(f"score_eval must be 'frozen' or 'reeval', got {score_eval!r}")
    if score_eval == "reeval" and velocity_fn is None:
        raise ValueError("score_eval='reeval' needs velocity_fn(x, t) to evaluate the velocity at (x', t_next)")
    if not kappa > 0:
        raise ValueError(f"kappa must be > 0, got {kappa}")
    t_, t_next_ = check_step_inputs(v, x, t, t_next)
    dt = t_next_ - t_
    x_pred = x.float() + dt * v.float()
    g = _diffusion(diffusion)(t_, noise_level, t_second)
    std = torch.minimum(g * torch.sqrt(-dt), kappa * t_next_)

    if score_eval == "reeval" and bool((std > 0).any()):
        score_velocity = velocity_fn(x_pred.to(x.dtype), t_next).float()
        if score_velocity.shape != x.shape:
            raise ValueError(f"velocity_fn returned shape {tuple(score_velocity.shape)}, expected {tuple(x.shape)}")
    else:
        score_velocity = v.float()
    # Where t_next = 0 the step is deterministic (std = 0); a safe divisor keeps the score finite there.
    positive = t_next_ > 0
    safe_t_next = torch.where(positive, t_next_, torch.ones_like(t_next_))
    score = torch.where(positive, -(x_pred + (1 - t_next_) * score_velocity) / safe_t_next, torch.zeros_like(x_pred))
    return langevin_correction(
        x,
        x_pred,
        score,
        std,
        std / torch.sqrt(-dt),
        noise=noise,
        generator=generator,
        prev_sample=prev_sample,
        reduce=reduce,
    )


def langevin_correction(
    x: Tensor,
    x_pred: Tensor,
    score: Tensor,
    std: Tensor,
    flowgrpo_std: Tensor,
    *,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
    reduce: Reduce = "mean",
) -> Transition:
    """One unadjusted Langevin move from ``x_pred`` with step ``δ = std² / 2``: ``mean = x_pred + δ · score``."""
    mean = x_pred + std**2 / 2 * score
    return make_transition(
        x, mean, std, flowgrpo_std, noise=noise, generator=generator, prev_sample=prev_sample, reduce=reduce
    )


def sde_step(
    kind: str,
    v: Tensor,
    x: Tensor,
    t: TimeLike,
    t_next: TimeLike,
    *,
    noise_level: float,
    diffusion: Diffusion = "flowgrpo",
    score_eval: Literal["frozen", "reeval"] = "frozen",
    velocity_fn: VelocityFn | None = None,
    t_second: TimeLike | None = None,
    kappa: float = 0.95,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
    reduce: Reduce = "mean",
    log_prob: LogProb = "exact",
) -> Transition:
    """The step registered as ``kind`` (a config's ``sampler.kind``, see :func:`register_sde_step`), given the
    options its signature names; the others are ignored, except ``log_prob`` other than ``"exact"``, which the kind
    must take (only ``cps`` does). Same arguments, same draw: a registered step sees exactly what a direct call would.
    """
    step = get_sde_step(kind, log_prob)
    options = {
        "noise_level": noise_level,
        "diffusion": diffusion,
        "score_eval": score_eval,
        "velocity_fn": velocity_fn,
        "t_second": t_second,
        "kappa": kappa,
        "noise": noise,
        "generator": generator,
        "prev_sample": prev_sample,
        "reduce": reduce,
        "log_prob": log_prob,
    }
    return step(v, x, t, t_next, **{name: value for name, value in options.items() if _takes(step, name)})
