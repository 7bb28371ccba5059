"""Flow-GRPO's clipped per-step loss on rollouts sampled by lagged weights (decoupled PPO): ``grpo.objective: lagged``.

Settings ``grpo.lagged``. DiffusionNFT samples each epoch with "old" weights that trail the trained ones,
θ_old ← η θ_old + (1 - η) θ before each epoch (its soft update, :class:`~.nft.SoftUpdate`; η grows with the optimizer
steps up to a cap); on the shapes task that update damped the drift of nft's long runs (docs/methods.md). This
objective gives the per-step clipped loss the same rollouts, so the logged training rewards and sample grids are the
lagged weights'. PPO's ratio cannot simply be taken against the sampling weights then: they trail the trained ones by
η/(1 - η) epochs on average (one at η = 0.5), so with Flow-GRPO's narrow clip many ratios would start outside
``[1 - ε, 1 + ε]``: those clipped on their advantage's side train nothing, the others train without a trust region.
Decoupled PPO (Hilton et al., "Batch size-invariance for policy optimization", arXiv 2110.00641) separates the two
roles of the old policy: the *behaviour* policy that sampled (the lagged weights, whose log-prob the rollout stored)
and the *proximal* policy the trust region is around (the trainable weights as the epoch's training began)::

    r = exp(log p_θ(x_{t+1} | x_t) - log p_prox(x_{t+1} | x_t))              (clipped as Flow-GRPO's)
    w = exp(log p_prox(x_{t+1} | x_t) - log p_behav(x_{t+1} | x_t))          (importance weight, no gradient)
    loss = mean_i w_i · max(-A_i r_i, -A_i clip(r_i, 1-ε, 1+ε)) + β·KL

with ε = ``grpo.clip_range`` and the KL of :mod:`.clipped` (``grpo.kl``, unweighted). w > 0 is folded into the
advantage, ``A_i w_i``, and :func:`~.clipped.grpo_loss` computes the rest. ``log p_prox`` is one more forward without
gradient per term, on a copy of the weights taken when the epoch's training began (:class:`~.nft.OldWeights`); until
the epoch's first optimizer step moves them it is the current forward's own log-prob, detached, and that forward is
skipped. So r is exactly 1 at every term before the epoch's first step, and the trainer's
``train/onpolicy_ratio_dev`` is 0 by construction here; the re-scoring check it stands for elsewhere is w at η = 0
(before the schedule starts, behaviour and proximal weights are the same: w = 1 within a few float32 ulps, and the
loss is ``clipped``'s).

Deviations, stated: w is not truncated here (it is logged, ``behaviour_weight`` with ``_min`` / ``_max``), and
``grpo.log_prob_reduce: sum`` is refused, since a log-prob summed over every latent element would put the whole lag
of the weights into one exponent; the schedule is DiffusionNFT's ``return_decay`` (:func:`~.nft.old_decay`), counted
in this run's optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from ..checks import ConfigError
from ..rollout import evaluate_transitions, stored_log_probs
from .base import MicroBatch, Objective, register_objective
from .clipped import LossStats, grpo_loss, reference_kl, step_advantages
from .nft import OldWeights, SoftUpdate, check_soft_update, settings_decay

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config
    from ..rollout import Trajectory


@dataclass
class LaggedConfig:
    """``grpo.lagged:`` the soft update of the sampling weights (DiffusionNFT's ``return_decay``: before each epoch's
    rollout old ← η old + (1 - η) current, η = min((optimizer steps - start) · rate, max))."""

    old_decay_rate: float = 0.004  # η's growth per optimizer step (the shapes main job takes ~4 steps an epoch)
    old_decay_max: float = 0.5  # η's cap, in (0, 1) (DiffusionNFT's decay_type 1)
    old_decay_start: int = 0  # optimizer steps with η = 0 first


def decoupled_grpo_loss(
    log_prob: Tensor,
    proximal_log_prob: Tensor,
    behaviour_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    kl: Tensor | None = None,
    beta: float = 0.0,
) -> tuple[Tensor, LossStats, Tensor]:
    """``mean(w · max(-A·r, -A·clip(r, 1-ε, 1+ε))) + β·mean(KL)`` with ``r = exp(logp - logp_prox)`` and the
    importance weight ``w = exp(logp_prox - logp_behav)`` (no gradient). All per-sample tensors are [B]; returns the
    loss, :class:`~.clipped.LossStats` of r, and w."""
    if not (proximal_log_prob.shape == behaviour_log_prob.shape == log_prob.shape):
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, proximal_log_prob {tuple(proximal_log_prob.shape)} and "
            f"behaviour_log_prob {tuple(behaviour_log_prob.shape)} must have the same shape"
        )
    proximal = proximal_log_prob.detach()
    weight = torch.exp(proximal - behaviour_log_prob.detach().to(proximal.device))
    weighted = advantages.detach().to(weight.device) * weight  # w > 0: w·max(-A r, -A clip r) = max(-wA r, -wA clip r)
    loss, stats = grpo_loss(log_prob, proximal, weighted, clip_range=clip_range, kl=kl, beta=beta)
    return loss, stats, weight


def lagged_timestep_loss(
    adapter: PipelineAdapter,
    cfg: Config,
    sub: Trajectory,
    positions: Tensor,
    advantages: Tensor,
    proximal: OldWeights,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One trained timestep of a micro-batch: the stored transitions at ``positions`` ([B] window positions) under the
    proximal weights (no gradient; skipped while ``proximal`` has not moved) and the current ones, the
    KL reference forward when β > 0, and :func:`decoupled_grpo_loss` against the stored (behaviour) log-probs. Logs
    :class:`~.clipped.LossStats` and ``behaviour_weight`` (mean, ``_min``, ``_max``). ``advantages``: [B], or
    [B, W] per step (read at ``positions``)."""
    reduce = cfg.grpo.log_prob_reduce
    advantages = step_advantages(advantages, positions)
    proximal_log_prob = None
    if proximal.moved():  # before the epoch's first step the proximal forward is this one
        with torch.no_grad(), adapter.without_ddp(), proximal.swapped_in():  # no DDP: no buffer broadcast needed
            proximal_log_prob = evaluate_transitions(
                adapter, sub, positions, cfg.sampler, log_prob_reduce=reduce
            ).log_prob
    new = evaluate_transitions(adapter, sub, positions, cfg.sampler, log_prob_reduce=reduce)
    kl = reference_kl(adapter, cfg, sub, positions, new)
    if proximal_log_prob is None:
        proximal_log_prob = new.log_prob.detach()
    behaviour = stored_log_probs(sub, positions).to(new.log_prob.device)
    loss, stats, weight = decoupled_grpo_loss(
        new.log_prob, proximal_log_prob, behaviour, advantages, clip_range=cfg.grpo.clip_range, kl=kl,
        beta=cfg.grpo.kl.beta,
    )  # fmt: skip
    with torch.no_grad():
        extra = {
            "behaviour_weight": weight.mean(),
            "behaviour_weight_min": weight.min(),
            "behaviour_weight_max": weight.max(),
        }
    return loss, {**stats._asdict(), **extra}


