"""Wan2.2 text-to-video (``WanPipeline``) through ``WanAdapter`` on tiny offline pipelines: A14B's two experts
(``transformer`` above the boundary timestep, ``transformer_2`` below it, ``guidance_scale_2`` on the low-noise one)
and TI2V-5B's per-token timesteps (``expand_timesteps``, the Wan2.2 VAE). Each: a noise-free rollout equals
``pipe()`` (the same expert at every step), re-scoring the stored trajectory gives ratio exactly 1 on steps of
either expert, LoRA on both experts or one, and two epochs of the trainer resumed exactly and exported to plain
diffusers (one LoRA file per expert, ``load_into_transformer_2``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from resume_helper import train_and_resume

from flowgrpo.adapters import WanAdapter, make_adapter
from flowgrpo.adapters.wan import WanExperts
from flowgrpo.config import ConfigError, SamplerConfig, load_config
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline, wan22_components

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_wan.yaml"
PROMPTS = ['a sign that says "hello"', "a red cube", "a red cube"]


def _pipe(*, ti2v: bool = False, euler: bool = True) -> WanPipeline:
    """A tiny Wan2.2 pipeline (A14B's two experts, or ``ti2v``: TI2V-5B's layout) in eval mode; ``euler``: its UniPC
    scheduler swapped for FlowMatchEuler with the same shift (our steps are Euler-type: pipe() is matched on it)."""
    pipe = WanPipeline(**wan22_components(0, ti2v=ti2v))
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    if euler:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return pipe


def _record_experts(pipe: WanPipeline) -> tuple[list[tuple[str, tuple[int, ...]]], list]:
    """Hooks on both experts that log (expert, timestep shape) of every forward; returns (log, hook handles)."""
    log: list[tuple[str, tuple[int, ...]]] = []
    handles = []
    for name in ("transformer", "transformer_2"):
        module = getattr(pipe, name)
        if module is None:
            continue
        hook = lambda _m, _a, kwargs, name=name: log.append((name, tuple(kwargs["timestep"].shape)))  # noqa: E731
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return log, handles


@pytest.mark.parametrize(
    "steps,cfg,cfg2,height,width,frames",
    [(4, 4.5, 2.0, 32, 32, 5), (5, 1.0, None, 16, 32, 9)],
    ids=["cfg-square", "nocfg-wide-9frames"],
)
def test_two_experts_noise_free_rollout_reproduces_pipe(steps, cfg, cfg2, height, width, frames):
    pipe = _pipe()
    adapter = make_adapter(pipe, num_frames=frames, guidance_scale_2=cfg2)
    experts = adapter.transformer
    assert isinstance(experts, WanExperts) and adapter.experts == 2
    assert experts.transformer is pipe.transformer and experts.transformer_2 is pipe.transformer_2
    latents = adapter.initial_noise(3, height, width, generator=torch.Generator().manual_seed(0))
    call = dict(
        prompt=PROMPTS, guidance_scale=cfg, num_inference_steps=steps, height=height, width=width, num_frames=frames
    )
    log, handles = _record_experts(pipe)
    expected = pipe(**call, guidance_scale_2=cfg2, latents=latents.clone(), output_type="pt").frames
    pipe_experts = list(log)
    expected_latents = pipe(**call, guidance_scale_2=cfg2, latents=latents.clone(), output_type="latent").frames
    log.clear()
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=cfg)
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1], sampler, range(0, steps - 1), height=height, width=width, initial_latents=latents
    )
    for handle in handles:
        handle.remove()
    assert log == pipe_experts  # the same expert at every step (and CFG's second forward on it)
    assert {name for name, _ in log} == {"transformer", "transformer_2"}  # both experts ran
    timesteps = adapter.schedule(steps, height, width)[1]
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    assert adapter.expert_of(timesteps).tolist() == [int(t < boundary) for t in timesteps.tolist()]
    torch.testing.assert_close(traj.final_latents, expected_latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    if cfg2 is not None:  # guidance_scale_2 really changes the low-noise steps
        plain = pipe(**call, latents=latents.clone(), output_type="latent").frames
        assert (plain - expected_latents).abs().max() > 1e-3


def test_velocity_runs_each_sample_on_its_own_expert():
    """A batch whose samples straddle the boundary: each row is its expert's CFG, by hand from the two transformers."""
    pipe = _pipe()
    adapter = make_adapter(pipe, num_frames=5, guidance_scale_2=2.0)
    x = adapter.initial_noise(3, 32, 32, generator=torch.Generator().manual_seed(3))
    sigma = torch.tensor([0.95, 0.5, 0.9])  # timesteps 950 (transformer), 500 (transformer_2), 900 (transformer)
    embeds = adapter.encode_prompts(PROMPTS, with_negative=True)
    with torch.no_grad():
        v = adapter.velocity(x, sigma, embeds, 4.5)
        for row, (model, scale) in enumerate(
            [(pipe.transformer, 4.5), (pipe.transformer_2, 2.0), (pipe.transformer, 4.5)]
        ):
            t = (sigma[row : row + 1] * 1000).float()
            inputs = dict(hidden_states=x[row : row + 1], timestep=t, return_dict=False)
            cond = model(**inputs, encoder_hidden_states=embeds.prompt_embeds[row : row + 1])[0]
            uncond = model(**inputs, encoder_hidden_states=embeds.negative_embeds[row : row + 1])[0]
            torch.testing.assert_close(v[row : row + 1], uncond + scale * (cond - uncond), rtol=0, atol=1e-5)
    assert adapter.expert_of(sigma * 1000).tolist() == [0, 1, 0]


