"""DDPO's JPEG (in)compressibility rewards (https://arxiv.org/abs/2305.13301, ddpo-pytorch rewards.py).

Size of the image saved as JPEG at quality 95, in kB (1000 bytes): ``jpeg_incompressibility``
rewards large files (detail), ``jpeg_compressibility`` is its negative (simple images).
"""

from __future__ import annotations

import io
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from .base import BaseReward, to_uint8_hwc
from .registry import register_reward


def jpeg_size_kb(pixels_hwc, quality: int = 95) -> float:
    buffer = io.BytesIO()
    Image.fromarray(pixels_hwc).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(BaseReward):
    sign = 1.0

    def __init__(self, *, device: str | torch.device = "cpu", batch_size: int | None = None, quality: int = 95) -> None:
        super().__init__(device="cpu", batch_size=batch_size)  # PIL encodes on the CPU
        if not 1 <= quality <= 100:
            raise ValueError(f"{self.name}: quality must be in [1, 100]; got {quality}")
        self.quality = quality

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        sizes = [jpeg_size_kb(img, self.quality) for img in to_uint8_hwc(images)]
        return self.sign * torch.tensor(sizes, dtype=torch.float64)


@register_reward("jpeg_compressibility")
class JpegCompressibility(JpegIncompressibility):
    sign = -1.0
