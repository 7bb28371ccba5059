"""Non-square images: ``model.height`` / ``model.width`` beside ``model.resolution`` (``ModelConfig.size``, height
first as diffusers'). The config's refusals, every registered family with a tiny build sampling a non-square size
through the config's rollout strategy exactly as its diffusers ``pipe(height=H, width=W)``, the memory estimate and
its advice, the offline store's record and refusal, and one training epoch whose image grids are non-square.

The size is 32 x 48 (height x width): a swapped order anywhere changes a shape, so it cannot pass unnoticed."""

from __future__ import annotations

import inspect
import json
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image
from rollout_helper import rollout_context

from flowgrpo.adapters import families
from flowgrpo.adapters.registry import families_with_option
from flowgrpo.config import ConfigError, ModelConfig, load_config
from flowgrpo.data import PromptDataset, open_image
from flowgrpo.memory import check_memory, geometry
from flowgrpo.offline import INFO, SAMPLES, build_store, check_store, write_store
from flowgrpo.pipelines import build_adapter
from flowgrpo.rollouts import get_rollout
from flowgrpo.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_sd3.yaml"
HEIGHT, WIDTH = 32, 48
SIZE = [f"model.height={HEIGHT}", f"model.width={WIDTH}"]
SMALL = ["sampler.num_steps=2", "sampler.batch_size=2", "grpo.group_size=2", "grpo.groups_per_epoch=1"]
SMALL += ["train.batch_size=2", "model.lora.rank=2", "model.lora.alpha=4", "run.progress=false"]
TINY_FAMILIES = [pytest.param(spec, id=spec.name) for spec in families() if spec.tiny is not None]
# pipe()'s guidance without CFG, where it is not 1 (the scale every adapter takes): ZImagePipeline counts from 0.
NO_GUIDANCE = {"zimage": 0.0}
# Pipelines whose ``latents`` take the adapter's packed tokens [B, (H/m)(W/m), C] unpacked, [B, C, H/m, W/m] (FLUX.2's
# packing is a row-major reshape, flowgrpo/adapters/flux2.py); the other pipelines take the adapter's layout.
UNPACKED_LATENTS = ("Flux2Pipeline", "Flux2KleinPipeline")
# A family whose own grid is coarser than 16 samples a non-square size on it (LTX2Pipeline: multiples of 32).
SIZE_OF = {"ltx2": (32, 64)}
# pipe() options that turn off what a family's adapter does not run at guidance 1 (LTX-2: its audio CFG, STG, modality
# guidance and rescale); such a pipeline takes the adapter's joint latents as video ``latents`` and ``audio_latents``.
PIPE_OPTIONS = {
    "LTX2Pipeline": dict(
        audio_guidance_scale=1.0,
        stg_scale=0.0,
        audio_stg_scale=0.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
        guidance_rescale=0.0,
        audio_guidance_rescale=0.0,
    )
}
# Pipelines that size their sources for the VAE by a module constant (the area model.source_area replaces) rather than
# by what they hand calculate_dimensions: the tiny area goes there (Edit-Plus also sizes its text encoder's pictures).
SOURCE_AREA_CONSTANT = {"QwenImageEditPlusPipeline": "VAE_IMAGE_SIZE"}


# ---------------------------------------------------------------- the config
def test_size_is_height_then_width_and_resolution_alone_stays_square():
    square = load_config(TINY)
    assert (square.model.height, square.model.width) == (None, None)
    assert square.model.size == (32, 32) and square.model.size_keys == "model.resolution=32"
    wide = load_config(TINY, SIZE)
    assert wide.model.size == (HEIGHT, WIDTH) and wide.model.size_keys == "model.height=32, model.width=48"
    assert load_config(TINY, [*SIZE, "model.resolution=512"]).model.size == (HEIGHT, WIDTH)  # height / width win
    assert ModelConfig(resolution=64, height=16, width=80).size == (16, 80)
    # Flow-GRPO's general_ocr_wan2_1: config.height = 240, config.width = 416.
    wan = load_config(ROOT / "configs" / "wan21_t2v_ocr.yaml", training=False)
    assert wan.model.size == (240, 416) and wan.model.num_frames == 33


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.height=32"], r"^model\.height=32 without model\.width: non-square images need both; set model\.width"),
        (["model.width=48"], r"^model\.width=48 without model\.height: .*set model\.height too"),
        (["model.height=40", "model.width=48"], r"^model\.height must be a multiple of 16, got 40; try 32$"),
        (["model.height=32", "model.width=56"], r"^model\.width must be a multiple of 16, got 56; try 48$"),
        (["model.height=32", "model.width=0"], r"^model\.width must be >= 1, got 0$"),
        (["model.height=-16", "model.width=32"], r"^model\.height must be >= 1, got -16$"),
        (["model.resolution=24"], r"^model\.resolution must be a multiple of 16, got 24; try 16$"),
    ],
    ids=["height-alone", "width-alone", "height-off-grid", "width-off-grid", "zero", "negative", "resolution"],
)
def test_bad_sizes_are_refused_naming_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_a_side_off_the_familys_own_grid_is_refused_when_it_loads_naming_the_keys(monkeypatch):
    # Every tiny family's grid divides 16; a family whose grid is 32 (as if its patches were 4x4) refuses 32 x 48.
    from flowgrpo.adapters.sd3 import SD3Adapter

    monkeypatch.setattr(SD3Adapter, "size_multiple", property(lambda self: 32))
    with pytest.raises(ConfigError, match=r"^model\.height=32, model\.width=48: sd3: .*multiples of 32.* got 32x48"):
        build_adapter(load_config(TINY, SIZE).model)


