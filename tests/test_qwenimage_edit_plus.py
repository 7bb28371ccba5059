"""Multi-image editing with Qwen-Image-Edit-Plus (``QwenImageEditPlusPipeline``, Qwen-Image-Edit-2509 / -2511) on the
tiny offline pipeline: a noise-free rollout equals the diffusers pipeline itself (latents and images, with and without
true CFG, square and non-square, two pictures and one), the text encoder reading "Picture 1", "Picture 2" at the
pipeline's 384² and the VAE at its (tiny) area; exact re-scoring; the LoRA targets against Flow-Factory's; the prompt
files' lists of images and their refusals; two epochs of the trainer resumed exactly and exported to plain diffusers.

``pipe()`` sizes every source for the VAE to about ``VAE_IMAGE_SIZE`` = 1024² pixels, slow at tiny sizes: the tiny
adapter's ``source_area`` (32²) is swapped into the pipeline module's ``VAE_IMAGE_SIZE`` (the only change)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from PIL import Image
from resume_helper import train_and_resume

from flowgrpo.adapters import ADAPTERS, make_adapter
from flowgrpo.adapters.qwenimage import QwenImageAdapter
from flowgrpo.adapters.qwenimage_edit_plus import FLOW_FACTORY_LORA_TARGETS, QwenImageEditPlusAdapter
from flowgrpo.checks import ConfigError
from flowgrpo.config import SamplerConfig, load_config
from flowgrpo.data import DataError, PromptDataset, check_editing, open_image
from flowgrpo.pipelines import load_pipeline, pipeline_kind
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_qwenimage_edit_plus.yaml"
IMAGES = ROOT / "configs" / "prompts" / "edit_images"
TRAIN = ROOT / "configs" / "prompts" / "edit_plus_tiny_train.jsonl"
NEGATIVE = " "
TINY_AREA = 32 * 32  # model.source_area of configs/tiny_qwenimage_edit_plus.yaml, for pipe()'s VAE_IMAGE_SIZE 1024²
SQUARE, CIRCLE, TRIANGLE, STRIPES = (
    str(IMAGES / f) for f in ("red_square.png", "blue_circle.png", "green_triangle.png", "yellow_stripes.png")
)
PROMPTS = ["put the circle in the square", "give the triangle the stripes", "put the circle in the square"]
SOURCES = [(SQUARE, CIRCLE), (TRIANGLE, STRIPES), (SQUARE, CIRCLE)]  # rows 0 and 2: the same pair
GROUPS = [0, 1, 0]


@pytest.fixture(scope="module")
def pipe() -> QwenImageEditPlusPipeline:
    return build_tiny_pipeline("qwenimage-edit-plus")


def _adapter(pipe: QwenImageEditPlusPipeline) -> QwenImageEditPlusAdapter:
    adapter = make_adapter(pipe, negative_prompt=NEGATIVE, source_area=TINY_AREA)
    assert type(adapter) is QwenImageEditPlusAdapter
    return adapter


def _shown(source: str, height: int, width: int) -> Image.Image:
    """A source as the adapter hands it to the pipeline's own sizing: RGB, resized bicubic to the output size."""
    return open_image(source).resize((width, height), Image.Resampling.BICUBIC)


def _pipe(pipe, monkeypatch, sources, latents, *, output_type, steps, cfg, height, width) -> torch.Tensor:
    """diffusers' QwenImageEditPlusPipeline, one prompt at a time (it refuses batches), each picture resized to the
    output size first; the tiny area in place of VAE_IMAGE_SIZE (CONDITION_IMAGE_SIZE stays 384²)."""
    monkeypatch.setattr(plus_module, "VAE_IMAGE_SIZE", TINY_AREA)
    out = [
        pipe(
            image=[_shown(s, height, width) for s in group],
            prompt=PROMPTS[i],
            negative_prompt=NEGATIVE,
            true_cfg_scale=cfg,
            latents=latents[i : i + 1].clone(),
            num_inference_steps=steps,
            height=height,
            width=width,
            output_type=output_type,
        ).images
        for i, group in enumerate(sources)
    ]
    monkeypatch.undo()
    return torch.cat(out)


