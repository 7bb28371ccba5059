"""CLIP-family rewards on tiny random-weight architectures: formulas, determinism, batching, weight loading.

No weights can be downloaded here, so each "real weights" path is exercised by saving a random
model in the format the real checkpoint uses and loading it through the one-line config.
"""

import open_clip
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

from rewards import AestheticMLP, build_reward
from rewards.clip_models import OPENAI_MEAN, OPENAI_STD, clip_preprocess

OPEN_CLIP_TINY = {
    "embed_dim": 32,
    "vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 16, "image_size": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
HF_TINY = {
    "text_config": {"vocab_size": 49408, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "max_position_embeddings": 77},
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "image_size": 64, "patch_size": 16},
    "projection_dim": 32,
}
VISION_TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "image_size": 64, "patch_size": 16, "projection_dim": 768}
SPECS = {
    "clipscore": {"random_init": True, "model_config": OPEN_CLIP_TINY},
    "hpsv2": {"random_init": True, "model_config": OPEN_CLIP_TINY},
    "pickscore": {"random_init": True, "config": HF_TINY},
    "aesthetic": {"random_init": True, "vision_config": VISION_TINY},
}
PROMPTS = ["a photo of a cat", "a red car", "a bowl of fruit on a table", "text"]


def _images(batch=4, h=80, w=96, seed=0):
    return torch.rand(batch, 3, h, w, generator=torch.Generator().manual_seed(seed))


def _build(name, **extra):
    return build_reward([{"name": name, **SPECS[name], **extra}]).rewards[name]


@pytest.mark.parametrize("name", list(SPECS))
def test_shapes_determinism_and_batch_invariance(name):
    rng = torch.get_rng_state()
    reward = _build(name, batch_size=4)
    assert torch.equal(torch.get_rng_state(), rng)  # seeded init leaves the global RNG alone
    assert not reward.model.training and not any(p.requires_grad for p in reward.model.parameters())
    images = _images()
    scores = reward(images, PROMPTS)[name]
    assert scores.shape == (4,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    assert scores.std() > 0  # depends on the image / prompt
    again = _build(name, batch_size=1)(images, PROMPTS)[name]  # rebuilt, one image per forward pass
    torch.testing.assert_close(again, scores, atol=1e-5, rtol=1e-5)
    other_seed = _build(name, seed=1)(images, PROMPTS)[name]
    assert not torch.allclose(other_seed, scores)


def test_clipscore_is_cosine_of_open_clip_embeddings():
    reward = _build("clipscore")
    images = _images()
    model = reward.model
    pixels = clip_preprocess(images, (64, 64), OPENAI_MEAN, OPENAI_STD)
    with torch.no_grad():
        img = F.normalize(model.encode_image(pixels), dim=-1)
        txt = F.normalize(model.encode_text(open_clip.tokenize(PROMPTS)), dim=-1)
    torch.testing.assert_close(reward(images, PROMPTS)["clipscore"], (img * txt).sum(-1))


def test_pickscore_is_scaled_cosine():
    reward = _build("pickscore")
    images = _images()
    ids = open_clip.tokenize(PROMPTS)
    with torch.no_grad():
        out = reward.model(input_ids=ids, attention_mask=(ids != 0).long(),
                           pixel_values=clip_preprocess(images, (64, 64), OPENAI_MEAN, OPENAI_STD))
        expected = reward.model.logit_scale.exp() * (out.image_embeds * out.text_embeds).sum(-1)
    torch.testing.assert_close(reward(images, PROMPTS)["pickscore"], expected)


def test_aesthetic_mlp_matches_laion_checkpoint_layout():
    shapes = {k: tuple(v.shape) for k, v in AestheticMLP().state_dict().items()}
    assert shapes == {
        "layers.0.weight": (1024, 768), "layers.0.bias": (1024,),
        "layers.2.weight": (128, 1024), "layers.2.bias": (128,),
        "layers.4.weight": (64, 128), "layers.4.bias": (64,),
        "layers.6.weight": (16, 64), "layers.6.bias": (16,),
        "layers.7.weight": (1, 16), "layers.7.bias": (1,),
    }
    reward = _build("aesthetic")
    images = _images()
    with torch.no_grad():
        embeds = reward.model.vision(pixel_values=clip_preprocess(images, (64, 64), OPENAI_MEAN, OPENAI_STD))
        expected = reward.model.head(F.normalize(embeds.image_embeds, dim=-1)).squeeze(-1)
    torch.testing.assert_close(reward(images, PROMPTS)["aesthetic"], expected)


def test_open_clip_weights_load_from_a_local_file(tmp_path):
    source = _build("clipscore", seed=3)
    state = source.model.state_dict()
    torch.save(state, tmp_path / "clip.pt")
    torch.save({"state_dict": state, "epoch": 1}, tmp_path / "hps.pt")  # the HPS checkpoint layout
    images = _images()
    expected = source(images, PROMPTS)["clipscore"]
    clip = build_reward([{"name": "clipscore", "model_config": OPEN_CLIP_TINY, "pretrained": f"{tmp_path}/clip.pt"}])
    hps = build_reward([{"name": "hpsv2", "model_config": OPEN_CLIP_TINY, "checkpoint": str(tmp_path / "hps.pt")}])
    torch.testing.assert_close(clip(images, PROMPTS)["clipscore"], expected)
    torch.testing.assert_close(hps(images, PROMPTS)["hpsv2"], expected)


def _hf_tokenizer():
    """A real CLIPTokenizer built from open_clip's bundled BPE vocabulary (same ids as CLIP's)."""
    bpe = open_clip.SimpleTokenizer()
    names = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    vocab = {names.get(k, k): v for k, v in bpe.encoder.items()}
    return CLIPTokenizer(vocab=vocab, merges=sorted(bpe.bpe_ranks, key=bpe.bpe_ranks.get))


def test_pickscore_loads_model_and_processor_from_a_directory(tmp_path):
    source = _build("pickscore", seed=2)
    source.model.save_pretrained(tmp_path / "model")
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}),
        tokenizer=_hf_tokenizer(),
    )
    processor.save_pretrained(tmp_path / "processor")
    loaded = build_reward([{"name": "pickscore", "model": str(tmp_path / "model"),
                            "processor": str(tmp_path / "processor"), "local_files_only": True}])
    assert isinstance(loaded.rewards["pickscore"].model, CLIPModel)
    images = _images()
    # HF pads with <|endoftext|>, open_clip with 0: the causal text tower makes that irrelevant.
    torch.testing.assert_close(loaded(images, PROMPTS)["pickscore"], source(images, PROMPTS)["pickscore"],
                               atol=1e-5, rtol=1e-5)


