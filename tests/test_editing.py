"""Image editing (FLUX.1-Kontext) on the tiny offline pipeline: alignment with diffusers' FluxKontextPipeline, exact
re-scoring, source images from prompt files (and their errors), the reward protocol's ``source_images``, the
``consistency`` reward, and the editing demo through the normal trainer, export and evaluation."""

from __future__ import annotations

import copy
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from PIL import ExifTags, Image
from script_helper import load_script

from flowgrpo.adapters import ADAPTERS, FluxKontextAdapter, make_adapter
from flowgrpo.config import SamplerConfig, load_config
from flowgrpo.data import DataError, PromptDataset, check_editing, open_image
from flowgrpo.pipelines import load_pipeline, pipeline_kind
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline
from rewards import AsyncReward, BaseReward, CombinedReward, RewardEntry, RewardError, build_reward

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "configs" / "prompts" / "edit_images"
SOURCES = [IMAGES / f"{name}.png" for name in ("red_square", "blue_circle", "red_square", "green_triangle")]
PROMPTS = ["make the square blue", "add a second circle", "make the square blue", "turn the triangle red"]
SIZE, GUIDANCE = 32, 2.5
TINY_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 16, "image_size": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


@pytest.fixture(scope="module", params=["kl", "tiny"])
def adapter(request):
    return make_adapter(build_tiny_pipeline("flux-kontext", vae=request.param))


def _pipe_images(pipe, sources, prompts, latents, steps):
    """diffusers' own FluxKontextPipeline, given the sources at the generated size (as Flow-GRPO resizes them)."""
    images = None if sources is None else [_resized(s) for s in sources]
    return pipe(
        image=images,
        prompt=prompts,
        latents=latents.clone(),
        num_inference_steps=steps,
        guidance_scale=GUIDANCE,
        height=SIZE,
        width=SIZE,
        max_area=SIZE * SIZE,
        _auto_resize=False,
        output_type="pt",
    ).images


def _resized(source) -> Image.Image:
    """A source image at the generated size, as Flow-GRPO's Kontext script resizes it (PIL's default, bicubic)."""
    return open_image(source).resize((SIZE, SIZE))


def _pixels(source) -> torch.Tensor:
    """What rewards get as the source image: ``[3, H, W]`` in [0, 1]."""
    return torch.from_numpy(np.array(_resized(source))).permute(2, 0, 1).float() / 255


# ---------------------------------------------------------------- the adapter against FluxKontextPipeline
def test_kontext_pipeline_gets_its_own_adapter_kind_and_tiny_build(tmp_path):
    script = load_script("make_tiny_pipeline")
    make_tiny = script.main

    pipe = build_tiny_pipeline("flux-kontext")
    assert isinstance(pipe, FluxKontextPipeline) and pipeline_kind(pipe) == "flux-kontext"
    assert type(make_adapter(pipe)) is FluxKontextAdapter and ADAPTERS["flux-kontext"] is FluxKontextAdapter
    assert make_tiny([str(tmp_path / "kontext"), "--kind", "flux-kontext"]) == 0
    loaded = load_pipeline(str(tmp_path / "kontext"), dtype="fp32")  # kind read from model_index.json
    assert isinstance(loaded, FluxKontextPipeline) and type(make_adapter(loaded)) is FluxKontextAdapter
    assert isinstance(load_pipeline("tiny-flux-kontext", dtype="fp32"), FluxKontextPipeline)


@pytest.mark.parametrize("steps", [3, 5])
def test_noise_free_rollout_reproduces_flux_kontext_pipe(adapter, steps):
    latents = adapter.initial_noise(len(PROMPTS), SIZE, SIZE, generator=torch.Generator().manual_seed(steps))
    expected = _pipe_images(adapter.pipe, SOURCES, PROMPTS, latents, steps)
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=GUIDANCE)
    traj = rollout(
        adapter,
        PROMPTS,
        [0, 1, 0, 2],
        sampler,
        range(0, steps - 1),
        height=SIZE,
        width=SIZE,
        initial_latents=latents,
        sources=[str(s) for s in SOURCES],
    )
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    # The source really conditions the samples, and without sources Kontext is text-to-image as pipe(image=None).
    plain = _pipe_images(adapter.pipe, None, PROMPTS, latents, steps)
    assert (plain - expected).abs().max() > 1e-4
    no_source = rollout(
        adapter, PROMPTS, [0, 1, 0, 2], sampler, range(0, 0), height=SIZE, width=SIZE, initial_latents=latents
    )
    torch.testing.assert_close(no_source.images, plain, rtol=0, atol=1e-5)
    assert no_source.source_images is None