# ---------------------------------------------------------------- the pipeline kind and its tiny build
def test_edit_plus_pipeline_gets_its_own_kind_adapter_and_tiny_build(pipe):
    assert pipeline_kind(pipe) == "qwenimage-edit-plus" and ADAPTERS["qwenimage-edit-plus"] is QwenImageEditPlusAdapter
    assert QwenImageEditPlusAdapter.edits and QwenImageEditPlusAdapter.requires_sources
    assert QwenImageEditPlusAdapter.max_sources is None  # any number of pictures
    assert isinstance(load_pipeline("tiny-qwenimage-edit-plus", dtype="fp32"), QwenImageEditPlusPipeline)
    # The edit template's system part is the 64 tokens the pipeline drops: the embeddings start at "Picture 1: ".
    text = pipe.prompt_template_encode.format("Picture 1: <|vision_start|><|image_pad|><|vision_end|>make it")
    assert "".join(pipe.tokenizer.tokenize(text)[64:68]) == "Picture" and pipe.prompt_template_encode_start_idx == 64
    assert pipe.processor.image_processor.size["longest_edge"] == 32 * 32  # each picture read at 32² at most


# ---------------------------------------------------------------- noise 0: pipe() itself
@pytest.mark.parametrize(
    "steps,cfg,height,width,count",
    [(4, 4.0, 32, 32, 2), (3, 1.0, 32, 48, 2), (3, 2.5, 48, 32, 1)],
    ids=["cfg-square-two", "nocfg-wide-two", "cfg-tall-one"],
)
def test_noise_free_rollout_reproduces_edit_plus_pipe(pipe, monkeypatch, steps, cfg, height, width, count):
    adapter = _adapter(pipe)
    sources = [group[:count] for group in SOURCES]
    latents = adapter.initial_noise(len(PROMPTS), height, width, generator=torch.Generator().manual_seed(steps))
    call = dict(steps=steps, cfg=cfg, height=height, width=width)
    expected_latents = _pipe(pipe, monkeypatch, sources, latents, output_type="latent", **call)
    expected = _pipe(pipe, monkeypatch, sources, latents, output_type="pt", **call)
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=cfg)

    def run(groups):
        return rollout(
            adapter,
            PROMPTS,
            GROUPS,
            sampler,
            range(0, steps - 1),
            height=height,
            width=width,
            initial_latents=latents,
            sources=[list(g) if count > 1 else g[0] for g in groups],  # a list of paths, or one path
        )

    traj = run(sources)
    torch.testing.assert_close(traj.final_latents, expected_latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    # Each picture as the VAE sees it: calculate_dimensions(32², ratio) = 32x32 whatever the output's ratio, 8x8
    # packed tokens, the pictures one after another; rewards comparing with the source get Picture 1.
    assert traj.embeds.source_latents.shape == (3, count * 64, 16)
    picture_1 = pipe.image_processor.preprocess(_shown(sources[1][0], height, width), 32, 32)[0]
    torch.testing.assert_close(traj.source_images[1], ((picture_1 + 1) / 2).clamp(0, 1), rtol=0, atol=1e-6)
    assert (traj.embeds.negative_embeds is not None) == (cfg > 1)
    if count > 1:  # both pictures condition the edit, in order: "Picture 1" and "Picture 2" swapped is another edit
        swapped = run([group[::-1] for group in sources])
        assert (swapped.images - traj.images).abs().max() > 1e-4


def test_edit_2511s_zero_cond_t_matches_pipe_too(pipe, monkeypatch):
    """Qwen-Image-Edit-2511 runs in the same pipeline with a transformer whose ``zero_cond_t`` modulates the pictures'
    tokens at timestep 0, telling them apart by ``img_shapes``: a noise-free rollout equals pipe() there too, and the
    same weights without it (2509) give other latents."""
    from diffusers import QwenImageTransformer2DModel

    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}  # no _use_default_values
    transformer = QwenImageTransformer2DModel.from_config({**config, "zero_cond_t": True})
    assert transformer.zero_cond_t
    transformer.load_state_dict(pipe.transformer.state_dict())  # the same weights: only the conditioning differs
    edit_2511 = QwenImageEditPlusPipeline(**{**pipe.components, "transformer": transformer.eval()})
    edit_2511.set_progress_bar_config(disable=True)
    adapter = _adapter(edit_2511)
    latents = adapter.initial_noise(len(PROMPTS), 32, 32, generator=torch.Generator().manual_seed(0))
    call = dict(output_type="latent", steps=2, cfg=4.0, height=32, width=32)
    expected = _pipe(edit_2511, monkeypatch, SOURCES, latents, **call)
    sampler = SamplerConfig(noise_level=0.0, num_steps=2, guidance_scale=4.0)
    sources = [list(g) for g in SOURCES]
    run = dict(height=32, width=32, initial_latents=latents, sources=sources, decode=False)
    traj = rollout(adapter, PROMPTS, GROUPS, sampler, range(0, 1), **run)
    torch.testing.assert_close(traj.final_latents, expected, rtol=0, atol=1e-5)
    assert (_pipe(pipe, monkeypatch, SOURCES, latents, **call) - expected).abs().max() > 1e-4


