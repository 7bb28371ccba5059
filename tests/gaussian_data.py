"""Closed-form flow for Gaussian data ``x0 ~ N(m, τ² I)`` (docs/design.md §3.5): the exact velocity field."""

from __future__ import annotations

import torch
from torch import Tensor


def gaussian_velocity(x: Tensor, t: Tensor | float, m: float, tau: float) -> Tensor:
    """``v(x, t) = E[eps - x0 | x_t = x]`` for ``x_t = (1 - t) x0 + t eps``."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    if t.ndim == 1:
        t = t.view(-1, *([1] * (x.ndim - 1)))
    variance = (1 - t) ** 2 * tau**2 + t**2
    return -m + (t - (1 - t) * tau**2) / variance * (x.float() - (1 - t) * m)


def uniform_sigmas(num_steps: int) -> Tensor:
    return torch.linspace(1.0, 0.0, num_steps + 1)
