"""Checks every module may use: the error types (a bad config, bad data), the choice / range / frame-count checks,
image sizes.

A leaf module (it imports nothing of flowgrpo), so objectives, advantage estimators and adapters validate their own
settings without importing :mod:`flowgrpo.config`, which imports their registries.
"""

from __future__ import annotations

import difflib
from typing import Any


class ConfigError(ValueError):
    """A bad configuration: the message says which key, what was given, and what to do."""


class DataError(ValueError):
    """A missing, empty or malformed prompt file, or a source image that cannot be used."""


def check_range(
    key: str,
    value: float | None,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    why: str = "",
) -> None:
    """``value`` (None: unset, allowed) must lie in the interval; open ends exclude the bound."""
    if value is None:
        return
    ok = (low is None or (value > low if low_open else value >= low)) and (
        high is None or (value < high if high_open else value <= high)
    )
    if ok:
        return
    if high is None:
        bound = f"> {low}" if low_open else f">= {low}"
    else:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        bound = f"lie in {left}{low}, {high}{right}"
    raise ConfigError(f"{key} must {'' if high is not None else 'be '}{bound}{f' ({why})' if why else ''}, got {value}")


def check_true_cfg(scale: float, negative_prompt: str) -> None:
    """``model.true_cfg_scale`` (FLUX's true CFG, diffusers' ``true_cfg_scale``): 1 is off; above 1 it guides away
    from ``model.negative_prompt``, which must then be set: ``FluxPipeline`` does true CFG only with a negative prompt
    and would silently sample without it, and the empty default here means none."""
    check_range("model.true_cfg_scale", scale, 1, why="1 is off, as in pipe()")
    if scale > 1 and not negative_prompt:
        raise ConfigError(
            f"model.true_cfg_scale={scale} guides away from a negative prompt, but model.negative_prompt is empty: "
            'set model.negative_prompt (e.g. " ", or "blurry, low quality"), or model.true_cfg_scale: 1'
        )


def height_width(size: int | tuple[int, int]) -> tuple[int, int]:
    """An image size as ``(height, width)``: a pair as it is (``ModelConfig.size``), one int as a square."""
    if isinstance(size, int):
        return size, size
    height, width = size
    return int(height), int(width)


def one_of(path: str, value: Any, allowed: tuple[str, ...] | list[str]) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{path} must be one of {', '.join(map(str, allowed))}, got {value!r}{hint}")


def check_trackers(trackers: list[str], path: str = "run.trackers") -> None:
    """Each tracker a name accelerate knows and whose package is installed: accelerate raises a traceback for an
    unknown name and skips one that is not installed with only a debug log, and the run would then log to none of
    them without saying so. Checked by the trainer, not by the config (evaluating or exporting a run's weights on
    a machine without its trackers, or sampling an offline store, logs to no tracker)."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    available = {str(t) for t in get_available_trackers()}
    for name in trackers:
        one_of(path, name, LoggerType.list())
        if name != "all" and name not in available:
            raise ConfigError(
                f"{path}: {name} is not installed; pip install {name}, or remove it from {path} (metrics.jsonl is "
                "written either way)"
            )


WAN_TEMPORAL_FACTOR = 4  # frames per latent frame of AutoencoderKLWan (Wan2.1), after the first frame


def check_num_frames(
    num_frames: int, temporal_factor: int = WAN_TEMPORAL_FACTOR, key: str = "model.num_frames"
) -> None:
    """Refuse a frame count the video VAE cannot take: it encodes the first frame alone and then ``temporal_factor``
    frames per latent frame, so the count must be ``temporal_factor · k + 1``. The message lists the valid values."""
    f = temporal_factor
    whole = isinstance(num_frames, int) and not isinstance(num_frames, bool) and num_frames >= 1
    if whole and (num_frames - 1) % f == 0:
        return
    if not whole:
        valid = f"1, {1 + f}, {1 + 2 * f}, ..."
        raise ConfigError(f"{key} must be a positive frame count {f}k + 1 ({valid}), got {num_frames!r}")
    below = (num_frames - 1) // f * f + 1
    raise ConfigError(
        f"{key}={num_frames} is not a frame count the video VAE can take: it encodes the first frame alone and then "
        f"{f} frames per latent frame, so the count must be {f}k + 1 (1, {1 + f}, {1 + 2 * f}, ..., 81, ...); the "
        f"nearest valid values are {below} and {below + f}"
    )