def test_sources_are_sized_as_the_pipeline_sizes_them(pipe):
    """The VAE's size: calculate_dimensions(source_area, ratio) (pipe(): VAE_IMAGE_SIZE 1024²); the text encoder's:
    calculate_dimensions(CONDITION_IMAGE_SIZE 384², ratio), whatever source_area."""
    adapter = make_adapter(pipe)
    assert plus_module.VAE_IMAGE_SIZE == 1024 * 1024 and plus_module.CONDITION_IMAGE_SIZE == 384 * 384
    for height, width in ((32, 32), (32, 48), (512, 768), (768, 512)):
        vae_w, vae_h = plus_module.calculate_dimensions(plus_module.VAE_IMAGE_SIZE, width / height)
        cond_w, cond_h = plus_module.calculate_dimensions(plus_module.CONDITION_IMAGE_SIZE, width / height)
        assert adapter.source_size(height, width) == (vae_h, vae_w)
        assert adapter.condition_size(height, width) == _adapter(pipe).condition_size(height, width) == (cond_h, cond_w)
    assert adapter.source_size(512, 768) == (832, 1248) and adapter.condition_size(512, 768) == (320, 480)


# ---------------------------------------------------------------- re-scoring, caching
def test_rescoring_edit_plus_gives_ratio_exactly_one(pipe):
    adapter = _adapter(pipe)
    sampler = SamplerConfig(kind="euler_maruyama", noise_level=1.0, num_steps=4, guidance_scale=4.0)
    traj = rollout(
        adapter,
        PROMPTS,
        GROUPS,
        sampler,
        range(0, 3),
        torch.Generator().manual_seed(1),
        height=32,
        width=32,
        sources=[list(g) for g in SOURCES],
    )
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])
    sub = traj.select([2, 1])  # a micro-batch carries its own rows' pictures and text
    with torch.no_grad():
        torch.testing.assert_close(evaluate_transitions(adapter, sub, 1, sampler).log_prob, traj.log_probs[[2, 1], 1])
    # 2 unique (prompt, pictures) pairs + the negative prompt with each: one text-encoder call each, cached; each of
    # the 4 images through the VAE once.
    assert adapter.text_encoder_calls == 4 and len(adapter._pair_cache) == 4 and adapter.source_encoder_calls == 1
    assert len(adapter._source_cache) == 4


