"""Rollout strategies: how an epoch's samples are produced, one registered class each (``sampler.rollout``).

Built in: ``chain`` (:mod:`.chain`); ``branch`` (:mod:`.branch`, TempFlow-GRPO's trajectory branching);
``iso_temporal`` (:mod:`.iso`, Flash-GRPO's iso-temporal grouping); ``dense``
(:mod:`.dense`, the chain plus a reward for every stage of the window: TP-GRPO, VGPO); ``entropy_merge``
(:mod:`.merged`, E-GRPO's merged SDE step on a branch rollout); ``tree`` (:mod:`.tree`, BranchGRPO); ``offline``
(:mod:`.offline`, groups sampled once and served from a store: GDRO). Add one
with :func:`register_rollout` on a :class:`RolloutStrategy` subclass (see :mod:`.base`). The per-batch sampler
itself (SDE/ODE steps, window, prefix) is :mod:`flowgrpo.rollout`.
"""

from ..rollout import make_window
from . import branch, chain, dense, iso, merged, offline, tree  # noqa: F401  (register the built-in strategies)
from .base import (
    ROLLOUTS,
    Collected,
    RolloutContext,
    RolloutStrategy,
    available_rollouts,
    get_rollout,
    register_rollout,
    rollout_sections,
    validate_rollout,
)

__all__ = [
    "ROLLOUTS",
    "Collected",
    "RolloutContext",
    "RolloutStrategy",
    "available_rollouts",
    "get_rollout",
    "make_window",
    "register_rollout",
    "rollout_sections",
    "validate_rollout",
]
