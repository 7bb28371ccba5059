"""``imagereward``: the key map from the official checkpoint onto transformers' BLIP, checked against the reference.

The reference (``image-reward`` 1.5) cannot be installed beside this project's pins, so
``tests/fixtures/imagereward/make_fixture.py`` ran its own ``ImageReward`` class once (tiny ViT / med.py
BERT / MLP, its ``score`` and ``inference_rank``) with deterministic weights and recorded the scores,
its state-dict layout and its token ids; it also recorded the layout of the full-size model, i.e. of
``ImageReward.pt``. Here the same weights, under the reference's key names, go through the key map.
"""

import importlib.util
import json
import os

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from torchvision import transforms

from rewards import build_reward
from rewards.clip_models import OPENAI_MEAN, OPENAI_STD
from rewards.imagereward import (
    MED_CONFIG,
    SCORE_MEAN,
    SCORE_STD,
    VISION_CONFIG,
    ImageRewardModel,
    convert_state_dict,
    load_reference_weights,
    reference_name,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "imagereward")
_spec = importlib.util.spec_from_file_location("imagereward_fixture", os.path.join(FIXTURES, "make_fixture.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)
with open(fx.TINY_PATH) as _f:
    TINY = json.load(_f)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A bert-style tokenizer dir (``vocab.txt``) and the reference-named tiny checkpoint as .pt and .safetensors."""
    root = tmp_path_factory.mktemp("imagereward")
    (root / "tok").mkdir()
    (root / "tok" / "vocab.txt").write_text("\n".join(fx.VOCAB) + "\n")
    state = fx.pattern_state_dict(TINY["layout"])
    torch.save(state, root / "ImageReward.pt")
    save_file(state, str(root / "ImageReward.safetensors"))
    return root


def _reward(files, **options):
    spec = {
        "name": "imagereward",
        "checkpoint": str(files / "ImageReward.pt"),
        "tokenizer": str(files / "tok"),
        "vision_config": fx.TINY_VISION,
        "med_config": fx.TINY_MED,
        "local_files_only": True,
        **options,
    }
    return build_reward([spec]).rewards["imagereward"]


def _images(height=fx.TINY_SIZE, width=fx.TINY_SIZE):
    """The fixture's uint8 images as the float (B, 3, H, W) batch a reward receives."""
    return torch.stack([fx.pattern_image(i, height, width) for i in range(len(fx.PROMPTS))]).permute(0, 3, 1, 2) / 255


def test_scores_match_the_reference_model(files):
    assert (TINY["score_mean"], TINY["score_std"]) == (SCORE_MEAN, SCORE_STD)
    expected = torch.tensor(TINY["scores"])
    torch.testing.assert_close(torch.tensor(TINY["inference_rank"]), expected)  # the reference's two entry points
    assert expected.std() > 0.1  # the weights make the score depend on image and prompt
    images = _images()
    for checkpoint in ("ImageReward.pt", "ImageReward.safetensors", str(files)):  # a file, or a dir holding filename
        reward = _reward(files, checkpoint=str(files / checkpoint), batch_size=3)  # chunks of 3 and 1
        got = reward(images, fx.PROMPTS)["imagereward"]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # every prompt against every image, in one batch: the text cross-attends to the right image
    all_pairs = reward(images.repeat(4, 1, 1, 1), [p for p in fx.PROMPTS for _ in range(4)])["imagereward"]
    torch.testing.assert_close(all_pairs.view(4, 4), torch.tensor(TINY["scores_all_pairs"]), atol=1e-5, rtol=0)


def test_tokenizer_matches_blip_init_tokenizer(files):
    tok = _reward(files).tokenizer
    assert {t: tok.convert_tokens_to_ids(t) for t in TINY["added_tokens"]} == TINY["added_tokens"]
    ids = tok(fx.PROMPTS, padding="max_length", truncation=True, max_length=35)["input_ids"]
    assert ids == TINY["input_ids"]  # [CLS] ... [SEP], word pieces, [UNK], padded with 0 to 35


def test_official_checkpoint_layout_maps_onto_the_default_architecture():
    with open(fx.REAL_PATH) as f:
        layout = json.load(f)["layout"]
    state = {k: torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for k, shape, dtype in layout}
    with torch.device("meta"):
        model = ImageRewardModel(VISION_CONFIG, MED_CONFIG)
    mapped = convert_state_dict(state)
    expected = model.state_dict()
    assert sorted(mapped) == sorted(expected)
    assert all(mapped[k].shape == expected[k].shape for k in expected)
    dropped = {k for k in state if not k.startswith(("blip.visual_encoder.", "blip.text_encoder.", "mlp."))}
    assert dropped == {
        "blip.vision_proj.weight",
        "blip.vision_proj.bias",
        "blip.text_proj.weight",
        "blip.text_proj.bias",
    }
    position_ids = {"blip.text_encoder.embeddings.position_ids"}  # a buffer, rebuilt by transformers
    assert {reference_name(k) for k in mapped} == set(state) - dropped - position_ids  # the map inverts
    load_reference_weights(model, state, source="ImageReward.pt")  # the shape checks and strict load pass
    assert model.vision.config.layer_norm_eps == 1e-6 and model.text.config.num_attention_heads == 12


def test_preprocessing_follows_the_reference_transform(files):
    """Non-square images: shortest side to 32 (bicubic), centre crop, CLIP normalisation, as ImageReward's
    ``_transform`` on uint8 PIL images; the resampling kernels and the uint8 rounding differ slightly."""
    reward = _reward(files)
    reference = transforms.Compose(
        [
            transforms.Resize(fx.TINY_SIZE, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(fx.TINY_SIZE),
            transforms.ToTensor(),
            transforms.Normalize(OPENAI_MEAN, OPENAI_STD),
        ]
    )
    enc = reward.tokenizer(fx.PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    for height, width in ((48, 40), (40, 72)):
        images = _images(height, width)
        pixels = torch.stack([reference(Image.fromarray(fx.pattern_image(i, height, width).numpy())) for i in range(4)])
        assert (reward.preprocess(images) - pixels).abs().mean() < 0.01  # a crop off by one pixel gives ~0.1
        with torch.no_grad():
            expected = (reward.model(pixels, enc["input_ids"], enc["attention_mask"]) - SCORE_MEAN) / SCORE_STD
        torch.testing.assert_close(reward(images, fx.PROMPTS)["imagereward"], expected, atol=0.03, rtol=0)


def test_dtype_and_options(files):
    images = _images()
    bf16 = _reward(files, dtype="bf16")
    assert bf16.model.vision.embeddings.patch_embedding.weight.dtype == torch.bfloat16
    assert bf16.model.head.layers[0].weight.dtype == torch.float32  # the reference's MLP sees float32 features
    out = bf16(images, fx.PROMPTS)["imagereward"]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor(TINY["scores"]), atol=0.05, rtol=0)
    a = _reward(files, random_init=True, seed=1)(images, fx.PROMPTS)["imagereward"]
    b = _reward(files, random_init=True, seed=1, batch_size=1)(images, fx.PROMPTS)["imagereward"]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_missing_or_wrong_checkpoint_errors_name_the_file_and_the_fix(files, tmp_path):
    with pytest.raises(FileNotFoundError, match="imagereward checkpoint.*/nope/ImageReward.pt"):
        _reward(files, checkpoint="/nope/ImageReward.pt")
    state = fx.pattern_state_dict(TINY["layout"])
    cases = {
        "other.pt": ({"visual.proj": torch.zeros(2)}, "is not an ImageReward checkpoint"),
        "partial.pt": ({k: v for k, v in state.items() if "blocks.1." not in k}, "lacks weights.*blocks.1"),
        "extra.pt": ({**state, "blip.visual_encoder.head.weight": torch.zeros(2)}, "has weights.*head.weight"),
        "pooler.pt": ({**state, "blip.text_encoder.pooler.dense.bias": torch.zeros(2)}, "has weights.*pooler"),
        "pickle.pt": ({"epoch": object()}, "cannot read"),
    }
    for name, (bad, message) in cases.items():
        torch.save(bad, tmp_path / name)
        with pytest.raises(ValueError, match=f"{name}.*{message}|{message}.*{name}") as err:
            _reward(files, checkpoint=str(tmp_path / name))
        assert "huggingface.co/THUDM/ImageReward" in str(err.value)
    with pytest.raises(ValueError, match=r"does not fit the .*cls_token \(1, 1, 32\) vs \(1, 1, 16\)"):
        _reward(files, vision_config={**fx.TINY_VISION, "hidden_size": 16, "intermediate_size": 64})
    with pytest.raises(ValueError, match="tokenizer .* has 22 tokens but the text encoder only 12"):
        _reward(files, random_init=True, med_config={**fx.TINY_MED, "vocab_size": 12})
    with pytest.raises(FileNotFoundError, match="tokenizer.*vocab.txt"):
        _reward(files, tokenizer=str(tmp_path / "no-tokenizer"))
