"""Image editing with Qwen-Image-Edit (``QwenImageEditPipeline``) on the tiny offline pipeline: alignment with the
diffusers pipeline itself with and without true CFG (its text encoder reading each source image), exact re-scoring for
every sampler, (prompt, image) caching, refusals, and the editing demo through the normal trainer and export to plain
diffusers. The editing data, the reward protocol's ``source_images`` and the ``consistency`` reward are tested in
test_editing.py (FLUX.1-Kontext); its sources, prompts and helpers are reused here."""

from __future__ import annotations

import json
from pathlib import Path

import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_module
import pytest
import torch
from diffusers import QwenImageEditPipeline
from PIL import Image
from script_helper import load_script
from test_editing import PROMPTS, SIZE, SOURCES, _pixels

from flowgrpo.adapters import ADAPTERS, QwenImageEditAdapter, make_adapter
from flowgrpo.config import SamplerConfig, load_config
from flowgrpo.data import DataError, PromptDataset, check_editing, open_image
from flowgrpo.pipelines import load_pipeline, pipeline_kind
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline, tiny_qwen_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_qwenimage_edit.yaml"
NEGATIVE = " "  # Flow-GRPO's negative prompt for Qwen-Image(-Edit)
GROUPS = [0, 1, 0, 2]  # PROMPTS / SOURCES: rows 0 and 2 are the same pair
TINY_AREA = 32 * 32  # the tiny model's source area (model.source_area; configs/tiny_qwenimage_edit.yaml) for 1024²


def _adapter() -> QwenImageEditAdapter:
    adapter = make_adapter(build_tiny_pipeline("qwenimage-edit"), negative_prompt=NEGATIVE, source_area=TINY_AREA)
    assert type(adapter) is QwenImageEditAdapter
    return adapter


def _pipe_images(pipe, monkeypatch, sources, prompts, latents, *, steps, cfg, height=SIZE, width=SIZE):
    """diffusers' own QwenImageEditPipeline, one (prompt, source) at a time, given each source resized to the output
    size. pipe() sizes the source to calculate_dimensions(1024², ratio) whatever the output size, slow at tiny sizes:
    the tiny adapter's area replaces 1024² there (the only change; both then size and resize identically)."""
    original = edit_module.calculate_dimensions

    def tiny_area(area, ratio):
        assert area == 1024 * 1024  # what pipe() asks for, whatever the output size
        return original(TINY_AREA, ratio)

    monkeypatch.setattr(edit_module, "calculate_dimensions", tiny_area)
    images = [
        pipe(
            image=open_image(source).resize((width, height)),
            prompt=prompt,
            negative_prompt=NEGATIVE,
            true_cfg_scale=cfg,
            latents=latents[i : i + 1].clone(),
            num_inference_steps=steps,
            height=height,
            width=width,
            output_type="pt",
        ).images
        for i, (prompt, source) in enumerate(zip(prompts, sources, strict=True))
    ]
    monkeypatch.setattr(edit_module, "calculate_dimensions", original)
    return torch.cat(images)


# ---------------------------------------------------------------- the pipeline kind and its tiny build
def test_qwenimage_edit_pipeline_gets_its_own_kind_adapter_and_tiny_build(tmp_path):
    script = load_script("make_tiny_pipeline")

    pipe = build_tiny_pipeline("qwenimage-edit")
    assert isinstance(pipe, QwenImageEditPipeline) and pipeline_kind(pipe) == "qwenimage-edit"
    assert ADAPTERS["qwenimage-edit"] is QwenImageEditAdapter and QwenImageEditAdapter.edits
    assert script.main([str(tmp_path / "edit"), "--kind", "qwenimage-edit"]) == 0
    loaded = load_pipeline(str(tmp_path / "edit"), dtype="fp32")  # kind read from model_index.json
    assert isinstance(loaded, QwenImageEditPipeline) and type(make_adapter(loaded)) is QwenImageEditAdapter
    assert isinstance(load_pipeline("tiny-qwenimage-edit", dtype="fp32"), QwenImageEditPipeline)
    # As with the real tokenizer, the edit template's system part is the 64 tokens the pipeline drops: the embeddings
    # start at <|vision_start|>, the image's tokens (read by the vision tower) and then the instruction.
    tokens = pipe.tokenizer.tokenize(pipe.prompt_template_encode.format("make the square blue"))
    assert pipe.prompt_template_encode_start_idx == 64 and tokens[64] == "<|vision_start|>"
    assert len(tiny_qwen_tokenizer()) < len(pipe.tokenizer)  # the text-to-image tokenizer (and weights) unchanged


