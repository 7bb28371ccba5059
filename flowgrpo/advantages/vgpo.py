"""``grpo.advantage.estimator: vgpo``: VGPO, value-anchored group policy optimisation (Shao et al., "Anchoring Values
in Temporal and Group Dimensions for Flow Matching Model Alignment", arXiv 2512.12387; ICLR 2026 submission "Value-
Anchored Group Policy Optimization for Flow Models"). Needs ``sampler.rollout: dense`` (``extras["step_rewards"]``,
a sample's stage values ``V_0 .. V_W``, and ``extras["step_indices"]``; :mod:`flowgrpo.rollouts.dense`). Returns one
advantage per sample and window step, ``[N, W]``.

Temporal Cumulative Reward Mechanism (TCRM), for one sample (pure functions below)::

    R_j = V_{j+1}                               the instant reward of window step j: the reward of the one-step
                                                prediction of the state the step leads to (eq. 9)
    Q_j = Σ_{i=j}^{W-1} γ^{i-j} R_i             the process value: expected cumulative reward from stage j (eq. 10),
                                                one sampled trajectory (a single-rollout Monte-Carlo estimate)
    ω_j = Q_j / mean_{j'} Q_{j'}                the timestep weight (eq. 11); 1 for a sample whose mean Q is <= 0

Adaptive Dual Advantage Estimation (ADAE), per window step j over the samples of the prompt group g::

    A_{i,j} = ω_{i,j} · [ (Q_{i,j} - mean_g(Q_{·,j})) / (std_g(Q_{·,j}) + eps)  +  k · a_{i,j} · Q_{i,j} ]

    the relative (group-normalised) term plus the absolute-value anchor k·Q, clipped to ±clip; a_{i,j} = 1 while
    the step's schedule index is below ``anchor_steps`` (null: always). When a group's values are all equal the
    relative term is 0 and the anchor still moves every image by its own value: the signal survives.

**Against the paper.** Neither the paper's text nor its code could be read here (the stored copies hold the abstract;
its code is not public): the formulas are reconstructed from the abstract and the ICLR 2026 reviews of the
submission, which state eq. 9 (one-step ODE projection x̂_0 of the state after each step, its reward the instant
reward), eq. 10 (discounted sum Q_t along the sampled trajectory), eq. 11 (ω_t = Q_t / mean over t of Q_t), and ADAE
as "a relative term with an absolute-value term so that the advantage does not collapse when the group reward
standard deviation goes to zero", with α = k·std(Q) in its appendix B limit and α enabled "only for the first 5
sampling steps" (appendix A.2). ``(Q - μ + α·Q) / σ`` with ``α = k·σ`` is the form written above; the published
eq. 13 may differ in where eps sits. The values of γ and k were not found: the defaults (γ = 0.9, k = 0.1) are this
project's choice, not the paper's. The instant rewards of the stages after the window (ODE steps, not trained) are
not observed: Q sums to the window's end (with a window ending at step S-2 and an Euler last step, R_{W-1} is the
final image's reward). The group std is unbiased under ``std: group``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import ConfigError, one_of
from .base import AdvantageInputs, register_advantage_estimator
from .tp import STDS, require_dense, step_values


@dataclass
class VGPOSettings:
    """``grpo.advantage.vgpo:`` VGPO's process values and anchored normalisation (flowgrpo/advantages/vgpo.py)."""

    gamma: float = 0.9  # γ in (0, 1]: discount of later instant rewards in Q_j (the paper's value not found)
    anchor: float = 0.1  # k >= 0: weight of the absolute term k·Q (0: the relative term only; paper's value not found)
    anchor_steps: int | None = 5  # the anchor acts on schedule steps < this (the paper: the first 5); null: all
    timestep_weight: bool = True  # ω_j = Q_j / mean_j Q (eq. 11); false: ω = 1
    std: str = "group"  # group: per prompt group and step | global: per step over all samples


def instant_rewards(values: Tensor) -> Tensor:
    """``R_j = V_{j+1}``: ``[N, W + 1]`` stage values -> ``[N, W]``, each step's reward of the state it leads to."""
    if values.ndim != 2 or values.shape[1] < 2:
        raise ValueError(f"stage values must be [N, W + 1] with W >= 1, got shape {tuple(values.shape)}")
    return values[:, 1:]


def process_values(rewards: Tensor, gamma: float) -> Tensor:
    """``Q_j = Σ_{i≥j} γ^{i-j} R_i`` over a sample's ``[N, W]`` instant rewards (the backward recursion
    ``Q_j = R_j + γ·Q_{j+1}``, ``Q_{W-1} = R_{W-1}``)."""
    q = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for j in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, j] + gamma * running
        q[:, j] = running
    return q


