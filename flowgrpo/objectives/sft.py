"""Online SFT: reward-filtered fine-tuning (RAFT, Dong et al., arXiv 2304.06767) as ``grpo.objective: sft``.

Settings ``grpo.sft``. Each epoch keeps the images the reward ranks best and fits them with the plain rectified-flow
loss the model was pretrained with; the others train nothing (no negative term, unlike AWM's negative weights)::

    x_σ = (1 - σ) x0 + σ ε,   loss = mean_{i kept} mean |v_θ(x_σ, σ) - (ε - x0_i)|²  +  β_KL · KL

Which images are kept (``grpo.sft.select``): ``top_k``, the ``grpo.sft.top_k`` highest-advantage images of each group
(the Flow-GRPO repository's SFT baseline keeps each group's best image, ``PerPromptStatTracker`` ``type='sft'``), or
``positive``, every image with advantage > 0 (better than its group's mean). A group without a better-than-average
image (all rewards equal, or dropped by ``grpo.nan_policy: drop``) keeps none: its top-k rows are forwarded with weight
0 (the Flow-GRPO code trains all of such a group's images, as each equals the maximum). Only the kept images are
forwarded; ``positive`` pads them with random others of weight 0 up to a multiple of the micro-batches (at least one
each), as Flow-GRPO's zero-advantage filter does (:func:`~flowgrpo.batching.kept_samples`). σ and ε as for AWM
(:mod:`.forward`); ``grpo.kl.beta`` adds β_KL · mean |v_θ − v_ref|² to the adapter-disabled model over the forwarded
rows. With every image kept and unit weights this is AWM's loss at advantage 1 (the plain flow-matching loss).

Named ``sft`` after the Flow-GRPO baseline ("SFT / Online SFT"); RAFT is the same filter-then-fit loop. Against the
Flow-GRPO script (``scripts/train_sd3_sft.py``): it forwards every image and averages ``A·d + β·kl`` over all of
them with A = 1 for the best image and 0 else, so its fitting term is 1/G of the mean here (its ``train.beta`` = 100
against that: about ``100·G`` here), and it samples with a reference adapter refreshed every ``ref_update_step``
optimizer steps (online SFT), where the rollouts here use the current weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from ..batching import kept_samples
from ..checks import ConfigError, one_of
from .base import MicroBatch, check_own_selection, register_objective
from .forward import (
    ForwardProcessConfig,
    ForwardProcessObjective,
    flow_matching_error,
    noised_point,
    velocity,
    velocity_kl,
)

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config

SELECTIONS = ("top_k", "positive")


@dataclass
class SFTConfig(ForwardProcessConfig):
    """``grpo.sft:`` how σ and ε are drawn (as :class:`ForwardProcessConfig`), and which images are fitted."""

    select: str = "top_k"  # top_k: each group's top_k best images | positive: every image with advantage > 0
    top_k: int = 1  # images kept per group with select: top_k (Flow-GRPO's SFT baseline: 1, the best)


def top_k_per_group(advantages: Tensor, group_ids: Tensor, k: int) -> Tensor:
    """Per group (in increasing id order), the indices of its ``k`` highest-advantage samples, best first (the
    earlier of equal ones first)."""
    kept = []
    for g in torch.unique(group_ids).tolist():
        members = torch.nonzero(group_ids == g).flatten()
        order = torch.sort(advantages[members], descending=True, stable=True).indices
        kept.append(members[order[:k]])
    return torch.cat(kept)


def kept_weights(advantages: Tensor, group_ids: Tensor, select: str) -> Tensor:
    """1 for the rows that train, 0 for the rest: ``positive``, A > 0; ``top_k`` (the rows are the kept ones),
    every row of a group whose best row has A > 0."""
    if select == "positive":
        return (advantages > 0).to(advantages.dtype)
    index = torch.unique(group_ids.cpu(), return_inverse=True)[1].to(advantages.device)
    best = advantages.new_zeros(int(index.max()) + 1).scatter_reduce(0, index, advantages, "amax", include_self=False)
    return (best[index] > 0).to(advantages.dtype)


@register_objective("sft")
class SFT(ForwardProcessObjective):
    """Online SFT: the flow-matching loss on each epoch's best images, ``grpo.sft.timesteps`` terms per sample."""

    config_class: ClassVar[type] = SFTConfig

    @classmethod
    def validate(cls, config: Config) -> None:
        super().validate(config)
        check_own_selection(config)
        s, size = config.grpo.sft, config.grpo.group_size
        one_of("grpo.sft.select", s.select, SELECTIONS)
        if s.select == "top_k" and not 1 <= s.top_k < size:
            raise ConfigError(
                f"grpo.sft.top_k={s.top_k} must lie in [1, grpo.group_size - 1 = {size - 1}] (keeping all {size} "
                f"images of a group would ignore the rewards); set grpo.sft.top_k: 1"
            )

    @classmethod
    def needs_whole_groups(cls, config: Config) -> bool:
        return config.grpo.sft.select == "top_k"  # a group's best images are known where the whole group is

    def select_samples(
        self, advantages: Tensor, num_micro_batches: int, generator: torch.Generator, group_ids: Tensor | None = None
    ) -> Tensor:
        """``top_k``: each group's best images; ``positive``: those with A > 0 and fill-ins of weight 0."""
        if self.settings.select == "positive":
            return kept_samples(advantages.clamp_min(0), num_micro_batches, generator)
        if group_ids is None:
            raise ValueError("grpo.sft.select=top_k ranks the samples of each group: select_samples needs group_ids")
        return top_k_per_group(advantages, group_ids, self.settings.top_k)

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """One term: a fresh (σ, ε) per sample, the mean flow-matching loss of the kept rows plus β_KL × the
        velocity KL (scalar, to backward); logs ``loss``, ``policy_loss``, ``kl`` and ``kept`` (rows of weight 1)."""
        sub, kl_beta = batch.trajectory, self.config.grpo.kl.beta
        point = noised_point(adapter, self.settings, sub, batch.generator)
        v = velocity(adapter, point, sub)
        error = flow_matching_error(v, point)
        advantages = batch.advantages.detach().float().to(error.device)
        weight = kept_weights(advantages, sub.group_ids, self.settings.select)
        policy_loss = (weight * error).sum() / weight.sum().clamp_min(1)
        kl = velocity_kl(adapter, kl_beta, point, sub, v)
        loss = policy_loss + kl_beta * kl
        stats = {"policy_loss": policy_loss.detach(), "kl": kl.detach(), "kept": weight.sum()}
        return loss, {"loss": loss.detach(), **stats}
