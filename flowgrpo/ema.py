"""Exponential moving average of the trainable (adapter) weights, kept in float32."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class EMA:
    def __init__(self, params: Iterable[torch.nn.Parameter], decay: float) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"EMA decay must lie in [0, 1), got {decay}")
        self.decay = decay
        self.shadow = [p.detach().float().clone() for p in params]

    @torch.no_grad()
    def update(self, params: Iterable[torch.nn.Parameter]) -> None:
        for s, p in zip(self.shadow, params, strict=True):
            s.lerp_(p.detach().float(), 1 - self.decay)
