"""Group-level Direct Reward Optimization (GDRO; Wang, Chen, Xu, Liu, Zhao, arXiv 2601.02036, CVPR 2026, "GDRO:
Group-level Reward Post-training Suitable for Diffusion Models") as ``grpo.objective: gdro``.

Settings ``grpo.gdro``. GDRO trains on groups sampled once by the reference model and scored once: fully offline
(``sampler.rollout: offline``, :mod:`flowgrpo.rollouts.offline`) and independent of the sampler (no SDE, no
log-probs). Diffusion-DPO's implicit reward of an image, the reference-relative flow-matching error at a noised
point, is fitted to the group's explicit rewards by a Plackett–Luce cross-entropy over the group's ranking. Per group
of k images, one (σ, ε) shared by the group (the loss compares the images at one t, as Diffusion-DPO does)::

    x_σ = (1 - σ) x0_i + σ ε,   d_i = mean |v_θ(x_σ, σ) - (ε - x0_i)|²,   d_i^ref = the same, adapter-disabled model
    s_i = -β (d_i - d_i^ref)                                          implicit reward (paper eq. 5, β = T·β_KL)
    images sorted by explicit reward, best first (x_1 ≻ … ≻ x_k); position i's target over the rest {x_i … x_k}:
    q_i(j) = exp(r_j / τ) / Σ_{m ≥ i} exp(r_m / τ)                    (τ = 0: one-hot on x_i, the paper's L_rank)
    L_GDRO = Σ_{i=1}^{k-1} [ log Σ_{m ≥ i} exp(s_m) - Σ_{j ≥ i} q_i(j) s_j ]                           (eq. 7)
    L_reg  = d_best, the flow-matching error of the group's highest-reward image (the one-hot mask M, eq. 8)
    loss   = mean over groups of (L_GDRO + γ L_reg)  +  β_KL · mean |v_θ - v_ref|²                     (eq. 9)

Each bracket is the cross-entropy between the target q_i and softmax(s) over the images not yet placed, so
L_GDRO is the cross-entropy of the Plackett–Luce ranking; the first bracket alone is the paper's top-1 loss (eq. 6).
With k = 2, τ → 0 and two different rewards, L_GDRO is Diffusion-DPO's loss ``-log σ(s_w - s_l)`` with DPO's β equal
to 2β (:mod:`.dpo` halves its β; tests/test_gdro.py checks the equality); the whole loss is Diffusion-DPO's only with
γ = 0, since the top-1 term has no counterpart there (a pair of equal rewards weighs 0 in both). Where rewards tie,
τ = 0 spreads a position's target evenly over the images tied with x_i (the limit τ → 0 of the softmax). Its gradient
on d_j is ``β Σ_i (q_i(j) - p_i(j))`` over the positions j takes part in (p_i = softmax(s) over the rest): AWM's push
towards better images, weighted by how far the model's implicit ranking is from the rewards', vanishing once they
agree. The top-1 term is plain flow matching on
each group's best image, against the quality loss the paper saw when the ranking margin grows.

The explicit rewards r come in as the objective's advantages. With ``grpo.advantage.estimator: centered`` (R minus
the group's mean, not divided by a std) they are the rewards up to one shift per group, which the softmax ignores:
q is the paper's softmax(r/τ) exactly, with τ in the rewards' units, as long as no |R - group mean| exceeds
``grpo.advantage.clip`` (5 by default; ``centered`` clamps to ±clip in the rewards' units, which flattens the targets
of a group whose rewards spread further: raise the clip for such rewards). A std-normalised estimator (``group``,
``global_std``) makes τ a temperature in standard deviations instead.

The paper's values (FLUX.1-dev, LoRA rank 32 with EMA; the presets ``sd35m_gdro.yaml`` and ``shapes_gdro.yaml`` say
what they take): group size k = 6 (k = 4 and 8 also stable, k = 2 under-optimises), τ = 0.05 (0.025 unstable, 0.5
under-optimises), β = 12 on OCR (6 hacks the reward) and 6 on GenEval (4 collapses), γ = 0.5 on OCR and 1.0 on GenEval
(γ = 0 collapses like a small β).

Where this is unsure: no public code, and the paper's PDF could not be read here; the equations and values above come
from two independent detailed summaries of it, which agree with each other (their learning rate, 3e-4, and 16
pre-generated images per prompt come from one only). Deliberate choices, each a deviation where the paper differs:
``d`` is the mean over the latent's elements (as Diffusion-DPO's code and :mod:`.dpo`/:mod:`.dgpo`; if the paper sums
over elements, its β means a larger one here); σ ~ the logit-normal of :mod:`.forward` (the paper does not say how t
is drawn), shifted by ``time_shift``; images of equal reward keep their stored order in the ranking (the stable
sort: the position at which each leaves the set of images not yet placed), a position's target is spread evenly
over the images tied with it at τ = 0 (at τ > 0 the softmax already is), and the first of a group's best takes the
top-1 term; a group whose rewards are all equal, which includes a group ``grpo.nan_policy: drop`` dropped (its
advantages are all 0), has no ranking and weighs 0 in both terms (as a tied pair in :mod:`.dpo`; its images still
count in the mean over the micro-batch's groups and in the KL); the optional velocity KL (``grpo.kl.beta``) is this
project's, not the paper's (0 in the presets); the stored groups are trained whole, never re-drawn as subsets of a
larger set per prompt. The paper's corrected score (its evaluation against reward hacking, via UnifiedReward) is not
part of training and not implemented here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from ..checks import check_range
from .base import MicroBatch, check_own_selection, register_objective
from .forward import ForwardProcessConfig, ForwardProcessObjective, compare_to_reference, velocity_kl

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config


@dataclass
class GDROConfig(ForwardProcessConfig):
    """``grpo.gdro:`` how σ and ε are drawn (as :class:`ForwardProcessConfig`, one per group), and GDRO's β, τ, γ."""

    beta: float = 12.0  # β of the implicit reward s = -β (d_θ - d_ref) (paper: OCR 12, GenEval 6)
    tau: float = 0.05  # temperature of the targets softmax(r / τ) over the rewards; 0: the ranking only (L_rank)
    gamma: float = 0.5  # weight of the top-1 term: the best image's flow-matching error (paper: OCR 0.5, GenEval 1.0)


