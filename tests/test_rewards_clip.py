"""CLIP-family rewards on tiny random-weight architectures: formulas, determinism, batching, weight loading.

No weights can be downloaded here, so each "real weights" path is exercised by saving a random
model in the format the real checkpoint uses and loading it through the one-line config.
"""

import json
import re
import warnings

import open_clip
import pytest
import torch
import torch.nn.functional as F
import transformers
from PIL import Image
from safetensors.torch import save_file
from torch import nn
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

from rewards import AestheticMLP, build_reward
from rewards.clip_models import OPENAI_MEAN, OPENAI_STD, ImagePreprocess, clip_preprocess

OPEN_CLIP_TINY = {
    "embed_dim": 32,
    "vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 16, "image_size": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
HF_TINY = {
    "text_config": {
        "vocab_size": 49408,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 77,
    },
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 64,
        "patch_size": 16,
    },
    "projection_dim": 32,
}
VISION_TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 64,
    "patch_size": 16,
    "projection_dim": 768,
}
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
    pixels = clip_preprocess(images, (64, 64), OPENAI_MEAN, OPENAI_STD, interpolation="bilinear")  # Flow-GRPO's
    with torch.no_grad():
        img = F.normalize(model.encode_image(pixels), dim=-1)
        txt = F.normalize(model.encode_text(open_clip.tokenize(PROMPTS)), dim=-1)
    torch.testing.assert_close(reward(images, PROMPTS)["clipscore"], (img * txt).sum(-1))


def test_pickscore_is_scaled_cosine():
    reward = _build("pickscore")
    images = _images()
    ids = open_clip.tokenize(PROMPTS)
    with torch.no_grad():
        out = reward.model(
            input_ids=ids,
            attention_mask=(ids != 0).long(),
            pixel_values=clip_preprocess(images, (64, 64), OPENAI_MEAN, OPENAI_STD),
        )
        expected = reward.model.logit_scale.exp() * (out.image_embeds * out.text_embeds).sum(-1)
    torch.testing.assert_close(reward(images, PROMPTS)["pickscore"], expected)


