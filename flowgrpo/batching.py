"""How an epoch's samples are cut into training micro-batches, and which of their steps each one trains."""

from __future__ import annotations

import torch
from torch import Tensor


def kept_samples(advantages: Tensor, num_micro_batches: int, generator: torch.Generator) -> Tensor:
    """Flow-GRPO's zero-advantage filter (``scripts/train_sd3.py``): the indices of the samples with a non-zero
    advantage, plus randomly chosen zero-advantage ones until their count is a multiple of ``num_micro_batches``
    (at least one per micro-batch, so that every process runs as many micro-batches, each non-empty)."""
    keep = advantages != 0
    count = int(keep.sum())
    missing = -count % num_micro_batches if count else num_micro_batches
    if missing:
        zero = torch.nonzero(~keep).flatten()
        keep[zero[torch.randperm(len(zero), generator=generator)[:missing]]] = True
    return torch.nonzero(keep).flatten()


def micro_batches(samples: Tensor, num_micro_batches: int, generator: torch.Generator) -> list[Tensor]:
    """``samples`` (indices) shuffled and cut into ``num_micro_batches`` micro-batches of equal size."""
    if len(samples) % num_micro_batches:
        raise ValueError(f"{len(samples)} samples do not split into {num_micro_batches} equal micro-batches")
    order = samples[torch.randperm(len(samples), generator=generator)]
    return list(order.view(num_micro_batches, -1))


def group_micro_batches(
    samples: Tensor, group_ids: Tensor, num_micro_batches: int, generator: torch.Generator
) -> list[Tensor]:
    """``samples`` (indices; ``group_ids`` [N] the group of every index) cut into ``num_micro_batches``
    micro-batches of whole groups: the groups in a random order, each group's samples together and in the order
    ``samples`` gives them (an objective that pairs a group's images relies on it)."""
    groups, inverse = torch.unique(group_ids[samples], return_inverse=True)
    if len(groups) % num_micro_batches:
        raise ValueError(f"{len(groups)} groups do not split into {num_micro_batches} micro-batches of whole groups")
    per = len(groups) // num_micro_batches
    order = torch.randperm(len(groups), generator=generator).tolist()
    members = [samples[inverse == g] for g in range(len(groups))]
    return [torch.cat([members[g] for g in order[i * per : (i + 1) * per]]) for i in range(num_micro_batches)]


def trained_positions(
    batch: int, steps: int, generator: torch.Generator, *, shuffle: bool = True, fraction: float = 1.0
) -> Tensor:
    """``[batch, k]`` window positions each sample trains, in order: a random permutation per sample (``shuffle``)
    or ``0..steps-1``, keeping the first :func:`trained_count` (DanceGRPO's timestep_fraction)."""
    k = trained_count(steps, fraction)
    if shuffle:
        return torch.stack([torch.randperm(steps, generator=generator)[:k] for _ in range(batch)])
    return torch.arange(k).expand(batch, k)


def trained_count(steps: int, fraction: float) -> int:
    """``max(1, int(fraction · steps))`` of a window's ``steps`` are trained per sample (DanceGRPO's int())."""
    return max(1, int(fraction * steps))
