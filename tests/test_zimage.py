"""Z-Image (``ZImagePipeline``) through ``ZImageAdapter`` on the tiny offline pipeline: a noise-free rollout equals
``pipe()`` (latents and images, with and without CFG, square and non-square, ``cfg_normalization`` /
``cfg_truncation`` and a dynamic-shift scheduler too), the stored trajectory re-scores to a ratio of exactly 1 for
every sampler, the LoRA targets, refusals, and the trainer's run / resume / export against plain diffusers in a fresh
process.

Guidance: this project's ``guidance_scale`` ``w`` is ``pipe(guidance_scale=w - 1)`` (flowgrpo/adapters/zimage.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline
from resume_helper import export_and_sample, train_and_resume

from flowgrpo.adapters import make_adapter, unwrap
from flowgrpo.adapters.zimage import ZImageAdapter
from flowgrpo.config import SamplerConfig
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_zimage.yaml"
# The last prompt is 34 tokens with the chat template, the others under 32: the transformer pads each caption to a
# multiple of 32, so the rows' sequences differ in length and its attention masks are used.
PROMPTS = [
    'a sign that says "hello"',
    "a red cube",
    "a red cube",
    "a photo of a red cube and a blue ball on a table at night with two green apples and a white cup of coffee",
]


def _adapter(**options) -> ZImageAdapter:
    adapter = make_adapter(build_tiny_pipeline("zimage"), **options)
    assert isinstance(adapter, ZImageAdapter)
    return adapter


def _pipe(adapter: ZImageAdapter, latents: torch.Tensor, output_type: str, **call) -> torch.Tensor:
    # ZImagePipeline writes the chat-templated prompts into the list it is given: hand it a copy each time.
    return adapter.pipe(prompt=list(PROMPTS), latents=latents.clone(), output_type=output_type, **call).images


@pytest.mark.parametrize(
    "steps,pipe_guidance,height,width",
    [(4, 0.0, 32, 32), (3, 0.0, 32, 48), (4, 3.0, 32, 32), (3, 3.0, 32, 48)],
    ids=["nocfg-square", "nocfg-wide", "cfg-square", "cfg-wide"],
)
def test_noise_free_rollout_reproduces_pipe(steps, pipe_guidance, height, width):
    adapter = _adapter()
    latents = adapter.initial_noise(len(PROMPTS), height, width, generator=torch.Generator().manual_seed(0))
    assert latents.shape == (4, 4, height // 2, width // 2) and latents.dtype == torch.float32  # [B, C, H/f, W/f]
    call = dict(guidance_scale=pipe_guidance, num_inference_steps=steps, height=height, width=width)
    expected_latents = _pipe(adapter, latents, "latent", **call)
    expected = _pipe(adapter, latents, "pt", **call)
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=pipe_guidance + 1)  # w = g + 1
    traj = rollout(
        adapter,
        PROMPTS,
        [0, 1, 1, 2],
        sampler,
        range(0, steps - 1),
        height=height,
        width=width,
        initial_latents=latents,
    )
    # Measured on a Xeon CPU: both exactly equal (max |diff| 0.0).
    torch.testing.assert_close(traj.final_latents, expected_latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    assert traj.images.shape == (4, 3, height, width)
    # pipe()'s own schedule: float32 torch.linspace sigmas, the checkpoint's static shift 3.
    assert torch.equal(adapter.schedule(steps, height, width)[0], adapter.pipe.scheduler.sigmas)
    embeds = traj.embeds
    lengths = embeds.mask.sum(dim=1).tolist()
    assert embeds.pooled is None and lengths[1] < 32 < lengths[3]  # each prompt at its own length
    assert (embeds.negative_embeds is not None) == (pipe_guidance > 0)
    if pipe_guidance > 0:  # CFG really changes the images
        plain = _pipe(adapter, latents, "latent", **{**call, "guidance_scale": 0.0})
        assert (plain - expected_latents).abs().max() > 1e-3


def test_cfg_normalization_truncation_and_a_dynamic_shift_match_pipe():
    options = dict(cfg_normalization=1.0, cfg_truncation=0.6)
    adapter = _adapter(**options)
    dynamic = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    adapter.pipe.scheduler = adapter.scheduler = dynamic  # mu from the token count, as FLUX
    steps, height, width = 5, 48, 32
    latents = adapter.initial_noise(len(PROMPTS), height, width, generator=torch.Generator().manual_seed(2))
    call = dict(guidance_scale=3.0, num_inference_steps=steps, height=height, width=width)
    expected = _pipe(adapter, latents, "latent", **call, **options)
    sigmas = adapter.schedule(steps, height, width)[0]
    assert torch.equal(sigmas, adapter.pipe.scheduler.sigmas)
    truncated = ((1000 - sigmas[:-1] * 1000) / 1000 > 0.6).sum()
    assert 0 < truncated < steps  # some steps really run without CFG
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=4.0)
    run = dict(height=height, width=width, initial_latents=latents, decode=False)
    traj = rollout(adapter, PROMPTS, [0, 1, 1, 2], sampler, range(0, 0), **run)
    torch.testing.assert_close(traj.final_latents, expected, rtol=0, atol=1e-5)
    # Without the options: another result (the cap and the truncation both act here).
    plain = _pipe(adapter, latents, "latent", **call)
    assert (plain - expected).abs().max() > 1e-3
    adapter.cfg_normalization, adapter.cfg_truncation = 0.0, 1.0
    torch.testing.assert_close(
        rollout(adapter, PROMPTS, [0, 1, 1, 2], sampler, range(0, 0), **run).final_latents, plain
    )


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
def test_rescoring_the_stored_trajectory_gives_ratio_exactly_one(sampler_kwargs):
    adapter = _adapter()
    sampler = SamplerConfig(**{"noise_level": 0.7, "num_steps": 5, "guidance_scale": 4.0, **sampler_kwargs})
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1, 2], sampler, range(1, 3), torch.Generator().manual_seed(1), height=32, width=48
    )
    assert traj.latents.shape == (4, 2, 4, 16, 24) and traj.latents.dtype == torch.float32
    assert torch.isfinite(traj.log_probs).all() and (traj.stds > 0).all()
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])
    positions = torch.tensor([1, 0, 0, 1])  # per-sample window positions (shuffled timesteps)
    with torch.no_grad():
        again = evaluate_transitions(adapter, traj, positions, sampler)
    assert torch.equal(again.log_prob, traj.log_probs[torch.arange(4), positions])


def test_lora_targets_are_every_blocks_attention_and_feed_forward():
    adapter = _adapter()
    model = unwrap(adapter.transformer)
    blocks = [f"{stack}.{i}" for stack in ("noise_refiner", "context_refiner", "layers") for i in range(2)]
    blocks = [b for b in blocks if any(n.startswith(b + ".") for n, _ in model.named_modules())]
    assert len(blocks) == 4  # the tiny model: one block in each refiner, two main blocks
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    in_blocks = {n for n in linears if n.startswith(tuple(f"{b}." for b in blocks))}
    # Every Linear of the blocks but their adaLN modulation; nothing outside them (embedders, final layer).
    expected = {n for n in in_blocks if "adaLN_modulation" not in n}
    assert expected == {f"{b}.{target}" for b in blocks for target in ZImageAdapter.default_lora_targets}
    adapter.add_lora(rank=2, alpha=2)
    assert {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n} == expected
    # The gradient reaches every LoRA weight (none is left out of the graph, which DDP would refuse).
    sampler = SamplerConfig(noise_level=0.7, num_steps=3, guidance_scale=4.0)
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1, 2], sampler, range(0, 2), torch.Generator().manual_seed(0), height=32, width=32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    evaluate_transitions(adapter, traj, 1, sampler).log_prob.mean().backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and p.grad is not None and p.grad.abs().sum() > 0 for n, p in trainable)


def test_unsupported_pipelines_sizes_and_options_are_refused():
    for name in ("ZImageImg2ImgPipeline", "ZImageOmniPipeline", "ZImageControlNetPipeline"):
        with pytest.raises(ValueError, match=f"{name} is not supported yet.*ZImagePipeline"):
            make_adapter(type(name, (), {})())
    with pytest.raises(ValueError, match="vae='kl'"):
        build_tiny_pipeline("zimage", vae="tiny")
    with pytest.raises(ValueError, match="multiples of 4"):
        _adapter().latent_shape(30, 32)
    with pytest.raises(ValueError, match="max_sequence_length must be >= 1"):
        _adapter(max_sequence_length=0)
    with pytest.raises(ValueError, match="cfg_normalization must be >= 0"):
        _adapter(cfg_normalization=-1.0)
    pipe = build_tiny_pipeline("zimage")
    pipe.transformer.register_to_config(all_patch_size=(4,))
    with pytest.raises(ValueError, match="patch size 2"):
        ZImageAdapter(pipe)


def _plain_diffusers(path: Path, prompts: list[str], latents: torch.Tensor, lora: Path | None = None) -> torch.Tensor:
    """``ZImagePipeline.from_pretrained`` (+ ``load_lora_weights``) and ``pipe()``: diffusers alone, no flowgrpo code
    between the files and the images (in this process: an interpreter start would cost most of the test's time)."""
    pipe = ZImagePipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    call = dict(guidance_scale=3.0, num_inference_steps=4, height=32, width=32, output_type="pt")
    return pipe(prompt=list(prompts), latents=latents.clone(), **call).images


def test_train_resume_and_export_match_plain_diffusers(tmp_path):
    from flowgrpo.evaluation import ode_sampler
    from flowgrpo.export import run_config

    base = tmp_path / "base"
    build_tiny_pipeline("zimage", seed=0).save_pretrained(str(base))
    common = [f"model.pretrained={base}", "run.progress=false", "train.lr=5e-2", "grpo.groups_per_epoch=2"]

    ckpt, _ = train_and_resume(TINY, tmp_path, common)
    prompts = ["a red cube", PROMPTS[3]]
    adapter, latents, ours = export_and_sample(ckpt, tmp_path, prompts, steps=4)
    assert ode_sampler(run_config(ckpt).eval).guidance_scale == 4.0  # the config's w = 4: pipe(guidance_scale=3.0)

    base_images = _plain_diffusers(base, prompts, latents)
    assert (base_images - ours).abs().max() > 1e-3  # the adapter really changes the images
    torch.testing.assert_close(_plain_diffusers(base, prompts, latents, tmp_path / "lora"), ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(_plain_diffusers(tmp_path / "merged", prompts, latents), ours, rtol=0, atol=1e-4)
    assert isinstance(adapter.pipe, ZImagePipeline)
