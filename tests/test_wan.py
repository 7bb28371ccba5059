"""Wan2.1 text-to-video (``WanPipeline``) through ``WanAdapter`` on the tiny offline pipeline: alignment with ``pipe()``
(FlowMatchEuler scheduler, with and without CFG), Flow-GRPO's recipe on the hub's UniPC flow sigmas, the on-policy
ratio for every sampler, frame counts, video rewards (image rewards by frames, whole-clip rewards), the evaluation's
frame grid and GIF, and one epoch of the trainer exported to plain diffusers in a fresh process."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from PIL import Image
from plain_diffusers import run_plain_diffusers
from script_helper import load_script

from flowgrpo.adapters import WanAdapter, make_adapter
from flowgrpo.config import ConfigError, SamplerConfig, load_config
from flowgrpo.evaluation import image_grid, write_report
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline
from rewards import Brightness, CombinedReward, FrameReward, RewardEntry, build_reward
from samplers import euler_maruyama_step

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_wan.yaml"
PROMPTS = ['a sign that says "hello"', "a red cube", "a red cube"]


def _adapter(*, euler: bool = False, num_frames: int = 5) -> WanAdapter:
    """The tiny pipeline's adapter; ``euler``: its scheduler swapped for FlowMatchEuler with the same shift."""
    pipe = build_tiny_pipeline("wan")
    if euler:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    adapter = make_adapter(pipe, num_frames=num_frames)
    assert isinstance(adapter, WanAdapter)
    return adapter


@pytest.mark.parametrize(
    "steps,cfg,height,width,frames", [(4, 1.0, 32, 32, 5), (3, 4.5, 16, 32, 9)], ids=["nocfg", "cfg-wide-9frames"]
)
def test_noise_free_rollout_reproduces_pipe(steps, cfg, height, width, frames):
    # Our samplers are Euler-type: pipe() is reproduced with FlowMatchEulerDiscreteScheduler(shift=flow_shift).
    adapter = _adapter(euler=True, num_frames=frames)
    latents = adapter.initial_noise(len(PROMPTS), height, width, generator=torch.Generator().manual_seed(0))
    assert latents.shape == (3, 4, (frames - 1) // 4 + 1, height // 4, width // 4)  # [B, C, F', H/4, W/4]
    call = dict(
        prompt=PROMPTS, guidance_scale=cfg, num_inference_steps=steps, height=height, width=width, num_frames=frames
    )
    expected = adapter.pipe(**call, latents=latents.clone(), output_type="pt").frames
    expected_latents = adapter.pipe(**call, latents=latents.clone(), output_type="latent").frames
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=cfg)
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1], sampler, range(0, steps - 1), height=height, width=width, initial_latents=latents
    )
    assert traj.images.shape == (3, frames, 3, height, width)  # clips [B, F, 3, H, W]
    torch.testing.assert_close(traj.final_latents, expected_latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    assert torch.equal(adapter.schedule(steps, height, width)[0], adapter.pipe.scheduler.sigmas)
    assert (traj.embeds.negative_embeds is not None) == (cfg > 1)
    assert traj.embeds.pooled is None
    assert (traj.images[:, 0] - traj.images[:, -1]).abs().max() > 1e-3  # the frames really differ


def test_unipc_checkpoints_step_on_their_flow_sigmas_and_integer_timesteps():
    """The hub's UniPC scheduler: its sigmas and timesteps, Euler steps on them (Flow-GRPO's train_wan2_1.py)."""
    adapter = _adapter()
    steps, cfg = 4, 4.5
    sigmas, timesteps = adapter.schedule(steps, 32, 32)
    reference = copy.deepcopy(adapter.pipe.scheduler)
    reference.set_timesteps(steps)
    assert torch.equal(sigmas, reference.sigmas) and torch.equal(timesteps, reference.timesteps)
    assert timesteps.dtype == torch.int64 and sigmas[-1] == 0
    latents = adapter.initial_noise(3, 32, 32, generator=torch.Generator().manual_seed(2))
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=cfg)
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1], sampler, range(0, 0), height=32, width=32, initial_latents=latents, decode=False
    )
    # By hand: pipe()'s CFG on the transformer fed the scheduler's integer timesteps, x + (σ' - σ) v.
    pipe = adapter.pipe
    text, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=512)  # pipe()'s
    empty, _ = pipe.encode_prompt([""] * 3, do_classifier_free_guidance=False, max_sequence_length=512)
    x = latents.clone()
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            t = t.expand(3)
            cond = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
            uncond = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=empty, return_dict=False)[0]
            x = x + (sigmas[i + 1] - sigmas[i]) * (uncond + cfg * (cond - uncond))
    torch.testing.assert_close(traj.final_latents, x, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "sampler_kwargs",
    [
        {"kind": "euler_maruyama"},
        {"kind": "euler_maruyama", "diffusion": "flowgrpo_wan", "noise_level": 1.0, "last_step": "sde"},
        {"kind": "euler_maruyama", "diffusion": "dance", "noise_level": 0.3},
        {"kind": "cps"},
        {"kind": "langevin"},
        {"kind": "langevin", "score_eval": "reeval"},
    ],
    ids=["em", "flowgrpo_wan", "dance", "cps", "lc_frozen", "lc_reeval"],
)
def test_rescoring_the_stored_trajectory_gives_ratio_exactly_one(sampler_kwargs):
    adapter = _adapter()
    sampler = SamplerConfig(**{"noise_level": 0.7, "num_steps": 5, "guidance_scale": 4.5, **sampler_kwargs})
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1], sampler, range(1, 3), torch.Generator().manual_seed(1), height=32, width=32
    )
    assert traj.latents.shape == (3, 2, 4, 2, 8, 8)  # [B, W, C, F', h, w]: the frame axis is part of the latents
    assert torch.isfinite(traj.log_probs).all() and (traj.stds > 0).all()
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])
    positions = torch.tensor([1, 0, 1])  # per-sample window positions (shuffled timesteps)
    with torch.no_grad():
        again = evaluate_transitions(adapter, traj, positions, sampler)
    assert torch.equal(again.log_prob, traj.log_probs[torch.arange(3), positions])