@pytest.mark.parametrize(
    "sampler_kwargs",
    [
        {"kind": "euler_maruyama"},
        {"kind": "euler_maruyama", "diffusion": "dance", "noise_level": 0.3},
        {"kind": "cps"},
        {"kind": "langevin"},
        {"kind": "langevin", "score_eval": "reeval"},
    ],
    ids=["em", "dance", "cps", "lc_frozen", "lc_reeval"],
)
def test_rescoring_edits_gives_ratio_exactly_one(sampler_kwargs):
    adapter = make_adapter(build_tiny_pipeline("flux-kontext"))
    sampler = SamplerConfig(**{"noise_level": 0.7, "num_steps": 5, "guidance_scale": GUIDANCE, **sampler_kwargs})
    traj = rollout(
        adapter,
        PROMPTS,
        [0, 1, 0, 2],
        sampler,
        range(1, 4),
        torch.Generator().manual_seed(1),
        height=SIZE,
        width=SIZE,
        sources=SOURCES,
    )
    assert traj.embeds.source_latents.shape == (4, (SIZE // 4) ** 2, 16)
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])
    sub = traj.select([3, 0])  # a micro-batch carries its own rows' sources
    with torch.no_grad():
        torch.testing.assert_close(evaluate_transitions(adapter, sub, 1, sampler).log_prob, traj.log_probs[[3, 0], 1])


def test_sources_are_encoded_once_per_image_and_returned_for_rewards():
    adapter = make_adapter(build_tiny_pipeline("flux-kontext"))
    sampler = SamplerConfig(num_steps=2, guidance_scale=GUIDANCE)
    encoded = []
    encode = adapter._encode_sources
    adapter._encode_sources = lambda pixels: encoded.append(len(pixels)) or encode(pixels)
    for epoch in range(2):
        traj = rollout(
            adapter,
            PROMPTS,
            [0, 1, 0, 2],
            sampler,
            range(0, 1),
            torch.Generator().manual_seed(epoch),
            height=SIZE,
            width=SIZE,
            sources=SOURCES,
        )
    assert encoded == [3] and adapter.source_encoder_calls == 1  # 3 unique images, one batched VAE pass
    expected = torch.stack([_pixels(s) for s in SOURCES])
    torch.testing.assert_close(traj.source_images, expected, rtol=0, atol=1e-6)
    assert traj.source_images.device.type == "cpu"
    adapter.clear_prompt_cache()
    pil = Image.open(SOURCES[0])  # PIL images work too, cached by their pixels
    adapter.encode_conditions(PROMPTS[:2], sources=[pil, pil.copy()], height=SIZE, width=SIZE)
    assert encoded == [3, 1]


def test_text_to_image_adapters_refuse_source_images():
    flux = make_adapter(build_tiny_pipeline("flux"))
    with pytest.raises(ValueError, match="generates from text alone"):
        flux.encode_conditions(PROMPTS[:1], sources=SOURCES[:1], height=SIZE, width=SIZE)
    data = PromptDataset.from_file(ROOT / "configs" / "prompts" / "edit_tiny_train.jsonl")
    with pytest.raises(DataError, match="data.train: .*edit_tiny_train.jsonl gives each prompt a source image") as err:
        check_editing({"data.train": data}, adapter=flux)
    assert "is a flux text-to-image pipeline" in str(err.value) and "flux-kontext or qwenimage-edit" in str(err.value)
    check_editing({"data.train": data}, adapter=make_adapter(build_tiny_pipeline("flux-kontext")))
    # Wan generates video: the message names it so (it said "text-to-image pipeline").
    with pytest.raises(DataError, match='is a wan text-to-video pipeline: it takes no "image"'):
        check_editing({"data.test": data}, adapter=make_adapter(build_tiny_pipeline("wan")))


