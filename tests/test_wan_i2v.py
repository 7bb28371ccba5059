"""Wan image-to-video (``WanImageToVideoPipeline``) through ``WanImageToVideoAdapter`` on tiny offline pipelines:
Wan2.1 I2V (CLIP image embeddings) and Wan2.2 I2V A14B (two experts, no image encoder). A noise-free rollout equals
``pipe(image=...)`` (square and non-square, one image per prompt), the condition and the image embeddings are the
pipeline's own, re-scoring gives ratio exactly 1, refusals, and two epochs of the trainer resumed exactly and
exported to plain diffusers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
from PIL import Image
from resume_helper import train_and_resume

from flowgrpo.adapters import make_adapter
from flowgrpo.adapters.wan_i2v import WanImageToVideoAdapter
from flowgrpo.config import ConfigError, SamplerConfig, load_config
from flowgrpo.data import DataError
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline, wan_i2v_components

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_wan_i2v.yaml"
IMAGES = ROOT / "configs" / "prompts" / "edit_images"
PROMPTS = ["a red cube", "a blue ball"]
SOURCES = [str(IMAGES / "red_square.png"), str(IMAGES / "green_triangle.png")]  # 32x32, and 40x24: resized


def _pipe(*, wan22: bool = False, euler: bool = True) -> WanImageToVideoPipeline:
    """The tiny I2V pipeline (``wan22``: Wan2.2's two experts); ``euler``: FlowMatchEuler with the same shift."""
    if not wan22:
        pipe = build_tiny_pipeline("wan-i2v")
    else:
        pipe = WanImageToVideoPipeline(**wan_i2v_components(0, wan22=True))
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.eval()
        pipe.set_progress_bar_config(disable=True)
    if euler:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return pipe


def _shown(source: str, height: int, width: int) -> Image.Image:
    """The image as the adapter gives it to the model: RGB, resized bicubic to the clip's size."""
    image = Image.open(source).convert("RGB")
    return image if image.size == (width, height) else image.resize((width, height), Image.Resampling.BICUBIC)


@pytest.mark.parametrize("wan22,height,width", [(False, 32, 32), (False, 16, 32), (True, 16, 32)])
def test_noise_free_rollout_reproduces_pipe(wan22, height, width):
    pipe = _pipe(wan22=wan22)
    adapter = make_adapter(pipe, num_frames=5)
    assert isinstance(adapter, WanImageToVideoAdapter) and adapter.experts == (2 if wan22 else 1)
    latents = adapter.initial_noise(2, height, width, generator=torch.Generator().manual_seed(0))
    assert latents.shape == (2, 4, 2, height // 4, width // 4)  # the VAE's z_dim; the transformer takes 12
    steps, cfg = 4, 4.0
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=cfg)

    def run(sources: list[str]):
        return rollout(
            adapter,
            PROMPTS,
            [0, 1],
            sampler,
            range(3),
            height=height,
            width=width,
            initial_latents=latents,
            sources=sources,
        )

    traj = run(SOURCES)
    # pipe() takes one image per call: each prompt with its own.
    expected = torch.cat(
        [
            pipe(
                image=_shown(source, height, width),
                prompt=prompt,
                height=height,
                width=width,
                num_frames=5,
                num_inference_steps=steps,
                guidance_scale=cfg,
                latents=latents[i : i + 1].clone(),
                output_type="pt",
            ).frames
            for i, (prompt, source) in enumerate(zip(PROMPTS, SOURCES, strict=True))
        ]
    )
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    assert traj.embeds.source_images.shape == (2, 3, height, width)  # what rewards comparing with the source get
    assert (traj.embeds.source_embeds is None) == wan22  # CLIP image embeddings only where the model reads them
    assert adapter.expert_of(adapter.schedule(steps, height, width)[1]).tolist() == ([0, 1, 1, 1] if wan22 else [0] * 4)
    # The image conditions the clip: another image, another clip.
    again = run(SOURCES[::-1])
    assert (again.images - traj.images).abs().max() > 1e-3


def test_a_step_exactly_on_the_boundary_runs_the_high_noise_expert_as_pipe():
    """UniPC at 4 steps feeds t = 999, 900 | 750, 500, and Wan2.2 I2V's boundary is 0.9 · 1000 = 900: pipe() runs
    ``transformer`` at t = 900 (``t >= boundary``). Our rollout on the UniPC schedule against pipe() taking Euler steps
    on the same sigmas and timesteps: the same expert at every forward, and the same clip."""
    pipe = _pipe(wan22=True, euler=False)
    adapter = make_adapter(pipe, num_frames=5)
    sigmas, timesteps = adapter.schedule(4, 16, 32)
    assert timesteps.tolist() == [999, 900, 750, 500] and pipe.config.boundary_ratio * 1000 == 900.0
    latents = adapter.initial_noise(1, 16, 32, generator=torch.Generator().manual_seed(0))
    log: list[str] = []
    handles = [
        getattr(pipe, name).register_forward_pre_hook(lambda *_, name=name: log.append(name))
        for name in ("transformer", "transformer_2")
    ]
    sampler = SamplerConfig(noise_level=0.0, num_steps=4, guidance_scale=4.0)
    traj = rollout(
        adapter, PROMPTS[:1], [0], sampler, range(0), height=16, width=32, initial_latents=latents, sources=SOURCES[:1]
    )
    ours = list(log)
    log.clear()
    euler = FlowMatchEulerDiscreteScheduler()  # pipe()'s Euler step, x + (σ' − σ) v, on UniPC's grid

    def on_unipc_grid(num_inference_steps: int, device=None, **_) -> None:
        assert num_inference_steps == 4
        euler.sigmas, euler.timesteps = sigmas.clone(), timesteps.float()
        euler._step_index = euler._begin_index = None

    euler.set_timesteps = on_unipc_grid
    pipe.scheduler = euler
    call = dict(prompt=PROMPTS[0], height=16, width=32, num_frames=5, num_inference_steps=4, guidance_scale=4.0)
    expected = pipe(image=_shown(SOURCES[0], 16, 32), **call, latents=latents.clone(), output_type="pt").frames
    for handle in handles:
        handle.remove()
    assert log == ours == ["transformer"] * 4 + ["transformer_2"] * 4  # t = 900: the high-noise expert, CFG's 2
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)


