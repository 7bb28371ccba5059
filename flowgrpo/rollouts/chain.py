"""``sampler.rollout: chain``: one sampling chain per image, SDE inside the sampler's window and ODE elsewhere.

Rollout batches of ``sampler.batch_size`` images in the epoch's prompt order (:func:`flowgrpo.rollout.rollout` samples
each: shared prefix, window, post-window solver). The window (:class:`samplers.SlidingWindow`) is a function of the
epoch, or with ``sampler.window.per_batch`` of (epoch, global batch index) as Flow-GRPO-Fast draws it. Objectives that
train the final samples only (``rollout = "ode"``) get no window, every step the ODE, unless they take SDE rollouts
(``Objective.sde_final_samples``) and ``sampler.noise_level > 0``: then the window's steps use the SDE and nothing of
them is kept (the design-space study's SDE rollouts).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..rollout import StepObserver, Trajectory, make_window, rollout
from .base import Collected, RolloutStrategy, register_rollout

if TYPE_CHECKING:
    from ..data import EpochSample
    from .base import RolloutContext


@register_rollout("chain")
class Chain(RolloutStrategy):
    """Today's rollouts: independent chains per image (a group shares its prefix with ``same_initial_noise``)."""

    def __init__(self, context: RolloutContext) -> None:
        super().__init__(context)
        self.keep_transitions = context.objective.rollout == "sde_window"
        noisy = context.objective.sde_final_samples and context.config.sampler.noise_level > 0
        self.window = make_window(context.config, self.keep_transitions or noisy)

    def collect(self, epoch: int) -> Collected | None:
        ctx, cfg = self.context, self.context.config
        window = self.window.steps(epoch)
        slots = ctx.epoch_slots(epoch)
        num_batches = math.ceil(len(slots) / cfg.sampler.batch_size)
        starts: list[int] = []  # each batch's window start, for the metrics

        def sample(index: int, batch: list[EpochSample]) -> list[Trajectory]:
            prompts, metadata, sources = self.batch_inputs(batch)
            # Flow-GRPO-Fast: a new random window for every batch, a function of (seed, epoch, global batch index).
            batch_window = (
                self.window.steps(epoch, batch=ctx.rank * num_batches + index)
                if cfg.sampler.window.per_batch
                else window
            )
            starts.append(batch_window.start if batch_window else -1)
            trajectory = self.sample_batch(prompts, [s.group_id for s in batch], metadata, sources, batch_window)
            return [self.submit(trajectory)]  # scored while the next batch samples

        parts = self.sample_batches(slots, epoch, sample)
        if parts is None:
            return None
        start = sum(starts) / len(starts) if cfg.sampler.window.per_batch else starts[0]  # mean of the batches'
        return Collected(Trajectory.cat(parts), {"window/start": start, "window/size": len(window)})

    def sample_batch(
        self,
        prompts: list[str],
        group_ids: list[int],
        metadata: list[dict[str, Any]],
        sources: list[Any] | None,
        window: range,
        observe: StepObserver | None = None,
    ) -> Trajectory:
        """One rollout batch (:func:`flowgrpo.rollout.rollout` with the run's sampler; ``observe`` sees its window
        and post-window steps). A subclass adds to it (the dense rollout scores each stage's one-step prediction)
        without repeating the epoch's loop."""
        cfg = self.context.config
        return rollout(
            self.context.adapter,
            prompts,
            group_ids,
            cfg.sampler,
            window,
            self.context.generator,
            observe=observe,
            keep_transitions=self.keep_transitions,
            **self.sampling_options(metadata, sources),
        )