def plackett_luce_loss(implicit: Tensor, rewards: Tensor, tau: float) -> Tensor:
    """One group's L_GDRO (see the module): the implicit rewards ``implicit`` [k] ranked by the explicit ``rewards``
    [k] (best first, ties in the given order), the cross-entropy of each position's target softmax(r / τ) over the
    images not yet placed (τ = 0: one-hot on the image placed there, uniform over the images tied with it) against
    softmax(s) over them, summed."""
    order = torch.sort(rewards, descending=True, stable=True).indices
    s, r = implicit[order], rewards[order].to(implicit.dtype)
    total = implicit.new_zeros(())
    for i in range(len(s) - 1):
        rest = s[i:]
        if tau > 0:
            target = torch.softmax(r[i:] / tau, dim=0)
        else:  # the limit τ → 0: softmax(r / τ) spreads evenly over the largest remaining rewards
            target = (r[i:] == r[i]).to(rest.dtype)
            target = target / target.sum()
        total = total + torch.logsumexp(rest, dim=0) - (target * rest).sum()
    return total


def gdro_loss(
    error: Tensor, reference_error: Tensor, rewards: Tensor, groups: Tensor, beta: float, tau: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Over the groups of ``groups`` ([B] ids): the mean L_GDRO of the implicit rewards s = -β (d - d_ref), the mean
    flow-matching error of each group's best image (L_reg, the first of equal ones), and the share of a group's
    ordered pairs (r_i > r_j) whose implicit rewards are ordered the same way (s_i > s_j). A group whose rewards are
    all equal (no ranking; a group the NaN policy dropped has advantages 0) adds 0 to both means."""
    implicit = -beta * (error - reference_error)
    ranking, top, right, pairs = [], [], 0.0, 0
    for g in torch.unique(groups.cpu()).tolist():
        members = torch.nonzero(groups.cpu() == g).flatten().to(error.device)
        s, r = implicit[members], rewards[members]
        weight = float(bool((r != r[0]).any()))  # 0: nothing to rank (all equal, or dropped)
        ranking.append(weight * plackett_luce_loss(s, r, tau))
        top.append(weight * error[members[torch.sort(r, descending=True, stable=True).indices[0]]])
        ordered = r[:, None] > r[None, :]
        right += float(((s[:, None] > s[None, :]) & ordered).sum())
        pairs += int(ordered.sum())
    accuracy = torch.tensor(right / pairs if pairs else 0.0)
    return torch.stack(ranking).mean(), torch.stack(top).mean(), accuracy


@register_objective("gdro")
class GDRO(ForwardProcessObjective):
    """GDRO's group ranking loss: ``grpo.gdro.timesteps`` terms per micro-batch of whole groups, each a fresh (σ, ε)
    per group."""

    config_class: ClassVar[type] = GDROConfig

    @classmethod
    def validate(cls, config: Config) -> None:
        super().validate(config)
        check_own_selection(config)
        s = config.grpo.gdro
        check_range("grpo.gdro.beta", s.beta, 0, low_open=True)
        check_range("grpo.gdro.tau", s.tau, 0, why="0: the ranking only")
        check_range("grpo.gdro.gamma", s.gamma, 0)

    @classmethod
    def needs_whole_groups(cls, config: Config) -> bool:  # noqa: ARG003
        return True

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """One term: L_GDRO + γ L_reg + β_KL × the velocity KL (scalar, to backward); logs ``loss``, ``policy_loss``
        (L_GDRO), ``top1_error`` (L_reg), ``kl`` and ``implicit_acc`` (the share of ordered pairs ranked right)."""
        sub, kl_beta, s = batch.trajectory, self.config.grpo.kl.beta, self.settings
        c = compare_to_reference(adapter, s, sub, batch.generator, share=sub.group_ids)
        rewards = batch.advantages.detach().float().to(c.error.device)
        ranking, top1, accuracy = gdro_loss(c.error, c.reference_error, rewards, sub.group_ids, s.beta, s.tau)
        kl = velocity_kl(adapter, kl_beta, c.point, sub, c.velocity, c.reference)
        loss = ranking + s.gamma * top1 + kl_beta * kl
        stats = {"policy_loss": ranking.detach(), "top1_error": top1.detach(), "kl": kl.detach()}
        return loss, {"loss": loss.detach(), **stats, "implicit_acc": accuracy}
