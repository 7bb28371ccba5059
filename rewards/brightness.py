"""Mean brightness: a cheap, model-free reward that a policy can visibly move (CPU learning tests, demos)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .base import BaseReward
from .registry import register_reward


@register_reward("brightness")
class Brightness(BaseReward):
    """Mean pixel value in [0, 1] over channels and pixels."""

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        return images.double().cpu().mean(dim=(1, 2, 3))
