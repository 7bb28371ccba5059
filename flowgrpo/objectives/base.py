"""The objective seam: what one training term of a micro-batch computes, chosen by ``grpo.objective``.

An objective is a class registered by name::

    @register_objective("my_objective")
    class MyObjective(Objective):
        config_class = MySettings          # optional dataclass: its section, grpo.my_objective.*
        rollout = "ode"                    # "sde_window": the window's SDE transitions are stored and re-scored
                                           # "ode": the rollout is the plain ODE, the final samples are trained
                                           # (SDE window steps, not kept, with sde_final_samples and noise > 0)
        samples_from_current_weights = False  # True: the loss assumes the epoch's samples were drawn with the
                                              # weights its training compares with (old weights, a likelihood
                                              # ratio): refused on samples drawn once (sampler.rollout: offline)

        def loss(self, adapter, batch):    # batch: MicroBatch -> (scalar to backward, {metric: scalar})
            ...

The trainer knows only this interface: it asks the objective which samples train this epoch
(:meth:`Objective.select_samples`) and how they form micro-batches (:meth:`Objective.micro_batches`), asks each
micro-batch for its terms
(:meth:`Objective.terms`, one backward each) and steps the optimizer. Everything a method needs beyond that — its
settings and their validation, what it refuses under sharded parameters, what the rollout must keep for it beyond
the log-probs (:attr:`Objective.needs_sampling_means`), whether its loss compares the images of a group
(:meth:`Objective.needs_whole_groups`: pairs, group sums), state for one epoch (DiffusionNFT's old weights,
:meth:`Objective.begin_epoch`; and carried across epochs, :meth:`Objective.sampling_weights`,
:meth:`Objective.checkpoint_weights`), whether its samples must come from the weights being trained
(:attr:`Objective.samples_from_current_weights`) — lives in its module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from ..batching import group_micro_batches, kept_samples, micro_batches, trained_count, trained_positions
from ..checks import ConfigError, one_of

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config
    from ..rollout import Trajectory

ROLLOUTS = ("sde_window", "ode")
_AUTO_FLAG = "_samples_from_current_weights_auto"  # in a class's __dict__: its flag was set by __init_subclass__


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
    #: an ``ode`` objective that takes SDE rollouts: with ``sampler.noise_level > 0`` the window's steps sample with
    #: the SDE and nothing of them is kept (the forward-process objectives, :mod:`.forward`); False: the plain ODE
    #: whatever the noise level
    sde_final_samples: ClassVar[bool] = False
    #: why the objective cannot run on parameters sharded over processes (DeepSpeed ZeRO, FSDP); None: it can
    refuses_sharded: ClassVar[str | None] = None
    #: whether the loss assumes that the epoch's samples were drawn with the trainable weights as the epoch's training
    #: begins (stored log-probs, old weights, a likelihood ratio): then it cannot train on samples drawn once by
    #: another model (``sampler.rollout: offline``). True for every ``sde_window`` objective (set by
    #: ``__init_subclass__`` from the rollout unless the class or a base class sets it: a value set that way is no
    #: choice, so an ``ode`` subclass of an ``sde_window`` objective gets False), and for nft and fpo (their old
    #: weights). The offline rollout refuses every ``sde_window`` objective whatever it says (the store holds no SDE
    #: transitions).
    samples_from_current_weights: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        chosen = any(
            "samples_from_current_weights" in c.__dict__ and not c.__dict__.get(_AUTO_FLAG, False)
            for c in cls.__mro__
            if c is not Objective
        )
        if not chosen:  # set from the rollout, and marked so that a subclass does not count it as a class's choice
            cls.samples_from_current_weights = cls.rollout == "sde_window"  # it re-scores stored log-probs
            setattr(cls, _AUTO_FLAG, True)

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

    @classmethod
    def validate_updates(cls, config: Config, steps_per_epoch: int) -> None:
        """Refuse a config whose ``steps_per_epoch`` optimizer steps per epoch (all ``train.inner_epochs`` passes, at
        the validated process count) this objective cannot learn with. Runs after the batch arithmetic is checked."""

    @classmethod
    def needs_whole_groups(cls, config: Config) -> bool:  # noqa: ARG003 (the default needs no setting)
        """Whether the loss compares the images of one group (best against worst, a sum over the group): then each
        process samples whole groups (:func:`~flowgrpo.data.rank_groups`) and every micro-batch holds whole groups
        (:meth:`micro_batches`), which :func:`check_whole_groups` makes possible before anything loads. Off by
        default: a group may then span processes and micro-batches."""
        return False

    def steps(self, trajectory: Trajectory) -> int:
        """How many places each sample could train: the stored window's steps (sde_window objectives); one, the final
        sample, for ode objectives (awm and nft override it with their number of σ draws per sample)."""
        return trajectory.num_trained_steps if self.rollout == "sde_window" else 1

    def num_terms(self, trajectory: Trajectory) -> int:
        """Loss terms (backward passes) per micro-batch and pass over the samples."""
        steps = self.steps(trajectory)
        return trained_count(steps, self.config.grpo.timestep_fraction) if steps else 0

    def select_samples(
        self,
        advantages: Tensor,
        num_micro_batches: int,
        generator: torch.Generator,
        group_ids: Tensor | None = None,  # noqa: ARG002 (for objectives that select within groups)
    ) -> Tensor:
        """Indices of this process's samples that train this epoch (``advantages``: [N] or [N, W]; ``group_ids``:
        [N], each sample's group)."""
        if not self.config.grpo.drop_zero_advantage:
            return torch.arange(len(advantages))
        nonzero = advantages if advantages.ndim == 1 else advantages.abs().sum(dim=1)
        return kept_samples(nonzero, num_micro_batches, generator)

    def micro_batches(
        self, samples: Tensor, group_ids: Tensor, num_micro_batches: int, generator: torch.Generator
    ) -> list[Tensor]:
        """The selected ``samples`` (indices) cut into ``num_micro_batches`` micro-batches of equal size in a random
        order; of whole groups, each group's samples in the order :meth:`select_samples` gave them, when
        :meth:`needs_whole_groups` (``group_ids``: [N], each sample's group)."""
        if self.needs_whole_groups(self.config):
            return group_micro_batches(samples, group_ids, num_micro_batches, generator)
        return micro_batches(samples, num_micro_batches, generator)

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

    def sampling_weights(self, params: list[torch.nn.Parameter], step: int) -> AbstractContextManager[None]:
        """The context the epoch's rollout runs in, after ``step`` optimizer steps: the weights it samples with.
        Default: the trainable weights as they are (DiffusionNFT's soft update swaps in its old weights)."""
        return contextlib.nullcontext()

    def begin_epoch(self, params: list[torch.nn.Parameter]) -> None:
        """Called before an epoch's first update with the trainable parameters (e.g. to keep the old weights)."""

    def checkpoint_weights(self) -> list[Tensor] | None:
        """Weights the objective carries from epoch to epoch, in the trainable parameters' order, for a checkpoint to
        save (``old_weights.safetensors``); None: none."""
        return None

    def restore_weights(self, saved: list[Tensor] | None, params: list[torch.nn.Parameter]) -> str | None:
        """Take back what :meth:`checkpoint_weights` saved (None: the checkpoint holds none); a warning to print, or
        None."""
        return None

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


