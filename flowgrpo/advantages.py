"""Group-relative advantages (GRPO): each image's reward against the other images of its prompt."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

STD_EPS = 1e-4


def group_advantages(
    rewards: Tensor, group_ids: Tensor, *, std: str = "group", clip: float = 5.0, eps: float = STD_EPS
) -> Tensor:
    """``A_i = (R_i - mean_G(i)) / (std + eps)`` clipped to ``±clip`` (eps: Flow-GRPO 1e-4, DanceGRPO 1e-8).

    rewards, group_ids: [N] over *all* processes' samples of the epoch (gather before calling).
    std: ``group`` — the unbiased std of the sample's group (``torch.std``, as DanceGRPO and MixGRPO);
    ``global`` — the population std of all N rewards (``np.std``, as Flow-GRPO's ``global_std=True``).
    """
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]")
    if std not in ("group", "global"):
        raise ValueError(f"advantage std must be 'group' or 'global', got {std!r}")
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
    else:
        scale = rewards.std(correction=0)
    return (centered / (scale + eps)).clamp(-clip, clip).float()


def compute_advantages(
    scores: Mapping[str, Tensor],
    weights: Mapping[str, float],
    group_ids: Tensor,
    *,
    std: str = "group",
    clip: float = 5.0,
    per_reward: bool = False,
    normalize_weights: bool = False,
    eps: float = STD_EPS,
) -> Tensor:
    """Advantages of the weighted total (``scores["total"]``), or MixGRPO's per-reward aggregation.

    per_reward: advantages of each reward separately, then ``Σ_k w_k A_k`` clipped (only the sum, as MixGRPO's
    ``advantage_aggr``), so a reward with a large scale cannot drown the others. normalize_weights: ``w_k / Σ w``
    first (MixGRPO), so the sum is a weighted mean of the per-reward advantages rather than a sum.
    """
    if not per_reward:
        return group_advantages(scores["total"], group_ids, std=std, clip=clip, eps=eps)
    total = torch.zeros_like(scores["total"], dtype=torch.float32)
    weight_sum = sum(weights.values()) if normalize_weights else 1.0
    if weight_sum <= 0:
        raise ValueError(f"normalize_weights needs reward weights with a positive sum, got {dict(weights)}")
    for name, weight in weights.items():
        weight = weight / weight_sum
        total += weight * group_advantages(scores[name], group_ids, std=std, clip=math.inf, eps=eps)
    return total.clamp(-clip, clip)
