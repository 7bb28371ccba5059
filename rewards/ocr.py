"""Text-rendering reward (Flow-GRPO's OCR task) with RapidOCR, which runs offline on ONNX Runtime.

Target text = the first double-quoted part of the prompt (``a sign that says "OPEN 24 HOURS"``),
or ``metadata["text"]`` when given. Both sides are normalised (NFKC, whitespace removed,
lower-cased) and scored ``1 - min(edit_distance, len) / len`` — 1 if the target is contained
in the recognised text — as Flow-GRPO's ``OcrScorer`` does (https://arxiv.org/abs/2505.05470).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .base import BaseReward, to_uint8_hwc
from .registry import register_reward

_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')


def quoted_text(prompt: str) -> str:
    """The first double-quoted span of ``prompt`` (straight or curly quotes)."""
    match = _QUOTED.search(prompt)
    if match is None:
        raise ValueError(f'ocr reward: prompt has no quoted text to render: {prompt!r}; write it as "TEXT"')
    return match.group(1) if match.group(1) is not None else match.group(2)


def normalize_text(text: str) -> str:
    return "".join(unicodedata.normalize("NFKC", text).split()).lower()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_score(recognized: str, target: str, *, containment: bool = True) -> float:
    """``1 - min(dist, len) / len`` on normalised text; with ``containment``, 1 when the target appears in the
    recognised text (Flow-GRPO's image scorer; its video scorer has no such shortcut)."""
    recognized, target = normalize_text(recognized), normalize_text(target)
    if not target:
        raise ValueError("ocr reward: the quoted target text is empty")
    if containment and target in recognized:
        return 1.0
    return 1.0 - min(edit_distance(recognized, target), len(target)) / len(target)


@register_reward("ocr")
class OcrReward(BaseReward):
    """RapidOCR text-rendering accuracy in [0, 1].

    Options: ``use_cls`` (run the text-direction classifier; Flow-GRPO runs without it),
    ``min_confidence`` (drop detections below it), ``engine_options`` (kwargs for ``RapidOCR``,
    e.g. ``{"intra_op_num_threads": 4}``), ``containment`` (default true: a recognised text that contains the
    target scores 1, as Flow-GRPO's image scorer; false: the edit distance alone, as its video scorer).
    It runs on the CPU whatever ``device`` says.
    """

    def __init__(
        self,
        *,
        device: str | torch.device = "cpu",
        batch_size: int | None = None,
        use_cls: bool = False,
        min_confidence: float = 0.0,
        engine_options: dict[str, Any] | None = None,
        containment: bool = True,
    ) -> None:
        super().__init__(device="cpu", batch_size=batch_size)
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as err:
            raise ImportError(
                "the 'ocr' reward needs rapidocr-onnxruntime: pip install -e .[ocr]  (or rapidocr-onnxruntime)"
            ) from err
        self.engine = RapidOCR(**(engine_options or {}))  # loads the bundled ONNX models once
        self.use_cls = use_cls
        self.min_confidence = min_confidence
        self.containment = bool(containment)

    def recognize(self, image_hwc: np.ndarray) -> str:
        """All text RapidOCR finds in one uint8 RGB image, in its reading order."""
        bgr = np.ascontiguousarray(image_hwc[..., ::-1])  # RapidOCR treats arrays as OpenCV BGR
        result, _ = self.engine(bgr, use_cls=self.use_cls)
        return "".join(text for _, text, conf in (result or []) if float(conf) > self.min_confidence)

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        targets = [str(m["text"]) if "text" in m else quoted_text(p) for p, m in zip(prompts, metadata, strict=True)]
        pixels = to_uint8_hwc(images)
        return torch.tensor(
            [
                ocr_score(self.recognize(img), t, containment=self.containment)
                for img, t in zip(pixels, targets, strict=True)
            ]
        )