def test_condition_and_image_embeddings_are_the_pipelines():
    pipe = _pipe()
    adapter = make_adapter(pipe, num_frames=9)
    embeds = adapter.encode_conditions(PROMPTS, sources=SOURCES, height=16, width=32)
    for i, source in enumerate(SOURCES):
        image = _shown(source, 16, 32)
        pixels = pipe.video_processor.preprocess(image, height=16, width=32)
        _, condition = pipe.prepare_latents(pixels, 1, 4, 16, 32, 9, torch.float32, torch.device("cpu"))
        assert condition.shape == (1, 4 + 4, 3, 4, 8)  # mask (4) + image latents (z 4), 3 latent frames
        torch.testing.assert_close(embeds.source_latents[i : i + 1], condition, rtol=0, atol=1e-6)
        assert condition[0, :4, 0].eq(1).all() and condition[0, :4, 1:].eq(0).all()  # the first latent frame is given
        torch.testing.assert_close(embeds.source_embeds[i : i + 1], pipe.encode_image(image), rtol=0, atol=1e-6)
    assert embeds.source_embeds.shape == (2, 17, 16)  # CLIP's penultimate hidden states: 16 patches + class token
    calls = adapter.source_encoder_calls
    adapter.encode_conditions(PROMPTS[::-1], sources=SOURCES[::-1], height=16, width=32)
    assert adapter.source_encoder_calls == calls  # cached per image and size


