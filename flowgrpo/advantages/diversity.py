"""GARDO's diversity-aware advantage shaping, ``grpo.advantage.diversity``: the positive advantages of images that
are far from the rest of their group grow, those of near-duplicates shrink.

GARDO (He et al., arXiv 2512.24138; code tinnerhrhe/GARDO ``flow_grpo/stat_tracking.py``) embeds each image (DINOv3
ViT-L/16), and within each prompt's group takes every image's cosine distance to its nearest neighbour; an image that
beats its group's mean reward has its advantage multiplied by that distance over the group's mean of it::

    u_i = f_i / |f_i|,   d_i = min_{j ≠ i in G(i)} (1 − u_i·u_j),   m_i = d_i / mean_{j in G(i)} d_j
    A'_i = m_i · A_i  if A_i > 0,  else A_i        then clipped to ±grpo.advantage.clip

It applies to whatever ``grpo.advantage.estimator`` returns (per-step advantages ``[N, W]``: the positive entries of
a sample's row). A group whose images are all equal (every d 0) is left as it is. Negative advantages are never
scaled, so a bad image is pushed away as hard whatever its novelty: only "good and different" is rewarded more.

The feature here is cheap and needs no model: each decoded image (every frame of a clip) area-averaged to
``size × size`` pixels per channel, flattened, minus its own mean (so the cosine is the images' pixel correlation:
layout and colour, not overall brightness). DINOv3's semantic features would see "the same object drawn
differently" as close where pixels do not. GARDO's code also divides its advantage by no std (``(R − mean) · m``):
that is the estimator's choice (``grpo.advantage.estimator``), not this option's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import ConfigError, check_range

if TYPE_CHECKING:
    from ..config import Config
    from ..rollout import Trajectory

FEATURES = "diversity_features"  # Trajectory.extras / AdvantageInputs.extras key: [B, D] float32


@dataclass
class DiversityConfig:
    """``grpo.advantage.diversity:`` GARDO's diversity-aware advantage shaping (:mod:`.diversity`)."""

    enabled: bool = False  # positive advantages × (distance to the nearest image of the group / the group's mean of it)
    size: int = 16  # the images are area-averaged to size × size pixels per channel for the distance (GARDO: DINOv3)


def check_diversity(config: Config) -> None:
    d = config.grpo.advantage.diversity
    check_range("grpo.advantage.diversity.size", d.size, 1, why="pixels per side of the averaged image")
    if not d.enabled and d.size != DiversityConfig.size:
        raise ConfigError(
            f"grpo.advantage.diversity.size={d.size} does nothing while grpo.advantage.diversity.enabled=false; "
            "set enabled: true, or remove size"
        )


def diversity_features(settings: Any, trajectory: Trajectory) -> dict[str, Tensor]:
    """``{FEATURES: [B, D]}`` for this process's samples when ``settings`` (the grpo.advantage section) enables the
    shaping, else ``{}``: the images area-averaged to ``size²`` per channel (video: every frame), flattened, centred."""
    d = settings.diversity
    if not d.enabled:
        return {}
    images = trajectory.images
    if images is None:
        raise ValueError("grpo.advantage.diversity needs the decoded images, and this rollout kept none")
    frames = images.float().flatten(0, images.ndim - 4)  # [B·F, 3, H, W] (images: F = 1)
    pooled = F.adaptive_avg_pool2d(frames, d.size).reshape(images.shape[0], -1)
    return {FEATURES: (pooled - pooled.mean(dim=1, keepdim=True)).cpu()}


def nearest_distances(features: Tensor, group_ids: Tensor) -> Tensor:
    """``d_i = min_{j ≠ i in i's group} (1 − cos(f_i, f_j))``, float64 [N] (groups of at least 2)."""
    u = F.normalize(features.double(), dim=1)
    distance = 1 - (u @ u.T).clamp(-1, 1)
    others = (group_ids[:, None] == group_ids[None, :]) & ~torch.eye(len(u), dtype=torch.bool)
    return distance.masked_fill(~others, torch.inf).min(dim=1).values


def diversity_multipliers(features: Tensor, group_ids: Tensor) -> Tensor:
    """``m_i = d_i / mean_{G(i)} d``, float64 [N]: 1 in a group whose images are all equal."""
    d = nearest_distances(features, group_ids)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    means = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, d)[inverse] / counts[inverse]
    return torch.where(means > 0, d / means.clamp_min(1e-300), torch.ones_like(d))


def amplify_diverse(advantages: Tensor, extras: Any, group_ids: Tensor, clip: float) -> Tensor:
    """``advantages`` ([N] or [N, W]) with each positive entry times its sample's :func:`diversity_multipliers`, then
    clipped to ``±clip`` (``extras``: the gathered per-sample extras, holding ``FEATURES``)."""
    if FEATURES not in extras:
        raise ValueError("grpo.advantage.diversity needs each sample's features (extras['diversity_features'])")
    m = diversity_multipliers(extras[FEATURES], group_ids).to(advantages.dtype)
    m = m.view(-1, *([1] * (advantages.ndim - 1)))
    return torch.where(advantages > 0, advantages * m, advantages).clamp(-clip, clip)
