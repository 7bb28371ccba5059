"""``sampler.rollout: iso_temporal``: Flash-GRPO's iso-temporal grouping (He et al., arXiv:2605.15980).

Every group of the epoch is sampled with the SDE (and trained) at one place of the schedule, drawn per group: all of
the group's images share that step, so its advantages compare images whose stochasticity entered at the same time and
the difficulty of a timestep cannot confound them (the paper's "timestep-confounded variance"). Different groups of
the epoch are at different steps, so an epoch still covers the schedule. Everywhere else a chain is the ODE, as in
:mod:`.chain`: with ``sampler.same_initial_noise`` a group's images share the ODE prefix up to their step (computed
once per group of a rollout batch, ``sampler.shared_prefix``) and differ only by that step's SDE noise.

**The draw.** Group ``g`` of the epoch (``g = group_id − epoch · grpo.groups_per_epoch``) starts its window at the
``g``-th value of ``torch.randint(0, max_start + 1, (groups_per_epoch,), generator)``, uniform over
``0..sampler.window.max_start``, with the generator seeded by numpy's ``SeedSequence([run.seed, epoch, 0x150])``
(:func:`group_starts`): a pure function of (seed, epoch, g), so every process holding a copy of the group and a
resumed run agree, and a stream of its own. (The window strategies' ``random`` draw, seeded ``run.seed · 1_000_003 +
epoch``, coincides for seed 0 with the epoch plan's ``run.seed · 100_003 + epoch``, and drawn per group it correlates
with the prompts the plan chose: on the shapes prompts (396, 16 groups, starts 0..4, 300 epochs) prompt indices ≡ 0
mod 5 took start 4 more than twice as often as any other start.)
``sampler.window.size`` steps from there are SDE and stored; Flash-GRPO trains one (size 1).

**Batches.** This process's slots (the epoch's order, as :mod:`.chain`) are sorted by their group's window start
(stably) and cut into rollout batches of ``sampler.batch_size``, so groups at the same step sample together; each
batch is sampled with one :func:`flowgrpo.rollout.rollout` call per distinct window in it (usually one or two), and
rewards are submitted per call, in the trajectory's row order. Every process has as many batches as with ``chain``.

**Against the reference** (github.com/Shredded-Pork/Flash-GRPO, ``scripts/train_wanx2_1_flash.py`` @8cfc973): there
rank 0 draws one step per prompt with Python's ``random.choices`` over the first 10 of 20 steps and broadcasts the
dictionary; here the draw is a seeded function of the group, with no collective. The reference's group members start
from their own initial noise (``prepare_latents`` draws every clip); ``same_initial_noise`` chooses either.

Refused: objectives that train the final samples only (nothing stored), windows that are not ``random`` or are drawn
per rollout batch, and FSDP (its forwards are collectives, and processes whose batches split at different steps run
different numbers of forwards; DDP and DeepSpeed ZeRO-2 run them independently).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from samplers import SlidingWindow

from ..checks import ConfigError
from ..rollout import Trajectory
from .base import Collected, register_rollout
from .chain import Chain

if TYPE_CHECKING:
    from ..config import Config
    from ..data import EpochSample
    from .base import RolloutContext


#: mixed into the draw's seed: the iso-temporal stream is none of the other generators'
ISO_STREAM = 0x150


def group_starts(seed: int, epoch: int, groups_per_epoch: int, max_start: int) -> Tensor:
    """The window start of each of the epoch's groups, ``[groups_per_epoch]`` long: ``torch.randint(0, max_start + 1,
    (groups_per_epoch,))`` from a generator seeded by ``np.random.SeedSequence([seed, epoch, ISO_STREAM])``."""
    state = int(np.random.SeedSequence([seed, epoch, ISO_STREAM]).generate_state(1)[0])
    return torch.randint(0, max_start + 1, (groups_per_epoch,), generator=torch.Generator().manual_seed(state))


def group_windows(
    window: SlidingWindow, seed: int, epoch: int, group_ids: Iterable[int], groups_per_epoch: int
) -> dict[int, range]:
    """``{group_id: window}`` for the epoch's groups: ``window.size`` steps from the group's :func:`group_starts`
    (``window``: the sampler's, a ``random`` one, whose ``max_start`` keeps every window whole)."""
    first = epoch * groups_per_epoch
    starts = group_starts(seed, epoch, groups_per_epoch, window.max_start).tolist()
    windows: dict[int, range] = {}
    for group_id in sorted(set(group_ids)):
        index = group_id - first
        if not 0 <= index < groups_per_epoch:
            raise ValueError(
                f"group id {group_id} is not one of epoch {epoch}'s groups {first}..{first + groups_per_epoch - 1}"
            )
        windows[group_id] = range(starts[index], starts[index] + window.size)
    return windows


def split_by_window(slots: list[EpochSample], windows: dict[int, range]) -> list[tuple[range, list[EpochSample]]]:
    """The slots of one rollout batch as ``(window, slots)`` parts, one per distinct window (by start), each keeping
    the batch's order."""
    parts: dict[int, tuple[range, list[EpochSample]]] = {}
    for slot in slots:
        window = windows[slot.group_id]
        parts.setdefault(window.start, (window, []))[1].append(slot)
    return [parts[start] for start in sorted(parts)]


@register_rollout("iso_temporal")
class IsoTemporal(Chain):
    """One SDE window per group, drawn per group (Flash-GRPO's iso-temporal grouping); ODE elsewhere. Each part of a
    rollout batch that shares a window is sampled as the chain rollout samples a batch (:meth:`Chain.sample_batch`)."""

    def __init__(self, context: RolloutContext) -> None:
        super().__init__(context)
        assert isinstance(self.window, SlidingWindow)  # validate() refused objectives that store nothing

    @classmethod
    def validate(cls, config: Config, world_size: int = 1) -> None:  # noqa: ARG003 (no per-process setting)
        from ..objectives import get_objective  # the objective's class: does it store the window's transitions?

        w = config.sampler.window
        objective = config.grpo.objective
        if get_objective(objective).rollout != "sde_window":
            raise ConfigError(
                f"sampler.rollout=iso_temporal places each group's SDE step, but grpo.objective={objective} trains the "
                "final samples of a plain ODE rollout (nothing stored); use sampler.rollout: chain"
            )
        if w.size < 1:
            raise ConfigError(
                "sampler.rollout=iso_temporal draws a window per group; sampler.window.size: 0 means every step "
                "(the same for every group): set window.size: 1 (Flash-GRPO) or more"
            )
        if w.strategy != "random":
            raise ConfigError(
                f"sampler.rollout=iso_temporal draws each group's window uniformly over starts 0..window.max_start "
                f"and needs sampler.window.strategy: random, got {w.strategy!r}"
            )
        if w.per_batch:
            raise ConfigError(
                "sampler.window.per_batch=true draws a window per rollout batch, but sampler.rollout=iso_temporal "
                "draws one per group; set per_batch: false"
            )
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            raise ConfigError(
                "sampler.rollout=iso_temporal cannot run under FSDP: its forwards gather the sharded weights "
                "(collectives), and processes whose rollout batches split at different steps run different numbers "
                "of them; launch with DDP (configs/accelerate/multi_gpu.yaml) or DeepSpeed ZeRO-2, or use "
                "sampler.rollout: chain"
            )

    def collect(self, epoch: int) -> Collected | None:
        ctx, cfg = self.context, self.context.config
        slots = ctx.epoch_slots(epoch)
        group_ids = [s.group_id for s in slots]
        windows = group_windows(self.window, cfg.run.seed, epoch, group_ids, cfg.grpo.groups_per_epoch)
        slots = sorted(slots, key=lambda slot: windows[slot.group_id].start)  # stable: same-step groups together

        def sample(index: int, batch: list[EpochSample]) -> list[Trajectory]:
            return [self._sample(members, window) for window, members in split_by_window(batch, windows)]

        parts = self.sample_batches(slots, epoch, sample)  # should_stop once per batch, not per part
        if parts is None:
            return None
        trajectory = Trajectory.cat(parts)
        starts = trajectory.step_indices[:, 0].float()
        metrics = {
            "window/start": starts.mean().item(),  # mean over this process's samples
            "window/start_min": starts.min().item(),
            "window/start_max": starts.max().item(),
            "window/size": trajectory.num_trained_steps,
        }
        return Collected(trajectory, metrics)

    def _sample(self, slots: list[EpochSample], window: range) -> Trajectory:
        """Sample ``slots`` (groups that share ``window``) and hand the images to the reward scorer."""
        prompts, metadata, sources = self.batch_inputs(slots)
        return self.submit(self.sample_batch(prompts, [s.group_id for s in slots], metadata, sources, window))
