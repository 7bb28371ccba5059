"""LTX-2 text-to-video (``LTX2Pipeline``) through ``LTX2Adapter`` on the tiny offline pipeline: a noise-free rollout
equals ``pipe()`` on the video latents, the audio latents and the decoded clips (with and without CFG, square and not),
the video really depends on the audio stream (why the adapter carries it), the velocity is ``pipe()``'s x0-space CFG by
hand, re-scoring gives ratio exactly 1, the LoRA targets are the LTX-2 trainer's video-only list, the refusals, and two
epochs of the trainer resumed exactly and exported to plain diffusers' ``load_lora_weights``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import LTX2Pipeline
from diffusers.utils import logging as diffusers_logging
from resume_helper import export_and_sample, train_and_resume

from flowgrpo.adapters import make_adapter
from flowgrpo.adapters.ltx2 import VIDEO_ATTENTION, LTX2Adapter
from flowgrpo.checks import ConfigError
from flowgrpo.config import SamplerConfig
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline, ltx2_components

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_ltx2.yaml"
PROMPTS = ['a sign that says "hello"', "a red cube", "a red cube"]
# pipe()'s guidance terms the adapter does not run, off; the audio stream guided by the video's scale (module docstring)
PLAIN_CFG = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0)
PLAIN_CFG.update(guidance_rescale=0.0, audio_guidance_rescale=0.0)


@pytest.fixture(scope="module")
def adapter() -> LTX2Adapter:
    diffusers_logging.set_verbosity_error()  # pipe(latents=packed) warns that it cannot infer the sizes (given here)
    return make_adapter(build_tiny_pipeline("ltx2"), num_frames=5)


def _pipe(adapter: LTX2Adapter, latents: torch.Tensor, cfg: float, steps: int, height: int, width: int, kind: str):
    """``pipe()`` from the adapter's joint latents: the video tokens as ``latents`` (packed: used as they are), the
    audio tokens as ``audio_latents`` (pipe() normalises them by the audio VAE's statistics, 0 and 1 here)."""
    pipe = adapter.pipe
    assert pipe.audio_vae.latents_mean.eq(0).all() and pipe.audio_vae.latents_std.eq(1).all()
    video, audio = adapter.split(latents)
    call = dict(prompt=PROMPTS, guidance_scale=cfg, audio_guidance_scale=cfg, num_inference_steps=steps, **PLAIN_CFG)
    call.update(height=height, width=width, num_frames=adapter.num_frames)
    return pipe(**call, latents=video.clone(), audio_latents=audio.clone(), output_type=kind)


@pytest.mark.parametrize(
    "steps,cfg,height,width", [(3, 1.0, 32, 32), (3, 3.0, 32, 64), (2, 4.0, 64, 32)], ids=["nocfg", "cfg-wide", "tall"]
)
def test_noise_free_rollout_reproduces_pipe(adapter, steps, cfg, height, width):
    pipe = adapter.pipe
    latents = adapter.initial_noise(3, height, width, generator=torch.Generator().manual_seed(0))
    video_tokens = 2 * (height // 4) * (width // 4)  # F' = 2 latent frames of the tiny VAE's factor-4 grid
    assert latents.shape == (3, video_tokens + 5, 4) and adapter.audio_tokens == 5  # round(5 / 24 · 100 / 4) = 5
    expected = _pipe(adapter, latents, cfg, steps, height, width, "latent")
    frames = _pipe(adapter, latents, cfg, steps, height, width, "pt").frames
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=cfg)
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1], sampler, range(0, steps - 1), height=height, width=width, initial_latents=latents
    )
    vae = pipe.vae
    ours = pipe._denormalize_latents(
        adapter.video_latents(traj.final_latents, height, width), vae.latents_mean, vae.latents_std, 0.9
    )
    assert ours.shape == expected.frames.shape == (3, 4, 2, height // 4, width // 4)
    audio = pipe._unpack_audio_latents(adapter.split(traj.final_latents)[1], 5, num_mel_bins=2)
    torch.testing.assert_close(ours, expected.frames, rtol=0, atol=1e-5)
    torch.testing.assert_close(audio, expected.audio, rtol=0, atol=1e-5)
    assert traj.images.shape == frames.shape == (3, 5, 3, height, width)
    torch.testing.assert_close(traj.images, frames, rtol=0, atol=1e-5)
    # the schedule is pipe()'s dynamic shift at the video tokens alone: mu = calculate_shift(video tokens, 1024, ...)
    sigmas = adapter.schedule(steps, height, width)[0]
    mu = 0.95 + (video_tokens - 1024) * (2.05 - 0.95) / (4096 - 1024)
    base = torch.linspace(1, 1 / steps, steps, dtype=torch.float64)
    shifted = torch.exp(torch.tensor(mu)) / (torch.exp(torch.tensor(mu)) + (1 / base - 1))
    torch.testing.assert_close(sigmas[:-1].double(), shifted, rtol=0, atol=1e-6)


def test_velocity_is_pipes_x0_space_cfg_and_the_video_depends_on_the_audio(adapter):
    pipe = adapter.pipe
    x = adapter.initial_noise(2, 32, 32, generator=torch.Generator().manual_seed(3))
    embeds = adapter.encode_conditions(PROMPTS[:2], with_negative=True, height=32, width=32)
    sigma = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        v = adapter.velocity(x, sigma, embeds, 3.0)
        # by hand: both streams through the transformer, negative and conditional, as pipe() calls it
        outs = []
        for text in (embeds.prompt_embeds, embeds.negative_embeds):
            video, audio = adapter.split(x)
            out = pipe.transformer(
                hidden_states=video,
                audio_hidden_states=audio,
                encoder_hidden_states=text[..., :16],
                audio_encoder_hidden_states=text[..., 16:],
                timestep=sigma * 1000,
                sigma=sigma * 1000,
                encoder_attention_mask=embeds.mask,
                audio_encoder_attention_mask=embeds.mask,
                num_frames=2,
                height=8,
                width=8,
                fps=24.0,
                audio_num_frames=5,
                use_cross_timestep=True,
                return_dict=False,
            )
            outs.append(torch.cat(out, dim=1))
        cond, uncond = outs
        torch.testing.assert_close(v, uncond + 3.0 * (cond - uncond), rtol=0, atol=1e-5)  # = x0-space CFG, exactly
        # the video tokens' velocity changes with the audio tokens alone: a video-only rollout could not be pipe()'s
        other = x.clone()
        other[:, -5:] = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(4))
        changed = adapter.velocity(other, sigma, embeds, 3.0)
    assert (changed[:, :-5] - v[:, :-5]).abs().max() > 1e-4


