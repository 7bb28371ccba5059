"""The rollout seam: how an epoch's samples are produced, chosen by ``sampler.rollout``.

A rollout strategy is a class registered by name::

    @register_rollout("my_rollout")
    class MyRollout(RolloutStrategy):
        def collect(self, epoch: int) -> Collected | None: ...

``collect`` samples this process's share of the epoch, hands every batch of images to ``context.submit`` as soon as
it exists (rewards are scored in the background while the next batch samples) and returns the epoch's
:class:`~flowgrpo.rollout.Trajectory` with metrics about how it was produced; or None when ``context.should_stop()``
said so between batches (every process must see the same number of batches). :meth:`RolloutStrategy.sample_batches`
runs that loop; ``batch_inputs``, ``sampling_options`` and ``submit`` do a batch's common parts. The built-in
strategies are listed in :mod:`flowgrpo.rollouts`; a source of stored samples (``offline``) returns their stored
rewards as :attr:`Collected.scores` instead of submitting anything, and may keep files in ``context.run_dir`` (None
during the strategy's ``__init__``, which the trainer runs before the run directory exists; set before the first
``collect``). A
strategy with settings sets ``config_class`` (its section ``sampler.<name>.*``); what its estimator needs beyond the
rewards travels in ``Trajectory.extras``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..checks import one_of
from ..data import epoch_plan, rank_groups, rank_slice

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config
    from ..data import EpochSample, PromptDataset
    from ..objectives import Objective
    from ..rollout import Trajectory

Item = TypeVar("Item")  # what a strategy cuts into rollout batches: its slots, or slots with what it planned for each


@dataclass
class RolloutContext:
    """What a strategy may use; the same object for the whole run."""

    config: Config
    adapter: PipelineAdapter
    data: PromptDataset  # the training prompts
    objective: Objective  # what the samples will train (its ``rollout``: whether SDE transitions are stored)
    generator: torch.Generator  # this process's rollout noise, re-seeded every epoch by the trainer
    rank: int
    num_processes: int
    # (images, prompts, metadata, source images or None): score in the background
    submit: Callable[[Tensor, list[str], list[dict[str, Any]], Tensor | None], None]
    should_stop: Callable[[], bool]  # a collective: every process gets the same answer
    progress: bool = False  # show progress bars
    # (images, prompts, metadata, source images or None) -> the reward's scores now, in this thread ("total": [B]):
    # for strategies that score intermediate predictions (dense step rewards) rather than only the final images
    score: Callable[[Tensor, list[str], list[dict[str, Any]], Tensor | None], dict[str, Tensor]] | None = None
    # The run's directory, for files a strategy keeps (an offline store it samples). None while the strategy is built:
    # the trainer builds it before the run directory exists (what its __init__ refuses leaves none) and sets this
    # field once the directory does, before the first collect().
    run_dir: Path | None = None

    def epoch_slots(self, epoch: int) -> list[EpochSample]:
        """This process's (prompt, group) slots of the epoch: ``grpo.groups_per_epoch`` prompts drawn from
        ``(run.seed, epoch)``, ``grpo.group_size`` images each, dealt over processes (in whole groups when the
        objective compares a group's images); with ``sampler.antithetic``, a group's images two by two side by side."""
        g, seed, pairs = self.config.grpo, self.config.run.seed, self.config.sampler.antithetic
        plan = epoch_plan(len(self.data), g.group_size, g.groups_per_epoch, seed=seed, epoch=epoch, pairs=pairs)
        deal = rank_groups if self.objective.needs_whole_groups(self.config) else rank_slice
        return deal(plan, self.rank, self.num_processes)


@dataclass
class Collected:
    """An epoch's samples on this process, and metrics (``name: value``) about how they were produced."""

    trajectory: Trajectory
    metrics: dict[str, float]
    # The rewards of the trajectory's samples when the strategy already has them ("total" and one per reward, [B]
    # each, in the trajectory's order: an offline store's); None: the reward scores what was submitted.
    scores: dict[str, Tensor] | None = None


class RolloutStrategy:
    """Base class of the registered rollout strategies: built once per run, ``collect`` once per epoch."""

    name: str = ""
    config_class: type | None = None  # optional dataclass: its section, sampler.<name>

    def __init__(self, context: RolloutContext) -> None:
        self.context = context

    @classmethod
    def validate(cls, config: Config, world_size: int = 1) -> None:  # noqa: ARG003 (the default needs no setting)
        """Refuse settings this strategy cannot use at ``world_size`` processes (a ConfigError naming key and fix),
        before anything loads; reads only what is cheap to read (files are checked in full in ``__init__``, which
        runs before the run directory exists). The count reaches an override as ``world_size`` (a parameter of that
        name, positional or keyword-only, or ``**kwargs``); one written as ``validate(cls, config)`` still works: it
        is then called without the count (:func:`validate_rollout`)."""

    def collect(self, epoch: int) -> Collected | None:
        raise NotImplementedError

    def sample_batches(
        self, items: Sequence[Item], epoch: int, sample: Callable[[int, list[Item]], list[Trajectory]]
    ) -> list[Trajectory] | None:
        """The epoch's loop: ``items`` (this process's share, in sampling order) cut into rollout batches of
        ``sampler.batch_size``, and ``sample(index, batch)`` on each in turn (a progress bar over them), which samples
        the batch, hands each part to :meth:`submit` as soon as it exists and returns the parts. All the parts in
        order; None when ``context.should_stop()`` said so after a batch (every process has the same number of
        batches: validated)."""
        ctx = self.context
        size = ctx.config.sampler.batch_size
        batches = [list(items[i : i + size]) for i in range(0, len(items), size)]
        parts: list[Trajectory] = []
        for index, batch in enumerate(tqdm(batches, desc=f"sampling e{epoch}", leave=False, disable=not ctx.progress)):
            parts.extend(sample(index, batch))
            if ctx.should_stop():
                return None
        return parts

    def batch_inputs(self, slots: Sequence[EpochSample]) -> tuple[list[str], list[dict[str, Any]], list[Any] | None]:
        """The prompts of ``slots``, copies of their metadata, and their source images (image editing, else None)."""
        data = self.context.data
        indices = [s.prompt_index for s in slots]
        return [data.prompts[i] for i in indices], [dict(data.metadata[i]) for i in indices], data.sources_of(indices)

    def sampling_options(self, metadata: list[dict[str, Any]], sources: list[Any] | None) -> dict[str, Any]:
        """The keyword arguments every rollout function takes from the run's settings (the image size, ``model.size``,
        ``grpo.log_prob_reduce``, ``run.seed`` for the noise), from the objective (``store_means``: whether it needs
        each stored transition's sampling mean, :attr:`~flowgrpo.objectives.Objective.needs_sampling_means`) and from
        the batch (its metadata and source images)."""
        cfg = self.context.config
        height, width = cfg.model.size
        return {
            "store_means": self.context.objective.needs_sampling_means,
            "height": height,
            "width": width,
            "log_prob_reduce": cfg.grpo.log_prob_reduce,
            "noise_seed": cfg.run.seed,
            "metadata": metadata,
            "sources": sources,
        }

    def submit(self, trajectory: Trajectory) -> Trajectory:
        """Hand a sampled batch's images to the reward, scored in the background while the next batch samples (editing
        rewards also see each sample's source image); then keep them on the CPU, for image grids only (frees the
        device memory)."""
        self.context.submit(trajectory.images, trajectory.prompts, trajectory.metadata, trajectory.source_images)
        trajectory.images = trajectory.images.cpu()
        return trajectory


ROLLOUTS: dict[str, type[RolloutStrategy]] = {}


def register_rollout(name: str):
    """Class decorator: make ``sampler.rollout: <name>`` produce the epochs' samples with this strategy."""

    def register(cls: type[RolloutStrategy]) -> type[RolloutStrategy]:
        if name in ROLLOUTS and ROLLOUTS[name] is not cls:
            raise ValueError(f"rollout strategy {name!r} is already registered ({ROLLOUTS[name].__qualname__})")
        cls.name = name
        ROLLOUTS[name] = cls
        return cls

    return register


def rollout_sections() -> dict[str, type]:
    """``sampler.<name>`` config sections: the settings class of every registered strategy that has one."""
    return {name: cls.config_class for name, cls in ROLLOUTS.items() if cls.config_class is not None}


def available_rollouts() -> list[str]:
    """The names ``sampler.rollout`` accepts."""
    return sorted(ROLLOUTS)


def get_rollout(name: str) -> type[RolloutStrategy]:
    one_of("sampler.rollout", name, available_rollouts())
    return ROLLOUTS[name]


def validate_rollout(config: Config, world_size: int = 1) -> None:
    """``sampler.rollout``'s own checks (:meth:`RolloutStrategy.validate`) at ``world_size`` processes, passed as
    ``world_size=`` to a ``validate`` with a parameter of that name (positional or keyword-only) or ``**kwargs``; one
    without (the hook's older form, the config only) is called without the count."""
    check = get_rollout(config.sampler.rollout).validate
    params = inspect.signature(check).parameters
    named = params.get("world_size")
    if named is not None and named.kind is named.POSITIONAL_ONLY:
        check(config, world_size)
    elif named is not None or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        check(config, world_size=world_size)
    else:
        check(config)
