"""flowgrpo.memory: a config whose latents and rollout buffers cannot fit is refused before the run directory exists
(issue 28: ``configs/tiny_wan.yaml model.resolution=100000`` drew 160 GB of noise after the run had started)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.checks import ConfigError
from flowgrpo.config import load_config
from flowgrpo.memory import check_memory, device_available, estimate, geometry, host_available
from flowgrpo.pipelines import build_adapter
from flowgrpo.trainer import GRPOTrainer
from rewards import AsyncReward

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["run.progress=false", "eval.every=0"]


def _config(name: str, output_dir: Path, *overrides: str):
    return load_config(ROOT / "configs" / f"{name}.yaml", [f"run.output_dir={output_dir}", *QUIET, *overrides])


def _stub(shape: tuple[int, ...], *, device: str = "cpu", dtype: torch.dtype = torch.float32, frames: int = 1):
    """What check_memory reads of an adapter: its size grid, latent shape, dtype and device (SD3-like: f = 8)."""
    return SimpleNamespace(
        size_multiple=16,
        latent_shape=lambda h, w: tuple(d if i < len(shape) - 2 else d * h // 16 for i, d in enumerate(shape)),
        latent_dtype=dtype,
        device=torch.device(device),
        num_frames=frames,
    )


def test_a_resolution_that_cannot_fit_is_refused_quickly_before_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    runs = tmp_path / "runs"
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        GRPOTrainer(_config("tiny_wan", runs, "model.resolution=100000"))
    assert time.monotonic() - start < 120  # the adapter is built, nothing of the configured size
    message = str(info.value)
    assert "\n" not in message
    for name in ("model.resolution=100000", "model.num_frames=5", "sampler.batch_size", "grpo.group_size", "TB"):
        assert name in message, message
    assert "initial noise 160.0 GB" in message  # the allocation the issue saw: 8 × 4×2×25000×25000 float32
    assert not runs.exists()
    # The script: one paragraph, exit code 2, no traceback, no run directory.
    cmd = [sys.executable, "scripts/train.py", "--config", "configs/tiny_wan.yaml", f"run.output_dir={runs}"]
    result = subprocess.run(
        [*cmd, "model.resolution=100000", *QUIET],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr and "model.resolution=100000" in result.stderr
    assert not runs.exists()


@pytest.mark.parametrize(
    "name", ["tiny_sd3", "tiny_wan", "shapes", "shapes_awm", "tiny_qwenimage", "tiny_flux_kontext"]
)
def test_the_shipped_small_configs_fit(name, tmp_path):
    config = _config(name, tmp_path)
    adapter = build_adapter(config.model, "cpu")
    found = check_memory(config, adapter)
    assert 0 < found.device_total + found.host_total < 2 * 10**9
    assert not list(tmp_path.iterdir())


BRANCH = ("sampler.rollout=branch", "sampler.same_initial_noise=true", "grpo.objective=tempflow")


@pytest.mark.parametrize(
    ("name", "overrides"),
    # branch: one stored step per image (before: 9); guard: the float32 sampling means as well
    [("tiny_sd3", ()), ("tiny_wan", ()), ("tiny_sd3", BRANCH), ("tiny_sd3", ("grpo.objective=guard",))],
)
def test_the_estimate_is_what_an_epoch_of_rollouts_keeps(name, overrides, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    trainer = GRPOTrainer(_config(name, tmp_path, "run.epochs=1", *overrides))
    trainer.run_lock.release()
    config, adapter = trainer.config, trainer.adapter
    means = trainer.objective.needs_sampling_means
    found = estimate(config, geometry(adapter, config.model.resolution), stores_means=means)
    trainer.scorer = AsyncReward(trainer.reward, max_pending=2)  # as run_epoch: rewards scored meanwhile
    with trainer.scorer:
        trajectory = trainer.rollouts.collect(0).trajectory
        trainer.scorer.results()
    stored = trajectory.latents.nbytes + trajectory.next_latents.nbytes + trajectory.final_latents.nbytes
    assert found.device["stored trajectory"] == stored
    assert found.device.get("sampling means") == (trajectory.means.nbytes if means else None)
    assert found.host["sampled images"] == trajectory.images.float().nbytes
    batch = config.sampler.batch_size
    assert found.host["initial noise"] == batch * trajectory.final_latents[0].numel() * 4
    assert found.stored_steps == trajectory.latents.shape[1] and found.samples == len(trajectory)


def test_each_buffer_follows_its_formula_and_the_refusal_names_what_fits(monkeypatch):
    config = load_config(
        None,
        [
            "model.resolution=1024",
            "grpo.group_size=16",
            "grpo.groups_per_epoch=32",
            "sampler.num_steps=10",
            "sampler.batch_size=8",
        ],
    )
    adapter = _stub((16, 2, 2), dtype=torch.bfloat16)  # SD3-like: 16 channels, f = 8, bfloat16 latents
    shape = geometry(adapter, 1024)
    assert shape.latent_elements == 16 * 128 * 128 and shape.latent_shape == "16×128×128" and shape.latent_bytes == 2
    found = estimate(config, shape, world_size=2)  # 512 samples over 2 processes, 9 stored steps
    latent = 16 * 128 * 128
    assert found.samples == 256 and found.stored_steps == 9
    assert found.device == {
        "stored trajectory": 256 * 19 * latent * 2,
        "rollout batch": 3 * 8 * latent * 2,
        "decoded batch": 8 * 3 * 1024 * 1024 * 4,
    }
    assert found.host == {"initial noise": 8 * latent * 4, "sampled images": 256 * 3 * 1024 * 1024 * 4}
    assert estimate(config, shape, stores_transitions=False).stored_steps == 0  # awm, nft: final samples only
    with_means = estimate(config, shape, world_size=2, stores_means=True).device  # GRPO-Guard's μ_old, float32
    assert with_means == {**found.device, "sampling means": 256 * 9 * latent * 4}
    check_memory(config, adapter, world_size=2, available=(None, 10**12))
    with pytest.raises(ConfigError, match=r"needs at least .* of RAM .* but 1.0 GB is available") as info:
        check_memory(config, adapter, world_size=2, available=(None, 10**9))
    fits = int(str(info.value).split("fit up to about ")[1].split(",")[0])
    assert 16 <= fits < 1024 and fits % 16 == 0
    smaller = load_config(None, [f"model.resolution={fits}", "grpo.group_size=16", "grpo.groups_per_epoch=32"])
    check_memory(smaller, adapter, world_size=2, available=(None, 10**9))  # the resolution it names fits
    # Processes on one machine share its RAM.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="for each of the 8 processes on this machine"):
        check_memory(config, adapter, world_size=2, available=(None, 10**10))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    # On an accelerator the device's buffers meet its free memory, the host's the RAM.
    gpu = _stub((16, 2, 2), device="cuda", dtype=torch.bfloat16)
    check_memory(config, gpu, world_size=2, available=(10**10, 10**10))
    with pytest.raises(ConfigError, match=r"of the cuda device .*stored trajectory"):
        check_memory(config, gpu, world_size=2, available=(10**8, 10**12))
    with pytest.raises(ConfigError, match=r"of RAM .*sampled images"):
        check_memory(config, gpu, world_size=2, available=(10**12, 10**8))


def test_packed_and_video_latents_scale_with_the_area():
    packed = SimpleNamespace(  # FLUX-like: (tokens, 4 · channels), f = 8 with 2×2 packing
        size_multiple=16, latent_shape=lambda h, w: ((h // 16) * (w // 16), 64), latent_dtype=torch.float32
    )
    assert geometry(packed, 512).latent_elements == 32 * 32 * 64 and geometry(packed, 512).latent_shape == "1024×64"
    video = _stub((16, 21, 2, 2), frames=81)  # Wan-like: 21 latent frames of 81
    shape = geometry(video, 480)
    assert shape.latent_elements == 16 * 21 * 60 * 60 and shape.pixels == 3 * 81 * 480 * 480


def test_available_memory_is_measured():
    assert host_available() > 0 and device_available(torch.device("cpu")) > 0  # psutil, /proc/meminfo or sysconf
    assert device_available(torch.device("meta")) is None  # unknown: not checked
