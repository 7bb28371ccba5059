"""The shipped shapes model: a plain diffusers pipeline, the same rollout code as SD3.5, and a seeded,
exactly resumable pretraining script."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

from flowgrpo.adapters import make_adapter
from flowgrpo.config import SamplerConfig
from flowgrpo.pipelines import load_pipeline
from flowgrpo.rollout import rollout
from flowgrpo.shapes import split
from flowgrpo.shapes_model import SHAPES_MODEL_DIR, TEXT_LENGTH, pixels_to_latents, render_scenes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def test_the_shipped_model_opens_in_plain_diffusers_and_samples():
    pipe = DiffusionPipeline.from_pretrained(SHAPES_MODEL_DIR, text_encoder_3=None, tokenizer_3=None)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline" and pipe.vae_scale_factor == 4
    out = pipe(
        "a red circle",
        num_inference_steps=4,
        max_sequence_length=TEXT_LENGTH,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert out.shape == (1, 3, 32, 32) and 0 <= out.min() and out.max() <= 1
    record = json.loads((SHAPES_MODEL_DIR / "pretraining.json").read_text())
    assert record["command"].startswith("python scripts/pretrain_shapes.py") and record["eval"]


def test_a_noise_free_rollout_of_the_shipped_model_reproduces_pipe():
    pipe = load_pipeline("shapes-sd3", dtype="fp32")
    adapter = make_adapter(pipe, max_sequence_length=TEXT_LENGTH)
    prompts = ["two green squares", "a blue triangle above a red circle"]
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    sampler = SamplerConfig(noise_level=0.0, num_steps=6, guidance_scale=4.5)
    traj = rollout(adapter, prompts, [0, 1], sampler, range(0, 0), height=32, width=32, initial_latents=latents)
    expected = pipe(
        prompts,
        latents=latents,
        num_inference_steps=6,
        guidance_scale=4.5,
        max_sequence_length=TEXT_LENGTH,
        output_type="pt",
    ).images
    torch.testing.assert_close(traj.images, expected, atol=1e-5, rtol=0)


def _argv(tmp_path: Path, name: str, *extra: str) -> list[str]:
    """2 autoencoder steps, then 4 transformer steps, checkpoints after every step."""
    return [
        "--vae-steps",
        "2",
        "--vae-batch-size",
        "4",
        "--steps",
        "4",
        "--batch-size",
        "4",
        "--warmup",
        "2",
        "--work",
        str(tmp_path / name),
        "--out",
        str(tmp_path / f"{name}-model"),
        "--checkpoint-every",
        "1",
        "--eval-every",
        "100",
        "--eval-per-tag",
        "1",
        "--eval-steps",
        "2",
        *extra,
    ]


def _pretrain(tmp_path: Path, name: str, stop_after: int) -> dict[str, torch.Tensor]:
    """Run the pretraining script in this process until ``stop_after`` steps in all (an interruption), and return
    its latest checkpoint's weights."""
    import pretrain_shapes

    work = tmp_path / name
    assert pretrain_shapes.main(_argv(tmp_path, name), stop_after=stop_after) == 0
    if stop_after < 2:
        return load_file(work / "vae-checkpoint" / "model.safetensors")
    vae = load_file(work / "vae" / "diffusion_pytorch_model.safetensors")
    if stop_after == 2:
        return vae
    weights = load_file(work / "checkpoint" / "model.safetensors")
    return {**weights, **{f"vae.{k}": v for k, v in vae.items()}}


def test_pretraining_is_seeded_and_an_interrupted_run_resumes_to_the_same_weights(tmp_path, capsys):
    import pretrain_shapes

    torch_threads = torch.get_num_threads()
    straight = _pretrain(tmp_path, "straight", stop_after=6)
    _pretrain(tmp_path, "resumed", stop_after=1)  # stops inside the autoencoder stage, as if interrupted
    _pretrain(tmp_path, "resumed", stop_after=2)  # the autoencoder's last step ...
    shutil.rmtree(tmp_path / "resumed" / "vae")  # ... interrupted before its result was written
    _pretrain(tmp_path, "resumed", stop_after=4)  # then inside the transformer stage
    resumed = _pretrain(tmp_path, "resumed", stop_after=6)
    again = _pretrain(tmp_path, "again", stop_after=6)
    assert torch.get_num_threads() == torch_threads  # the script restores the caller's thread count
    assert straight.keys() == resumed.keys() and any(k.startswith("vae.") for k in straight)
    # Same process, same thread count, same tensors: bit-for-bit equality is what is guaranteed here.
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
        assert torch.equal(straight[key], again[key]), key
    final = DiffusionPipeline.from_pretrained(tmp_path / "straight-model", text_encoder_3=None, tokenizer_3=None)
    for key, value in final.vae.state_dict().items():  # the pipeline ships the autoencoder stage 2 trained on
        assert torch.equal(value, straight[f"vae.{key}"]), key
    # Its latents are normalised by the statistics measured on fresh scenes: about N(0, 1) on other scenes too
    # (a 2-step autoencoder: 128 scenes x 256 latents, the 0.1 tolerance is several standard errors).
    rng = np.random.default_rng(5)
    specs = [s for s in split()[0] for _ in range(2)][:128]
    pixels = render_scenes(specs, rng)
    with torch.no_grad():
        latents = pixels_to_latents(final.vae, pixels)
    assert abs(latents.mean().item()) < 0.1 and abs(latents.std().item() - 1) < 0.1
    # A finished stage is reused only with the arguments that made it.
    assert pretrain_shapes.main(_argv(tmp_path, "straight", "--vae-lr", "1e-3")) == 2
    assert "--work" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad", [["--steps", "0"], ["--ema", "1.5"], ["--vae-steps", "0"], ["--vae-latent-noise", "-1"]]
)
def test_pretraining_refuses_bad_arguments(bad, capsys):
    import pretrain_shapes

    with pytest.raises(SystemExit) as err:
        pretrain_shapes.main(bad)
    assert err.value.code == 2 and "must" in capsys.readouterr().err
