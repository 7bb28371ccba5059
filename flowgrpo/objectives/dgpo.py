"""Direct Group Preference Optimization (DGPO; Luo, Hu, Tang, arXiv 2510.08425) as ``grpo.objective: dgpo``.

Settings ``grpo.dgpo``. DGPO keeps GRPO's group-relative advantages and drops the policy gradient: a group's images
are split by advantage into a positive set G⁺ (A > 0) and a negative set G⁻ (A < 0), and the model maximises the
likelihood of the group-level preference G⁺ ≻ G⁻ in DPO's form, ``log σ(R_θ(G⁺) − R_θ(G⁻))`` (the paper's objective,
as its README states it). A group's reward is the advantage-weighted sum of Diffusion-DPO's implicit rewards,
``r_θ(x) = −β (d_θ(x) − d_ref(x))`` with ``d`` the flow-matching error at a noised point, weights ``|A|`` (the two sets'
weights have equal sums since a group's advantages sum to 0, which makes the partition functions cancel), over the
group size G. What this module computes, per group g of G images, one (σ, ε) shared by the group::

    x_σ = (1 - σ) x0_i + σ ε,   d_i = mean |v_θ(x_σ, σ) - (ε - x0_i)|²,   d_i^ref = the same, adapter-disabled model
    S_g  = β/G · Σ_{i∈g} A_i (d_i - d_i^ref)                 (= R_θ(G⁻) - R_θ(G⁺))
    loss = 1/β · mean_g −log σ(−S_g)  +  β_KL · mean_i mean |v_θ - v_ref|²

β = ``grpo.dgpo.beta``, β_KL = ``grpo.kl.beta`` (the reference velocity is the one ``d^ref`` used: no extra
forward). Its gradient, ``(1/B) Σ_g σ(S_g) Σ_{i∈g} A_i ∇d_i`` over the B images of the micro-batch, is that of the
public code's surrogate (``compute_group_dgpo_loss_allreduce`` in Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py``:
``sigmoid(Σ A·β·Δd/G)`` without gradient times ``A·d``, mean over the batch); the 1/β keeps that scale, so β_KL and
the learning rate mean what they mean there. Read it as AWM (:mod:`.awm`) with each group's weight σ(S_g) in (0, 1):
near 1 while the group's better images fit no better than the reference relative to its worse ones, falling to 0 as
the preference is learned, so the push away from bad images stops by itself. With v_θ = v_ref, σ(S_g) = 1/2: the
gradient is half AWM's on the same draws. Nothing of the sampling path is used: deterministic ODE rollouts
(``sampler.noise_level: 0``), the paper's point against SDE-based GRPO.

Where this is unsure: the paper's own equations could not be read (only its abstract and README); the group reward's
form above (weights A, the 1/G, the sign) is read from the public code, which agrees with the README's objective.
Against that code, deliberately simpler: no PPO-style clip of ``d_i`` against an EMA "old" model (``clip_dsm``,
``clip_range`` 1e-2) and no EMA reference or sampling with it (``use_ema_ref``, ``switch_ema_ref``); σ is drawn per
group from the logit-normal of :mod:`.forward` rather than one sampler timestep per term among the first
``trunc_steps + 1`` (the high-noise end) shared by the whole batch; rollouts use the Euler ODE (the code: DPM-Solver).
Each group trains on one process in whole micro-batches (``Objective.needs_whole_groups``); the code all-reduces the
group sums over GPUs instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_range
from .base import MicroBatch, check_own_selection, register_objective
from .forward import ForwardProcessConfig, ForwardProcessObjective, compare_to_reference, velocity_kl

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config


@dataclass
class DGPOConfig(ForwardProcessConfig):
    """``grpo.dgpo:`` how σ and ε are drawn (as :class:`ForwardProcessConfig`, one per group), and DPO's β."""

    beta: float = 100.0  # β of the implicit rewards: larger, a sharper group weight σ(S_g) (DGPO's code: 100)


def group_preference_loss(
    error: Tensor, reference_error: Tensor, advantages: Tensor, groups: Tensor, beta: float
) -> tuple[Tensor, Tensor]:
    """``1/β · mean_g softplus(S_g)`` (= −log σ(−S_g)) with ``S_g = β/G_g · Σ_{i∈g} A_i (d_i − d_i^ref)`` over the
    groups of ``groups`` ([B] ids; G_g their sizes), and the S_g ([groups])."""
    index = torch.unique(groups.cpu(), return_inverse=True)[1].to(error.device)
    size = torch.bincount(index).to(error.dtype)
    margin = torch.zeros_like(size).index_add(0, index, advantages * (error - reference_error)) * beta / size
    return F.softplus(margin).mean() / beta, margin


@register_objective("dgpo")
class DGPO(ForwardProcessObjective):
    """DGPO's group preference loss: ``grpo.dgpo.timesteps`` terms per micro-batch of whole groups, each a fresh
    (σ, ε) per group."""

    config_class: ClassVar[type] = DGPOConfig

    @classmethod
    def validate(cls, config: Config) -> None:
        super().validate(config)
        check_own_selection(config)
        check_range("grpo.dgpo.beta", config.grpo.dgpo.beta, 0, low_open=True)

    @classmethod
    def needs_whole_groups(cls, config: Config) -> bool:  # noqa: ARG003
        return True

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """One term: the group preference loss plus β_KL × the velocity KL (scalar, to backward); logs ``loss``,
        ``policy_loss``, ``kl`` and ``implicit_acc`` (the share of groups whose preference holds, S_g < 0)."""
        sub, kl_beta = batch.trajectory, self.config.grpo.kl.beta
        c = compare_to_reference(adapter, self.settings, sub, batch.generator, share=sub.group_ids)
        advantages = batch.advantages.detach().float().to(c.error.device)
        policy_loss, margin = group_preference_loss(
            c.error, c.reference_error, advantages, sub.group_ids, self.settings.beta
        )
        kl = velocity_kl(adapter, kl_beta, c.point, sub, c.velocity, c.reference)
        loss = policy_loss + kl_beta * kl
        stats = {"policy_loss": policy_loss.detach(), "kl": kl.detach(), "implicit_acc": (margin < 0).float().mean()}
        return loss, {"loss": loss.detach(), **stats}
