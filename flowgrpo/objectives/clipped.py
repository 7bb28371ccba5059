"""The per-timestep clipped GRPO objective (Flow-GRPO eq. 8; ddpo-pytorch's PPO core): ``grpo.objective: clipped``.

The rollout stores the SDE transitions of the sampler's window (``sampler.window``); each term re-scores one stored
transition per sample under the current weights and applies PPO's clipped ratio to the sample's advantage::

    r = exp(log p_θ(x_{t+1} | x_t) - log p_old(x_{t+1} | x_t)),   loss = mean(max(-A·r, -A·clip(r, 1-ε, 1+ε))) + β·KL

with ε = ``grpo.clip_range``, log-probs reduced over latent elements by ``grpo.log_prob_reduce`` and β =
``grpo.kl.beta`` (the KL of the transition to the adapter-disabled model's, ``grpo.kl.convention``). Settings stay at
``grpo.*`` (clip_range, log_prob_reduce, shuffle_timesteps, timestep_fraction, drop_zero_advantage) where every
real-model preset has them. Per-step advantages ``[B, W]`` are read at each sample's trained window position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
from torch import Tensor

from samplers import transition_kl

from ..rollout import evaluate_transitions, stored_log_probs
from .base import MicroBatch, Objective, register_objective
from .kl import gated_mean, kl_gate

if TYPE_CHECKING:
    from samplers import Transition

    from ..adapters import PipelineAdapter
    from ..config import Config
    from ..rollout import Trajectory


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

    log_prob, old_log_prob, advantages: [B] for one trained timestep; kl: [B], or the micro-batch's KL term (scalar).
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


def at_positions(values: Tensor, positions: Tensor) -> Tensor:
    """``values[i, positions[i]]``: a per-step field ``[B, W]`` at each sample's trained window position ([B])."""
    return values.gather(1, positions.view(-1, 1).to(values.device)).squeeze(1)


def step_advantages(advantages: Tensor, positions: Tensor) -> Tensor:
    """The advantages ``[B]`` a term trains with: as given, or per-step ones ``[B, W]`` read at ``positions``."""
    return at_positions(advantages, positions) if advantages.ndim == 2 else advantages


def timestep_loss(
    adapter: PipelineAdapter, cfg: Config, sub: Trajectory, positions: Tensor, advantages: Tensor
) -> tuple[Tensor, LossStats]:
    """One trained timestep of a micro-batch: re-score the stored transitions at ``positions`` ([B] window positions)
    under the current weights, the KL reference forward when β > 0, and the clipped GRPO loss (scalar, to backward).
    ``advantages``: [B], or [B, W] per step (read at ``positions``)."""
    advantages = step_advantages(advantages, positions)
    new = evaluate_transitions(adapter, sub, positions, cfg.sampler, log_prob_reduce=cfg.grpo.log_prob_reduce)
    kl = reference_kl(adapter, cfg, sub, positions, new)
    old = stored_log_probs(sub, positions).to(new.log_prob.device)
    return grpo_loss(new.log_prob, old, advantages, clip_range=cfg.grpo.clip_range, kl=kl, beta=cfg.grpo.kl.beta)


def reference_kl(
    adapter: PipelineAdapter, cfg: Config, sub: Trajectory, positions: Tensor, new: Transition
) -> Tensor | None:
    """The KL term of one trained timestep (scalar): each transition's KL to the reference model's (``new``: the
    transitions under the current weights, ``grpo.kl.convention``), averaged over the micro-batch's samples, or with
    ``grpo.kl.gate`` over its gated ones (:func:`~.kl.gated_mean`). None when β = 0, 0 when none is gated: either way
    without the reference forward, which runs without DDP (``adapter.reference()``), so a process that skips it issues
    the same collectives as one that runs it. Called after ``new``'s graph-building forward: the reference's swap of
    the parameters' storage is undone before the backward (:class:`~.nft.OldWeights`)."""
    if cfg.grpo.kl.beta <= 0:
        return None
    gate, reduce = kl_gate(sub), cfg.grpo.log_prob_reduce
    if gate is not None and not gate.any():
        return torch.zeros((), device=new.log_prob.device)
    with torch.no_grad(), adapter.reference():
        ref = evaluate_transitions(adapter, sub, positions, cfg.sampler, log_prob_reduce=reduce)
    return gated_mean(transition_kl(new, ref.mean, cfg.grpo.kl.convention, reduce), gate)


@register_objective("clipped")
class Clipped(Objective):
    """Flow-GRPO's clipped ratio on the stored SDE transitions (the trainer's default)."""

    rollout: ClassVar[str] = "sde_window"

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        loss, stats = timestep_loss(adapter, self.config, batch.trajectory, batch.positions, batch.advantages)
        return loss, stats._asdict()