# ---------------------------------------------------------------- every family against its pipe()
def _family_config(spec, tmp_path: Path):
    """The tiny sd3 recipe at 32 x 48 on ``spec``'s tiny model: noise 0 (every step the ODE), guidance 1 (pipe()'s
    guidance means different things per family; 1 is off for all), editing prompts for an editing family, 5 frames
    for a video family, a small source area where the family sizes sources by area (as its tiny demo)."""
    prompts = "edit_tiny_train.jsonl" if spec.edits else "tiny_train.txt"
    extra = ["model.num_frames=5"] if spec.video else []
    if spec.name in families_with_option("source_area"):
        extra.append("model.source_area=1024")
    height, width = SIZE_OF.get(spec.name, (HEIGHT, WIDTH))
    return load_config(
        TINY,
        [
            f"model.pretrained=tiny-{spec.name}",
            f"model.height={height}",
            f"model.width={width}",
            *SMALL,
            *extra,
            "model.max_sequence_length=null",  # each family's default, as pipe() below
            "sampler.noise_level=0",
            "sampler.guidance_scale=1",
            f"data.train=configs/prompts/{prompts}",
            f"run.output_dir={tmp_path}",
        ],
    )


def _euler(adapter) -> None:
    """Our samplers step Euler-type: a pipeline whose scheduler is another (Wan's UniPC) gets diffusers'
    FlowMatchEuler with the same shift in pipe() and in the adapter alike (as tests/test_wan.py)."""
    if not isinstance(adapter.scheduler, FlowMatchEulerDiscreteScheduler):
        shift = adapter.scheduler.config.get("flow_shift", 1.0)
        adapter.pipe.scheduler = adapter.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)


