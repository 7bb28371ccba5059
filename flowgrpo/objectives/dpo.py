"""Online DPO for flow models (Diffusion-DPO's loss, Wallace et al., arXiv 2311.12908) as ``grpo.objective: dpo``.

Settings ``grpo.dpo``. Each epoch, each group's best and worst image (highest and lowest advantage, i.e. reward) form
a preference pair (x_w, x_l), as the DPO baseline of the Flow-GRPO repository pairs them (``PerPromptStatTracker``
``type='dpo'``, ``scripts/train_sd3_dpo.py``). Both are noised with the same σ and ε, as Diffusion-DPO does, and
Diffusion-DPO's loss is applied to the flow-matching errors relative to a reference model::

    x_σ = (1 - σ) x0 + σ ε,   d(x) = mean |v(x_σ, σ) - (ε - x0)|²   (v_θ: trained; v_ref: the reference)
    loss = mean_pairs −log σ(−β/2 · [(d_θ(x_w) − d_ref(x_w)) − (d_θ(x_l) − d_ref(x_l))])  +  β_KL · KL

β = ``grpo.dpo.beta``; the optional KL (``grpo.kl.beta``) is mean |v_θ − v_base|² to the adapter-disabled model.
The reference (``grpo.dpo.reference``): ``base``, the adapter-disabled model (Diffusion-DPO's frozen reference), or
``epoch``, the trainable weights as the epoch's training began (:class:`~.nft.OldWeights`, swapped in for one
forward), which is Flow-GRPO's "Online DPO" (its reference adapter, copied from the learner every
``ref_update_step`` steps, also samples the rollouts). Minimising it lowers the better image's error and raises the
worse one's relative to the reference, by a weight σ(β/2 · margin) that vanishes once the pair is ordered.

A group whose rewards are all equal has no preference: its pair (two arbitrary images) is forwarded but weighted 0
(the Flow-GRPO code trains images 1 and 0 of such a group as if 1 were better). σ ~ the logit-normal of
:mod:`.forward` with ``time_shift``, as the Flow-GRPO DPO script draws it (``compute_density_for_timestep_sampling``,
logit-normal (0, 1), on the scheduler's shifted sigmas). Rollouts are the plain ODE with the current weights, like
awm/nft (SDE steps with ``sampler.noise_level > 0``); the Flow-GRPO script samples with its reference adapter and
refreshes it only when ``global_step`` is a multiple of ``ref_update_step`` at an epoch start (its 39 steps per epoch
against 40: every 40 epochs).
Micro-batches hold whole pairs (``Objective.needs_whole_groups``): ``train.batch_size`` counts the groups' images
(a multiple of ``grpo.group_size``), of which 2 per group are forwarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_range, one_of
from .base import MicroBatch, check_own_selection, register_objective
from .forward import ForwardProcessConfig, ForwardProcessObjective, compare_to_reference, velocity_kl
from .nft import OldWeights

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config

REFERENCES = ("base", "epoch")


@dataclass
class DPOConfig(ForwardProcessConfig):
    """``grpo.dpo:`` how σ and ε are drawn (as :class:`ForwardProcessConfig`, one per pair), DPO's β and the
    reference model."""

    beta: float = 100.0  # β of the implicit rewards (Flow-GRPO's DPO configs: train.beta = 100)
    reference: str = "base"  # base: the adapter-disabled model | epoch: the weights as the epoch's training began


def best_and_worst(advantages: Tensor, group_ids: Tensor) -> Tensor:
    """Per group (in increasing id order), the indices of its highest- and lowest-advantage sample, in that order
    (the first of equal ones); a group of equal advantages gives its first two samples."""
    pairs = []
    for g in torch.unique(group_ids).tolist():
        members = torch.nonzero(group_ids == g).flatten()
        a = advantages[members]
        best, worst = int(torch.argmax(a)), int(torch.argmin(a))
        if best == worst:
            best, worst = 0, 1
        pairs.append(members[[best, worst]])
    return torch.cat(pairs)


def pair_loss(delta: Tensor, advantages: Tensor, beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """Diffusion-DPO's loss on pairs of rows (2p, 2p + 1): ``delta`` [2P] = d_θ − d_ref, the higher advantage of a
    pair is the winner; pairs of equal advantage weigh 0. The mean over pairs, the inside term
    −β/2 (Δ_w − Δ_l) [P] and the weights [P]."""
    delta, advantages = delta.view(-1, 2), advantages.view(-1, 2)
    first_wins = advantages[:, 0] >= advantages[:, 1]
    winner = torch.where(first_wins, delta[:, 0], delta[:, 1])
    loser = torch.where(first_wins, delta[:, 1], delta[:, 0])
    inside = -beta / 2 * (winner - loser)
    weight = (advantages[:, 0] != advantages[:, 1]).to(inside.dtype)
    return (F.softplus(-inside) * weight).mean(), inside, weight


@register_objective("dpo")
class DPO(ForwardProcessObjective):
    """Diffusion-DPO on each group's best and worst image: ``grpo.dpo.timesteps`` terms per micro-batch, each a
    fresh (σ, ε) per pair."""

    config_class: ClassVar[type] = DPOConfig

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.old_weights: OldWeights | None = None

    @property
    def refuses_sharded(self) -> str | None:  # type: ignore[override]  (depends on grpo.dpo.reference)
        if self.settings.reference != "epoch":
            return None
        return (
            "with grpo.dpo.reference=epoch swaps the epoch's weights into the trainable parameters for a forward, "
            "written for parameters that are whole tensors on every process (one process, DDP); under DeepSpeed or "
            "FSDP set grpo.dpo.reference: base"
        )

    @classmethod
    def validate(cls, config: Config) -> None:
        super().validate(config)
        check_own_selection(config)
        check_range("grpo.dpo.beta", config.grpo.dpo.beta, 0, low_open=True)
        one_of("grpo.dpo.reference", config.grpo.dpo.reference, REFERENCES)

    @classmethod
    def needs_whole_groups(cls, config: Config) -> bool:  # noqa: ARG003
        return True

    def select_samples(
        self, advantages: Tensor, num_micro_batches: int, generator: torch.Generator, group_ids: Tensor | None = None
    ) -> Tensor:
        """Each group's best and worst sample, the pair's rows next to each other."""
        if group_ids is None:
            raise ValueError("grpo.objective=dpo pairs the samples of each group: select_samples needs group_ids")
        return best_and_worst(advantages, group_ids)

    def begin_epoch(self, params: list[torch.nn.Parameter]) -> None:
        if self.settings.reference == "epoch":
            self.old_weights = OldWeights(params)

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """One term: a fresh (σ, ε) per pair, the DPO loss plus β_KL × the velocity KL (scalar, to backward); logs
        ``loss``, ``policy_loss``, ``kl`` and ``implicit_acc`` (the share of ordered pairs the model ranks right)."""
        sub, kl_beta = batch.trajectory, self.config.grpo.kl.beta
        if len(sub) % 2 or bool((sub.group_ids[0::2] != sub.group_ids[1::2]).any()):
            raise ValueError(f"grpo.objective=dpo trains pairs of one group on rows (2p, 2p + 1), got {sub.group_ids}")
        weights = self.old_weights if self.settings.reference == "epoch" else None
        share = torch.arange(len(sub)) // 2
        c = compare_to_reference(adapter, self.settings, sub, batch.generator, share, weights)
        advantages = batch.advantages.detach().float().to(c.error.device)
        policy_loss, inside, weight = pair_loss(c.error - c.reference_error, advantages, self.settings.beta)
        base = c.reference if weights is None else None  # the KL's reference is the base model
        kl = velocity_kl(adapter, kl_beta, c.point, sub, c.velocity, base)
        loss = policy_loss + kl_beta * kl
        accuracy = ((inside > 0).to(weight.dtype) * weight).sum() / weight.sum().clamp_min(1)
        stats = {"policy_loss": policy_loss.detach(), "kl": kl.detach(), "implicit_acc": accuracy.detach()}
        return loss, {"loss": loss.detach(), **stats}
