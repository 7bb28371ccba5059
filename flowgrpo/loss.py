"""The per-timestep clipped GRPO objective (Flow-GRPO eq. 8; ddpo-pytorch's PPO core)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class LossStats(NamedTuple):
    """Scalars of one timestep's loss, detached, for logging."""

    loss: Tensor
    policy_loss: Tensor
    kl: Tensor
    ratio_mean: Tensor
    ratio_min: Tensor
    ratio_max: Tensor
    clip_fraction: Tensor
    approx_kl: Tensor  # 0.5 · E[(logp - logp_old)²], the PPO diagnostic


def grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    kl: Tensor | None = None,
    beta: float = 0.0,
) -> tuple[Tensor, LossStats]:
    """``mean(max(-A·r, -A·clip(r, 1-ε, 1+ε))) + β·mean(KL)`` with ``r = exp(logp - logp_old)``.

    log_prob, old_log_prob, advantages, kl: [B] for one trained timestep.
    """
    if not (log_prob.shape == old_log_prob.shape == advantages.shape):
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and advantages "
            f"{tuple(advantages.shape)} must have the same shape"
        )
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach().to(ratio.dtype)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    kl_mean = kl.mean() if kl is not None else torch.zeros((), device=ratio.device)
    loss = policy_loss + beta * kl_mean
    with torch.no_grad():
        stats = LossStats(
            loss=loss.detach(),
            policy_loss=policy_loss.detach(),
            kl=kl_mean.detach(),
            ratio_mean=ratio.mean(),
            ratio_min=ratio.min(),
            ratio_max=ratio.max(),
            clip_fraction=((ratio - 1.0).abs() > clip_range).float().mean(),
            approx_kl=0.5 * (log_ratio**2).mean(),
        )
    return loss, stats