# ---------------------------------------------------------------- prompt files with source images
def _jsonl(folder: Path, lines: list[str], name: str = "edits.jsonl") -> Path:
    path = folder / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_editing_rows_resolve_images_relative_to_the_file(tmp_path):
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (8, 8), "red").save(tmp_path / "imgs" / "a.png")
    path = _jsonl(
        tmp_path,
        [
            '{"prompt": "make it blue", "image": "imgs/a.png", "tag": "color"}',
            "",
            '{"instruction": "add a dot", "image": "imgs/a.png"}',
        ],
    )
    data = PromptDataset.from_file(path)
    assert data.prompts == ["make it blue", "add a dot"] and data.metadata == [{"tag": "color"}, {}]
    assert data.sources == [str((tmp_path / "imgs" / "a.png").resolve())] * 2
    assert data.sources_of([1]) == data.sources[1:]
    assert PromptDataset.from_file(ROOT / "configs" / "prompts" / "tiny_train.txt").sources_of([0]) is None


def test_missing_or_unreadable_source_images_are_reported_with_file_and_line(tmp_path):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "ok.png")
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    whole = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])  # truncated: the header reads, the pixels do not
    (tmp_path / "folder.png").mkdir()
    rows = [
        '{"prompt": "a", "image": "ok.png"}',
        '{"prompt": "b", "image": "missing.png"}',
        '{"prompt": "c", "image": "junk.png"}',
        '{"prompt": "d", "image": "cut.png"}',
        '{"prompt": "e", "image": "folder.png"}',
        '{"prompt": "f", "image": 3}',
        '{"prompt": "g"}',
    ]
    path = _jsonl(tmp_path, rows)
    with pytest.raises(DataError) as err:
        PromptDataset.from_file(path, "data.test")
    message = str(err.value)
    assert message.startswith("data.test: 6 editing row(s) without a usable source image")
    assert f"{path}:2: image 'missing.png' does not exist" in message
    assert f"{path}:3: image 'junk.png' cannot be read as an image" in message
    assert f"{path}:4: image 'cut.png' cannot be read as an image" in message
    assert f"{path}:5: image 'folder.png' is not a file" in message
    assert "and 1 more" in message  # :6 and :7 are past the five shown
    with pytest.raises(DataError, match=r':2 has no "image" field, but other rows do'):
        PromptDataset.from_file(_jsonl(tmp_path, [rows[0], rows[6]], "mixed.jsonl"))
    with pytest.raises(DataError, match=r':1: "image" must be an image file path, got 3'):
        PromptDataset.from_file(_jsonl(tmp_path, [rows[5]], "typed.jsonl"))


# ---------------------------------------------------------------- source images in every PIL mode
def _source_rgb(tmp_path: Path, write, name: str) -> tuple[np.ndarray, list[str], Path]:
    """Write an image with ``write(path)``, read it as an editing row's source; ``(pixels [H, W, 3], notes, path)``."""
    file = tmp_path / name
    write(file)
    data = PromptDataset.from_file(_jsonl(tmp_path, [json.dumps({"prompt": "edit", "image": name})]))
    pixels = np.asarray(open_image(data.sources[0]))
    assert pixels.dtype == np.uint8 and pixels.shape[2] == 3
    return pixels, data.notes, file


def _gray3(values: np.ndarray) -> np.ndarray:
    return np.repeat(values[..., None], 3, axis=2)


def test_16_bit_grayscale_is_scaled_to_8_bits_not_clipped_to_white(tmp_path):
    values = np.array([[0, 128, 129, 257], [32896, 40000, 65534, 65535]], dtype=np.uint16)
    expected = _gray3(np.round(values / 257).astype(np.uint8))  # 65535 -> 255, 257 -> 1, 128 -> 0, 129 -> 1
    for name, saved in (("gray16.png", values), ("gray16_be.tif", values.astype(">u2"))):
        pixels, notes, _ = _source_rgb(tmp_path, lambda f, v=saved: Image.fromarray(v).save(f), name)
        assert Image.open(tmp_path / name).mode in ("I;16", "I;16B", "I")
        np.testing.assert_array_equal(pixels, expected)
        said = "were 16-bit grayscale: scaled to 8 bits as round(v / 257)"
        assert notes == [f"data.train: 1 source image(s) {said} (first: {tmp_path / 'edits.jsonl'}:1)"]
    # A 16-bit transparent gray value (tRNS) becomes the white background.
    pixels, notes, _ = _source_rgb(tmp_path, lambda f: Image.fromarray(values).save(f, transparency=40000), "t16.png")
    np.testing.assert_array_equal(pixels[1, 1], [255, 255, 255])
    np.testing.assert_array_equal(pixels[1, 0], expected[1, 0])
    assert any("composited onto white (255, 255, 255)" in n for n in notes)


