"""Weighted combination of rewards: each reward's raw scores under its key, plus ``total``.

Raw per-reward scores are kept (not only the weighted sum) so the trainer can compute
per-reward advantages and sum them with the weights (MixGRPO's aggregation) as well as
advantages of ``total``; ``CombinedReward.weights`` says which keys enter the sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Metadata, Reward, RewardError, accepts_source_images, as_score_dict, check_inputs, check_source_images
from .nan_policy import check_nan_policy, raise_if_nonfinite
from .video import FrameReward, takes_video


@dataclass(frozen=True)
class RewardEntry:
    key: str  # name of this reward's scores in the output
    weight: float
    reward: Reward


def _primary(key: str, scores: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """A reward's own score: its only output, or its ``total`` when it returns several (e.g. remote)."""
    if len(scores) == 1:
        return next(iter(scores.values())), {}
    if "total" not in scores:
        raise RewardError(
            f"reward '{key}' returned several scores ({', '.join(scores)}) but no 'total' to weight", reward=key
        )
    return scores["total"], {k: v for k, v in scores.items() if k != "total"}


class CombinedReward:
    """``reward(images, prompts, metadata) -> {key: Tensor(B,), ..., "total": Tensor(B,)}``.

    A reward returning several scores with a ``total`` (a remote combined reward) contributes its
    ``total`` under ``key`` and the others as ``"key/sub"`` (logged, not weighted).

    ``source_images`` (editing) goes to the rewards whose signature takes it, and only to those (decided once, here).

    Videos ``(B, F, 3, H, W)`` (``rewards.video``): a reward that takes video gets the clips; any other one scores
    them frame by frame through ``FrameReward(reward)``, the mean over all frames (a reward's ``frames`` option in
    ``build_reward`` chooses the frames and the reduction instead).
    """

    def __init__(self, entries: Sequence[RewardEntry], *, nan_policy: str = "error") -> None:
        self.entries = list(entries)
        self.nan_policy = check_nan_policy(nan_policy)
        self._takes_sources = {e.key: accepts_source_images(e.reward) for e in self.entries}
        # what scores a video batch under each key: the reward itself, or its frame-by-frame wrapper
        self._video = {
            e.key: e.reward if takes_video(e.reward) else FrameReward(e.reward, name=e.key) for e in self.entries
        }

    @property
    def weights(self) -> dict[str, float]:
        return {e.key: e.weight for e in self.entries}

    @property
    def rewards(self) -> dict[str, Reward]:
        return {e.key: e.reward for e in self.entries}

    @property
    def needs_source_images(self) -> list[str]:
        """Keys of the rewards that cannot score without source images (``uses_source_images``, e.g. consistency)."""
        return [e.key for e in self.entries if getattr(e.reward, "uses_source_images", False)]

    def check_prompts(self, prompts: Sequence[str]) -> None:
        """Let each reward that can tell (``reward.check_prompts``, e.g. a task grammar) refuse prompts before any
        work; raises its ``ValueError`` naming the prompt."""
        for e in self.entries:
            check = getattr(e.reward, "check_prompts", None)
            if callable(check):
                check(list(prompts))

    def __call__(
        self,
        images: Tensor,
        prompts: Sequence[str],
        metadata: Metadata | None = None,
        source_images: Tensor | None = None,
    ) -> dict[str, Tensor]:
        prompts, metadata = check_inputs(images, prompts, metadata, video=True)
        batch = images.shape[0]
        video = images.ndim == 5  # clips (B, F, 3, H, W)
        if source_images is not None:
            check_source_images(source_images, batch)
        out: dict[str, Tensor] = {}
        total = torch.zeros(batch, dtype=torch.float64)
        for e in self.entries:
            reward = self._video[e.key] if video else e.reward
            passes = source_images is not None and self._takes_sources[e.key] and reward is e.reward
            sources = {"source_images": source_images} if passes else {}
            try:
                raw = as_score_dict(reward(images, prompts, metadata, **sources), e.key, batch)
            except Exception as err:  # name the reward: a trace through five wrappers does not
                raise RewardError(f"reward '{e.key}' failed: {type(err).__name__}: {err}", reward=e.key) from err
            primary, extras = _primary(e.key, raw)
            out[e.key] = primary
            out.update({f"{e.key}/{k}": v for k, v in extras.items()})
            total += e.weight * primary.double()
        if self.nan_policy == "error":
            raise_if_nonfinite({k: out[k] for k in self.weights}, prompts)
        out["total"] = total.float()
        return out

    def __repr__(self) -> str:
        inner = ", ".join(f"{e.key}={e.weight:g}" for e in self.entries)
        return f"CombinedReward({inner}, nan_policy={self.nan_policy!r})"