@pytest.mark.parametrize(
    "steps,cfg,height,width", [(4, 4.0, 32, 32), (3, 1.0, 32, 32), (3, 2.5, 48, 32)], ids=["cfg", "nocfg", "tall"]
)
def test_noise_free_rollout_reproduces_qwenimage_edit_pipe(monkeypatch, steps, cfg, height, width):
    adapter = _adapter()
    latents = adapter.initial_noise(len(PROMPTS), height, width, generator=torch.Generator().manual_seed(steps))
    expected = _pipe_images(
        adapter.pipe, monkeypatch, SOURCES, PROMPTS, latents, steps=steps, cfg=cfg, height=height, width=width
    )
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=cfg)
    traj = rollout(
        adapter,
        PROMPTS,
        GROUPS,
        sampler,
        range(0, steps - 1),
        height=height,
        width=width,
        initial_latents=latents,
        sources=[str(s) for s in SOURCES],
    )
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    # Sources as pipe() sizes them, by the area alone: 32x32 for 32x32 and for 48x32 images too (not the 64x32 that
    # an area of H·W gives), so the two img_shapes entries differ there.
    source_size = (32, 32)
    assert traj.source_images.shape == (4, 3, *source_size) and adapter.source_size(height, width) == source_size
    assert traj.embeds.source_latents.shape == (4, source_size[0] * source_size[1] // 16, 16)
    assert (traj.embeds.negative_embeds is not None) == (cfg > 1)
    # Another source image gives another edit (it conditions the samples).
    other = _pipe_images(
        adapter.pipe, monkeypatch, SOURCES[::-1], PROMPTS, latents, steps=steps, cfg=cfg, height=height, width=width
    )
    assert (other - expected).abs().max() > 1e-4


def test_sources_are_sized_to_the_pipelines_area_whatever_the_output_size():
    """QwenImageEditPipeline sizes the source (for its text encoder and its VAE alike) to calculate_dimensions(1024²,
    ratio), and so does Flow-GRPO since "fix qwen image edit resolution": the adapter's default, refused if too small
    for the ratio, and model.source_area reaches the adapter only for qwenimage-edit."""
    from flowgrpo.checks import ConfigError
    from flowgrpo.pipelines import build_adapter

    adapter = make_adapter(build_tiny_pipeline("qwenimage-edit"))
    for height, width in ((32, 32), (32, 48), (48, 32), (512, 512), (512, 768)):
        pipe_width, pipe_height, _ = edit_module.calculate_dimensions(1024 * 1024, width / height)
        assert adapter.source_size(height, width) == (pipe_height, pipe_width)
    assert adapter.source_size(512, 768) == (832, 1248)
    with pytest.raises(ValueError, match="model.source_area=1024 rounds a 32x128 output's source to 0x64 pixels"):
        _adapter().source_size(32, 128)
    tiny = load_config(TINY).model
    assert tiny.source_area == TINY_AREA and build_adapter(tiny).source_size(48, 32) == (32, 32)
    refused = "model.source_area=1024 is an option of qwenimage-edit, qwenimage-edit-plus only, but the model is "
    refused += "qwenimage"
    with pytest.raises(ConfigError, match=refused + r" \(QwenImagePipeline\): remove model.source_area"):
        make_adapter(build_tiny_pipeline("qwenimage"), source_area=TINY_AREA)
    with pytest.raises(ConfigError, match=refused):
        load_config(TINY, ["model.kind=qwenimage"])
    with pytest.raises(ConfigError, match="model.source_area must be >= 1024"):
        load_config(TINY, ["model.source_area=512"])


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
def test_rescoring_qwenimage_edits_gives_ratio_exactly_one(sampler_kwargs):
    adapter = _adapter()
    sampler = SamplerConfig(**{"noise_level": 1.0, "num_steps": 5, "guidance_scale": 4.0, **sampler_kwargs})
    traj = rollout(
        adapter,
        PROMPTS,
        GROUPS,
        sampler,
        range(1, 4),
        torch.Generator().manual_seed(1),
        height=SIZE,
        width=SIZE,
        sources=SOURCES,
    )
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])
    sub = traj.select([3, 0])  # a micro-batch carries its own rows' sources and text (padded to the batch's length)
    with torch.no_grad():
        torch.testing.assert_close(evaluate_transitions(adapter, sub, 1, sampler).log_prob, traj.log_probs[[3, 0], 1])