def test_float_images_are_read_as_intensities_in_0_1(tmp_path):
    values = np.array([[0.0, 0.25, 0.5, 1.0], [0.002, 0.999, 1.001, -0.001]], dtype=np.float32)
    pixels, notes, _ = _source_rgb(tmp_path, lambda f: Image.fromarray(values).save(f), "float.tif")
    assert Image.open(tmp_path / "float.tif").mode == "F"
    np.testing.assert_array_equal(pixels, _gray3(np.round(np.clip(values, 0, 1) * 255).astype(np.uint8)))
    assert "were float grayscale in [0, 1]: scaled to 8 bits as round(v · 255)" in notes[0]
    for name, bad, said in (
        ("big.tif", 200.0, "float pixels in [-0.001, 200]"),
        ("nan.tif", np.nan, "NaN or infinite"),
    ):
        wrong = values.copy()
        wrong[0, 0] = bad
        Image.fromarray(wrong).save(tmp_path / name)
        with pytest.raises(DataError) as err:
            PromptDataset.from_file(_jsonl(tmp_path, [json.dumps({"prompt": "e", "image": name})]), "data.test")
        message = str(err.value)
        assert f"edits.jsonl:1: image '{name}' holds" in message and said in message
        assert "save it as an 8-bit RGB (or RGBA) PNG" in message and "\n" not in message


def test_transparency_is_composited_onto_white(tmp_path):
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (5, 6, 4), dtype=np.uint8)
    rgba[0, 0, 3], rgba[0, 1, 3] = 0, 255
    c, a = rgba[..., :3].astype(float), rgba[..., 3:].astype(float)
    over_white = np.round((c * a + 255 * (255 - a)) / 255)
    pixels, notes, file = _source_rgb(tmp_path, lambda f: Image.fromarray(rgba, "RGBA").save(f), "rgba.png")
    np.testing.assert_array_equal(pixels, over_white.astype(np.uint8))
    np.testing.assert_array_equal(pixels[0, 0], [255, 255, 255])  # fully transparent: the background
    assert notes == [
        "data.train: 1 source image(s) had transparent pixels: composited onto white (255, 255, 255), each channel "
        f"round((c·a + 255·(255 − a)) / 255) (first: {tmp_path / 'edits.jsonl'}:1)"
    ]
    la = rgba[..., [0, 3]]
    pixels, _, _ = _source_rgb(tmp_path, lambda f: Image.fromarray(la, "LA").save(f), "la.png")
    np.testing.assert_array_equal(pixels, over_white[..., [0, 0, 0]].astype(np.uint8))  # its gray is the red
    # The same conversion for a PIL image given directly; an opaque alpha is simply dropped, unnoted.
    np.testing.assert_array_equal(np.asarray(open_image(Image.open(file))), over_white.astype(np.uint8))
    rgba[..., 3] = 255
    pixels, notes, _ = _source_rgb(tmp_path, lambda f: Image.fromarray(rgba, "RGBA").save(f), "opaque.png")
    np.testing.assert_array_equal(pixels, rgba[..., :3])
    assert notes == []


def test_palette_transparency_is_composited_onto_white(tmp_path):
    indices = np.array([[0, 1, 2], [2, 1, 0]], dtype=np.uint8)
    palette = np.array([[10, 20, 30], [200, 100, 50], [0, 0, 255]])
    alpha = np.array([0, 128, 255])  # the tRNS chunk: index 0 transparent, 1 half, 2 opaque

    def write(file: Path) -> None:
        image = Image.fromarray(indices, "P")
        image.putpalette(palette.astype(np.uint8).ravel().tolist())
        image.save(file, transparency=bytes(alpha[:2].tolist()))

    pixels, notes, _ = _source_rgb(tmp_path, write, "palette.png")
    assert Image.open(tmp_path / "palette.png").mode == "P"
    a = alpha[indices][..., None]
    np.testing.assert_array_equal(pixels, np.round((palette[indices] * a + 255 * (255 - a)) / 255).astype(np.uint8))
    np.testing.assert_array_equal(pixels[0, 0], [255, 255, 255])
    assert "had transparent pixels" in notes[0]
    # One transparent index (an int), as GIF and most PNG editors write it.
    pixels, _, _ = _source_rgb(
        tmp_path, lambda f: Image.open(tmp_path / "palette.png").save(f, transparency=2), "p2.png"
    )
    np.testing.assert_array_equal(pixels[0, 2], [255, 255, 255])
    np.testing.assert_array_equal(pixels[0, 1], palette[1])


