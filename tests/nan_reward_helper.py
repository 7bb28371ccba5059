"""A custom reward for tests: brightness, but NaN for prompts mentioning a cat."""

from __future__ import annotations

import torch


class NanForCats:
    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def __call__(self, images, prompts, metadata=None):
        scores = images.mean(dim=(1, 2, 3)).float().cpu()
        cats = torch.tensor(["cat" in p for p in prompts])
        return {"NanForCats": torch.where(cats, torch.full_like(scores, float("nan")), scores)}


class NanAlways:
    """A judge whose every reply fails to parse: NaN for every image."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def __call__(self, images, prompts, metadata=None):
        return {"NanAlways": torch.full((len(images),), float("nan"))}
