"""The OCR reward with the real RapidOCR models on text rendered with PIL."""

import builtins

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from rewards import OcrReward, build_reward, edit_distance, ocr_score, quoted_text


def render(text: str, size=(256, 256), font_size=28) -> torch.Tensor:
    """Black text on white, large enough for the detector; (3, H, W) in [0, 1]."""
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=font_size)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size[0] - right + left) // 2, (size[1] - bottom + top) // 2), text, fill="black", font=font)
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def ocr():
    return OcrReward()


def test_quoted_text_and_formula():
    assert quoted_text('A neon sign that says "Open 24 Hours" at night') == "Open 24 Hours"
    assert quoted_text("a mug reading “Good Morning”, studio") == "Good Morning"
    assert quoted_text('two "first" and "second"') == "first"  # Flow-GRPO: prompt.split('"')[1]
    with pytest.raises(ValueError, match="no quoted text"):
        quoted_text("a cat")
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3 and edit_distance("ab", "ab") == 0
    assert ocr_score("OPEN 24 hours", "open24hours") == 1.0  # spaces and case are normalised away
    assert ocr_score("xx open 24 hours xx", "Open 24 Hours") == 1.0  # contained
    # Flow-GRPO's video scorer: the edit distance alone, 1 - min(4, 11) / 11
    assert ocr_score("xx open 24 hours xx", "Open 24 Hours", containment=False) == pytest.approx(1 - 4 / 11)
    assert ocr_score("HELLO WORLB", "hello world") == pytest.approx(1 - 1 / 10)
    assert ocr_score("", "hello") == 0.0
    assert ocr_score("a completely different and much longer text", "hello") == 0.0  # distance capped at len


def test_reads_rendered_quoted_text(ocr):
    texts = ["FLOW GRPO", "Open 24 Hours", "Hello World"]
    prompts = [f'A storefront sign that says "{t}", photo' for t in texts]
    images = torch.stack([render(t) for t in texts])
    scores = ocr(images, prompts)["ocr"]
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert (scores >= 0.95).all(), scores


def test_blank_image_scores_zero_and_partial_text_follows_formula(ocr):
    images = torch.stack([torch.ones(3, 256, 256), render("HELLO WORLB"), render("GRPO")])
    prompts = ['a sign "Hello World"', 'a sign "Hello World"', 'a sign "FLOW GRPO"']
    scores = ocr(images, prompts)["ocr"]
    assert scores[0] == 0.0
    assert scores[1] == pytest.approx(0.9, abs=1e-6)  # one substitution in 10 normalised characters
    assert scores[2] == pytest.approx(1 - 4 / 8, abs=1e-6)  # "grpo" vs "flowgrpo": 4 deletions


def test_metadata_text_overrides_prompt_and_batching_is_invariant(ocr):
    images = torch.stack([render("FLOW GRPO"), render("Hello World")])
    prompts = ["no quotes needed here", 'a sign "Hello World"']
    meta = [{"text": "flow grpo"}, {}]
    scores = ocr(images, prompts, meta)["ocr"]
    assert scores.tolist() == [1.0, 1.0]
    chunked = build_reward([{"name": "ocr", "batch_size": 1}])(images, prompts, meta)["ocr"]
    assert torch.equal(scores, chunked)


def test_missing_rapidocr_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("rapidocr_onnxruntime"):
            raise ImportError("No module named 'rapidocr_onnxruntime'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"pip install -e \.\[ocr\]"):
        OcrReward()