def test_cmyk_jpeg_is_converted_by_formula(tmp_path):
    cmyk = np.zeros((16, 16, 4), dtype=np.uint8)
    cmyk[:, :8] = (0, 255, 255, 0)  # red
    cmyk[:, 8:] = (100, 50, 0, 100)
    pixels, notes, file = _source_rgb(tmp_path, lambda f: Image.fromarray(cmyk, "CMYK").save(f, quality=100), "c.jpg")
    decoded = np.asarray(Image.open(file)).astype(float)  # the CMYK values as decoded (JPEG is lossy)
    expected = np.round((255 - decoded[..., :3]) * (255 - decoded[..., 3:]) / 255)
    np.testing.assert_array_equal(pixels, expected.astype(np.uint8))
    near = lambda got, want: np.abs(got.astype(int) - want).max() <= 3  # noqa: E731
    assert near(pixels[4, 4], (255, 0, 0)) and near(pixels[4, 12], (94, 125, 155))  # (155·155/255, 205·155/255, 155)
    assert "were CMYK: converted as round((255 − C)·(255 − K) / 255) per channel" in notes[0]


def test_exif_orientation_is_applied_and_other_modes_are_refused(tmp_path):
    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 10
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6  # shown rotated 90° clockwise
    got, notes, _ = _source_rgb(tmp_path, lambda f: Image.fromarray(pixels).save(f, exif=exif), "turned.png")
    np.testing.assert_array_equal(got, np.rot90(pixels, k=-1))
    assert "had an EXIF orientation: turned upright" in notes[0]
    Image.fromarray(np.full((4, 4), 70000, dtype=np.int32)).save(tmp_path / "int32.tif")
    Image.new("LAB", (4, 4)).save(tmp_path / "lab.tif")
    rows = [json.dumps({"prompt": "e", "image": n}) for n in ("int32.tif", "lab.tif")]
    with pytest.raises(DataError) as err:
        PromptDataset.from_file(_jsonl(tmp_path, rows))
    message = str(err.value)
    assert (
        "edits.jsonl:1: image 'int32.tif' holds 32-bit integer pixels (PIL mode I), which have no defined range"
        in message
    )
    assert "edits.jsonl:2: image 'lab.tif' has PIL mode LAB, which is not converted to RGB here" in message
    with pytest.raises(DataError, match=r"the source image \(a PIL image\) has PIL mode LAB"):
        open_image(Image.new("LAB", (2, 2)))


def test_a_self_referencing_symlink_is_refused_before_the_run_directory(tmp_path):
    from flowgrpo.trainer import GRPOTrainer

    os.symlink(tmp_path / "loop.png", tmp_path / "loop.png")
    path = _jsonl(tmp_path, ['{"prompt": "edit", "image": "loop.png"}'])
    with pytest.raises(DataError) as err:
        PromptDataset.from_file(path)
    assert f"{path}:1: image 'loop.png' is a symbolic link that leads back to itself ({tmp_path / 'loop.png'})" in str(
        err.value
    )
    overrides = [f"run.output_dir={tmp_path / 'runs'}", f"data.train={path}", "data.test=null"]
    with pytest.raises(DataError, match="symbolic link that leads back to itself"):
        GRPOTrainer(load_config(ROOT / "configs" / "tiny_flux_kontext.yaml", overrides))
    assert not (tmp_path / "runs").exists()
    os.remove(tmp_path / "loop.png")
    os.symlink(tmp_path / "gone.png", tmp_path / "loop.png")
    with pytest.raises(DataError, match=r"'loop.png' is a symbolic link to a file that does not exist"):
        PromptDataset.from_file(path)


