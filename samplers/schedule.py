"""The sigma schedule exactly as diffusers' SD3 / FLUX pipelines set it, so rollouts and ``pipe()`` agree.

Takes any diffusers flow-match scheduler object (duck-typed: ``config``, ``set_timesteps``, ``sigmas``,
``timesteps``); works on a copy, so the caller's scheduler state is untouched. Also the static shifted
schedule MixGRPO and DanceGRPO use instead of the pipeline's (:func:`static_shift_schedule`).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

Family = Literal["sd3", "flux"]


def calculate_shift(
    image_seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float
) -> float:
    """FLUX's resolution-dependent shift ``mu``: linear in the image token count (as in diffusers)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + base_shift - slope * base_seq_len


def pipeline_schedule(
    scheduler: Any,
    num_steps: int,
    *,
    family: Family,
    image_seq_len: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(sigmas, timesteps)`` as ``pipe(num_inference_steps=num_steps)`` uses them.

    sigmas: float32 ``[T + 1]`` from ~1 down to 0; timesteps: ``[T]`` values fed to the network.
    ``image_seq_len`` is the transformer's token count (``(H/8/p) · (W/8/p)``); needed when the scheduler
    shifts dynamically (always for FLUX).
    SD3: static shift from the scheduler config (dynamic only if the config asks, max_shift default 1.16).
    FLUX: ``sigmas = linspace(1, 1/T, T)`` then the dynamic shift ``mu`` (max_shift default 1.15).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    config = scheduler.config
    kwargs: dict[str, Any] = {}
    dynamic = bool(config.get("use_dynamic_shifting", False))
    if family == "flux" or dynamic:
        if image_seq_len is None:
            raise ValueError("this scheduler shifts with the resolution: pass image_seq_len")
        kwargs["mu"] = calculate_shift(
            image_seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15 if family == "flux" else 1.16),
        )
    scheduler = copy.deepcopy(scheduler)
    if family == "sd3":
        scheduler.set_timesteps(num_steps, device=device, **kwargs)
    elif family == "flux":
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
        scheduler.set_timesteps(sigmas=sigmas, device=device, **kwargs)
    else:
        raise ValueError(f"family must be 'sd3' or 'flux', got {family!r}")
    return scheduler.sigmas.to(torch.float32), scheduler.timesteps


def time_shift(t: Tensor, shift: float) -> Tensor:
    """SD3's static shift ``shift · t / (1 + (shift - 1) · t)`` — MixGRPO's and DanceGRPO's ``sd3_time_shift``."""
    return (shift * t) / (1 + (shift - 1) * t)


def truncated_timesteps(sigmas: Tensor | float) -> Tensor:
    """The network timestep ``int(1000 · σ)`` that MixGRPO and DanceGRPO feed (``timestep_value = int(sigma * 1000)``
    in their ``run_sample_step``; the FLUX transformer then gets it divided by 1000). float32, truncated toward 0."""
    return torch.trunc(torch.as_tensor(sigmas, dtype=torch.float32) * 1000)


def static_shift_schedule(
    num_steps: int, shift: float, *, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """``(sigmas [T + 1], timesteps [T])`` of the static shifted schedule MixGRPO and DanceGRPO sample FLUX with.

    ``sigmas = time_shift(linspace(1, 0, T + 1), shift)`` in float32, computed as their ``sample_reference_model``
    does (so the values match bit for bit), and ``timesteps = int(1000 · σ)`` (:func:`truncated_timesteps`).
    Unlike :func:`pipeline_schedule` it ignores the resolution; ``shift = 1`` is the plain linear schedule.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not (math.isfinite(shift) and shift > 0):
        raise ValueError(f"the time shift must be a finite number > 0, got {shift}")
    sigmas = time_shift(torch.linspace(1, 0, num_steps + 1), shift)
    return sigmas.to(device), truncated_timesteps(sigmas[:-1]).to(device)