# ---------------------------------------------------------------- LoRA targets
def test_lora_targets_are_flow_factorys():
    """Flow-Factory's default_target_modules (suffixes, peft's matching) select the twelve Linear layers of every block
    that the Qwen-Image list names; the last block's text-stream outputs get none (never trained)."""
    adapter = make_adapter(build_tiny_pipeline("qwenimage-edit-plus"))
    assert adapter.default_lora_targets == QwenImageAdapter.default_lora_targets
    linears = [n for n, m in adapter.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    flow_factory = {n for n in linears if any(n == t or n.endswith("." + t) for t in FLOW_FACTORY_LORA_TARGETS)}
    blocks = len(adapter.transformer.transformer_blocks)
    ours = {f"transformer_blocks.{i}.{t}" for i in range(blocks) for t in QwenImageAdapter.default_lora_targets}
    assert flow_factory == ours
    adapter.add_lora(rank=2, alpha=2)
    wrapped = {n.split(".lora_A")[0] for n, _ in adapter.transformer.named_parameters() if ".lora_A." in n}
    excluded = set(adapter.lora_exclude(adapter.transformer))
    assert len(excluded) == 3 and wrapped == flow_factory - excluded


# ---------------------------------------------------------------- the prompt files' lists of images, refusals
def test_prompt_files_give_a_list_of_images_per_row(tmp_path, pipe):
    data = PromptDataset.from_file(TRAIN)
    assert data.sources_per_prompt == 2 and data.sources[0] == (SQUARE, CIRCLE)
    assert data.sources[0][1].origin.endswith("edit_plus_tiny_train.jsonl:1")  # each path knows its row
    edit_plus = _adapter(pipe)
    check_editing({"data.train": data}, adapter=edit_plus)
    one_source = make_adapter(build_tiny_pipeline("qwenimage-edit"))
    refused = r"gives 2 source images per prompt .* qwenimage-edit takes 1: .*\(model.kind qwenimage-edit-plus\)"
    with pytest.raises(DataError, match=refused):
        check_editing({"data.train": data}, adapter=one_source)
    with pytest.raises(ValueError, match="qwenimage-edit takes 1 source image per prompt, got 2"):
        one_source.encode_conditions(PROMPTS[:1], sources=[[SQUARE, CIRCLE]], height=32, width=32)
    kontext = make_adapter(build_tiny_pipeline("flux-kontext"))
    with pytest.raises(ValueError, match="flux-kontext takes one source image per prompt, got a list of 2"):
        kontext.encode_conditions(PROMPTS[:1], sources=[(SQUARE, CIRCLE)], height=32, width=32)

    shutil.copy(SQUARE, tmp_path / "square.png")
    square = str((tmp_path / "square.png").resolve())

    def rows(*images) -> Path:
        file = tmp_path / "rows.jsonl"
        file.write_text("".join(json.dumps({"prompt": f"p{i}", "image": v}) + "\n" for i, v in enumerate(images)))
        return file

    single = PromptDataset.from_file(rows(["square.png"], "square.png"))  # a one-path list is that path, as before
    assert single.sources_per_prompt == 1 and single.sources == [square, square] and isinstance(single.sources[0], str)
    assert PromptDataset.from_file(rows(["square.png"] * 3)).sources == [(square,) * 3]
    with pytest.raises(DataError, match=r"give different numbers of source images \(1 at .*:1, 2 at .*:2\).*split"):
        PromptDataset.from_file(rows("square.png", ["square.png", "square.png"]))
    with pytest.raises(DataError, match=r'"image" must be an image file path, got \[\] \(or a non-empty list'):
        PromptDataset.from_file(rows([]))
    with pytest.raises(DataError, match=r"image 'missing.png' does not exist"):
        PromptDataset.from_file(rows(["square.png", "missing.png"]))


def test_what_edit_plus_refuses(pipe):
    adapter = _adapter(pipe)
    with pytest.raises(ValueError, match="QwenImageEditPlusPipeline cannot generate from text alone"):
        adapter.encode_conditions(PROMPTS[:1], height=32, width=32)
    with pytest.raises(ValueError, match="reads each prompt with its source image"):
        adapter.encode_prompts(PROMPTS[:1])
    with pytest.raises(ValueError, match=r"the prompts of a batch give 1 or 2 source images: .* the same number"):
        adapter.encode_conditions(PROMPTS[:2], sources=[SQUARE, [SQUARE, CIRCLE]], height=32, width=32)
    with pytest.raises(ValueError, match="a prompt's list of source images is empty"):
        adapter.encode_conditions(PROMPTS[:1], sources=[[]], height=32, width=32)
    text = PromptDataset.from_file(ROOT / "configs" / "prompts" / "tiny_train.txt")
    with pytest.raises(DataError, match="qwenimage-edit-plus edits images and cannot generate from text alone"):
        check_editing({"data.train": text}, adapter=adapter)
    with pytest.raises(ValueError, match=r"qwenimage-edit-plus: model.source_area=1024 rounds a 32x128 output's"):
        adapter.source_size(32, 128)
    assert load_config(TINY).model.source_area == TINY_AREA  # model.source_area: the Edit families' option only
    with pytest.raises(ConfigError, match="source_area=1024 is an option of qwenimage-edit, qwenimage-edit-plus only"):
        load_config(TINY, ["model.kind=qwenimage"])


# ---------------------------------------------------------------- train, resume, export to plain diffusers
def test_two_epochs_resume_exactly_and_export_matches_plain_diffusers(tmp_path, monkeypatch):
    from flowgrpo.evaluation import ode_sampler
    from flowgrpo.export import adapter_from_checkpoint, export_checkpoint, run_config

    base = tmp_path / "base"
    build_tiny_pipeline("qwenimage-edit-plus").save_pretrained(str(base))
    overrides = [f"model.pretrained={base}", "run.progress=false", "train.lr=5e-2", "eval.every=0"]
    overrides += ["grpo.group_size=2", "sampler.num_steps=3"]  # 4 images a batch, 2 trained steps: fast
    monkeypatch.setattr("flowgrpo.trainer.write_curves", lambda run_dir: None)  # matplotlib: seconds, not tested here
    monkeypatch.setattr("flowgrpo.trainer.write_before_after", lambda run_dir: None)
    ckpt, weights = train_and_resume(TINY, tmp_path, overrides)
    assert any("attn.add_k_proj.lora_B" in k and weights[k].abs().max() > 0 for k in weights)  # the text stream trains

    export_checkpoint(ckpt, tmp_path / "lora")
    export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    config = run_config(ckpt)
    adapter = adapter_from_checkpoint(config, ckpt)
    latents = adapter.initial_noise(2, 32, 32, generator=torch.Generator().manual_seed(0))
    sampler = ode_sampler(config.eval)
    groups = [list(g) for g in SOURCES[:2]]
    ours = rollout(
        adapter, PROMPTS[:2], [0, 1], sampler, range(0, 0), height=32, width=32, initial_latents=latents, sources=groups
    ).images
    call = dict(output_type="pt", steps=sampler.num_steps, cfg=sampler.guidance_scale, height=32, width=32)
    outputs = {}
    for name, path, lora in [("base", base, False), ("lora", base, True), ("merged", tmp_path / "merged", False)]:
        plain = QwenImageEditPlusPipeline.from_pretrained(str(path))
        plain.set_progress_bar_config(disable=True)
        if lora:
            plain.load_lora_weights(str(tmp_path / "lora"))
        outputs[name] = _pipe(plain, monkeypatch, SOURCES[:2], latents, **call)
    assert (outputs["base"] - ours).abs().max() > 1e-3  # the adapter really changes the edits
    torch.testing.assert_close(outputs["lora"], ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(outputs["merged"], ours, rtol=0, atol=1e-4)