def test_text_is_read_with_its_image_and_each_pair_encoded_once():
    adapter = _adapter()
    sampler = SamplerConfig(num_steps=2, guidance_scale=4.0)
    for epoch in range(2):
        traj = rollout(
            adapter,
            PROMPTS,
            GROUPS,
            sampler,
            range(0, 1),
            torch.Generator().manual_seed(epoch),
            height=SIZE,
            width=SIZE,
            sources=SOURCES,
        )
    # 3 unique (prompt, image) pairs + the negative prompt with each of 3 images: one batched text pass, one VAE pass.
    assert adapter.text_encoder_calls == 1 and adapter.source_encoder_calls == 1 and len(adapter._pair_cache) == 6
    torch.testing.assert_close(traj.source_images, torch.stack([_pixels(s) for s in SOURCES]), rtol=0, atol=1e-6)
    # The same instruction (and the negative prompt) read with another image is another embedding.
    same_text = adapter.encode_conditions(
        [PROMPTS[0]] * 2, with_negative=True, sources=SOURCES[:2], height=SIZE, width=SIZE
    )
    assert not torch.allclose(same_text.prompt_embeds[0], same_text.prompt_embeds[1])
    assert not torch.allclose(same_text.negative_embeds[0], same_text.negative_embeds[1])
    # A pair's embedding does not depend on the batch it was encoded in (to float noise).
    alone = _adapter().encode_conditions(PROMPTS[1:2], sources=SOURCES[1:2], height=SIZE, width=SIZE)
    length = int(traj.embeds.mask[1].sum())
    assert length == alone.prompt_embeds.shape[1]
    torch.testing.assert_close(traj.embeds.prompt_embeds[1:2, :length], alone.prompt_embeds, rtol=1e-5, atol=1e-6)
    adapter.clear_prompt_cache()
    pil = Image.open(SOURCES[0])  # PIL images work too, cached by their pixels
    adapter.encode_conditions(PROMPTS[:2], sources=[pil, pil.copy()], height=SIZE, width=SIZE)
    assert adapter.text_encoder_calls == 3 and len(adapter._pair_cache) == 2


def test_qwenimage_edit_refuses_prompts_without_source_images():
    adapter = _adapter()
    with pytest.raises(ValueError, match="cannot generate from text alone"):
        adapter.encode_conditions(PROMPTS[:1], height=SIZE, width=SIZE)
    with pytest.raises(ValueError, match="reads each prompt with its source image"):
        adapter.encode_prompts(PROMPTS[:1])
    with pytest.raises(ValueError, match="2 source images for 1 prompts"):
        adapter.encode_conditions(PROMPTS[:1], sources=SOURCES[:2], height=SIZE, width=SIZE)
    text = PromptDataset.from_file(ROOT / "configs" / "prompts" / "tiny_train.txt")
    with pytest.raises(DataError, match="data.train: qwenimage-edit edits images and cannot generate from text alone"):
        check_editing({"data.train": text}, adapter=adapter)
    check_editing(
        {"data.train": PromptDataset.from_file(ROOT / "configs" / "prompts" / "edit_tiny_train.jsonl")}, adapter=adapter
    )


# ---------------------------------------------------------------- the editing demo: train, then export to diffusers
def test_qwenimage_edit_demo_trains_and_exports_to_plain_diffusers(tmp_path, monkeypatch):
    from flowgrpo.evaluation import ode_sampler
    from flowgrpo.export import adapter_from_checkpoint, export_checkpoint, run_config
    from flowgrpo.trainer import GRPOTrainer

    base = tmp_path / "base"
    build_tiny_pipeline("qwenimage-edit").save_pretrained(str(base))
    config = load_config(
        TINY,
        [
            f"run.output_dir={tmp_path / 'runs'}",
            "run.progress=false",
            f"model.pretrained={base}",
            f"data.train={ROOT}/configs/prompts/edit_tiny_train.jsonl",
            f"data.test={ROOT}/configs/prompts/edit_tiny_test.jsonl",
        ],
    )
    trainer = GRPOTrainer(config)
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert len(trained) == 2 and all(r["train/onpolicy_ratio_dev"] == 0.0 for r in trained)
    assert all(0 < r["reward/consistency/mean"] <= 1 for r in trained) and "eval/consistency" in rows[-1]

    # Export: plain diffusers (from_pretrained + load_lora_weights) edits exactly as the trainer's noise-free sampling.
    ckpt = trainer.run_dir / "checkpoints" / "epoch-00002"
    export_checkpoint(ckpt, tmp_path / "lora")
    config = run_config(ckpt)
    adapter = adapter_from_checkpoint(config, ckpt)
    noise = adapter.initial_noise(2, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
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
    pipe = QwenImageEditPipeline.from_pretrained(str(base))
    kwargs = {"steps": sampler.num_steps, "cfg": sampler.guidance_scale}
    before = _pipe_images(pipe, monkeypatch, SOURCES[:2], PROMPTS[:2], noise, **kwargs)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    theirs = _pipe_images(pipe, monkeypatch, SOURCES[:2], PROMPTS[:2], noise, **kwargs)
    assert (before - ours).abs().max() > 1e-4  # the adapter really changes the edits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
