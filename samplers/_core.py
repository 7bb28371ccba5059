"""Shared plumbing for the step functions: time handling, input checks, noise, the Gaussian density.

Every step works in float32 (diffusers' flow-match ``step()`` upcasts for the same reason) and
returns its sample in the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
from torch import Tensor

Reduce = Literal["mean", "sum", "none"]
TimeLike = float | Tensor
LogProb = Literal["exact", "squared_error"]
LOG_PROBS = ("exact", "squared_error")

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)

F = TypeVar("F", bound=Callable[..., object])


def add_to_registry(registry: dict[str, F], name: str, fn: F, what: str) -> F:
    """``registry[name] = fn`` for the ``register_*`` decorators; a name already taken by another function is refused
    (a second registration would silently replace the first)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {what} needs a non-empty name, got {name!r}")
    taken = registry.get(name)
    if taken is not None and taken is not fn:
        raise ValueError(f"{what} {name!r} is already registered ({taken.__module__}.{taken.__qualname__})")
    registry[name] = fn
    return fn


@dataclass
class Transition:
    """One stochastic step ``sample = mean + std * z``, ``z ~ N(0, I)``.

    sample:   next latents in the input dtype, same shape as ``x``   # [B, ...]
    mean:     float32, differentiable in the velocity                # [B, ...]
    std:      float32, independent of the parameters; broadcasts to ``mean`` ([] or [B, 1, ...])
    log_prob: float32 per-sample log density of ``sample``           # [B] (or [B, ...] for reduce="none")
    flowgrpo_std: the std as Flow-GRPO returns it (without the sqrt(Δ) factor for Euler–Maruyama
        and Langevin, equal to ``std`` for CPS); the ``"flowgrpo"`` KL convention divides by it.
    """

    sample: Tensor
    mean: Tensor
    std: Tensor
    log_prob: Tensor
    flowgrpo_std: Tensor


def as_time(t: TimeLike, x: Tensor, name: str) -> Tensor:
    """A float or per-sample ``(B,)`` time as a float32 tensor that broadcasts against ``x``."""
    if isinstance(t, Tensor):
        t = t.detach().to(device=x.device, dtype=torch.float32)
        if t.ndim == 0:
            return t
        if t.ndim != 1 or t.shape[0] != x.shape[0]:
            raise ValueError(
                f"{name} must be a float or a per-sample tensor of shape ({x.shape[0]},), got {tuple(t.shape)}"
            )
        return t.view(-1, *([1] * (x.ndim - 1)))
    return torch.tensor(float(t), dtype=torch.float32, device=x.device)


def check_step_inputs(v: Tensor, x: Tensor, t: TimeLike, t_next: TimeLike) -> tuple[Tensor, Tensor]:
    """Validate a step's inputs and return ``(t, t_next)`` as broadcastable float32 tensors."""
    if v.shape != x.shape:
        raise ValueError(f"velocity shape {tuple(v.shape)} does not match latent shape {tuple(x.shape)}")
    if x.ndim < 2:
        raise ValueError(f"latents need a batch dimension and at least one more, got shape {tuple(x.shape)}")
    t_, t_next_ = as_time(t, x, "t"), as_time(t_next, x, "t_next")
    if not bool((t_next_ < t_).all()):
        raise ValueError(f"steps go from noise to data: need t_next < t, got t={_show(t_)}, t_next={_show(t_next_)}")
    if bool((t_next_ < 0).any()) or bool((t_ > 1).any()):
        raise ValueError(f"times must lie in [0, 1], got t={_show(t_)}, t_next={_show(t_next_)}")
    return t_, t_next_


def check_noise_level(noise_level: float, name: str = "noise_level") -> None:
    if not math.isfinite(noise_level) or noise_level < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {noise_level}")


def _show(t: Tensor) -> str:
    return f"{t.item():.6g}" if t.numel() == 1 else str([round(v, 6) for v in t.flatten().tolist()])


def draw_noise(x: Tensor, noise: Tensor | None, generator: torch.Generator | None) -> Tensor:
    """``z ~ N(0, I)`` in float32 on ``x``'s device; ``noise`` given is used as is."""
    if noise is not None:
        if noise.shape != x.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} does not match latent shape {tuple(x.shape)}")
        return noise.to(device=x.device, dtype=torch.float32)
    # Draw on the generator's device (as diffusers' randn_tensor does) so CPU generators work with CUDA latents.
    device = generator.device if generator is not None else x.device
    return torch.randn(x.shape, generator=generator, device=device, dtype=torch.float32).to(x.device)


