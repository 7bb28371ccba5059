"""Objectives: what the trainer minimises, one registered module each (``grpo.objective``).

- ``clipped`` (:mod:`.clipped`): Flow-GRPO's per-timestep clipped ratio on the stored SDE transitions.
- ``lagged`` (:mod:`.lagged`): the clipped per-step loss on rollouts sampled by soft-updated (lagged) weights,
  decoupled PPO's importance weight between them and the clip's proximal weights.
- ``awm`` (:mod:`.awm`): advantage-weighted flow matching on the noised final samples.
- ``nft`` (:mod:`.nft`): DiffusionNFT's negative-aware loss on the same noised samples.
- ``flash`` (:mod:`.flash`): Flash-GRPO's single-step clipped ratio with temporal gradient rectification.
- ``tempflow`` (:mod:`.tempflow`): TempFlow-GRPO's noise-aware weights on the clipped per-step loss.
- ``dgpo`` (:mod:`.dgpo`): DGPO's group-level preference (DPO over a group's better and worse images) on the noised
  final samples.
- ``dpo`` (:mod:`.dpo`): online Diffusion-DPO on each group's best and worst image.
- ``sft`` (:mod:`.sft`): online SFT / RAFT, the flow-matching loss on each group's best images.
- ``gdro`` (:mod:`.gdro`): GDRO's Plackett–Luce cross-entropy between a group's implicit rewards (reference-relative
  flow-matching errors) and its explicit rewards, for groups sampled once (``sampler.rollout: offline``).
- ``fpo`` (:mod:`.fpo`): FPO's clipped surrogate on the ratio of flow-matching losses (an ELBO ratio) against the
  epoch's sampling weights, on the noised final samples.

Add one with :func:`register_objective` on an :class:`Objective` subclass (see :mod:`.base`).
"""

from . import awm, clipped, dgpo, dpo, flash, fpo, gdro, guard, lagged, nft, sft, tempflow  # noqa: F401  (register the built-ins)
from .base import (
    OBJECTIVES,
    MicroBatch,
    Objective,
    available_objectives,
    get_objective,
    objective_sections,
    register_objective,
)

__all__ = [
    "OBJECTIVES",
    "MicroBatch",
    "Objective",
    "available_objectives",
    "get_objective",
    "objective_sections",
    "register_objective",
]