def timestep_weights(q: Tensor) -> Tensor:
    """``ω_j = Q_j / mean_j Q`` per sample (``[N, W]``); 1 for a sample whose mean Q is not positive."""
    mean = q.mean(dim=1, keepdim=True)
    positive = mean > 0
    return torch.where(positive, q / torch.where(positive, mean, torch.ones_like(mean)), torch.ones_like(q))


def anchored_advantages(
    q: Tensor,
    group_ids: Tensor,
    *,
    anchor: float,
    anchored: Tensor | None = None,
    weights: Tensor | None = None,
    std: str = "group",
    clip: float = 5.0,
    eps: float = 1e-4,
) -> Tensor:
    """ADAE (module docstring): ``ω · [(Q - mean_g) / (std_g + eps) + anchor · a · Q]`` per column, clipped.

    q, weights: [N, W]; anchored: [N, W] bool (a; None: everywhere); std as :func:`.group.group_advantages`.
    Rows with a non-finite Q get 0 and stay out of the statistics; so does a group left with fewer than 2 rows."""
    one_of("grpo.advantage.vgpo.std", std, STDS)
    n, w = q.shape
    out = torch.zeros((n, w), dtype=torch.float32)
    valid = torch.isfinite(q).all(dim=1)
    _, inverse, counts = torch.unique(group_ids[valid], return_inverse=True, return_counts=True)
    keep = torch.nonzero(valid).flatten()[counts[inverse] >= 2]
    if len(keep) == 0:
        return out
    q_k = q[keep].double()
    _, inv, cnt = torch.unique(group_ids[keep], return_inverse=True, return_counts=True)
    sums = torch.zeros((len(cnt), w), dtype=torch.float64).index_add_(0, inv, q_k)
    means = sums / cnt[:, None]
    centred = q_k - means[inv]
    if std == "group":
        sq = torch.zeros((len(cnt), w), dtype=torch.float64).index_add_(0, inv, centred**2)
        scale = torch.sqrt(sq / (cnt[:, None] - 1))[inv]
    else:
        scale = q_k.std(dim=0, correction=0, keepdim=True).expand_as(q_k)
    relative = centred / (scale + eps)
    a = torch.ones_like(q_k) if anchored is None else anchored[keep].to(torch.float64)
    omega = torch.ones_like(q_k) if weights is None else weights[keep].double()
    out[keep] = (omega * (relative + anchor * a * q_k)).clamp(-clip, clip).float()
    return out


def _check(config: Any) -> None:
    require_dense(config, "vgpo")
    v = config.grpo.advantage.vgpo
    if not 0 < v.gamma <= 1:
        raise ConfigError(f"grpo.advantage.vgpo.gamma must lie in (0, 1] (a discount), got {v.gamma}")
    if v.anchor < 0:
        raise ConfigError(
            f"grpo.advantage.vgpo.anchor must be >= 0 (the weight k of the absolute term k·Q; 0 turns it off), "
            f"got {v.anchor}"
        )
    if v.anchor_steps is not None and v.anchor_steps < 0:
        raise ConfigError(
            f"grpo.advantage.vgpo.anchor_steps must be >= 0 (schedule steps the anchor acts on) or null for all, "
            f"got {v.anchor_steps}"
        )
    one_of("grpo.advantage.vgpo.std", v.std, STDS)


@register_advantage_estimator("vgpo", config_class=VGPOSettings, validate=_check)
def vgpo(inputs: AdvantageInputs, settings: Any) -> Tensor:
    """VGPO's per-step advantages ``[N, W]`` (module docstring)."""
    v: VGPOSettings = settings.vgpo
    values = step_values(inputs, "vgpo")
    q = process_values(instant_rewards(values), v.gamma)
    anchored = None
    if v.anchor_steps is not None:
        steps = inputs.extras.get("step_indices")
        if steps is None or steps.shape != q.shape:
            raise ValueError(
                "grpo.advantage.vgpo.anchor_steps needs each sample's window step indices (extras['step_indices'] "
                "[N, W], added by sampler.rollout: dense); set anchor_steps: null to anchor every step"
            )
        anchored = steps < v.anchor_steps
    weights = timestep_weights(q) if v.timestep_weight else None
    return anchored_advantages(
        q,
        inputs.group_ids,
        anchor=v.anchor,
        anchored=anchored,
        weights=weights,
        std=v.std,
        clip=settings.clip,
        eps=settings.std_eps,
    )
