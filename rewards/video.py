"""Scoring videos: image rewards frame by frame, or rewards that take the whole clip.

A video batch is float ``(B, F, 3, H, W)`` in [0, 1] (what a video adapter's ``decode`` returns). A reward whose
class sets ``takes_video = True`` receives the clips whole (``(B, F, 3, H, W)``) and returns one score per clip. Any
other reward is an image reward: :class:`FrameReward` scores every ``every``-th frame of each clip as an image batch
``(B · F', 3, H, W)`` (prompts and metadata repeated per frame) and reduces each clip's frame scores to one.

``build_reward`` wraps nothing by default; :class:`~rewards.combine.CombinedReward` scores a video batch through
``FrameReward(reward)`` (the mean over all frames) for every reward that does not take video. A reward's ``frames``
option sets the wrapper explicitly::

    rewards:
      - {name: ocr, weight: 1.0, frames: {every: 4, reduce: positive_mean}}   # Flow-GRPO's video_ocr
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .base import Metadata, Reward, as_score_dict, check_inputs


def _positive_mean(scores: Tensor) -> Tensor:
    """Mean of each row's scores above 0, 0 where none is (Flow-GRPO's ``OcrScorer_video_or_image``)."""
    positive = scores > 0
    total = torch.where(positive, scores, torch.zeros_like(scores)).sum(dim=1)
    count = positive.sum(dim=1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


# How a clip's frame scores [B, F'] become one score [B].
FRAME_REDUCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "mean": lambda scores: scores.mean(dim=1),
    "min": lambda scores: scores.min(dim=1).values,
    "max": lambda scores: scores.max(dim=1).values,
    "positive_mean": _positive_mean,
}


def takes_video(reward: Any) -> bool:
    """Whether ``reward`` scores whole clips ``(B, F, 3, H, W)`` (its ``takes_video`` attribute)."""
    return bool(getattr(reward, "takes_video", False))


class FrameReward:
    """An image reward applied to videos: every ``every``-th frame from the first one, scored as images, then each
    clip's frame scores reduced by ``reduce`` (``mean`` | ``min`` | ``max`` | ``positive_mean``: the mean of the
    frames scoring above 0, as Flow-GRPO's video OCR reward). Every key the image reward returns is reduced alike.

    Flow-GRPO's Wan recipe scores text-to-video OCR on every 4th frame (``frame_interval = 4``), ``positive_mean``.
    """

    takes_video = True

    def __init__(self, reward: Reward, *, every: int = 1, reduce: str = "mean", name: str | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"frames.every must be a positive integer (score every n-th frame), got {every!r}")
        if reduce not in FRAME_REDUCTIONS:
            raise ValueError(f"frames.reduce must be one of {', '.join(FRAME_REDUCTIONS)}, got {reduce!r}")
        if takes_video(reward):
            raise ValueError(f"reward {name or reward!r} already scores whole videos (takes_video): do not wrap it")
        self.reward = reward
        self.every = every
        self.reduce = reduce
        self.name = name or getattr(reward, "name", None) or type(reward).__name__

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Metadata | None = None) -> dict[str, Tensor]:
        prompts, metadata = check_inputs(images, prompts, metadata, video=True)
        if images.ndim != 5:
            raise ValueError(f"{self.name}: FrameReward scores videos (B, F, 3, H, W); got {tuple(images.shape)}")
        frames = images[:, :: self.every]  # [B, F', 3, H, W]
        batch, count = frames.shape[:2]
        flat = frames.reshape(batch * count, *frames.shape[2:])
        scores = as_score_dict(
            self.reward(
                flat, [p for p in prompts for _ in range(count)], [dict(m) for m in metadata for _ in range(count)]
            ),
            self.name,
            batch * count,
        )
        reduce = FRAME_REDUCTIONS[self.reduce]
        return {key: reduce(value.view(batch, count)) for key, value in scores.items()}

    def check_prompts(self, prompts: list[str]) -> None:
        """The wrapped reward's own prompt check, if it has one (e.g. a task grammar)."""
        check = getattr(self.reward, "check_prompts", None)
        if callable(check):
            check(prompts)

    def __repr__(self) -> str:
        return f"FrameReward({self.reward!r}, every={self.every}, reduce={self.reduce!r})"
