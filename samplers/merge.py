"""Merged SDE steps and the entropy of a step (E-GRPO, Zhang et al., arXiv:2601.00423). Pure tensor maths.

Notation as :mod:`samplers.steps` (docs/design.md §3): ``sigmas`` is the schedule ``t_0 = 1 > t_1 > ... > t_T = 0``,
step ``i`` goes from ``t_i`` to ``t_{i+1}``.

**The merged step.** E-GRPO replaces the ``m`` consecutive steps ``i .. i+m-1`` by ONE stochastic transition from
``t_i`` to ``t_{i+m}``: the registered step kind evaluated over the merged interval, with the velocity and the
diffusion taken at its start. For Euler–Maruyama (Flow-GRPO's ``g(t) = a·sqrt(t / (1 - t))``), with
``Δ = t_i - t_{i+m}``::

    mean = x - Δ · (v + g(t_i)² / (2 t_i) · (x + (1 - t_i) v))
    std  = g(t_i) · sqrt(Δ)
    log p(x') = Σ_or_mean [ -(x' - mean)² / (2 std²) - log std - log sqrt(2π) ]

which is what the reference's ``_flow_grpo_step(..., merge_step=m)`` computes (shengjun-zhang/VisualGRPO @809e8f7,
``fastvideo/workers/sampler/flux_sampler.py``: ``sigma_prev = sigmas[index + merge_step]``, ``std_dev_t`` at
``sigmas[index]``). ``m = 1`` is the ordinary step, bit for bit (:func:`merged_sde_step` calls :func:`sde_step` with
``t_next = t_{i+1}``). It is not the exact composition of ``m`` Gaussian steps (whose std would be
``sqrt(Σ_j g(t_j)² Δ_j)`` under a linearised drift); the reference does not compose, and neither do we.

**The entropy of a step** (:func:`gaussian_entropy`): a transition ``N(mean, std² I)`` over ``D`` latent elements has
differential entropy ``D · h``, ``h = ½ log(2π e std²) = log std + ½ log(2π e)`` nats per element. It depends on the
schedule only (not on ``x`` or the network), so the steps to merge can be chosen before sampling:
:func:`entropy_merge_plan` tiles the schedule from step 0 with merged steps, each the shortest whose ``h`` reaches a
threshold ``τ``. On the reference's FLUX schedule (16 steps, static shift 3, ``a = 0.7``), any ``τ`` in
(0.807, 1.037] nats with ``max_end = 8`` gives its launch script's plan, steps 0, 1, 2, 4 merging 1, 1, 2, 3 steps
(``scripts/finetune/finetune_g2rpo_hps_merge.sh``: ``--eta_step_list 0 1 2 4 --eta_step_merge_list 1 1 2 3``); with
the default ``max_end`` (step 15) the tiling goes on past step 7 (``τ = 1.0``: a fifth merged step, 7..11).
The paper's own threshold (reported as τ ≈ 2.2 by a third-party summary) is on a scale its text defines; that text
was not available here, so this module's ``τ`` is the per-element Gaussian entropy above, stated as such.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ._core import Transition
from .steps import sde_step

#: ``½ log(2π e)``: the entropy of a standard normal, nats per element
HALF_LOG_2PI_E = 0.5 * math.log(2 * math.pi * math.e)


def merged_interval(sigmas: Tensor, index: int, span: int | Tensor) -> tuple[Tensor, Tensor]:
    """``(t_i, t_{i+m})`` of the merged step ``index .. index + span - 1`` on ``sigmas`` ``[T + 1]``.

    ``span``: an int, or a per-sample ``[B]`` long tensor (``t_{i+m}`` is then ``[B]``). Refuses ``m < 1`` and a
    merged step that would run past the end of the schedule (``i + m > T``).
    """
    num_steps = len(sigmas) - 1
    spans = torch.as_tensor(span, dtype=torch.long).cpu()
    if not 0 <= index < num_steps:
        raise ValueError(f"merged step start {index} must lie in 0..{num_steps - 1}")
    if spans.numel() == 0 or int(spans.min()) < 1:
        raise ValueError(f"a merged step spans at least 1 step, got {spans.tolist()}")
    if index + int(spans.max()) > num_steps:
        raise ValueError(
            f"a merged step from step {index} spanning {spans.tolist()} steps runs past the schedule's last step "
            f"({num_steps - 1}): spans must be <= {num_steps - index}"
        )
    t = sigmas[index]
    t_end = sigmas[index + int(spans)] if spans.ndim == 0 else sigmas[index + spans.to(sigmas.device)]
    return t, t_end


def merged_sde_step(
    kind: str,
    v: Tensor,
    x: Tensor,
    sigmas: Tensor,
    index: int,
    span: int | Tensor,
    **options: Any,
) -> Transition:
    """E-GRPO's merged step: ONE ``kind`` transition from ``t_index`` to ``t_{index + span}`` (module docstring).

    ``v``: the velocity at ``(x, t_index)``; ``span``: an int or per-sample ``[B]``; ``options``: those of
    :func:`samplers.sde_step` (``noise_level``, ``diffusion``, ``t_second``, ``generator``, ``prev_sample``,
    ``reduce``, ...). ``span = 1`` is ``sde_step(kind, v, x, sigmas[index], sigmas[index + 1], **options)``.
    """
    t, t_end = merged_interval(sigmas, index, span)
    return sde_step(kind, v, x, t, t_end, **options)


def gaussian_entropy(std: Tensor | float) -> Tensor:
    """Differential entropy of ``N(·, std²)`` per element, in nats: ``h = ½ log(2π e std²)``.

    A deterministic step (``std = 0``) has ``h = -inf``."""
    std = torch.as_tensor(std, dtype=torch.float64)
    return torch.log(std) + HALF_LOG_2PI_E


def merged_step_std(kind: str, sigmas: Tensor, index: int, span: int, *, noise_level: float, **options: Any) -> float:
    """The std of the merged step ``index .. index + span - 1`` under ``kind`` (a property of the schedule alone):
    the registered step evaluated on a zero latent, so every kind's own formula is used (Euler–Maruyama:
    ``g(t_i) · sqrt(t_i - t_{i+m})``). ``options``: ``diffusion``, ``t_second``, ``kappa`` as :func:`sde_step`."""
    zero = torch.zeros(1, 1)
    t, t_end = merged_interval(sigmas.detach().float().cpu(), index, span)
    step = sde_step(kind, zero, zero, t, t_end, noise_level=noise_level, noise=zero, **options)
    return float(torch.as_tensor(step.std).flatten()[0])


def entropy_merge_plan(
    sigmas: Tensor,
    threshold: float,
    *,
    kind: str = "euler_maruyama",
    noise_level: float,
    max_end: int | None = None,
    **options: Any,
) -> list[tuple[int, int]]:
    """The merged steps ``[(start, span), ...]`` that tile the schedule from step 0 (E-GRPO's adaptive merging).

    Greedy: from ``i = 0``, the span is the least ``m >= 1`` with ``h(i, m) >= threshold``
    (``h = ½ log(2π e std(i, m)²)``, :func:`gaussian_entropy` of :func:`merged_step_std`), then ``i ← i + m``.
    Merged steps end at or before step ``max_end`` (default ``T - 1``: the last step, into ``t = 0``, stays ODE);
    the tiling stops at the first ``i`` whose span would have to end later. Consecutive steps whose own entropy
    reaches ``τ`` stay single; low-entropy stretches merge until the merged step reaches it.

    ``sigmas``: ``[T + 1]``; ``t_second`` defaults to ``sigmas[1]`` (Flow-GRPO's diffusion at ``t = 1``).
    Refuses a threshold step 0 cannot reach (an empty plan).
    """
    if not math.isfinite(threshold):
        raise ValueError(f"the entropy threshold must be a finite number of nats, got {threshold}")
    sigmas = sigmas.detach().float().cpu()
    num_steps = len(sigmas) - 1
    limit = num_steps - 1 if max_end is None else int(max_end)
    if not 1 <= limit <= num_steps - 1:
        raise ValueError(f"max_end must lie in 1..{num_steps - 1} (the last step stays ODE), got {max_end}")
    options.setdefault("t_second", float(sigmas[1]))

    def entropy(i: int, m: int) -> float:
        return float(gaussian_entropy(merged_step_std(kind, sigmas, i, m, noise_level=noise_level, **options)))

    plan: list[tuple[int, int]] = []
    start = 0
    while start < limit:
        span = next((m for m in range(1, limit - start + 1) if entropy(start, m) >= threshold), None)
        if span is None:
            break
        plan.append((start, span))
        start += span
    if not plan:
        best = max(entropy(0, m) for m in range(1, limit + 1))
        raise ValueError(
            f"no merged step from step 0 ending by step {limit} reaches the entropy threshold {threshold} nats "
            f"(the highest is {best:.4f}); lower the threshold"
        )
    return plan