def _pipe_images(adapter, spec, prompts, sources, latents, steps, monkeypatch, size) -> torch.Tensor:
    """diffusers' own ``pipe(height=32, width=48)`` from ``latents``, one image at a time; an editing family gets each
    source resized to W x H (Flow-GRPO's ``ref_image.resize``); options only some pipelines take are passed where
    the signature has them (Kontext's ``max_area`` / ``_auto_resize``, a video's ``num_frames``)."""
    pipe = adapter.pipe
    takes = inspect.signature(type(pipe).__call__).parameters
    guidance = NO_GUIDANCE.get(spec.name, 1.0)
    height, width = size
    options = {"num_inference_steps": steps, "guidance_scale": guidance, "height": height, "width": width}
    options.update({"max_area": height * width, "_auto_resize": False} if "max_area" in takes else {})
    options.update(PIPE_OPTIONS.get(type(pipe).__name__, {}))
    options.update({"num_frames": adapter.num_frames} if "num_frames" in takes else {})
    module = sys.modules[type(pipe).__module__]
    if type(pipe).__name__ in SOURCE_AREA_CONSTANT:
        monkeypatch.setattr(module, SOURCE_AREA_CONSTANT[type(pipe).__name__], adapter.source_area)
    elif hasattr(adapter, "source_area") and hasattr(module, "calculate_dimensions"):
        # Qwen-Image-Edit sizes its source to calculate_dimensions(1024², ratio): the tiny model's area there.
        original = module.calculate_dimensions
        monkeypatch.setattr(module, "calculate_dimensions", lambda area, ratio: original(adapter.source_area, ratio))
    if type(pipe).__name__ in UNPACKED_LATENTS:
        m = adapter.size_multiple
        latents = latents.transpose(1, 2).reshape(len(latents), -1, height // m, width // m)
    audio = None
    if type(pipe).__name__ in PIPE_OPTIONS:
        latents, audio = adapter.split(latents)
    out = []
    for i, prompt in enumerate(prompts):
        image = {} if sources is None else {"image": open_image(sources[i]).resize((width, height))}
        image.update({} if audio is None else {"audio_latents": audio[i : i + 1].clone()})
        result = pipe(prompt=prompt, latents=latents[i : i + 1].clone(), output_type="pt", **image, **options)
        out.append(result.frames if spec.video else result.images)
    monkeypatch.undo()
    return torch.cat(out)


@pytest.mark.parametrize("spec", TINY_FAMILIES)
def test_every_family_samples_the_configured_size_as_its_pipe(spec, tmp_path, monkeypatch):
    config = _family_config(spec, tmp_path)
    adapter = build_adapter(config.model)
    _euler(adapter)
    context = rollout_context(config, adapter)
    trajectory = get_rollout(config.sampler.rollout)(context).collect(0).trajectory
    images = trajectory.images
    size = SIZE_OF.get(spec.name, (HEIGHT, WIDTH))
    assert (trajectory.height, trajectory.width) == size and images.shape[-2:] == size
    assert trajectory.step_indices[:, 0].eq(0).all()  # latents[:, 0]: the initial noise
    indices = [slot.prompt_index for slot in context.epoch_slots(0)]
    expected = _pipe_images(
        adapter,
        spec,
        trajectory.prompts,
        context.data.sources_of(indices),
        trajectory.latents[:, 0],
        config.sampler.num_steps,
        monkeypatch,
        size,
    )
    assert expected.shape == images.shape
    torch.testing.assert_close(images, expected, rtol=0, atol=1e-5)
    # The memory estimate's geometry is the size sampled: latents by area, pixels H·W (· frames).
    shape = geometry(adapter, config.model.size)
    assert shape.latent_elements == trajectory.final_latents[0].numel() and shape.pixels == images[0].numel()


# ---------------------------------------------------------------- memory
def _stub(channels: int = 16, factor: int = 8):
    """What check_memory reads of an adapter, SD3-like: latents [C, H/f, W/f], a grid of 16."""
    return SimpleNamespace(
        size_multiple=16,
        latent_shape=lambda h, w: (channels, h // factor, w // factor),
        latent_dtype=torch.bfloat16,
        device=torch.device("cpu"),
        num_frames=1,
    )


def test_the_memory_refusal_names_the_keys_set_and_a_size_of_the_same_shape_that_fits():
    groups = ["grpo.group_size=16", "grpo.groups_per_epoch=32", "sampler.num_steps=10", "sampler.batch_size=8"]
    config = load_config(None, ["model.height=720", "model.width=1280", *groups])
    adapter = _stub()
    shape = geometry(adapter, (720, 1280))
    assert shape.latent_shape == "16×90×160" and shape.latent_elements == 16 * 90 * 160
    assert shape.pixels == 3 * 720 * 1280
    available = (None, 10**9)
    with pytest.raises(ConfigError) as info:
        check_memory(config, adapter, world_size=2, available=available)
    message = str(info.value)
    assert message.startswith("model.height=720, model.width=1280 needs at least ")
    found = re.search(
        r"[Ll]ower model\.height and model\.width \(these buffers fit up to about (\d+) × (\d+), multiples "
        r"of 16\)",
        message,
    )
    assert found, message
    height, width = int(found[1]), int(found[2])
    assert height % 16 == width % 16 == 0 and height < 720 and width < 1280
    # Both sides shrunk by one factor s, each floored to the grid: their ranges of s overlap.
    assert max(height / 720, width / 1280) < min((height + 16) / 720, (width + 16) / 1280)
    fits = load_config(None, [f"model.height={height}", f"model.width={width}", *groups])
    check_memory(fits, adapter, world_size=2, available=available)  # the size it names fits
    bigger = load_config(None, [f"model.height={height + 16}", f"model.width={width + 16}", *groups])
    with pytest.raises(ConfigError):
        check_memory(bigger, adapter, world_size=2, available=available)
    # A square config is still told about model.resolution alone.
    square = load_config(None, ["model.resolution=1024", *groups])
    with pytest.raises(ConfigError, match=r"^model\.resolution=1024 needs .*[Ll]ower model\.resolution \(these buff"):
        check_memory(square, adapter, world_size=2, available=available)


# ---------------------------------------------------------------- the offline store
def test_the_offline_store_records_height_and_width_and_refuses_another_size(tmp_path):
    offline = ["grpo.objective=gdro", "sampler.rollout=offline", "grpo.advantage.estimator=centered"]
    offline += ["sampler.offline.groups=1", "eval.every=0"]
    config = load_config(TINY, [*SIZE, *SMALL, *offline, "sampler.noise_level=0"], training=False)
    adapter = build_adapter(config.model)
    data = PromptDataset.from_file(config.data.train)

    def score(images, prompts, metadata, sources):
        assert images.shape[-2:] == (HEIGHT, WIDTH)
        return {"total": images.mean(dim=(1, 2, 3)), "brightness": images.mean(dim=(1, 2, 3))}

    store = tmp_path / "store"
    info = build_store(config, adapter, data, score, store, log=lambda _: None)
    made = json.loads((store / INFO).read_text())["model"]
    assert (made["height"], made["width"]) == (HEIGHT, WIDTH) and "resolution" not in made
    assert info.latent_shape == adapter.latent_shape(HEIGHT, WIDTH) == (16, 16, 24)
    check_store(config, store)
    for overrides, stated, fix in [
        (
            ["model.height=48", "model.width=32"],
            "model.height=48, model.width=32",
            "model.height: 32 and model.width: 48",
        ),
        (["model.resolution=32"], "model.resolution=32", "model.height: 32 and model.width: 48"),
    ]:
        other = load_config(TINY, [*SMALL, *offline, "sampler.noise_level=0", *overrides], training=False)
        wanted = (
            rf"sampler\.offline\.path={re.escape(str(store))} was sampled with model\.height=32, model\.width=48 "
            rf"\(latents \[16, 16, 24\]\), but this config has {re.escape(stated)}; set {re.escape(fix)}, or sample"
        )
        with pytest.raises(ConfigError, match=wanted):
            check_store(other, store)
    # Validation refuses it too, before anything loads.
    with pytest.raises(ConfigError, match=r"was sampled with model\.height=32, model\.width=48 .* this config has "):
        load_config(TINY, [*SMALL, *offline, "sampler.noise_level=0", f"sampler.offline.path={store}"])
    # A half-set size is named as such before the store is compared (its message would read the size).
    with pytest.raises(ConfigError, match=r"^model\.height=32 without model\.width"):
        load_config(
            TINY, [*SMALL, *offline, "sampler.noise_level=0", f"sampler.offline.path={store}", "model.height=32"]
        )
    # A store written before model.height / width records model.resolution alone: read as a square.
    older = json.loads((store / INFO).read_text())
    older.pop("samples_sha256")
    older["model"] = {**{k: v for k, v in older["model"].items() if k not in ("height", "width")}, "resolution": 48}
    legacy = tmp_path / "legacy"
    from safetensors.torch import load_file

    write_store(legacy, load_file(str(store / SAMPLES)), older)
    with pytest.raises(ConfigError, match=r"was sampled with model\.resolution=48 .* set model\.height: 48 and model"):
        check_store(config, legacy)
    square = load_config(TINY, [*SMALL, *offline, "sampler.noise_level=0", "model.resolution=48"], training=False)
    check_store(square, legacy)


# ---------------------------------------------------------------- one training epoch
def test_one_training_epoch_at_a_non_square_size_writes_non_square_grids(tmp_path):
    more = ["run.epochs=1", "eval.every=1", "eval.num_steps=2", "eval.max_prompts=2", "run.image_grid_every=1"]
    config = load_config(TINY, [*SIZE, *SMALL, *more, f"run.output_dir={tmp_path}"])
    trainer = GRPOTrainer(config)
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    assert any(not torch.equal(p.detach(), b) for p, b in zip(trainer.params, before, strict=True))
    # image_grid enlarges 48-px-wide images 2x (96 // 48) and puts a 14-px caption under each: a cell is 96 x (64 + 14).
    cell_w, cell_h = 2 * WIDTH, 2 * HEIGHT + 14
    with Image.open(trainer.run_dir / "samples" / "epoch00000.png") as grid:  # one row of group_size = 2 images
        assert grid.size == (2 * cell_w, cell_h)
    for epoch in (0, 1):  # the base model's evaluation and the trained one's: 2 prompts, 2 columns
        with Image.open(trainer.run_dir / "eval" / f"epoch{epoch:05d}.png") as grid:
            assert grid.size == (2 * cell_w, cell_h)
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in row and math.isfinite(row["train/loss"]) for row in rows)
    saved = load_config(trainer.run_dir / "config.yaml", training=False)
    assert saved.model.size == (HEIGHT, WIDTH)
