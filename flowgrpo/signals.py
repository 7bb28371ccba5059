"""Pre-emption: SIGTERM / SIGINT finish the current optimizer step, every process agrees, the trainer checkpoints and
exits cleanly."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator


class StopRequest:
    """A pre-emption request. Signal handlers set it at any instant, also while this process waits inside a
    collective; the processes agree on it only at step boundaries, and once agreed it stays set.

    A signal that lands during an agreement's all-gather counts at the next one: read once before the gather,
    never overwritten by its result (overwriting lost the request when every process got it mid-gather).
    """

    #: a second SIGINT at least this long after the first stops at once (a person pressing Ctrl-C again);
    #: quicker repeats are the same request delivered twice (the terminal and then the launcher).
    interrupt_again_after_s = 2.0

    def __init__(self) -> None:
        self.first_signal_at: float | None = None
        self.agreed = False

    @property
    def received(self) -> bool:
        return self.first_signal_at is not None

    def on_signal(self, signum: int) -> bool:
        """Record a signal; True when it asks to stop now rather than after the current step."""
        now = time.monotonic()
        if self.first_signal_at is None:
            self.first_signal_at = now
            return False
        # SIGTERM never escalates: schedulers and launchers may each deliver it, and they SIGKILL after a grace.
        return signum == signal.SIGINT and now - self.first_signal_at >= self.interrupt_again_after_s

    def agree(self, any_process: Callable[[bool], bool]) -> bool:
        """Whether any process has received a signal (``any_process``: a collective); the same answer everywhere."""
        self.agreed = self.agreed or any_process(self.received)
        return self.agreed


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest) -> Iterator[None]:
    """While the block runs, SIGTERM / SIGINT set ``stop`` (the loop checkpoints and exits at the next step boundary);
    a second Ctrl-C, a while after the first, raises KeyboardInterrupt at once. The previous handlers come back."""

    def request_stop(signum, frame):  # noqa: ARG001
        # No printing here: a handler that runs inside print() would make a reentrant call on stdout.
        if stop.on_signal(signum):
            raise KeyboardInterrupt

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, request_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
