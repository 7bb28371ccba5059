"""Advantage estimators, one registered function each (``grpo.advantage.estimator``); see :mod:`.base`.

Built in (:mod:`.group`): ``group`` (group mean and std), ``global_std`` (Flow-GRPO), ``per_reward`` (MixGRPO),
``centered`` (the group mean only, no std: Dr. GRPO; GDRO's targets);
per window step from the stage rewards of ``sampler.rollout: dense``: ``turning_point`` (:mod:`.tp`, TP-GRPO) and
``vgpo`` (:mod:`.vgpo`, VGPO); per tree edge from ``sampler.rollout: tree``: ``tree`` (:mod:`.tree`, BranchGRPO).
``grpo.advantage.diversity`` (:mod:`.diversity`, GARDO) reshapes any estimator's advantages.
"""

from . import tp, tree, vgpo  # noqa: F401  (register the per-step estimators)
from .base import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    advantage_extras,
    available_advantage_estimators,
    compute_advantages,
    estimator_sections,
    get_advantage_estimator,
    register_advantage_estimator,
    validate_estimator,
)
from .group import STD_EPS, centered, global_std, group_advantages, group_std, per_reward

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "STD_EPS",
    "AdvantageInputs",
    "advantage_extras",
    "available_advantage_estimators",
    "centered",
    "compute_advantages",
    "estimator_sections",
    "get_advantage_estimator",
    "global_std",
    "group_advantages",
    "group_std",
    "per_reward",
    "register_advantage_estimator",
    "validate_estimator",
]
