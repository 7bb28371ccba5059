"""The objective seam: what one training term of a micro-batch computes, chosen by ``grpo.objective``.

An objective is a class registered by name::

    @register_objective("my_objective")
    class MyObjective(Objective):
        config_class = MySettings          # optional dataclass: its section, grpo.my_objective.*
        rollout = "ode"                    # "sde_window": the window's SDE transitions are stored and re-scored
                                           # "ode": the rollout is the plain ODE, the final samples are trained

        def loss(self, adapter, batch):    # batch: MicroBatch -> (scalar to backward, {metric: scalar})
            ...

The trainer knows only this interface: it asks the objective which samples train this epoch
(:meth:`Objective.select_samples`), cuts them into micro-batches, asks each micro-batch for its terms
(:meth:`Objective.terms`, one backward each) and steps the optimizer. Everything a method needs beyond that — its
settings and their validation, what it refuses under sharded parameters, what the rollout must keep for it beyond
the log-probs (:attr:`Objective.needs_sampling_means`), state for one epoch (DiffusionNFT's old weights,
:meth:`Objective.begin_epoch`) — lives in its module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from ..batching import kept_samples, trained_count, trained_positions
from ..checks import ConfigError, one_of

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config
    from ..rollout import Trajectory

ROLLOUTS = ("sde_window", "ode")


@dataclass
class MicroBatch:
    """One loss term's inputs: a micro-batch of the epoch's samples and where this term trains them."""

    trajectory: Trajectory  # the micro-batch's B samples (latents, embeddings, stored transitions)
    advantages: Tensor  # [B], or [B, W] from an estimator with per-step advantages (W = the window's steps)
    positions: Tensor  # [B] window position each sample trains in this term (sde_window objectives), else term index
    generator: torch.Generator  # CPU, seeded per (epoch, process): draws such as σ and ε come from it


class Objective:
    """Base class of the registered objectives. Subclasses implement :meth:`loss`; the rest has defaults.

    The defaults reproduce Flow-GRPO's sample handling: every sample trains (or, with ``grpo.drop_zero_advantage``,
    those with a non-zero advantage), and each trains ``int(grpo.timestep_fraction × steps)`` of its ``steps``, in a
    random order per sample when ``grpo.shuffle_timesteps``.
    """

    name: ClassVar[str] = ""  # set by register_objective
    config_class: ClassVar[type | None] = None  # its settings, the section grpo.<name>
    rollout: ClassVar[str] = "sde_window"
    #: why the objective cannot run on parameters sharded over processes (DeepSpeed ZeRO, FSDP); None: it can
    refuses_sharded: ClassVar[str | None] = None

    def __init__(self, config: Config) -> None:
        self.config = config

    @property
    def settings(self) -> Any:
        """This objective's section of the config (``grpo.<name>``), or None without one."""
        return getattr(self.config.grpo, self.name) if self.config_class is not None else None

    @property
    def needs_sampling_means(self) -> bool:
        """Whether the rollout keeps each stored transition's mean under the sampling weights
        (``Trajectory.means``, [B, W, *latent] float32: as much memory as the stored latents again in fp32), for an
        objective that needs the old policy's mean rather than only its log-prob (GRPO-Guard). Off by default: the
        others would pay the memory for nothing."""
        return False

    @classmethod
    def validate(cls, config: Config) -> None:
        """Refuse settings this objective cannot use (a :class:`ConfigError` naming key and fix). Runs with the rest
        of the config's validation, before anything is loaded."""

    def steps(self, trajectory: Trajectory) -> int:
        """How many places each sample could train: the stored window's steps (sde_window objectives); one, the final
        sample, for ode objectives (awm and nft override it with their number of σ draws per sample)."""
        return trajectory.num_trained_steps if self.rollout == "sde_window" else 1

    def num_terms(self, trajectory: Trajectory) -> int:
        """Loss terms (backward passes) per micro-batch and pass over the samples."""
        steps = self.steps(trajectory)
        return trained_count(steps, self.config.grpo.timestep_fraction) if steps else 0

    def select_samples(self, advantages: Tensor, num_micro_batches: int, generator: torch.Generator) -> Tensor:
        """Indices of this process's samples that train this epoch (``advantages``: [N] or [N, W])."""
        if not self.config.grpo.drop_zero_advantage:
            return torch.arange(len(advantages))
        nonzero = advantages if advantages.ndim == 1 else advantages.abs().sum(dim=1)
        return kept_samples(nonzero, num_micro_batches, generator)

    def terms(self, trajectory: Trajectory, advantages: Tensor, generator: torch.Generator) -> Iterator[MicroBatch]:
        """The terms of one micro-batch, in training order. Lazy: the positions are drawn when the first term is asked
        for, after the previous micro-batch's losses drew theirs (the draw order is part of an exact resume)."""
        g = self.config.grpo
        positions = trained_positions(
            len(trajectory),
            self.steps(trajectory),
            generator,
            shuffle=g.shuffle_timesteps,
            fraction=g.timestep_fraction,
        )
        for j in range(positions.shape[1]):
            yield MicroBatch(trajectory, advantages, positions[:, j], generator)

    def begin_epoch(self, params: list[torch.nn.Parameter]) -> None:
        """Called before an epoch's first update with the trainable parameters (e.g. to keep the old weights)."""

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The scalar to backward for one term, and detached scalars to log as ``train/<key>`` (mean over the epoch's
        terms; keys ending in ``_min`` / ``_max`` take the minimum / maximum)."""
        raise NotImplementedError


OBJECTIVES: dict[str, type[Objective]] = {}


def register_objective(name: str):
    """Class decorator: make ``grpo.objective: <name>`` train with this :class:`Objective` subclass."""

    def register(cls: type[Objective]) -> type[Objective]:
        if name in OBJECTIVES and OBJECTIVES[name] is not cls:
            raise ValueError(f"objective {name!r} is already registered ({OBJECTIVES[name].__qualname__})")
        if not (isinstance(cls, type) and issubclass(cls, Objective)):
            raise TypeError(f"@register_objective({name!r}) decorates an Objective subclass, got {cls!r}")
        one_of(f"{cls.__qualname__}.rollout", cls.rollout, ROLLOUTS)
        cls.name = name
        OBJECTIVES[name] = cls
        return cls

    return register


def available_objectives() -> list[str]:
    """The names ``grpo.objective`` accepts."""
    return sorted(OBJECTIVES)


def get_objective(name: str) -> type[Objective]:
    """The objective class registered as ``name`` (a :class:`ConfigError` listing the others if none is)."""
    one_of("grpo.objective", name, available_objectives())
    return OBJECTIVES[name]


def objective_sections() -> dict[str, type]:
    """``grpo.<name>`` config sections: the settings class of every registered objective that has one."""
    return {name: cls.config_class for name, cls in OBJECTIVES.items() if cls.config_class is not None}


__all__ = [
    "ConfigError",
    "MicroBatch",
    "OBJECTIVES",
    "Objective",
    "available_objectives",
    "get_objective",
    "objective_sections",
    "register_objective",
]
