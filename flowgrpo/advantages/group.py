"""Group-relative advantages (GRPO): each image's reward against the other images of its prompt.

The estimators ``group`` (the default), ``global_std`` (Flow-GRPO), ``per_reward`` (MixGRPO) and ``centered`` (no
std: the rewards' own scale, as Dr. GRPO and GDRO's reward softmax use them).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .base import AdvantageInputs, register_advantage_estimator

STD_EPS = 1e-4


def group_advantages(
    rewards: Tensor, group_ids: Tensor, *, std: str = "group", clip: float = 5.0, eps: float = STD_EPS
) -> Tensor:
    """``A_i = (R_i - mean_G(i)) / (std + eps)`` clipped to ``±clip`` (eps: Flow-GRPO 1e-4, DanceGRPO 1e-8).

    rewards, group_ids: [N] over *all* processes' samples of the epoch (gather before calling).
    std: ``group`` — the unbiased std of the sample's group (``torch.std``, as DanceGRPO and MixGRPO);
    ``global`` — the population std of all N rewards (``np.std``, as Flow-GRPO's ``global_std=True``);
    ``none`` — no division: ``R_i - mean_G(i)``, in the rewards' own units.
    """
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]")
    if std not in ("group", "global", "none"):
        raise ValueError(f"advantage std must be 'group', 'global' or 'none', got {std!r}")
    rewards = rewards.double()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        raise ValueError("every group needs at least 2 samples to compare; got a group of 1")
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, rewards)
    means = sums / counts
    centered = rewards - means[inverse]
    if std == "group":
        # Unbiased std within each group, as torch.std.
        sq = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, centered**2)
        scale = torch.sqrt(sq / (counts - 1))[inverse]
    elif std == "global":
        scale = rewards.std(correction=0)
    else:
        return centered.clamp(-clip, clip).float()
    return (centered / (scale + eps)).clamp(-clip, clip).float()


@register_advantage_estimator("group")
def group_std(inputs: AdvantageInputs, settings: Any) -> Tensor:
    """Today's default (DanceGRPO, MixGRPO): the weighted total against its group's mean, over the group's unbiased
    std, clipped to ``±settings.clip``."""
    return group_advantages(
        inputs.scores["total"], inputs.group_ids, std="group", clip=settings.clip, eps=settings.std_eps
    )


@register_advantage_estimator("global_std")
def global_std(inputs: AdvantageInputs, settings: Any) -> Tensor:
    """Flow-GRPO's ``global_std=True``: the group's mean, but the population std of all the epoch's totals."""
    return group_advantages(
        inputs.scores["total"], inputs.group_ids, std="global", clip=settings.clip, eps=settings.std_eps
    )


@register_advantage_estimator("centered")
def centered(inputs: AdvantageInputs, settings: Any) -> Tensor:
    """The weighted total against its group's mean, not divided by any std (Dr. GRPO, Liu et al. arXiv 2503.20783),
    clipped to ``±settings.clip``: differences in the rewards' own units. Within a group these are the rewards up to
    one shift, so a softmax over a group's advantages is the softmax of its rewards (GDRO's target, ``grpo.gdro``)
    as long as no |R - group mean| exceeds the clip, which is in the rewards' units here (a group spread wider has
    its extremes clamped, and its softmax flattened)."""
    return group_advantages(inputs.scores["total"], inputs.group_ids, std="none", clip=settings.clip)


@register_advantage_estimator("per_reward")
def per_reward(inputs: AdvantageInputs, settings: Any) -> Tensor:
    """MixGRPO's ``advantage_aggr``: group advantages of each reward separately, then ``Σ_k w_k A_k`` clipped (only
    the sum), so a reward with a large scale cannot drown the others. ``settings.normalize_weights``: ``w_k / Σ w``
    first, so the sum is a weighted mean of the per-reward advantages rather than a sum."""
    weights = inputs.weights
    total = torch.zeros_like(inputs.scores["total"], dtype=torch.float32)
    weight_sum = sum(weights.values()) if settings.normalize_weights else 1.0
    if weight_sum <= 0:
        raise ValueError(f"normalize_weights needs reward weights with a positive sum, got {dict(weights)}")
    for name, weight in weights.items():
        a = group_advantages(inputs.scores[name], inputs.group_ids, std="group", clip=math.inf, eps=settings.std_eps)
        total += weight / weight_sum * a
    return total.clamp(-settings.clip, settings.clip)