@pytest.mark.parametrize(
    "sampler_kwargs",
    [
        {"kind": "euler_maruyama", "diffusion": "flowgrpo_wan", "noise_level": 1.0, "last_step": "sde"},
        {"kind": "cps"},
    ],
    ids=["flowgrpo_wan", "cps"],
)
def test_rescoring_gives_ratio_exactly_one_on_both_experts(sampler_kwargs):
    adapter = make_adapter(_pipe(euler=False), num_frames=5, guidance_scale_2=3.0)  # the hub's UniPC flow sigmas
    sampler = SamplerConfig(**{"noise_level": 0.7, "num_steps": 6, "guidance_scale": 4.5, **sampler_kwargs})
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1], sampler, range(0, 4), torch.Generator().manual_seed(1), height=16, width=32
    )
    experts = adapter.expert_of(traj.sigmas[0] * 1000).tolist()
    assert experts[0] == 0 and experts[-1] == 1  # the window holds steps of both experts (999, 937 | 857, 750)
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])
    # Per-sample positions (shuffled timesteps) on both experts in one micro-batch: each expert runs on its rows alone,
    # a batch of other rows than the rollout's, so equal to float rounding (on one expert: exactly, as Wan2.1).
    for positions, exact in [(torch.tensor([0, 1, 0]), True), (torch.tensor([0, 3, 1]), False)]:
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, positions, sampler)
        expected = traj.log_probs[torch.arange(3), positions]
        assert torch.equal(again.log_prob, expected) or not exact
        torch.testing.assert_close(again.log_prob, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("experts", ["both", "high_noise", "low_noise"])
def test_lora_on_both_experts_or_one_and_its_gradients(experts):
    pipe = _pipe()
    adapter = make_adapter(pipe, num_frames=5, lora_experts=experts)
    adapter.add_lora(rank=2, alpha=4)
    model = adapter.transformer
    names = {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    want = {"both": {"transformer", "transformer_2"}, "high_noise": {"transformer"}, "low_noise": {"transformer_2"}}
    assert names == want[experts]
    for name in ("transformer", "transformer_2"):  # the pipeline's own modules carry it: pipe() runs the LoRA
        assert getattr(pipe, name)._hf_peft_config_loaded == (name in want[experts])
    with torch.no_grad():  # a non-zero LoRA, so that its output differs from the base model's
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
    x = adapter.initial_noise(2, 16, 16, generator=torch.Generator().manual_seed(0))
    embeds = adapter.encode_prompts(PROMPTS[:2])
    for sigma, expert in [(0.95, "transformer"), (0.5, "transformer_2")]:
        adapter.transformer.zero_grad(set_to_none=True)
        v = adapter.velocity(x, sigma, embeds, 1.0)
        v.square().mean().backward()  # a step on an expert without LoRA still backs up (gradient 0)
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert p.grad is not None  # every trainable weight is in every training forward (DDP)
                assert bool(p.grad.abs().sum() > 0) == n.startswith(f"{expert}.")  # the other's: exactly 0
        with torch.no_grad(), adapter.adapter_disabled():
            base = adapter.velocity(x, sigma, embeds, 1.0)
        assert bool((base - v).abs().max() > 1e-4) == (expert in want[experts])  # only a trained expert moves
    # Each adapted expert's LoRA as diffusers loads it: the checkpoint's names split by expert.
    from peft import get_peft_model_state_dict

    parts = WanAdapter.split_lora(get_peft_model_state_dict(model))
    assert set(parts) == want[experts]
    for expert, weights in parts.items():
        assert weights.keys() == get_peft_model_state_dict(getattr(pipe, expert)).keys()


def test_two_expert_options_are_refused_where_they_cannot_apply():
    one = build_tiny_pipeline("wan")
    with pytest.raises(ConfigError, match=r"model.guidance_scale_2=3.0 .* one transformer"):
        make_adapter(one, guidance_scale_2=3.0)
    with pytest.raises(ConfigError, match=r"model.lora_experts=high_noise .* one transformer"):
        make_adapter(one, lora_experts="high_noise")
    with pytest.raises(ConfigError, match=r"model.lora_experts must be one of both, high_noise, low_noise"):
        make_adapter(_pipe(), lora_experts="high")
    pipe = _pipe()
    pipe.register_to_config(boundary_ratio=None)  # pipe() would never run transformer_2
    with pytest.raises(ValueError, match="transformer_2 but no boundary_ratio"):
        WanAdapter(pipe)
    with pytest.raises(ConfigError, match=r"model.lora_experts=low_noise is an option of wan.* only"):
        load_config(
            ROOT / "configs" / "tiny_sd3.yaml",
            ["model.kind=sd3", "model.pretrained=tiny-sd3", "model.lora_experts=low_noise"],
        )


def test_ti2v_per_token_timesteps_reproduce_pipe():
    """TI2V-5B: one transformer on the Wan2.2 VAE's latents, fed one timestep per latent token, as pipe()."""
    pipe = _pipe(ti2v=True)
    adapter = make_adapter(pipe, num_frames=5)
    assert adapter.experts == 1 and adapter.size_multiple == 16
    for height, width in [(32, 32), (16, 32)]:
        latents = adapter.initial_noise(3, height, width, generator=torch.Generator().manual_seed(0))
        assert latents.shape == (3, 8, 2, height // 8, width // 8)  # z_dim 8, spatial factor 8 (2x2 patchify)
        call = dict(prompt=PROMPTS, guidance_scale=4.5, num_inference_steps=3, height=height, width=width, num_frames=5)
        log, handles = _record_experts(pipe)
        expected = pipe(**call, latents=latents.clone(), output_type="pt").frames
        pipe_log = list(log)
        log.clear()
        sampler = SamplerConfig(noise_level=0.0, num_steps=3, guidance_scale=4.5)
        traj = rollout(
            adapter, PROMPTS, [0, 1, 1], sampler, range(0, 2), height=height, width=width, initial_latents=latents
        )
        for handle in handles:
            handle.remove()
        tokens = 2 * (height // 16) * (width // 16)  # F' x (h/2) x (w/2) latent patches
        assert log == pipe_log and log[0] == ("transformer", (3, tokens))  # [B, tokens] timesteps, as pipe()
        torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    sampler = SamplerConfig(noise_level=0.7, num_steps=3, guidance_scale=4.5)
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1], sampler, range(0, 2), torch.Generator().manual_seed(1), height=16, width=16
    )
    for j in range(2):
        with torch.no_grad():
            assert torch.equal(evaluate_transitions(adapter, traj, j, sampler).log_prob, traj.log_probs[:, j])


def test_two_epochs_resume_exactly_and_export_loads_into_both_experts(tmp_path):
    from flowgrpo.config import WindowConfig
    from flowgrpo.evaluation import ode_sampler
    from flowgrpo.export import adapter_from_checkpoint, export_checkpoint, load_exported_lora, run_config

    base = tmp_path / "base"
    _pipe(euler=False).save_pretrained(str(base))
    overrides = [f"model.pretrained={base}", "model.guidance_scale_2=3.0", "run.progress=false", "train.lr=5e-2"]
    overrides += ["eval.every=0", "grpo.groups_per_epoch=2", "sampler.batch_size=4", "train.batch_size=4"]
    overrides += ["sampler.num_steps=4"]  # UniPC timesteps 999, 900 | 750, 500: both experts trained
    ckpt, a = train_and_resume(TINY, tmp_path, overrides)
    assert {k.split(".")[0] for k in a} == {"transformer", "transformer_2"}  # both experts trained
    assert all(a[k].abs().max() > 0 for k in a if "lora_B" in k and k.startswith("transformer_2.blocks.0"))

    export_checkpoint(ckpt, tmp_path / "lora")
    export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == [
        "pytorch_lora_weights.safetensors",
        "pytorch_lora_weights_transformer_2.safetensors",
    ]
    config = run_config(ckpt)
    adapter = adapter_from_checkpoint(config, ckpt)
    euler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # pipe() is matched on FlowMatchEuler (see above)
    adapter.scheduler = adapter.pipe.scheduler = euler
    prompts = ["a red cube", PROMPTS[0]]
    latents = adapter.initial_noise(2, 32, 32, generator=torch.Generator().manual_seed(0))
    sampler = ode_sampler(config.eval)
    sampler.num_steps, sampler.window = 6, WindowConfig(size=0)
    ours = rollout(adapter, prompts, [0, 1], sampler, range(0, 0), height=32, width=32, initial_latents=latents).images

    # Plain diffusers: each expert's file loaded by load_lora_weights (transformer_2's with load_into_transformer_2).
    kw = dict(prompt=prompts, guidance_scale=4.5, guidance_scale_2=3.0, num_inference_steps=6, height=32, width=32)
    kw.update(num_frames=5, latents=latents, output_type="pt")
    outputs = {}
    for name, path, lora in [("base", base, False), ("lora", base, True), ("merged", tmp_path / "merged", False)]:
        plain = WanPipeline.from_pretrained(str(path))
        plain.scheduler = euler
        plain.set_progress_bar_config(disable=True)
        if lora:
            plain.load_lora_weights(str(tmp_path / "lora"))
            plain.load_lora_weights(
                str(tmp_path / "lora"),
                weight_name="pytorch_lora_weights_transformer_2.safetensors",
                load_into_transformer_2=True,
            )
            assert plain.transformer._hf_peft_config_loaded and plain.transformer_2._hf_peft_config_loaded
        outputs[name] = plain(**kw).frames
    assert (outputs["base"] - ours).abs().max() > 1e-3  # the adapter really changes the clips
    torch.testing.assert_close(outputs["lora"], ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(outputs["merged"], ours, rtol=0, atol=1e-4)
    again = WanPipeline.from_pretrained(str(base))
    assert load_exported_lora(again, tmp_path / "lora") == ["transformer", "transformer_2"]