def test_aesthetic_loads_clip_dir_and_mlp_file(tmp_path):
    source = _build("aesthetic", seed=4)
    source.model.vision.save_pretrained(tmp_path / "clip")
    CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(
        tmp_path / "clip"
    )
    torch.save(source.model.head.state_dict(), tmp_path / "mlp.pth")
    save_file(source.model.head.state_dict(), str(tmp_path / "mlp.safetensors"))
    images = _images()
    expected = source(images, PROMPTS)["aesthetic"]
    for weights in ("mlp.pth", "mlp.safetensors"):
        loaded = build_reward([{"name": "aesthetic", "clip_model": str(tmp_path / "clip"),
                                "weights": str(tmp_path / weights), "local_files_only": True}])
        torch.testing.assert_close(loaded(images, PROMPTS)["aesthetic"], expected)
    # a directory holding the default file name works too
    torch.save(source.model.head.state_dict(), tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
    loaded = build_reward([{"name": "aesthetic", "clip_model": str(tmp_path / "clip"), "weights": str(tmp_path)}])
    torch.testing.assert_close(loaded(images, PROMPTS)["aesthetic"], expected)


def test_dtype_and_missing_weights():
    images = _images()
    fp32 = _build("clipscore")(images, PROMPTS)["clipscore"]
    bf16 = _build("clipscore", dtype="bf16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    out = bf16(images, PROMPTS)["clipscore"]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fp32, atol=0.05, rtol=0)
    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        _build("clipscore", dtype="half")
    with pytest.raises(ValueError, match="clipscore: no weights"):
        build_reward([{"name": "clipscore", "model_config": OPEN_CLIP_TINY, "pretrained": None}])
    with pytest.raises(ValueError, match="aesthetic: set weights="):
        build_reward([{"name": "aesthetic"}])
    with pytest.raises(FileNotFoundError, match="hpsv2 checkpoint.*pass a local path"):
        build_reward([{"name": "hpsv2", "checkpoint": "/nonexistent/HPS_v2.1_compressed.pt"}])


def test_preprocess_resizes_shortest_side_and_centre_crops():
    images = torch.rand(2, 3, 64, 64)
    same = clip_preprocess(images, (64, 64), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    torch.testing.assert_close(same, (images - 0.5) / 0.25)  # already the right size: no resampling
    wide = torch.zeros(1, 3, 32, 96)
    wide[..., 32:64] = 1.0  # the middle third survives the centre crop
    out = clip_preprocess(wide, (32, 32), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert out.shape == (1, 3, 32, 32) and torch.equal(out, torch.ones_like(out))
    assert clip_preprocess(torch.rand(2, 3, 80, 96), (64, 64), OPENAI_MEAN, OPENAI_STD).shape == (2, 3, 64, 64)


def test_openai_tags_get_quick_gelu(monkeypatch):
    """open_clip only warns when openai weights meet a GELU architecture; the reward must force QuickGELU."""
    calls = []

    def fake_create_model(arch, **kwargs):
        calls.append((arch, kwargs))
        return open_clip.CLIP(**OPEN_CLIP_TINY)

    monkeypatch.setattr(open_clip, "create_model", fake_create_model)
    build_reward([{"name": "clipscore", "model": "ViT-L-14", "pretrained": "openai"}])
    build_reward([{"name": "clipscore", "model": "ViT-L-14", "pretrained": "laion2b_s32b_b82k"}])
    assert [(a, k["pretrained"], k["force_quick_gelu"]) for a, k in calls] == [
        ("ViT-L-14", "openai", True), ("ViT-L-14", "laion2b_s32b_b82k", False)
    ]
    assert all(k["require_pretrained"] for _, k in calls)