def test_a_source_image_broken_during_the_run_names_its_row(tmp_path):
    for name in ("a.png", "b.png"):
        Image.new("RGB", (8, 8), "red").save(tmp_path / name)
    path = _jsonl(tmp_path, ['{"prompt": "x", "image": "a.png"}', '{"prompt": "y", "image": "b.png"}'])
    data = PromptDataset.from_file(path, "data.test")
    source = data.sources_of([1])[0]
    assert source == str(tmp_path / "b.png") and source.origin == f"data.test: {path}:2"
    assert pickle.loads(pickle.dumps(source)).origin == source.origin and copy.deepcopy(source).origin == source.origin
    adapter = make_adapter(build_tiny_pipeline("flux-kontext"))
    (tmp_path / "b.png").write_bytes(b"no longer an image")
    with pytest.raises(DataError) as err:  # at rollout time: the adapter reads the images again
        adapter.encode_sources(data.sources, SIZE, SIZE)
    message = str(err.value)
    assert message.startswith(f"data.test: {path}:2: the source image {tmp_path / 'b.png'} cannot be read as an image")
    assert "changed or was removed since: restore it" in message and "run.resume" in message
    os.remove(tmp_path / "b.png")
    os.symlink(tmp_path / "b.png", tmp_path / "b.png")  # a link loop: no RuntimeError from resolving it
    with pytest.raises(DataError, match=f"{path}:2: .* is a symbolic link that leads back to itself"):
        adapter.encode_sources(data.sources, SIZE, SIZE)


# ---------------------------------------------------------------- rewards and source images
class _Recorder(BaseReward):
    uses_source_images = True

    def score(self, images, prompts, metadata, source_images):
        return source_images.mean(dim=(1, 2, 3))


def test_source_images_reach_only_the_rewards_that_take_them():
    seen = {}

    def plain(images, prompts, metadata):  # an old-style reward: keeps working
        return images.mean(dim=(1, 2, 3))

    def editing(images, prompts, metadata, source_images=None):
        seen["sources"] = source_images
        return (images - source_images).abs().mean(dim=(1, 2, 3))

    images, sources = torch.rand(3, 3, 8, 8), torch.rand(3, 3, 16, 16)
    combined = CombinedReward([RewardEntry("plain", 1.0, plain), RewardEntry("recorder", 1.0, _Recorder(batch_size=2))])
    scores = combined(images, ["a"] * 3, None, source_images=sources)
    torch.testing.assert_close(scores["recorder"], sources.mean(dim=(1, 2, 3)))  # chunked by 2, all rows right
    torch.testing.assert_close(scores["plain"], images.mean(dim=(1, 2, 3)))
    assert combined.needs_source_images == ["recorder"]
    with pytest.raises(RewardError, match="reward 'recorder' failed.*call it with source_images="):
        combined(images, ["a"] * 3)
    with pytest.raises(ValueError, match="source_images has 2 images for 3 samples"):
        combined(images, ["a"] * 3, source_images=sources[:2])
    with AsyncReward(editing) as scorer:  # the background scorer forwards them too
        scorer.submit(images[:2], ["a", "b"], source_images=sources[:2, :, :8, :8])
        (out,) = scorer.results()
    assert torch.equal(seen["sources"], sources[:2, :, :8, :8]) and out.shape == (2,)
    with AsyncReward(plain) as scorer:
        scorer.submit(images, ["a"] * 3, source_images=sources)
        assert scorer.results()[0].shape == (3,)


def test_consistency_is_the_clip_image_cosine_with_the_source():
    reward = build_reward([{"name": "consistency", "random_init": True, "model_config": TINY_CLIP}])
    consistency = reward.rewards["consistency"]
    sources = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    edits = sources.flip(0)
    scores = reward(edits, ["x"] * 4, None, source_images=sources)["consistency"]
    model, pixels = consistency.model, consistency._pixels
    with torch.no_grad():
        expected = torch.nn.functional.cosine_similarity(
            model.encode_image(pixels(edits)), model.encode_image(pixels(sources))
        )
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-5)
    same = reward(sources, ["x"] * 4, None, source_images=sources)["consistency"]
    torch.testing.assert_close(same, torch.ones(4), rtol=0, atol=1e-5)
    assert (scores < same - 1e-4).all()
    with pytest.raises(RewardError, match="consistency.*compares each image with the image it edits"):
        reward(edits, ["x"] * 4)


