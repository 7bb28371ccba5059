"""What to do with NaN/inf scores: ``error`` (default) or ``drop`` the groups that contain them.

A group (the k images of one prompt) is dropped whole, because its advantages are relative to
its own mean: one missing member would silently change the others' advantages.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .base import RewardError

NAN_POLICIES = ("error", "drop")
logger = logging.getLogger("rewards")


class NonFiniteRewardError(RewardError):
    """A reward returned NaN or inf with ``nan_policy="error"``."""


def check_nan_policy(policy: str) -> str:
    if policy not in NAN_POLICIES:
        raise ValueError(f"nan_policy must be one of {', '.join(NAN_POLICIES)}; got {policy!r}")
    return policy


def raise_if_nonfinite(scores: Mapping[str, Tensor], prompts: Sequence[str] | None = None) -> None:
    for key, value in scores.items():
        bad = (~torch.isfinite(value)).nonzero().flatten().tolist()
        if bad:
            where = f" (prompt {prompts[bad[0]]!r})" if prompts is not None else ""
            raise NonFiniteRewardError(
                f"reward '{key}' returned non-finite scores at indices {bad[:8]}{where}; "
                "set nan_policy='drop' to drop the affected groups instead",
                reward=key,
            )


def apply_nan_policy(
    scores: Mapping[str, Tensor],
    group_ids: Sequence[int] | Tensor,
    policy: str = "error",
    keys: Sequence[str] | None = None,
) -> tuple[Tensor, int]:
    """Return ``(keep, dropped_groups)``: a bool mask ``(B,)`` over samples and how many groups were dropped.

    ``keys`` limits the check (default: every score, ``total`` included); ``group_ids`` holds the
    explicit group id of each sample (prompt index and epoch), never decoded prompts.
    """
    check_nan_policy(policy)
    keys = list(scores) if keys is None else list(keys)
    groups = torch.as_tensor(group_ids).flatten()
    bad = torch.zeros(groups.numel(), dtype=torch.bool)
    for key in keys:
        value = scores[key].flatten()
        if value.numel() != groups.numel():
            raise ValueError(f"scores['{key}'] has {value.numel()} entries but group_ids has {groups.numel()}")
        bad |= ~torch.isfinite(value.cpu())
    if not bad.any():
        return torch.ones_like(bad), 0
    if policy == "error":
        raise_if_nonfinite({k: scores[k] for k in keys})
    bad_groups = groups[bad].unique()
    keep = ~torch.isin(groups, bad_groups)
    per_key = ", ".join(f"{k}={int((~torch.isfinite(scores[k])).sum())}" for k in keys)
    logger.warning(
        "dropped %d of %d groups (%d samples) with non-finite rewards: %s",
        bad_groups.numel(),
        groups.unique().numel(),
        int((~keep).sum()),
        per_key,
    )
    return keep, int(bad_groups.numel())