def check_whole_groups(config: Config, world_size: int) -> None:
    """An objective that compares a group's images (:meth:`Objective.needs_whole_groups`) needs each group on one
    process and whole groups in every micro-batch: the groups must split evenly over the processes and
    ``train.batch_size`` must be a multiple of the group size."""
    g, t, name = config.grpo, config.train, config.grpo.objective
    if g.groups_per_epoch % world_size:
        raise ConfigError(
            f"grpo.objective={name} compares the images of a group, so each process samples whole groups: "
            f"grpo.groups_per_epoch={g.groups_per_epoch} must be a multiple of the {world_size} processes; set "
            f"grpo.groups_per_epoch: {-(-g.groups_per_epoch // world_size) * world_size}"
        )
    if t.batch_size % g.group_size:
        raise ConfigError(
            f"grpo.objective={name} trains whole groups in every micro-batch: train.batch_size={t.batch_size} must be "
            f"a multiple of grpo.group_size={g.group_size}; set train.batch_size: "
            f"{max(1, round(t.batch_size / g.group_size)) * g.group_size}"
        )


def check_own_selection(config: Config) -> None:
    """An objective that trains whole groups or picks its own samples within each group (best and worst, the top k)
    cannot take Flow-GRPO's zero-advantage filter, which drops single samples: refuse ``grpo.drop_zero_advantage``."""
    if config.grpo.drop_zero_advantage:
        raise ConfigError(
            f"grpo.objective={config.grpo.objective} trains whole groups or picks its own samples within each group, "
            "so grpo.drop_zero_advantage=true (which drops single samples) does not apply; set "
            "grpo.drop_zero_advantage: false"
        )


def objective_sections() -> dict[str, type]:
    """``grpo.<name>`` config sections: the settings class of every registered objective that has one."""
    return {name: cls.config_class for name, cls in OBJECTIVES.items() if cls.config_class is not None}


__all__ = [
    "ConfigError",
    "MicroBatch",
    "OBJECTIVES",
    "Objective",
    "available_objectives",
    "check_own_selection",
    "check_whole_groups",
    "get_objective",
    "objective_sections",
    "register_objective",
]
