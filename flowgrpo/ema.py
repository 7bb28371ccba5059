"""Exponential moving average of the trainable (adapter) weights, kept in float32."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


class EMA:
    """``shadow ← shadow + (1 - d)·(p - shadow)``.

    ``step(params, s)`` follows Flow-GRPO's ``EMAModuleWrapper.step`` (called after every training micro-batch, or
    after every optimizer step with ``train.ema_stepping: optimizer_step``, with the optimizer step count ``s``): it
    moves only when ``(s + 1) % update_every == 0``, with decay ``d = min((1 + s) / (10 + s), decay)`` when ``warmup``
    is set, else ``decay``.
    """

    def __init__(
        self, params: Iterable[torch.nn.Parameter], decay: float, *, update_every: int = 1, warmup: bool = False
    ) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"EMA decay must lie in [0, 1), got {decay}")
        if update_every < 1:
            raise ValueError(f"EMA update_every must be >= 1, got {update_every}")
        self.decay = decay
        self.update_every = update_every
        self.warmup = warmup
        self.shadow = [p.detach().float().clone() for p in params]

    def current_decay(self, optimization_step: int) -> float:
        if self.warmup:
            return min((1 + optimization_step) / (10 + optimization_step), self.decay)
        return self.decay

    @torch.no_grad()
    def update(self, params: Iterable[torch.nn.Parameter], decay: float | None = None) -> None:
        weight = 1 - (self.decay if decay is None else decay)
        for s, p in zip(self.shadow, params, strict=True):
            s.lerp_(p.detach().float(), weight)

    def step(self, params: Iterable[torch.nn.Parameter], optimization_step: int) -> None:
        if (optimization_step + 1) % self.update_every == 0:
            self.update(params, self.current_decay(optimization_step))

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self, params: list[torch.nn.Parameter]) -> Iterator[None]:
        """The EMA weights in ``params`` for the block (evaluation); the trained weights are restored after."""
        saved = [p.detach().clone() for p in params]
        for p, s in zip(params, self.shadow, strict=True):
            p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