def reduce_per_sample(values: Tensor, reduce: Reduce) -> Tensor:
    """Reduce ``[B, ...]`` element values to ``[B]``: mean (Flow-GRPO's convention) or sum."""
    if reduce == "none":
        return values
    dims = tuple(range(1, values.ndim))
    if reduce == "mean":
        return values.mean(dim=dims)
    if reduce == "sum":
        return values.sum(dim=dims)
    raise ValueError(f"reduce must be 'mean', 'sum' or 'none', got {reduce!r}")


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor | float, reduce: Reduce = "mean") -> Tensor:
    """Log density of ``sample`` under ``N(mean, std² I)``, reduced per sample.

    Elements with ``std == 0`` (a deterministic step) contribute 0 instead of ±inf.
    """
    sample, mean = sample.float(), mean.float()
    std, positive = _safe_std(std, mean.device)
    per_element = -((sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return reduce_per_sample(torch.where(positive, per_element, torch.zeros_like(per_element)), reduce)


def squared_error_log_prob(sample: Tensor, mean: Tensor, reduce: Reduce = "mean") -> Tensor:
    """Flow-GRPO's CPS "log-prob": ``-(sample - mean)²`` reduced per sample, with the Gaussian's ``1 / (2 std²)``
    factor and every constant dropped (``sde_step_with_logprob``, ``sde_type == 'cps'``: "remove all constants").
    Not a density; only ratios between two evaluations of the same transition are meaningful."""
    per_element = -((sample.detach().float() - mean.float()) ** 2)
    return reduce_per_sample(per_element, reduce)


def gaussian_kl(mean_p: Tensor, mean_q: Tensor, std: Tensor | float, reduce: Reduce = "mean") -> Tensor:
    """KL(N(mean_p, std²) ‖ N(mean_q, std²)) = (mean_p - mean_q)² / (2 std²), reduced per sample."""
    std, positive = _safe_std(std, mean_p.device)
    per_element = (mean_p.float() - mean_q.float()) ** 2 / (2 * std**2)
    return reduce_per_sample(torch.where(positive, per_element, torch.zeros_like(per_element)), reduce)


def _safe_std(std: Tensor | float, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(std with zeros replaced by 1, mask of std > 0)``: a deterministic step contributes 0, and no inf/NaN
    reaches the gradient through the masked branch."""
    std = torch.as_tensor(std, dtype=torch.float32, device=device)
    positive = std > 0
    return torch.where(positive, std, torch.ones_like(std)), positive


KLConvention = Literal["exact", "flowgrpo"]
KL_CONVENTIONS = ("exact", "flowgrpo")


def transition_kl(
    policy: Transition, reference_mean: Tensor, convention: KLConvention = "exact", reduce: Reduce = "mean"
) -> Tensor:
    """Per-sample KL between the policy's transition and a reference one with the same std.

    ``exact`` is the true Gaussian KL. ``flowgrpo`` divides by the std *without* the sqrt(Δ) factor,
    as Flow-GRPO's code does (its published β values were tuned that way): it equals exact · Δ for
    Euler–Maruyama and Langevin, and exact for CPS.
    """
    if convention == "exact":
        std = policy.std
    elif convention == "flowgrpo":
        std = policy.flowgrpo_std
    else:
        raise ValueError(f"KL convention must be one of {KL_CONVENTIONS}, got {convention!r}")
    return gaussian_kl(policy.mean, reference_mean, std, reduce)


def make_transition(
    x: Tensor,
    mean: Tensor,
    std: Tensor,
    flowgrpo_std: Tensor,
    *,
    noise: Tensor | None,
    generator: torch.Generator | None,
    prev_sample: Tensor | None,
    reduce: Reduce,
    log_prob: LogProb = "exact",
) -> Transition:
    """Draw (or take ``prev_sample``) from ``N(mean, std²)`` and score it.

    The log-prob is computed on the sample *after* the cast back to ``x.dtype``, so that re-scoring a
    stored sample in training reproduces the rollout's log-prob exactly (PPO ratio 1). ``log_prob``:
    ``exact`` (:func:`gaussian_log_prob`) or ``squared_error`` (:func:`squared_error_log_prob`).
    """
    if log_prob not in LOG_PROBS:
        raise ValueError(f"log_prob must be one of {LOG_PROBS}, got {log_prob!r}")
    if prev_sample is not None:
        if prev_sample.shape != x.shape:
            raise ValueError(f"prev_sample shape {tuple(prev_sample.shape)} does not match {tuple(x.shape)}")
        sample = prev_sample.detach().to(x.dtype)
    else:
        z = draw_noise(x, noise, generator)
        sample = (mean.detach() + std * z).to(x.dtype)
    if log_prob == "exact":
        score = gaussian_log_prob(sample, mean, std, reduce)
    else:
        score = squared_error_log_prob(sample, mean, reduce)
    return Transition(sample=sample, mean=mean, std=std, log_prob=score, flowgrpo_std=flowgrpo_std)