def test_aesthetic_mlp_matches_laion_checkpoint_layout():
    shapes = {k: tuple(v.shape) for k, v in AestheticMLP().state_dict().items()}
    assert shapes == {
        "layers.0.weight": (1024, 768),
        "layers.0.bias": (1024,),
        "layers.2.weight": (128, 1024),
        "layers.2.bias": (128,),
        "layers.4.weight": (64, 128),
        "layers.4.bias": (64,),
        "layers.6.weight": (16, 64),
        "layers.6.bias": (16,),
        "layers.7.weight": (1, 16),
        "layers.7.bias": (1,),
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
    images = _images(h=64, w=64)  # square: HPSv2 letterboxes where CLIP crops, the same pixels here
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
    loaded = build_reward(
        [
            {
                "name": "pickscore",
                "model": str(tmp_path / "model"),
                "processor": str(tmp_path / "processor"),
                "local_files_only": True,
            }
        ]
    )
    assert isinstance(loaded.rewards["pickscore"].model, CLIPModel)
    images = _images()
    # HF pads with <|endoftext|>, open_clip with 0: the causal text tower makes that irrelevant.
    torch.testing.assert_close(
        loaded(images, PROMPTS)["pickscore"], source(images, PROMPTS)["pickscore"], atol=1e-5, rtol=1e-5
    )


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
        loaded = build_reward(
            [
                {
                    "name": "aesthetic",
                    "clip_model": str(tmp_path / "clip"),
                    "weights": str(tmp_path / weights),
                    "local_files_only": True,
                }
            ]
        )
        torch.testing.assert_close(loaded(images, PROMPTS)["aesthetic"], expected)
    # a directory holding the file under LAION's name (DDPO's and Flow-GRPO's assets), named by filename
    torch.save(source.model.head.state_dict(), tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
    spec = {"name": "aesthetic", "clip_model": str(tmp_path / "clip"), "weights": str(tmp_path)}
    loaded = build_reward([{**spec, "filename": "sac+logos+ava1-l14-linearMSE.pth"}])
    torch.testing.assert_close(loaded(images, PROMPTS)["aesthetic"], expected)
    with pytest.raises(FileNotFoundError, match="directory .* has no 'aesthetic-model.pth'"):
        build_reward([spec])


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
    with pytest.raises(ValueError, match="clipscore: pretrained is null: no weights"):
        build_reward([{"name": "clipscore", "model_config": OPEN_CLIP_TINY, "pretrained": None}])
    with pytest.raises(FileNotFoundError, match="hpsv2 checkpoint: no such file '/nonexistent/HPS_v2.1_compressed.pt'"):
        build_reward([{"name": "hpsv2", "checkpoint": "/nonexistent/HPS_v2.1_compressed.pt"}])
    with pytest.raises(FileNotFoundError, match="hpsv2 checkpoint: 'xswu/HPSv2' is neither.*HPS_v2.1_compressed.pt"):
        build_reward([{"name": "hpsv2", "local_files_only": True}])  # the default: hub xswu/HPSv2, offline here


def test_hps_checkpoint_given_as_a_bare_file_name_says_how_to_pick_the_hub_file():
    """What the FLUX presets once said (``checkpoint: HPS_v2.1_compressed.pt``) is a missing file, not a hub repo."""
    with pytest.raises(FileNotFoundError, match="no such file 'HPS_v2.1_compressed.pt'.*leave this unset.*filename"):
        build_reward([{"name": "hpsv2", "checkpoint": "HPS_v2.1_compressed.pt"}])


def test_aesthetic_defaults_to_the_laion_mlp_on_the_hub():
    # TRL's copy of LAION's sac+logos+ava1-l14-linearMSE.pth; not in the (offline) cache here
    with pytest.raises(FileNotFoundError, match="'trl-lib/ddpo-aesthetic-predictor' is neither.*'aesthetic-model.pth'"):
        build_reward([{"name": "aesthetic", "local_files_only": True}])


def test_aesthetic_takes_the_projection_size_from_the_clip_config(tmp_path):
    """A ``CLIPConfig`` keeps ``projection_dim`` at the top; its ``vision_config`` says 512 (LAION repos, and
    transformers' own default), which the vision tower alone would read: a size mismatch."""
    config = CLIPConfig(**{**HF_TINY, "projection_dim": 48})
    assert config.vision_config.projection_dim == 512
    with torch.random.fork_rng():
        torch.manual_seed(5)
        clip, head = CLIPModel(config).eval(), AestheticMLP(48).eval()
    clip.save_pretrained(tmp_path / "clip")
    CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(
        tmp_path / "clip"
    )
    torch.save(head.state_dict(), tmp_path / "mlp.pth")
    spec = {"name": "aesthetic", "clip_model": str(tmp_path / "clip"), "weights": str(tmp_path / "mlp.pth")}
    reward = build_reward([{**spec, "local_files_only": True}])
    images = _images(h=64, w=64)
    with torch.no_grad():  # CLIP's image features: the projected pooled output of the vision tower
        pooled = clip.vision_model(
            pixel_values=clip_preprocess(images, (64, 64), OPENAI_MEAN, OPENAI_STD)
        ).pooler_output
        expected = head(F.normalize(clip.visual_projection(pooled), dim=-1)).squeeze(-1)
    torch.testing.assert_close(reward(images, PROMPTS)["aesthetic"], expected)


def test_preprocess_resizes_shortest_side_and_centre_crops():
    images = torch.rand(2, 3, 64, 64)
    same = clip_preprocess(images, (64, 64), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    torch.testing.assert_close(same, (images - 0.5) / 0.25)  # already the right size: no resampling
    wide = torch.zeros(1, 3, 32, 96)
    wide[..., 32:64] = 1.0  # the middle third survives the centre crop
    out = clip_preprocess(wide, (32, 32), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert out.shape == (1, 3, 32, 32) and torch.equal(out, torch.ones_like(out))
    assert clip_preprocess(torch.rand(2, 3, 80, 96), (64, 64), OPENAI_MEAN, OPENAI_STD).shape == (2, 3, 64, 64)
    # letterbox: 32x96 -> 11x32, 21 black rows split 10 above / 11 below
    box = clip_preprocess(torch.ones(1, 3, 32, 96), (32, 32), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), resize_mode="longest")
    assert torch.equal(box[0, 0, :, 0], torch.tensor([0.0] * 10 + [1.0] * 11 + [0.0] * 11))


def _photo(h, w, seed=0):
    """A smooth (photo-like) uint8 image as PIL and as a (1, 3, h, w) tensor in [0, 1], the same pixels."""
    small = torch.rand(1, 3, h // 16 + 1, w // 16 + 1, generator=torch.Generator().manual_seed(seed))
    pixels = F.interpolate(small, (h, w), mode="bicubic").clamp(0, 1).mul(255).round().to(torch.uint8)
    return Image.fromarray(pixels[0].permute(1, 2, 0).numpy()), pixels.float() / 255


# transformers' PIL image processor (5.x splits it off; 4.x's CLIPImageProcessor is the PIL one)
CLIP_PIL_PROCESSOR = getattr(transformers, "CLIPImageProcessorPil", CLIPImageProcessor)
HF_PROCESSOR = CLIP_PIL_PROCESSOR(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
REFERENCES = {  # ours, and the reference's own PIL transform
    "open_clip (CLIP, clipscore)": (
        ImagePreprocess.from_open_clip({"size": 224}),
        open_clip.image_transform(224, is_train=False),
    ),
    "open_clip squash, bilinear (SigLIP-like)": (
        ImagePreprocess.from_open_clip({"size": 224, "resize_mode": "squash", "interpolation": "bilinear"}),
        open_clip.image_transform(224, is_train=False, resize_mode="squash", interpolation="bilinear"),
    ),
    # HPSv2's preprocess_val (ResizeMaxSize + black padding) gives the same pixels as open_clip's "longest"
    "HPSv2 letterbox": (
        ImagePreprocess.from_open_clip({"size": 224}, resize_mode="longest"),
        open_clip.image_transform(224, is_train=False, resize_mode="longest"),
    ),
    "transformers CLIPImageProcessor (pickscore, aesthetic)": (
        ImagePreprocess.from_hf(HF_PROCESSOR),
        lambda image: torch.from_numpy(HF_PROCESSOR(images=image, return_tensors="np")["pixel_values"][0]),
    ),
}


@pytest.mark.parametrize("name", list(REFERENCES))
def test_preprocess_matches_the_references_pil_transforms(name):
    """Non-square generated sizes: 768x1024 (the long side truncates to 298, not 299) and 1216x832 (an odd crop
    margin: transformers floors it, torchvision rounds it). The references resample in PIL and store 8-bit pixels;
    we keep float32, so ~1 uint8 step (1/255/std = 0.015) is what remains."""
    ours, reference = REFERENCES[name]
    for h, w in ((768, 1024), (1216, 832)):
        image, pixels = _photo(h, w)
        diff = (ours(pixels) - reference(image)[None]).abs()
        assert diff.max() < 0.04 and diff.mean() < 0.006, (h, w, diff.max(), diff.mean())


def test_each_reward_preprocesses_like_its_reference(monkeypatch):
    assert _build("clipscore").preprocess == ImagePreprocess((64, 64), interpolation="bilinear")  # Flow-GRPO's
    assert _build("clipscore", preprocessing="open_clip").preprocess == ImagePreprocess((64, 64))
    assert _build("hpsv2").preprocess == ImagePreprocess((64, 64), resize_mode="longest")
    assert _build("pickscore").preprocess == ImagePreprocess((64, 64), floor_crop=True)
    assert _build("aesthetic").preprocess == ImagePreprocess((64, 64), floor_crop=True)
    # clipscore follows the open_clip model's config (SigLIP, DFN: squash); HPSv2 letterboxes whatever it says
    half = (0.5, 0.5, 0.5)
    cfg = {"size": 64, "resize_mode": "squash", "interpolation": "bilinear", "mean": half, "std": half}
    monkeypatch.setattr(open_clip, "get_model_preprocess_cfg", lambda net: cfg)
    squash = ImagePreprocess((64, 64), half, half, "squash", "bilinear")
    assert _build("clipscore", preprocessing="open_clip").preprocess == squash
    # Flow-GRPO's ClipScorer resizes the shortest side and crops whatever the model's config says; mean/std are kept
    assert _build("clipscore").preprocess == ImagePreprocess((64, 64), half, half, "shortest", "bilinear")
    assert _build("hpsv2").preprocess == ImagePreprocess((64, 64), half, half, "longest", "bicubic")


# open_clip.create_model's keywords in 2.26, the oldest version pyproject admits (pretrained_text came with 3.0)
OPEN_CLIP_2_26_KWARGS = {
    "pretrained",
    "precision",
    "device",
    "jit",
    "force_quick_gelu",
    "force_custom_text",
    "force_patch_dropout",
    "force_image_size",
    "force_preprocess_cfg",
    "pretrained_image",
    "pretrained_hf",
    "cache_dir",
    "output_dict",
    "require_pretrained",
}


def test_random_init_by_architecture_name_keeps_to_open_clip_2_26(monkeypatch, tmp_path):
    (tmp_path / "flowgrpo-tiny.json").write_text(json.dumps(OPEN_CLIP_TINY))
    open_clip.add_model_config(tmp_path / "flowgrpo-tiny.json")
    create_model = open_clip.create_model

    def create_model_2_26(name, *args, **kwargs):
        assert set(kwargs) <= OPEN_CLIP_2_26_KWARGS, f"open_clip 2.26 has no {set(kwargs) - OPEN_CLIP_2_26_KWARGS}"
        return create_model(name, *args, **kwargs)

    monkeypatch.setattr(open_clip, "create_model", create_model_2_26)
    for name in ("clipscore", "hpsv2"):
        reward = build_reward([{"name": name, "model": "flowgrpo-tiny", "random_init": True}])
        assert torch.isfinite(reward(_images(), PROMPTS)[name]).all()


def _torchscript_archive(state, path):
    """A TorchScript archive holding ``state`` under its names, as OpenAI's CLIP release files do."""
    root = nn.Module()
    for key, value in state.items():
        *parents, leaf = key.split(".")
        module = root
        for parent in parents:
            if not hasattr(module, parent):
                module.add_module(parent, nn.Module())
            module = getattr(module, parent)
        module.register_buffer(leaf, value)
    with warnings.catch_warnings():  # torch.jit.save is deprecated; OpenAI's files predate that
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(root), path)


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated")  # open_clip's loader for OpenAI's files
def test_openai_release_file_gets_quick_gelu(tmp_path):
    """OpenAI's ViT-*.pt (what ``clip.load`` caches) is a TorchScript archive of a QuickGELU model."""
    config = {
        "embed_dim": 32,
        "vision_cfg": {"layers": 1, "width": 64, "head_width": 64, "patch_size": 16, "image_size": 64},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 1},
    }  # OpenAI's layout: 64-wide heads, which its loader infers from the widths
    with torch.random.fork_rng():
        torch.manual_seed(6)
        quick = open_clip.CLIP(**config, quick_gelu=True).half().float().eval()  # the release is fp16
    extra = {
        "input_resolution": torch.tensor(64),
        "context_length": torch.tensor(77),
        "vocab_size": torch.tensor(49408),
    }
    _torchscript_archive({**quick.state_dict(), **extra}, tmp_path / "ViT-B-16.pt")
    gelu = open_clip.CLIP(**config).eval()
    gelu.load_state_dict(quick.state_dict())

    reward = build_reward([{"name": "clipscore", "model": "ViT-B-16", "pretrained": str(tmp_path / "ViT-B-16.pt")}])
    images = _images(h=64, w=64)
    pixels, tokens = clip_preprocess(images, (64, 64), OPENAI_MEAN, OPENAI_STD), open_clip.tokenize(PROMPTS)
    with torch.no_grad():
        expected, wrong = (
            (F.normalize(m.encode_image(pixels), dim=-1) * F.normalize(m.encode_text(tokens), dim=-1)).sum(-1)
            for m in (quick, gelu)
        )
    scores = reward(images, PROMPTS)["clipscore"]
    torch.testing.assert_close(scores, expected)
    assert (scores - wrong).abs().max() > 1e-3  # GELU would be measurably off


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
        ("ViT-L-14", "openai", True),
        ("ViT-L-14", "laion2b_s32b_b82k", False),
    ]
    assert all(k["require_pretrained"] for _, k in calls)


# ------------------------------------------------------------------------------------------------ issue 28


def test_clipscore_resizes_bilinear_as_flowgrpos_clip_scorer():
    """Flow-GRPO's ``ClipScorer`` (flow_grpo/clip_scorer.py) runs torchvision ``T.Resize(224)`` (bilinear, antialiased,
    on tensors), ``T.CenterCrop(224)`` and ``T.Normalize``; clipscore resized bicubic, as open_clip does."""
    import torchvision.transforms as T

    images = _images(h=80, w=96)  # shortest side 80 -> 64: 64 x 76, crop 6 columns off the left
    ours = _build("clipscore").preprocess(images)
    mean, std = torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1), torch.tensor(OPENAI_STD).view(1, 3, 1, 1)

    def torch_resize(mode):
        x = F.interpolate(images, size=(64, 76), mode=mode, antialias=True, align_corners=False)
        return (x[..., 6:70] - mean) / std

    torch.testing.assert_close(ours, torch_resize("bilinear"), atol=1e-5, rtol=0)
    assert (ours - torch_resize("bicubic")).abs().max() > 1e-2  # what clipscore did before
    reference = T.Compose([T.Resize(64), T.CenterCrop(64), T.Normalize(OPENAI_MEAN, OPENAI_STD)])  # Flow-GRPO's
    torch.testing.assert_close(ours, reference(images), atol=1e-5, rtol=0)
    # preprocessing: open_clip keeps the model's own config (bicubic for CLIP)
    open_clip_pixels = _build("clipscore", preprocessing="open_clip").preprocess(images)
    torch.testing.assert_close(open_clip_pixels, torch_resize("bicubic").clamp((0 - mean) / std, (1 - mean) / std))
    with pytest.raises(ValueError, match="clipscore: preprocessing must be one of flowgrpo, open_clip"):
        _build("clipscore", preprocessing="pil")


def _has_quick_gelu(model: nn.Module) -> bool:
    return any(isinstance(m, open_clip.transformer.QuickGELU) for m in model.modules())


def test_clipscore_quick_gelu_option_for_a_state_dict_file(tmp_path):
    source = open_clip.CLIP(**OPEN_CLIP_TINY)
    save_file(source.state_dict(), str(tmp_path / "clip.safetensors"))
    spec = {"name": "clipscore", "model_config": OPEN_CLIP_TINY, "pretrained": str(tmp_path / "clip.safetensors")}
    assert not _has_quick_gelu(build_reward([spec]).rewards["clipscore"].model)  # a file does not say: as named
    quick = build_reward([{**spec, "quick_gelu": True}]).rewards["clipscore"].model
    assert _has_quick_gelu(quick)
    assert _has_quick_gelu(_build("clipscore", quick_gelu=True).model)  # random_init too
    with pytest.raises(ValueError, match="clipscore: quick_gelu must be true, false or null; got 'yes'"):
        _build("clipscore", quick_gelu="yes")


def _clean_error(excinfo: pytest.ExceptionInfo) -> str:
    """A message the scripts print as one paragraph: a ValueError / OSError (what they catch), one line."""
    assert isinstance(excinfo.value, (ValueError, OSError)), type(excinfo.value)
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


def _truncated(path, source):
    data = source.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_clipscore_bad_pretrained_files_say_which_and_what_to_do(tmp_path):
    state = open_clip.CLIP(**OPEN_CLIP_TINY).state_dict()
    save_file(state, str(tmp_path / "good.safetensors"))
    torch.save(state, tmp_path / "good.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all\n" * 20)
    cases = {
        str(tmp_path / "missing.pt"): f"clipscore: pretrained '{tmp_path}/missing.pt' does not exist",
        "./clip.safetensors": "clipscore: pretrained './clip.safetensors' does not exist .relative paths start at",
        str(tmp_path): "is a directory; name the checkpoint file in it",
        str(tmp_path / "garbage.pt"): f"clipscore: pretrained: cannot read {tmp_path}/garbage.pt .*download or copy",
        str(_truncated(tmp_path / "cut.safetensors", tmp_path / "good.safetensors")): "cannot read .*cut.safetensors",
        str(_truncated(tmp_path / "cut.pt", tmp_path / "good.pt")): "cannot read .*cut.pt .*truncated or corrupt",
    }
    for pretrained, message in cases.items():
        with pytest.raises((ValueError, OSError)) as excinfo:
            build_reward([{"name": "clipscore", "model_config": OPEN_CLIP_TINY, "pretrained": pretrained}])
        assert re.search(message, _clean_error(excinfo)), (pretrained, str(excinfo.value))
    # by architecture name: an unknown tag lists the known ones; a file of another architecture says so
    with pytest.raises(FileNotFoundError) as excinfo:
        build_reward([{"name": "clipscore", "model": "ViT-B-32", "pretrained": "openaii"}])
    assert "'openaii' is neither a file" in _clean_error(excinfo) and "its tags: openai," in str(excinfo.value)
    other = {**OPEN_CLIP_TINY, "text_cfg": {**OPEN_CLIP_TINY["text_cfg"], "width": 64}}
    for spec in ({"model_config": other}, {"model": "ViT-B-32"}):
        with pytest.raises(ValueError) as excinfo:
            build_reward([{"name": "clipscore", "pretrained": str(tmp_path / "good.pt"), **spec}])
        what = "model_config" if "model_config" in spec else "model 'ViT-B-32'"
        assert f"good.pt' does not fit the architecture of {what}" in _clean_error(excinfo)


def test_hub_models_given_as_paths_that_do_not_exist_say_so(tmp_path):
    """huggingface_hub calls a missing path a malformed repo id ("Repo id must be in the form ...")."""
    for model in ("/nonexistent/PickScore_v1", "./PickScore_v1", "~/no/such/dir"):
        with pytest.raises(FileNotFoundError) as excinfo:
            build_reward([{"name": "pickscore", "model": model}])
        assert f"pickscore: model {model!r} does not exist (relative paths start at" in _clean_error(excinfo)
        assert "Repo id" not in str(excinfo.value)
    with pytest.raises(FileNotFoundError) as excinfo:
        build_reward([{"name": "aesthetic", "clip_model": "/nonexistent/clip", "random_init": True}])
    assert "aesthetic: clip_model '/nonexistent/clip' does not exist" in _clean_error(excinfo)
    # a valid repo id that is neither a local dir nor cached (offline): one paragraph with the hub's reason
    with pytest.raises(OSError) as excinfo:
        build_reward([{"name": "pickscore", "model": "no-such-org/no-such-model", "local_files_only": True}])
    assert "'no-such-org/no-such-model' is no local path" in _clean_error(excinfo)


def test_pickscore_truncated_weights_name_the_file(tmp_path):
    source = _build("pickscore", seed=1)
    source.model.save_pretrained(tmp_path / "model")
    _truncated(tmp_path / "model" / "model.safetensors", tmp_path / "model" / "model.safetensors")
    with pytest.raises(ValueError) as excinfo:
        build_reward([{"name": "pickscore", "model": str(tmp_path / "model"), "processor": str(tmp_path)}])
    message = _clean_error(excinfo)
    assert f"pickscore: model: cannot read {tmp_path}/model/model.safetensors" in message
    assert "truncated or corrupt" in message and "download or copy it again" in message


@pytest.mark.parametrize("name", ["hpsv2", "aesthetic"])
def test_unreadable_weight_files_name_the_option(tmp_path, name):
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all\n" * 20)
    if name == "hpsv2":
        spec = {"name": "hpsv2", "model_config": OPEN_CLIP_TINY, "checkpoint": str(tmp_path / "garbage.pt")}
        where = "hpsv2: checkpoint"
    else:
        _build("aesthetic").model.vision.save_pretrained(tmp_path / "clip")
        CLIP_PIL_PROCESSOR(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(
            tmp_path / "clip"
        )
        spec = {"name": "aesthetic", "clip_model": str(tmp_path / "clip"), "weights": str(tmp_path / "garbage.pt")}
        where = "aesthetic: weights"
    with pytest.raises(ValueError) as excinfo:
        build_reward([spec])
    assert f"{where}: cannot read {tmp_path}/garbage.pt" in _clean_error(excinfo)