@pytest.mark.parametrize(
    "sampler_kwargs",
    [{"kind": "euler_maruyama", "diffusion": "flowgrpo_wan", "noise_level": 1.0, "last_step": "sde"}, {"kind": "cps"}],
    ids=["flowgrpo_wan", "cps"],
)
def test_rescoring_gives_ratio_exactly_one(adapter, sampler_kwargs):
    sampler = SamplerConfig(**{"noise_level": 0.7, "num_steps": 3, "guidance_scale": 3.0, **sampler_kwargs})
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1], sampler, range(0, 2), torch.Generator().manual_seed(1), height=32, width=64
    )
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])


def test_lora_targets_are_the_ltx2_trainers_video_attention():
    # packages/ltx-trainer/docs/configuration-reference.md (Lightricks/LTX-2 @ec11c16), "For video-only training"
    listed = ("attn1.to_k", "attn1.to_q", "attn1.to_v", "attn1.to_out.0")
    listed += ("attn2.to_k", "attn2.to_q", "attn2.to_v", "attn2.to_out.0")
    assert LTX2Adapter.default_lora_targets == VIDEO_ATTENTION == listed
    adapter = make_adapter(build_tiny_pipeline("ltx2"), num_frames=5)
    adapter.add_lora(rank=2, alpha=4)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, p in adapter.transformer.named_parameters() if ".lora_A" in n}
    want = {f"transformer_blocks.{i}.{target}" for i in range(2) for target in VIDEO_ATTENTION}
    assert adapted == want  # not audio_attn1 / audio_attn2 / the cross-modal attentions, whose names end alike


