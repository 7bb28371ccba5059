"""Wall-clock time of the training loop's phases, for the epoch metrics and ``scripts/bench.py epoch``.

The trainer records each phase of an epoch (``sampling``, ``reward_wait``, ``advantages``, ``training``,
``checkpoint``, ``eval``) and marks where each epoch starts. Host ``perf_counter`` only: no device
synchronisation is added, so on an accelerator a phase ends when the host moves on; the phases that read
results back (the reward wait reads the images, training reads each loss) include the device work they wait for.
Time inside an epoch that no phase covers (logging, image grids, signal agreement, Python overhead) is idle.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

PHASES = ("sampling", "reward_wait", "advantages", "training", "checkpoint", "eval")


class Span(NamedTuple):
    phase: str  # one of PHASES, or "epoch" (a zero-length mark at an epoch's start) / "end" (after the last epoch)
    start: float  # time.perf_counter() seconds
    end: float


class PhaseTimer:
    """Spans of the most recent ``max_spans`` phases; ``add`` after the fact or ``with timer("phase"):``."""

    def __init__(self, max_spans: int = 4096) -> None:
        self.spans: deque[Span] = deque(maxlen=max_spans)

    def add(self, phase: str, start: float) -> float:
        """Record ``phase`` as running from ``start`` (a ``perf_counter`` reading) until now; its seconds."""
        end = time.perf_counter()
        self.spans.append(Span(phase, start, end))
        return end - start

    def mark(self, phase: str) -> None:
        """A zero-length span: where an epoch starts (``"epoch"``) or the loop ends (``"end"``)."""
        now = time.perf_counter()
        self.spans.append(Span(phase, now, now))

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, start)

    def epochs(self) -> list[dict[str, float]]:
        """One breakdown per complete epoch (from an ``epoch`` mark to the next mark): seconds of each phase,
        ``wall`` and ``idle`` (wall minus the phases)."""
        marks = [s for s in self.spans if s.phase in ("epoch", "end")]
        out = []
        for begin, end in zip(marks, marks[1:], strict=False):
            if begin.phase != "epoch":
                continue
            row = dict.fromkeys(PHASES, 0.0)
            for span in self.spans:
                if span.phase in row and begin.start <= span.start and span.end <= end.start:
                    row[span.phase] += span.end - span.start
            row["wall"] = end.start - begin.start
            row["idle"] = row["wall"] - sum(row[p] for p in PHASES)
            out.append(row)
        return out

    def summary(self) -> str:
        """The seconds of each phase over the complete epochs this timer saw, as one line (the run's cost split:
        sampling against training, for instance)."""
        rows = self.epochs()
        totals = {p: sum(r[p] for r in rows) for p in PHASES}
        shown = ", ".join(f"{p.replace('_', ' ')} {totals[p]:.1f} s" for p in PHASES)
        return f"time over {len(rows)} epoch(s): {shown}, wall {sum(r['wall'] for r in rows):.1f} s"