@pytest.mark.parametrize("wan22", [False, True], ids=["wan21-clip", "wan22-experts"])
def test_rescoring_gives_ratio_exactly_one(wan22):
    adapter = make_adapter(_pipe(wan22=wan22, euler=False), num_frames=5)  # the hub's UniPC flow sigmas
    sampler = SamplerConfig(kind="euler_maruyama", diffusion="flowgrpo_wan", noise_level=1.0, num_steps=6)
    sampler.guidance_scale, sampler.last_step = 4.0, "sde"
    sources = SOURCES + SOURCES[:1]
    traj = rollout(
        adapter,
        [*PROMPTS, "a red cube"],
        [0, 1, 0],
        sampler,
        range(1, 4),
        torch.Generator().manual_seed(1),
        height=16,
        width=32,
        sources=sources,
    )
    if wan22:
        assert adapter.expert_of(traj.sigmas[0] * 1000).tolist() == [0, 1, 1]  # 937 | 857, 750 (boundary 900)
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])


def test_what_image_to_video_refuses(tmp_path):
    adapter = make_adapter(_pipe(), num_frames=5)
    with pytest.raises(ValueError, match="wan-i2v animates an image: give each prompt its first frame"):
        adapter.encode_conditions(PROMPTS, height=16, width=16)
    with pytest.raises(ConfigError, match="model.max_sequence_length=256: with CLIP image embeddings .* 512"):
        make_adapter(_pipe(), max_sequence_length=256)
    make_adapter(_pipe(wan22=True), max_sequence_length=256)  # no image branch: any length
    ti2v = _pipe()
    ti2v.register_to_config(expand_timesteps=True)
    with pytest.raises(ValueError, match=r"expand_timesteps \(Wan2.2 TI2V-5B's image-to-video.* is not supported"):
        make_adapter(ti2v)
    from flowgrpo.trainer import GRPOTrainer

    text_only = [f"run.output_dir={tmp_path}", "data.train=configs/prompts/tiny_train.txt", "data.test=null"]
    with pytest.raises(DataError, match="wan-i2v edits images and cannot generate from text alone"):
        GRPOTrainer(load_config(TINY, text_only))
    assert not any(tmp_path.iterdir())


def test_two_epochs_resume_exactly_and_export_matches_plain_diffusers(tmp_path):
    from flowgrpo.config import WindowConfig
    from flowgrpo.evaluation import ode_sampler
    from flowgrpo.export import adapter_from_checkpoint, export_checkpoint, run_config

    base = tmp_path / "base"
    build_tiny_pipeline("wan-i2v").save_pretrained(str(base))
    overrides = [
        f"model.pretrained={base}",
        "run.progress=false",
        "train.lr=5e-2",
        "eval.every=0",
        "sampler.num_steps=4",
    ]
    ckpt, a = train_and_resume(TINY, tmp_path, overrides)
    assert any("attn2.add_k_proj.lora_B" in k and a[k].abs().max() > 0 for k in a)  # the image branch trains too

    export_checkpoint(ckpt, tmp_path / "lora")
    export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    config = run_config(ckpt)
    adapter = adapter_from_checkpoint(config, ckpt)
    euler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    adapter.scheduler = adapter.pipe.scheduler = euler
    latents = adapter.initial_noise(1, 32, 32, generator=torch.Generator().manual_seed(0))
    sampler = ode_sampler(config.eval)
    sampler.num_steps, sampler.window = 6, WindowConfig(size=0)
    ours = rollout(
        adapter,
        PROMPTS[:1],
        [0],
        sampler,
        range(0, 0),
        height=32,
        width=32,
        initial_latents=latents,
        sources=SOURCES[1:],
    ).images

    kw = dict(prompt=PROMPTS[0], image=_shown(SOURCES[1], 32, 32), guidance_scale=4.0, num_inference_steps=6)
    kw.update(height=32, width=32, num_frames=5, latents=latents, output_type="pt")
    outputs = {}
    for name, path, lora in [("base", base, False), ("lora", base, True), ("merged", tmp_path / "merged", False)]:
        plain = WanImageToVideoPipeline.from_pretrained(str(path))
        plain.scheduler = euler
        plain.set_progress_bar_config(disable=True)
        if lora:
            plain.load_lora_weights(str(tmp_path / "lora"))
        outputs[name] = plain(**kw).frames
    assert (outputs["base"] - ours).abs().max() > 1e-3  # the adapter really changes the clips
    torch.testing.assert_close(outputs["lora"], ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(outputs["merged"], ours, rtol=0, atol=1e-4)
