"""The advantage seam: how an epoch's rewards become advantages, chosen by ``grpo.advantage.estimator``.

An estimator is a function registered by name::

    @register_advantage_estimator("my_estimator")
    def my_estimator(inputs: AdvantageInputs, settings) -> Tensor:   # settings: the grpo.advantage section
        ...                                                          # [N], or [N, W] per trained step

It sees every process's samples of the epoch at once (the trainer gathers them first) and returns one advantage per
sample, or one per sample and window step (``inputs.num_steps`` = W) for methods that credit steps separately. The
trainer makes one call, :func:`compute_advantages`, which also gives the groups the reward's NaN policy dropped an
advantage of 0 and keeps them out of the others' statistics, and applies ``grpo.advantage.diversity``
(:mod:`.diversity`, GARDO's diversity-aware shaping) to any estimator's advantages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..checks import one_of
from .diversity import amplify_diverse, diversity_features


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator sees: the epoch's rewards over all processes, in gathered order."""

    scores: Mapping[str, Tensor]  # reward name -> [N]; "total" is the weighted sum the config asks for
    weights: Mapping[str, float]  # reward name -> its weight in "total"
    group_ids: Tensor  # [N] the prompt group of each sample
    num_steps: int  # W: trained window steps per sample (0 when the objective trains the final samples only)
    # The rollout's per-sample extras (Trajectory.extras, gathered like the scores): e.g. "step_rewards" [N, S]
    extras: Mapping[str, Tensor] = field(default_factory=dict)


Estimator = Callable[[AdvantageInputs, Any], Tensor]
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}
# name -> (its settings class: the section grpo.advantage.<name>, its validation of a whole config)
_ESTIMATOR_SETTINGS: dict[str, tuple[type | None, Callable[[Any], None] | None]] = {}


def register_advantage_estimator(
    name: str, *, config_class: type | None = None, validate: Callable[[Any], None] | None = None
) -> Callable[[Estimator], Estimator]:
    """Decorator: make ``grpo.advantage.estimator: <name>`` compute the advantages with this function.

    ``config_class`` (a dataclass) adds the section ``grpo.advantage.<name>``; the estimator reads it as
    ``settings.<name>``. ``validate(config)`` refuses settings it cannot use (a ConfigError naming key and fix),
    called before anything loads when the estimator is chosen."""

    def register(fn: Estimator) -> Estimator:
        if name in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        _ESTIMATOR_SETTINGS[name] = (config_class, validate)
        return fn

    return register


def estimator_sections() -> dict[str, type]:
    """``grpo.advantage.<name>`` config sections: the settings class of every registered estimator that has one."""
    return {
        name: cls for name, (cls, _) in _ESTIMATOR_SETTINGS.items() if cls is not None and name in ADVANTAGE_ESTIMATORS
    }


def validate_estimator(config: Any) -> None:
    """The chosen estimator's own checks of ``config`` (none unless it registered a ``validate``)."""
    _, check = _ESTIMATOR_SETTINGS.get(config.grpo.advantage.estimator, (None, None))
    if check is not None:
        check(config)


def available_advantage_estimators() -> list[str]:
    """The names ``grpo.advantage.estimator`` accepts."""
    return sorted(ADVANTAGE_ESTIMATORS)


def get_advantage_estimator(name: str) -> Estimator:
    one_of("grpo.advantage.estimator", name, available_advantage_estimators())
    return ADVANTAGE_ESTIMATORS[name]


def advantage_extras(settings: Any, trajectory: Any) -> dict[str, Tensor]:
    """Per-sample tensors ``[B, ...]`` the advantage settings need besides the rewards, from this process's samples
    (``trajectory``), for the trainer to gather into :attr:`AdvantageInputs.extras`: ``grpo.advantage.diversity``'s
    image features; ``{}`` when nothing is needed."""
    return diversity_features(settings, trajectory)


def compute_advantages(settings: Any, inputs: AdvantageInputs, keep: Tensor) -> Tensor:
    """The estimator ``settings.estimator`` on the samples in ``keep`` ([N] bool: groups the NaN policy kept); the
    others get 0. [N] or [N, W] as the estimator returns, float32."""
    estimator = get_advantage_estimator(settings.estimator)
    n = len(inputs.group_ids)
    if not keep.any():
        return torch.zeros(n)
    kept = AdvantageInputs(
        {k: v[keep] for k, v in inputs.scores.items()},
        inputs.weights,
        inputs.group_ids[keep],
        inputs.num_steps,
        {k: v[keep] for k, v in inputs.extras.items()},
    )
    values = estimator(kept, settings).float()
    if values.shape[0] != int(keep.sum()) or values.ndim not in (1, 2):
        raise ValueError(
            f"advantage estimator {settings.estimator!r} returned shape {tuple(values.shape)} for "
            f"{int(keep.sum())} samples; expected [N] or [N, W]"
        )
    if settings.diversity.enabled:  # GARDO's diversity-aware shaping, whatever the estimator
        values = amplify_diverse(values, kept.extras, kept.group_ids, settings.clip)
    out = torch.zeros((n, *values.shape[1:]))
    out[keep] = values
    return out