def test_refusals():
    pipe = build_tiny_pipeline("ltx2")
    with pytest.raises(ConfigError, match=r"model\.num_frames=6 is not a frame count .* 4k \+ 1"):
        LTX2Adapter(pipe, num_frames=6)
    adapter = LTX2Adapter(pipe, num_frames=9)
    assert adapter.latent_frames == 3 and adapter.audio_tokens == round(9 / 24 * 25)
    with pytest.raises(ValueError, match=r"ltx2: height and width must be positive multiples of 32 .* got 32x48"):
        adapter.latent_shape(32, 48)  # LTX2Pipeline.check_inputs refuses 48 too
    with pytest.raises(ValueError, match="ltx2 generates from text alone"):
        adapter.encode_conditions(PROMPTS[:1], sources=["x.png"], height=32, width=32)
    components = ltx2_components(0)
    components["audio_vae"] = type(components["audio_vae"])(**{**components["audio_vae"].config, "latent_channels": 4})
    with pytest.raises(ValueError, match="video tokens have 4 features and its audio tokens 8"):
        LTX2Adapter(LTX2Pipeline(**components), num_frames=5)
    components = ltx2_components(0)
    components["transformer"] = type(components["transformer"])(**{**components["transformer"].config, "patch_size": 2})
    with pytest.raises(ValueError, match=r"patch_size=2, patch_size_t=1 is not supported"):
        LTX2Adapter(LTX2Pipeline(**components), num_frames=5)


def test_two_epochs_resume_exactly_and_export_matches_plain_diffusers(tmp_path, monkeypatch):
    monkeypatch.setattr("flowgrpo.trainer.write_curves", lambda run_dir: None)  # matplotlib: most of the time here
    monkeypatch.setattr("flowgrpo.trainer.write_before_after", lambda run_dir: None)
    overrides = ["run.progress=false", "train.lr=5e-2", "eval.every=0", "sampler.num_steps=2", "sampler.batch_size=2"]
    overrides += ["grpo.groups_per_epoch=1", "train.batch_size=2", "model.max_sequence_length=64"]
    ckpt, a = train_and_resume(TINY, tmp_path, overrides)
    assert any("attn1.to_q.lora_B" in k and a[k].abs().max() > 0 for k in a)
    assert not any("audio" in k for k in a)  # the video attention only

    prompts = PROMPTS[1:]
    adapter, latents, ours = export_and_sample(ckpt, tmp_path, prompts, steps=4)
    video, audio = adapter.split(latents)
    kw = dict(prompt=prompts, guidance_scale=3.0, audio_guidance_scale=3.0, num_inference_steps=4, **PLAIN_CFG)
    kw.update(height=32, width=32, num_frames=5, max_sequence_length=64, output_type="pt")
    kw.update(latents=video, audio_latents=audio)
    outputs = {}
    for name in ("base", "lora", "merged"):
        plain = LTX2Pipeline.from_pretrained(str(tmp_path / "merged")) if name == "merged" else None
        plain = plain or build_tiny_pipeline("ltx2")
        plain.set_progress_bar_config(disable=True)
        if name == "lora":
            plain.load_lora_weights(str(tmp_path / "lora"))
            assert plain.transformer._hf_peft_config_loaded
        outputs[name] = plain(**kw).frames
    assert (outputs["base"] - ours).abs().max() > 1e-3  # the adapter really changes the clips
    torch.testing.assert_close(outputs["lora"], ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(outputs["merged"], ours, rtol=0, atol=1e-4)
