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

from .base import Metadata, Reward, RewardError, as_score_dict, check_inputs
from .nan_policy import check_nan_policy, raise_if_nonfinite


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
    """

    def __init__(self, entries: Sequence[RewardEntry], *, nan_policy: str = "error") -> None:
        self.entries = list(entries)
        self.nan_policy = check_nan_policy(nan_policy)

    @property
    def weights(self) -> dict[str, float]:
        return {e.key: e.weight for e in self.entries}

    @property
    def rewards(self) -> dict[str, Reward]:
        return {e.key: e.reward for e in self.entries}

    def check_prompts(self, prompts: Sequence[str]) -> None:
        """Let each reward that can tell (``reward.check_prompts``, e.g. a task grammar) refuse prompts before any
        work; raises its ``ValueError`` naming the prompt."""
        for e in self.entries:
            check = getattr(e.reward, "check_prompts", None)
            if callable(check):
                check(list(prompts))

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Metadata | None = None
    ) -> dict[str, Tensor]:
        prompts, metadata = check_inputs(images, prompts, metadata)
        batch = images.shape[0]
        out: dict[str, Tensor] = {}
        total = torch.zeros(batch, dtype=torch.float64)
        for e in self.entries:
            try:
                raw = as_score_dict(e.reward(images, prompts, metadata), e.key, batch)
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