@register_objective("lagged")
class Lagged(SoftUpdate, Objective):
    """Flow-GRPO's clipped per-step loss, decoupled: rollouts from DiffusionNFT's soft-updated old weights, the clip
    around the weights as the epoch's training began, an importance weight between the two."""

    config_class: ClassVar[type] = LaggedConfig
    rollout: ClassVar[str] = "sde_window"
    refuses_sharded: ClassVar[str | None] = (
        "swaps the lagged and the proximal weights into the trainable parameters for a forward, written for "
        "parameters that are whole tensors on every process (one process, DDP); under DeepSpeed or FSDP use "
        "grpo.objective: clipped"
    )

    def __init__(self, config: Config) -> None:
        super().__init__(config)  # SoftUpdate's old_weights: the lagged (behaviour) weights of the last trained epoch
        self.proximal: OldWeights | None = None  # the trainable weights as this epoch's training began

    @classmethod
    def validate(cls, config: Config) -> None:
        s = config.grpo.lagged
        check_soft_update("grpo.lagged", s)
        if s.old_decay_max <= 0:
            raise ConfigError(
                "grpo.objective=lagged samples with weights that trail the trained ones, but "
                "grpo.lagged.old_decay_max=0 keeps them equal: set grpo.lagged.old_decay_max in (0, 1) with "
                "grpo.lagged.old_decay_rate > 0 (0.5 and 0.004), or grpo.objective: clipped"
            )
        if config.grpo.log_prob_reduce != "mean":
            raise ConfigError(
                f"grpo.objective=lagged weights each term by exp(log p_prox - log p_behav), which with "
                f"grpo.log_prob_reduce={config.grpo.log_prob_reduce} sums the weights' whole lag over every latent "
                "element into one exponent (it overflows); set grpo.log_prob_reduce: mean (Flow-GRPO's)"
            )
        if config.sampler.noise_level <= 0:
            raise ConfigError(
                f"grpo.objective=lagged trains stochastic transitions, but sampler.noise_level="
                f"{config.sampler.noise_level} makes every step deterministic (ratio 1, no gradient); set "
                "sampler.noise_level > 0 (Flow-GRPO: 0.7)"
            )

    def old_decay(self, step: int) -> float | None:
        return settings_decay(self.settings, step)

    def begin_epoch(self, params: list[torch.nn.Parameter]) -> None:
        super().begin_epoch(params)  # the lagged weights that sampled this epoch: the next epoch mixes from them
        self.proximal = OldWeights(params)

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        if self.proximal is None:
            raise RuntimeError("grpo.objective=lagged: loss() before begin_epoch() took the epoch's proximal weights")
        return lagged_timestep_loss(
            adapter, self.config, batch.trajectory, batch.positions, batch.advantages, self.proximal
        )
