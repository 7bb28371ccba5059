"""The shipped shapes model: a plain diffusers pipeline, the same rollout code as SD3.5, and a seeded,
exactly resumable pretraining script."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

from flowgrpo.adapters import make_adapter
from flowgrpo.config import SamplerConfig
from flowgrpo.pipelines import load_pipeline
from flowgrpo.rollout import rollout
from flowgrpo.shapes_model import SHAPES_MODEL_DIR, TEXT_LENGTH

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def test_the_shipped_model_opens_in_plain_diffusers_and_samples():
    pipe = DiffusionPipeline.from_pretrained(SHAPES_MODEL_DIR, text_encoder_3=None, tokenizer_3=None)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline" and pipe.vae_scale_factor == 1
    out = pipe("a red circle", num_inference_steps=4, max_sequence_length=TEXT_LENGTH, output_type="pt",
               generator=torch.Generator().manual_seed(0)).images  # fmt: skip
    assert out.shape == (1, 3, 32, 32) and 0 <= out.min() and out.max() <= 1
    record = json.loads((SHAPES_MODEL_DIR / "pretraining.json").read_text())
    assert record["command"].startswith("python scripts/pretrain_shapes.py") and record["eval"]


def test_a_noise_free_rollout_of_the_shipped_model_reproduces_pipe():
    pipe = load_pipeline("shapes-sd3", dtype="fp32")
    adapter = make_adapter(pipe, max_sequence_length=TEXT_LENGTH)
    prompts = ["two green squares", "a blue triangle above a red circle"]
    latents = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    sampler = SamplerConfig(noise_level=0.0, num_steps=6, guidance_scale=4.5)
    traj = rollout(adapter, prompts, [0, 1], sampler, range(0, 0), height=32, width=32, initial_latents=latents)
    expected = pipe(prompts, latents=latents, num_inference_steps=6, guidance_scale=4.5,
                    max_sequence_length=TEXT_LENGTH, output_type="pt").images  # fmt: skip
    torch.testing.assert_close(traj.images, expected, atol=1e-5, rtol=0)


def _pretrain(tmp_path: Path, name: str, steps: int, total: int) -> dict[str, torch.Tensor]:
    """Run the pretraining script in this process until ``steps`` of a ``total``-step schedule (an interruption
    is a run of the same command whose --steps ends early; the schedule must then come from --total)."""
    import pretrain_shapes

    work = tmp_path / name
    argv = ["--steps", str(total), "--batch-size", "4", "--warmup", "2", "--work", str(work), "--out",
            str(tmp_path / f"{name}-model"), "--checkpoint-every", "2", "--eval-every", "100", "--eval-per-tag", "1",
            "--eval-steps", "2"]  # fmt: skip
    assert pretrain_shapes.main(argv, stop_after=steps) == 0
    return load_file(work / "checkpoint" / "model.safetensors")


def test_pretraining_is_seeded_and_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    torch_threads = torch.get_num_threads()
    straight = _pretrain(tmp_path, "straight", steps=4, total=4)
    _pretrain(tmp_path, "resumed", steps=2, total=4)  # stops after its step-2 checkpoint, as if interrupted
    resumed = _pretrain(tmp_path, "resumed", steps=4, total=4)
    again = _pretrain(tmp_path, "again", steps=4, total=4)
    assert torch.get_num_threads() == torch_threads  # the script restores the caller's thread count
    assert straight.keys() == resumed.keys()
    # Same process, same thread count, same tensors: bit-for-bit equality is what is guaranteed here.
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
        assert torch.equal(straight[key], again[key]), key
    untrained = load_file(tmp_path / "straight-model" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert untrained  # the final pipeline (EMA weights) was written


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--ema", "1.5"]])
def test_pretraining_refuses_bad_arguments(bad, capsys):
    import pretrain_shapes

    with pytest.raises(SystemExit) as err:
        pretrain_shapes.main(bad)
    assert err.value.code == 2 and "must" in capsys.readouterr().err
