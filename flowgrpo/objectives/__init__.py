"""Objectives: what the trainer minimises, one registered module each (``grpo.objective``).

- ``clipped`` (:mod:`.clipped`): Flow-GRPO's per-timestep clipped ratio on the stored SDE transitions.
- ``awm`` (:mod:`.awm`): advantage-weighted flow matching on the noised final samples.
- ``nft`` (:mod:`.nft`): DiffusionNFT's negative-aware loss on the same noised samples.
- ``flash`` (:mod:`.flash`): Flash-GRPO's single-step clipped ratio with temporal gradient rectification.
- ``tempflow`` (:mod:`.tempflow`): TempFlow-GRPO's noise-aware weights on the clipped per-step loss.

Add one with :func:`register_objective` on an :class:`Objective` subclass (see :mod:`.base`).
"""

from . import awm, clipped, flash, guard, nft, tempflow  # noqa: F401  (register the built-in objectives)
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