def test_flowgrpo_wan_diffusion_is_the_reference_step():
    """sde_step_with_logprob of Flow-GRPO's Wan script: std_dev_t = sigmas[1]·σ, its mean and log-prob."""
    generator = torch.Generator().manual_seed(0)
    x, v, prev = (torch.randn(2, 4, 3, 4, 4, generator=generator) for _ in range(3))
    sigma, sigma_next, sigma_max = 0.75, 0.5, 0.9
    step = euler_maruyama_step(
        v, x, sigma, sigma_next, noise_level=1.0, diffusion="flowgrpo_wan", t_second=sigma_max, prev_sample=prev
    )
    dt = torch.tensor(sigma_next - sigma)
    std_dev_t = sigma_max * sigma
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_dev_t * torch.sqrt(-dt)
    log_prob = -((prev - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    torch.testing.assert_close(step.mean, mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(step.std.expand_as(x), std.expand_as(x), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(step.log_prob, log_prob.mean(dim=(1, 2, 3, 4)), rtol=1e-5, atol=1e-5)


def test_frame_counts_and_unsupported_pipelines_are_refused():
    with pytest.raises(ConfigError, match=r"model.num_frames=6 .* 4k \+ 1 .* nearest valid values are 5 and 9"):
        load_config(TINY, ["model.num_frames=6"])
    with pytest.raises(ConfigError, match="model.kind=sd3 generates images"):
        load_config(TINY, ["model.kind=sd3", "model.pretrained=tiny-sd3"])
    with pytest.raises(ValueError, match=r"num_frames must be a positive frame count 4k \+ 1 .*got 0"):
        _adapter(num_frames=0)
    assert _adapter(num_frames=9).latent_shape(32, 48) == (4, 3, 8, 12)
    with pytest.raises(ValueError, match="model.num_frames is for video pipelines"):
        make_adapter(build_tiny_pipeline("sd3"), num_frames=5)
    with pytest.raises(ValueError, match="WanVideoToVideoPipeline is not supported yet"):
        make_adapter(type("WanVideoToVideoPipeline", (), {})())
    pipe = build_tiny_pipeline("wan")
    pipe.register_to_config(boundary_ratio=0.875)  # Wan2.2's two experts
    with pytest.raises(ValueError, match="Wan2.2"):
        WanAdapter(pipe)
    with pytest.raises(ValueError, match="multiples of 16"):
        _adapter().latent_shape(24, 32)


class _ClipReward:
    """A reward that takes whole clips: the brightness change from the first frame to the last."""

    takes_video = True

    def __call__(self, images, prompts, metadata=None):
        assert images.ndim == 5
        return images[:, -1].mean(dim=(1, 2, 3)) - images[:, 0].mean(dim=(1, 2, 3))


def test_image_rewards_score_videos_by_frames_and_clip_rewards_get_the_clip():
    videos = torch.rand(2, 5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    videos[1, 2] = 0.0  # a dark frame
    per_frame = videos.mean(dim=(2, 3, 4))  # [B, F] brightness of each frame
    prompts = ["a", "b"]
    scores = CombinedReward([RewardEntry("brightness", 1.0, Brightness()), RewardEntry("clip", 0.5, _ClipReward())])(
        videos, prompts
    )
    torch.testing.assert_close(scores["brightness"], per_frame.mean(dim=1).float())  # the mean over every frame
    clip = (per_frame[:, -1] - per_frame[:, 0]).float()
    torch.testing.assert_close(scores["clip"], clip)
    torch.testing.assert_close(scores["total"], (per_frame.mean(dim=1) + 0.5 * clip).float())
    # The frames option: every 2nd frame, the mean over frames scoring above 0 (Flow-GRPO's video OCR reduction).
    spec = [{"name": "brightness", "frames": {"every": 2, "reduce": "positive_mean"}}]
    picked = per_frame[:, ::2]  # frames 0, 2, 4; clip 1's frame 2 scores 0 and is left out
    expected = torch.stack([picked[0].mean(), picked[1, [0, 2]].mean()]).float()
    torch.testing.assert_close(build_reward(spec)(videos, prompts)["brightness"], expected)
    torch.testing.assert_close(
        FrameReward(Brightness(), reduce="min")(videos, prompts)["brightness"], per_frame.min(dim=1).values.float()
    )
    with pytest.raises(ValueError, match="frames: unknown option"):
        build_reward([{"name": "brightness", "frames": {"stride": 2}}])
    with pytest.raises(ValueError, match="frames.reduce must be one of"):
        build_reward([{"name": "brightness", "frames": {"reduce": "median"}}])
    with pytest.raises(ValueError, match="video batch .*rewards.FrameReward"):
        Brightness()(videos, prompts)  # an image reward called on clips directly says what to do


def test_a_frames_option_on_an_image_model_is_refused_before_any_work(tmp_path):
    from flowgrpo.trainer import GRPOTrainer

    frames = "rewards=[{name: brightness, frames: {every: 2}}]"
    image = load_config(ROOT / "configs" / "tiny_sd3.yaml", [f"run.output_dir={tmp_path}", frames])
    with pytest.raises(ConfigError, match=r"rewards\.brightness\.frames .* sd3 image pipeline: remove the frames"):
        GRPOTrainer(image)
    assert not any(tmp_path.iterdir())  # no run directory: nothing was started
    video = load_config(TINY, [f"run.output_dir={tmp_path}", "run.progress=false", frames])
    assert GRPOTrainer(video).reward.entries[0].reward.every == 2  # a video model takes it


def test_report_writes_a_frame_grid_and_an_animated_gif(tmp_path):
    frames = 5
    videos = torch.linspace(0, 1, frames).view(1, frames, 1, 1, 1).expand(2, frames, 3, 16, 16).clone()
    scores = {"total": torch.tensor([0.5, 0.25])}
    write_report(tmp_path, {"total": 0.375}, videos, ["a", "b"], scores, name="epoch00001")
    grid = Image.open(tmp_path / "epoch00001.png")
    cell = image_grid(videos[:, 0], ["a", "b"])
    assert grid.size == (cell.width * frames, cell.height)  # each cell a filmstrip of the 5 frames
    strip = torch.from_numpy(np.array(grid.convert("L"), dtype=np.int64))[10]
    assert strip[5] < strip[grid.width // 2 // frames * (frames - 1) + 5]  # left to right: frame 0 ... frame 4
    gif = Image.open(tmp_path / "epoch00001.gif")
    assert gif.n_frames == frames and gif.size == cell.size and gif.info["loop"] == 0
    levels = []
    for f in range(frames):
        gif.seek(f)
        levels.append(gif.convert("L").getpixel((5, 5)))
    assert levels == sorted(levels) and levels[0] < 10 and levels[-1] > 245  # frame f of the GIF is frame f


PLAIN_DIFFUSERS = """
import sys, torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
base, lora, merged, latents_file, prompts, out = sys.argv[1:]
latents, prompts = torch.load(latents_file), prompts.split("|")
kw = dict(prompt=prompts, guidance_scale=4.5, num_inference_steps=6, height=32, width=32, num_frames=5,
          latents=latents, output_type="pt")

def load(path):
    pipe = WanPipeline.from_pretrained(path)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return pipe

pipe = load(base)
pipe.load_lora_weights(lora)
torch.save({"lora": pipe(**kw).frames, "merged": load(merged)(**kw).frames, "base": load(base)(**kw).frames}, out)
"""


def test_one_epoch_on_video_then_export_matches_plain_diffusers(tmp_path):
    from flowgrpo.checkpoint import list_checkpoints
    from flowgrpo.config import WindowConfig
    from flowgrpo.evaluation import ode_sampler
    from flowgrpo.export import adapter_from_checkpoint, export_checkpoint, run_config
    from flowgrpo.pipelines import detect_kind, load_pipeline, pipeline_kind
    from flowgrpo.trainer import GRPOTrainer

    script = load_script("make_tiny_pipeline")
    base = tmp_path / "base"
    assert script.main([str(base), "--kind", "wan"]) == 0  # scripts/make_tiny_pipeline.py --kind wan
    assert detect_kind(str(base)) == "wan" and pipeline_kind(load_pipeline("tiny-wan", dtype="fp32")) == "wan"
    overrides = [
        f"model.pretrained={base}",
        f"run.output_dir={tmp_path / 'runs'}",
        "run.epochs=1",
        "run.progress=false",
        "train.lr=5e-2",
    ]
    trainer = GRPOTrainer(load_config(TINY, overrides))
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = rows[-1]
    assert trained["train/onpolicy_ratio_dev"] == 0.0 and trained["global_step"] > 0
    assert trained["reward/brightness/std"] > 0  # brightness averaged over each clip's frames varies over the group
    eval_dir = trainer.run_dir / "eval"
    assert Image.open(eval_dir / "epoch00001.gif").n_frames == 5 and (eval_dir / "epoch00001.png").is_file()
    assert (trainer.run_dir / "samples" / "epoch00000.png").is_file()  # the sampled groups' frame grid

    ckpt = list_checkpoints(trainer.run_dir)[-1]
    export_checkpoint(ckpt, tmp_path / "lora")
    export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    adapter = adapter_from_checkpoint(run_config(ckpt), ckpt)
    adapter.scheduler = adapter.pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # as the script below
    prompts = ["a red cube", PROMPTS[0]]
    latents = adapter.initial_noise(2, 32, 32, generator=torch.Generator().manual_seed(0))
    sampler = ode_sampler(run_config(ckpt).eval)
    sampler.num_steps, sampler.window = 6, WindowConfig(size=0)
    ours = rollout(adapter, prompts, [0, 1], sampler, range(0, 0), height=32, width=32, initial_latents=latents).images

    videos = run_plain_diffusers(
        PLAIN_DIFFUSERS, base, tmp_path / "lora", tmp_path / "merged", latents, prompts, tmp_path
    )
    assert (videos["base"] - ours).abs().max() > 1e-3  # the adapter really changes the clips
    torch.testing.assert_close(videos["lora"], ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(videos["merged"], ours, rtol=0, atol=1e-4)
    assert isinstance(adapter.pipe, WanPipeline)


def test_latents_stay_float32_under_a_bf16_model_and_a_nonzero_last_sigma_is_refused():
    """As WanPipeline: float32 latents and steps whatever the transformer's dtype (only its input is cast)."""
    pipe = build_tiny_pipeline("wan").to(torch.bfloat16)
    adapter = make_adapter(pipe, num_frames=5)
    sampler = SamplerConfig(noise_level=0.7, num_steps=3, guidance_scale=1.0)
    traj = rollout(
        adapter, PROMPTS[:2], [0, 1], sampler, range(0, 2), torch.Generator().manual_seed(0), height=16, width=16
    )
    assert adapter.dtype == torch.bfloat16
    assert traj.latents.dtype == traj.next_latents.dtype == traj.final_latents.dtype == torch.float32
    assert traj.latents.flatten(1).std(1).min() > 0.5  # the initial noise itself, not rounded to bf16
    with torch.no_grad():
        again = evaluate_transitions(adapter, traj, 1, sampler)
    assert torch.equal(again.log_prob, traj.log_probs[:, 1])
    adapter.scheduler = copy.deepcopy(adapter.scheduler)
    adapter.scheduler.register_to_config(final_sigmas_type="sigma_min")
    with pytest.raises(ValueError, match="last sigma is .*final_sigmas_type"):
        adapter.schedule(3, 16, 16)
