"""Which steps of the schedule are stochastic and trained (MixGRPO's sliding window, arXiv:2507.21802).

A window is a ``range`` of step indices; every other step is a plain ODE step. The last step
(index ``num_steps - 1``) is always ODE, so windows never go past ``num_steps - 2`` (``num_steps - 1 -
end_margin`` in general). The window is a pure function of the training iteration (and, for per-batch random
windows, the rollout batch) and the seed, so a resumed run sees the same windows.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Strategy = Literal["progressive", "random", "decay", "exp_decay"]
STRATEGIES = ("progressive", "random", "decay", "exp_decay")


class SlidingWindow:
    """Window of SDE (trained) steps as a function of the training iteration.

    Args:
        num_steps: sampling steps ``T`` of the schedule.
        size: steps in the window; ``0`` means every step but the last (plain Flow-GRPO).
        strategy: ``progressive`` — start moves by ``stride`` every ``shift_interval`` iterations and the
            window shrinks as it reaches the end; ``random`` — start drawn uniformly in
            ``[0, max_start]`` every iteration (Flow-GRPO-Fast: small size, ``max_start`` about T/2);
            ``decay`` / ``exp_decay`` — like progressive, but the iterations spent at start ``s`` shrink
            as ``shift_interval · (1 - decay_rate · relu(s - decay_threshold))`` or MixGRPO's
            ``shift_interval · exp(-decay_rate · relu(s - decay_threshold))`` (at least 1).
        shift_interval, stride: iterations per position and steps per move (progressive and decay strategies).
        roll_back: moving strategies go back to start 0 after the last position instead of staying there.
        seed: seeds the ``random`` strategy (together with the iteration).
        max_start: ``random`` only, the largest start (default: the last start where the full window fits).
        decay_rate, decay_threshold: ``decay`` / ``exp_decay``, the ``k`` and ``thr`` of the formulas above.
        end_margin: final steps no window reaches: 1 (default) keeps only the last step out; MixGRPO's code uses 2
            (its ``GRPOTrainingStates`` range stops before ``max_timesteps = sampling_steps - 2``).
    """

    def __init__(
        self,
        num_steps: int,
        size: int,
        *,
        strategy: Strategy = "progressive",
        shift_interval: int = 25,
        stride: int = 1,
        roll_back: bool = False,
        seed: int = 0,
        max_start: int | None = None,
        decay_rate: float = 0.1,
        decay_threshold: int = 0,
        end_margin: int = 1,
    ) -> None:
        if end_margin < 1:
            raise ValueError(f"end_margin must be >= 1 (the last step is always ODE), got {end_margin}")
        if num_steps < end_margin + 1:
            raise ValueError(
                f"num_steps must be >= {end_margin + 1} (the last {end_margin} step(s) are never in the window), "
                f"got {num_steps}"
            )
        trainable = num_steps - end_margin
        if size < 0:
            raise ValueError(f"window size must be >= 0 (0 = all steps but the last), got {size}")
        if size > trainable:
            raise ValueError(
                f"window size {size} exceeds the {trainable} trainable steps of a {num_steps}-step "
                f"schedule (the last {end_margin} step(s) are always ODE); use size <= {trainable} or 0 for all"
            )
        if strategy not in STRATEGIES:
            raise ValueError(f"window strategy must be one of {STRATEGIES}, got {strategy!r}")
        if shift_interval < 1 or stride < 1:
            raise ValueError(f"shift_interval and stride must be >= 1, got {shift_interval} and {stride}")
        if decay_rate < 0:
            raise ValueError(f"decay_rate must be >= 0, got {decay_rate}")
        self.num_steps = num_steps
        self.size = size or trainable
        self.strategy = strategy
        self.shift_interval = shift_interval
        self.stride = stride
        self.roll_back = roll_back
        self.seed = seed
        self.end_margin = end_margin
        self.last_index = num_steps - 1 - end_margin  # last step that may be stochastic
        full_window_max_start = trainable - self.size
        if max_start is not None and not 0 <= max_start <= full_window_max_start:
            raise ValueError(f"max_start must lie in [0, {full_window_max_start}], got {max_start}")
        self.max_start = full_window_max_start if max_start is None else max_start
        self.decay_rate = decay_rate
        self.decay_threshold = decay_threshold
        # Starts visited by the moving strategies, and how many iterations each one lasts.
        self._starts = list(range(0, self.last_index + 1, stride))
        self._dwell = [self._iterations_at(start) for start in self._starts]

    def _iterations_at(self, start: int) -> int:
        excess = max(start - self.decay_threshold, 0)
        if self.strategy == "decay":
            return max(1, round(self.shift_interval * (1 - self.decay_rate * excess)))
        if self.strategy == "exp_decay":
            return max(1, round(self.shift_interval * math.exp(-self.decay_rate * excess)))
        return self.shift_interval

    def start(self, iteration: int, batch: int | None = None) -> int:
        """First step index of the window at this training iteration.

        ``batch`` (``random`` only): the window of that rollout batch of the iteration (Flow-GRPO-Fast draws one
        per batch); batch ``b`` takes the ``b``-th draw of the iteration's generator, so batch 0 has the
        iteration's window and every value is a pure function of ``(seed, iteration, batch)``.
        """
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        if batch is not None:
            if self.strategy != "random":
                raise ValueError(f"per-batch windows need strategy 'random', not {self.strategy!r}")
            if batch < 0:
                raise ValueError(f"batch must be >= 0, got {batch}")
        if self.size == self.num_steps - self.end_margin:
            return 0
        if self.strategy == "random":
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + iteration)
            draws = torch.randint(0, self.max_start + 1, (1 if batch is None else batch + 1,), generator=generator)
            return int(draws[-1])
        cycle = sum(self._dwell)
        if self.roll_back:
            iteration %= cycle
        elif iteration >= cycle:
            return self._starts[-1]
        for start, dwell in zip(self._starts, self._dwell, strict=True):
            if iteration < dwell:
                return start
            iteration -= dwell
        raise AssertionError("unreachable: iteration lies within one cycle")

    def steps(self, iteration: int, batch: int | None = None) -> range:
        """Step indices sampled with the SDE (and trained) at this iteration (and rollout ``batch``, see
        :meth:`start`); shrinks near the end."""
        start = self.start(iteration, batch)
        return range(start, min(start + self.size, self.last_index + 1))

    def __repr__(self) -> str:
        return (
            f"SlidingWindow(num_steps={self.num_steps}, size={self.size}, strategy={self.strategy!r}, "
            f"shift_interval={self.shift_interval}, stride={self.stride}, roll_back={self.roll_back}, "
            f"end_margin={self.end_margin})"
        )


class NoWindow:
    """No SDE step: every step is an ODE step and nothing is stored (``grpo.objective: awm`` trains on the final
    samples only)."""

    def steps(self, iteration: int, batch: int | None = None) -> range:  # noqa: ARG002 (SlidingWindow's signature)
        return range(0, 0)

    def __repr__(self) -> str:
        return "NoWindow()"
