"""Tiny offline pipelines (flowgrpo.tiny) and pipeline loading (flowgrpo.pipelines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, QwenImagePipeline, StableDiffusion3Pipeline
from huggingface_hub import constants as hf_constants

from flowgrpo.pipelines import (
    PipelineLoadError,
    detect_kind,
    load_pipeline,
    parse_dtype,
    pipeline_kind,
)
from flowgrpo.tiny import TINY_SIZES, build_tiny_pipeline

REPO = Path(__file__).resolve().parents[1]
KINDS = ["sd3", "flux"]
ALL_KINDS = [*KINDS, "qwenimage"]  # the tests that need no family-specific component checks run on Qwen-Image too
CLASSES = {"sd3": StableDiffusion3Pipeline, "flux": FluxPipeline, "qwenimage": QwenImagePipeline}
PIPE_KWARGS = {  # SD3: CFG (batched uncond+cond); FLUX: guidance embedding; Qwen-Image: true CFG, negative prompt
    "sd3": {"guidance_scale": 4.5},
    "flux": {"guidance_scale": 3.5},
    "qwenimage": {"true_cfg_scale": 4.0, "negative_prompt": " "},
}
PROMPT = "a red cube on a table"


def _state(pipe) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value
        for name, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
        for key, value in module.state_dict().items()
    }


def _latents(kind: str, height: int, width: int, seed: int = 0) -> torch.Tensor:
    sizes = TINY_SIZES[kind]
    c, f = sizes["latent_channels"], sizes["vae_scale_factor"]
    x = torch.randn(1, c, height // f, width // f, generator=torch.Generator().manual_seed(seed))
    if kind in ("flux", "qwenimage"):  # FLUX / Qwen-Image take latents packed into 2x2 patches: (B, tokens, 4c)
        x = FluxPipeline._pack_latents(x, 1, c, height // f, width // f)
    return x


def _generate(pipe, kind: str, latents: torch.Tensor, height: int = 32, width: int = 32) -> torch.Tensor:
    return pipe(
        PROMPT,
        num_inference_steps=2,
        **PIPE_KWARGS[kind],
        height=height,
        width=width,
        latents=latents.clone(),
        output_type="pt",
    ).images


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_build_is_deterministic_per_seed(kind):
    rng_before = torch.get_rng_state()
    a, b, c = build_tiny_pipeline(kind, seed=0), build_tiny_pipeline(kind, seed=0), build_tiny_pipeline(kind, 1)
    assert torch.equal(torch.get_rng_state(), rng_before), "building must not consume the global RNG"
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for name in ("transformer", "vae", "text_encoder"):
        weights = [k for k in sa if k.startswith(name + ".") and sa[k].is_floating_point() and sa[k].numel() > 1]
        assert any(not torch.equal(sa[k], sc[k]) for k in weights), f"{name} does not depend on the seed"


@pytest.mark.parametrize("kind", KINDS)
def test_components_eval_and_kind(kind):
    pipe = build_tiny_pipeline(kind)
    assert isinstance(pipe, CLASSES[kind])
    assert pipeline_kind(pipe) == kind
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    assert len(modules) == (5 if kind == "sd3" else 4)
    assert not any(sub.training for m in modules for sub in m.modules())
    assert pipe.vae_scale_factor == TINY_SIZES[kind]["vae_scale_factor"]
    assert pipe.vae.config.latent_channels == TINY_SIZES[kind]["latent_channels"]
    assert pipe.transformer.config.pooled_projection_dim == TINY_SIZES[kind]["pooled_dim"]
    assert pipe.transformer.config.joint_attention_dim == TINY_SIZES[kind]["joint_dim"]
    # Text models are sized to their tokenizers, which must cover every id they produce.
    assert pipe.text_encoder.config.vocab_size == len(pipe.tokenizer)
    t5, t5_tok = (pipe.text_encoder_3, pipe.tokenizer_3) if kind == "sd3" else (pipe.text_encoder_2, pipe.tokenizer_2)
    assert t5.config.vocab_size == len(t5_tok)
    assert t5_tok.unk_token_id not in t5_tok("Hello, World 42!").input_ids


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("height,width", [(32, 32), (32, 48)])
def test_pipe_generates_finite_images_of_the_asked_size(kind, height, width):
    pipe = build_tiny_pipeline(kind)
    images = _generate(pipe, kind, _latents(kind, height, width), height, width)
    assert images.shape == (1, 3, height, width)
    assert torch.isfinite(images).all()
    assert images.min() >= 0 and images.max() <= 1
    assert images.std() > 0


def test_pipe_runs_in_bf16():
    pipe = load_pipeline("tiny-flux")  # default dtype bf16
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.text_encoder_2.dtype == torch.bfloat16
    images = pipe(PROMPT, num_inference_steps=2, height=32, width=32, output_type="pt").images
    assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all()


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_save_then_load_reproduces_the_in_memory_pipeline(kind, tmp_path):
    pipe = build_tiny_pipeline(kind, seed=5)
    pipe.save_pretrained(tmp_path, safe_serialization=True)
    assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == CLASSES[kind].__name__
    assert detect_kind(str(tmp_path)) == kind

    latents = _latents(kind, 32, 32)
    expected = _generate(pipe, kind, latents)
    by_us = load_pipeline(str(tmp_path), dtype="fp32")
    by_diffusers = CLASSES[kind].from_pretrained(tmp_path)  # fp32 by default
    weights = _state(pipe)
    for loaded in (by_us, by_diffusers):
        assert type(loaded) is CLASSES[kind]
        # Every weight round-trips bit for bit: that is what saving and loading must guarantee.
        state = _state(loaded)
        assert state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in weights)
        # The outputs of equal weights are not bit-equal across copies: the loaded weights lie in the safetensors
        # file's memory map (8-byte aligned, not 64), and CPU GEMM kernels pick their blocking and vector path by
        # alignment and CPU model, which reorders float sums (3.6e-7 on an AMD EPYC, from the text encoder; copied
        # into fresh memory, its output is bit-equal again). 1e-5 on images in [0, 1] is ~100 fp32 ulps at 1.0:
        # room for that, far below what a changed config (scheduler, dtype, a component) would move.
        torch.testing.assert_close(_generate(loaded, kind, latents), expected, rtol=0, atol=1e-5)
        for name in [n for n in pipe.components if n.startswith("tokenizer")]:
            assert getattr(loaded, name)(PROMPT).input_ids == getattr(pipe, name)(PROMPT).input_ids
    assert not any(
        sub.training for m in by_us.components.values() if isinstance(m, torch.nn.Module) for sub in m.modules()
    )


def test_tiny_sources_and_explicit_kind():
    pipe = load_pipeline("tiny-sd3", kind="sd3", dtype=torch.float32)
    expected = _state(build_tiny_pipeline("sd3", seed=0))
    assert all(torch.equal(v, expected[k]) for k, v in _state(pipe).items())
    assert detect_kind("tiny-flux") == "flux"
    with pytest.raises(ValueError, match=r"kind='flux'"):
        load_pipeline("tiny-sd3", kind="flux")


def test_kind_mismatch_and_unknown_kinds(tmp_path):
    build_tiny_pipeline("flux").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"FluxPipeline.*kind='sd3'"):
        load_pipeline(str(tmp_path), kind="sd3")
    with pytest.raises(ValueError, match=r"'sdxl'; expected 'auto' or one of \('flux', .*'sd3'"):  # the registry's
        load_pipeline(str(tmp_path), kind="sdxl")

    # A pipeline class we do not map needs an explicit kind.
    index = tmp_path / "model_index.json"
    index.write_text(index.read_text().replace('"FluxPipeline"', '"FluxImg2ImgPipeline"'))
    with pytest.raises(ValueError, match=r"cannot tell the kind.*FluxImg2ImgPipeline"):
        load_pipeline(str(tmp_path))
    assert pipeline_kind(load_pipeline(str(tmp_path), kind="flux", dtype="fp32")) == "flux"


def test_missing_sources_raise_a_clear_error(tmp_path, monkeypatch):
    missing = str(tmp_path / "no" / "such" / "dir")
    with pytest.raises(PipelineLoadError, match="does not exist") as info:
        load_pipeline(missing)
    assert missing in str(info.value)

    with pytest.raises(PipelineLoadError, match="no model_index.json"):
        load_pipeline(str(tmp_path))

    broken = tmp_path / "broken"
    build_tiny_pipeline("sd3").save_pretrained(broken)
    (broken / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(PipelineLoadError, match=r"local directory .*broken.*vae"):
        load_pipeline(str(broken))

    # An id that cannot be in the (empty) cache, while offline: one short error naming the id.
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    hub_id = "flowgrpo-tests/not-a-real-model"
    with pytest.raises(PipelineLoadError) as info:
        load_pipeline(hub_id)
    message = str(info.value)
    assert hub_id in message and "HF_HUB_OFFLINE=1" in message
    assert "local diffusers directory" in message and f"hf download {hub_id}" in message
    assert info.value.__suppress_context__ and info.value.__cause__ is None


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("fp16") is torch.float16
    assert parse_dtype("FP32") is torch.float32 and parse_dtype("torch.float32") is torch.float32
    assert parse_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="bf16"):
        parse_dtype("int8")
    with pytest.raises(ValueError):
        parse_dtype(torch.int64)
    with pytest.raises(ValueError, match="'sd3'"):
        pipeline_kind(object())


def test_make_tiny_pipeline_script(tmp_path):
    out = tmp_path / "tiny-flux-seed3"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_pipeline.py"), str(out), "--kind", "flux", "--seed", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert list(out.glob("*/*.safetensors")), "weights must be saved as safetensors"
    loaded = load_pipeline(str(out), dtype="fp32")
    expected = _state(build_tiny_pipeline("flux", seed=3))
    assert all(torch.equal(v, expected[k]) for k, v in _state(loaded).items())