def test_a_reward_needing_sources_is_refused_on_text_prompts_before_training(tmp_path):
    from flowgrpo.trainer import GRPOTrainer

    text_prompts = ROOT / "configs" / "prompts" / "tiny_train.txt"
    overrides = [f"run.output_dir={tmp_path}", f"data.train={text_prompts}", "data.test=null"]
    config = load_config(ROOT / "configs" / "tiny_flux_kontext.yaml", overrides)
    with pytest.raises(DataError, match="data.train: reward.s. consistency compare each edit with its source image"):
        GRPOTrainer(config)
    assert not list(tmp_path.iterdir())  # no run directory


# ---------------------------------------------------------------- the editing demo: train, export, evaluate
def test_editing_demo_trains_exports_and_evaluates(tmp_path, monkeypatch):
    from flowgrpo.evaluation import evaluate, ode_sampler
    from flowgrpo.export import adapter_from_checkpoint, export_checkpoint, run_config
    from flowgrpo.trainer import GRPOTrainer
    from rewards.consistency import Consistency

    scored = []
    score = Consistency.score
    monkeypatch.setattr(
        Consistency,
        "score",
        lambda self, images, prompts, metadata, source_images: (
            scored.append((list(prompts), source_images.clone()))
            or score(self, images, prompts, metadata, source_images)
        ),
    )
    prompts_dir = ROOT / "configs" / "prompts"
    config = load_config(
        ROOT / "configs" / "tiny_flux_kontext.yaml",
        [
            f"run.output_dir={tmp_path / 'runs'}",
            "run.progress=false",
            f"data.train={prompts_dir}/edit_tiny_train.jsonl",
            f"data.test={prompts_dir}/edit_tiny_test.jsonl",
        ],
    )
    trainer = GRPOTrainer(config)
    base = {n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters() if p.requires_grad}
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert len(trained) == 2 and all(r["train/onpolicy_ratio_dev"] == 0.0 for r in trained)
    assert all(0 < r["reward/consistency/mean"] <= 1 for r in trained)
    params = dict(trainer.adapter.transformer.named_parameters())
    assert any(not torch.equal(params[n], base[n]) for n in base)
    # Every scored edit came with its own prompt's source image, as the adapter prepared it.
    data = {
        p: s
        for p, s in zip(
            trainer.train_data.prompts + trainer.test_data.prompts,
            trainer.train_data.sources + trainer.test_data.sources,
            strict=True,
        )
    }
    assert len(scored) >= 4
    for prompts, sources in scored:
        for prompt, pixels in zip(prompts, sources, strict=True):
            torch.testing.assert_close(pixels, _pixels(data[prompt]), rtol=0, atol=1e-6)

    # Evaluation from the checkpoint (as scripts/evaluate.py) scores what the trainer's last evaluation scored.
    ckpt = trainer.run_dir / "checkpoints" / "epoch-00002"
    config = run_config(ckpt)
    adapter = adapter_from_checkpoint(config, ckpt)
    test_data = PromptDataset.from_file(config.data.test, "data.test")
    summary, *_ = evaluate(adapter, test_data, build_reward(config.rewards), config.eval, resolution=32, seed=0)
    assert summary["consistency"] == pytest.approx(rows[-1]["eval/consistency"], abs=1e-6)

    # Export: plain diffusers with load_lora_weights edits exactly as the trainer's own noise-free sampling.
    export_checkpoint(ckpt, tmp_path / "lora")
    pipe = build_tiny_pipeline("flux-kontext", vae="tiny")
    before = _pipe_images(pipe, SOURCES[:2], PROMPTS[:2], noise := adapter.initial_noise(2, SIZE, SIZE), 4)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    theirs = _pipe_images(pipe, SOURCES[:2], PROMPTS[:2], noise, 4)
    sampler = ode_sampler(config.eval)
    ours = rollout(
        adapter,
        PROMPTS[:2],
        [0, 1],
        sampler,
        range(0, 0),
        height=SIZE,
        width=SIZE,
        initial_latents=noise,
        sources=SOURCES[:2],
    ).images
    assert (before - ours).abs().max() > 1e-4  # the adapter really changes the edits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
