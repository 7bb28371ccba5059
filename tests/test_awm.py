"""Advantage-weighted matching (grpo.objective: awm): the loss against its formula on the bare transformer, what one
step does to the weighted samples, the config checks, and a trainer run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from flowgrpo.adapters import make_adapter
from flowgrpo.checkpoint import CONFIG_FILE, recipe_changes
from flowgrpo.config import ConfigError, SamplerConfig, load_config
from flowgrpo.objectives import MicroBatch
from flowgrpo.objectives.awm import AWM as AWMObjective
from flowgrpo.rollout import rollout
from flowgrpo.tiny import build_tiny_pipeline
from flowgrpo.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_sd3.yaml"
AWM = ["grpo.objective=awm", "sampler.noise_level=0"]
PROMPTS = ["a red cube", "a red cube", "a blue ball", "a blue ball"]
SIZE = 32


def _config(*overrides):
    return load_config(TINY, ["run.progress=false", *AWM, *overrides])


def _with_lora(adapter):
    adapter.add_lora(4, 8, "default", "gaussian", 0.0)
    with torch.no_grad():  # LoRA B starts at 0; move it so the adapter is part of what is checked
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
            elif "lora_A" in name:  # peft's gaussian init (std 1/r) drew from the global RNG: whatever ran before
                p.normal_(0, 1 / 4, generator=torch.Generator().manual_seed(1000 + len(name)))
    return adapter


def awm_loss(adapter, cfg, sub, positions, advantages, generator=None):
    """One term of the awm objective on a micro-batch (positions: unused by awm, as the trainer passes them)."""
    return AWMObjective(cfg).loss(adapter, MicroBatch(sub, advantages, positions, generator))


def _setup(kind="sd3", guidance=4.5):
    adapter = _with_lora(make_adapter(build_tiny_pipeline(kind, seed=0)))
    sampler = SamplerConfig(noise_level=0.0, num_steps=4, guidance_scale=guidance)
    traj = rollout(
        adapter, PROMPTS, [0, 0, 1, 1], sampler, range(0, 0), torch.Generator().manual_seed(1), height=SIZE, width=SIZE
    )
    return adapter, traj


def _draws(x0, seed=7):
    """σ and ε as flowgrpo.objectives.forward draws them for logit_mean 0.3, logit_std 0.7, time_shift 3:
    σ = sigmoid(0.3 + 0.7 z) shifted by the SD3 scheduler's formula, then ε."""
    g = torch.Generator().manual_seed(seed)
    sigma = torch.sigmoid(0.3 + 0.7 * torch.randn(len(x0), generator=g))
    sigma = 3 * sigma / (1 + 2 * sigma)
    return sigma, torch.randn(x0.shape, generator=g)


def _conditional_velocity(transformer, traj, noisy, sigma):
    """The transformer fed the prompt only (no CFG), at timestep 1000 σ as the SD3 scheduler feeds it."""
    return transformer(
        hidden_states=noisy,
        timestep=1000 * sigma,
        encoder_hidden_states=traj.embeds.prompt_embeds,
        pooled_projections=traj.embeds.pooled,
    ).sample


def test_awm_loss_is_the_advantage_weighted_flow_matching_loss_of_the_conditional_model():
    adapter, traj = _setup()
    cfg = _config("grpo.awm.logit_mean=0.3", "grpo.awm.logit_std=0.7", "grpo.awm.time_shift=3")
    advantages = torch.tensor([1.5, -0.5, 0.25, -1.25])
    loss, stats = awm_loss(
        adapter, cfg, traj, torch.zeros(4, dtype=torch.long), advantages, torch.Generator().manual_seed(7)
    )
    # The same draws, by hand, and the conditional velocity there.
    x0 = traj.final_latents
    sigma, noise = _draws(x0)
    s = sigma.view(4, 1, 1, 1)
    with torch.no_grad():
        v = _conditional_velocity(adapter.transformer, traj, (1 - s) * x0 + s * noise, sigma)
    per_sample = ((v - (noise - x0)) ** 2).mean(dim=(1, 2, 3))
    expected = (advantages * per_sample).mean()
    # Same process, same tensors, same kernels: only the order of the final reductions may differ (a few ulp).
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=0)
    assert set(stats) == {"loss", "policy_loss", "kl"} and stats["kl"] == 0
    zero, _ = awm_loss(adapter, cfg, traj, torch.zeros(4, dtype=torch.long), torch.zeros(4))
    assert zero.item() == 0.0

    # β > 0: + β · mean |v - v_ref|², v_ref from the same transformer with its LoRA switched off, same draws.
    anchored = _config("grpo.awm.logit_mean=0.3", "grpo.awm.logit_std=0.7", "grpo.awm.time_shift=3", "grpo.kl.beta=0.5")
    loss, stats = awm_loss(
        adapter, anchored, traj, torch.zeros(4, dtype=torch.long), advantages, torch.Generator().manual_seed(7)
    )
    adapter.transformer.disable_adapters()
    with torch.no_grad():
        v_ref = _conditional_velocity(adapter.transformer, traj, (1 - s) * x0 + s * noise, sigma)
    adapter.transformer.enable_adapters()
    kl = ((v - v_ref) ** 2).mean()
    assert kl > 0
    torch.testing.assert_close(stats["kl"], kl, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss.detach(), expected + 0.5 * kl, rtol=1e-6, atol=0)


def test_awm_cfg_fits_the_guided_velocity_the_rollout_sampled_with():
    adapter, traj = _setup(guidance=4.5)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, _ = awm_loss(
        adapter,
        _config("grpo.awm.cfg=true"),
        traj,
        torch.zeros(4, dtype=torch.long),
        advantages,
        torch.Generator().manual_seed(5),
    )
    g = torch.Generator().manual_seed(5)
    sigma = torch.sigmoid(torch.randn(4, generator=g))
    noise = torch.randn(traj.final_latents.shape, generator=g)
    x0, s = traj.final_latents, sigma.view(4, 1, 1, 1)
    e = traj.embeds
    with torch.no_grad():
        both = adapter.transformer(
            hidden_states=torch.cat([(1 - s) * x0 + s * noise] * 2),
            timestep=torch.cat([1000 * sigma] * 2),
            encoder_hidden_states=torch.cat([e.negative_embeds, e.prompt_embeds]),
            pooled_projections=torch.cat([e.negative_pooled, e.pooled]),
        ).sample
    uncond, cond = both.chunk(2)
    guided = uncond + 4.5 * (cond - uncond)
    expected = (advantages * ((guided - (noise - x0)) ** 2).mean(dim=(1, 2, 3))).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=0)


def test_one_awm_step_fits_a_better_sample_and_unfits_a_worse_one():
    adapter, traj = _setup()
    cfg = _config()
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    one = traj.select([0])

    def error():  # the sample's flow-matching error at fixed draws
        loss, _ = awm_loss(
            adapter, cfg, one, torch.zeros(1, dtype=torch.long), torch.ones(1), torch.Generator().manual_seed(3)
        )
        return loss

    before = error().item()
    for advantage, sign in ((1.0, -1), (-1.0, 1)):
        with torch.no_grad():
            for p, p0 in zip(params, start, strict=True):
                p.copy_(p0)
        # A small plain gradient step on A · error: to first order the error moves by -lr · A · |∇error|².
        loss, _ = awm_loss(
            adapter,
            cfg,
            one,
            torch.zeros(1, dtype=torch.long),
            torch.tensor([advantage]),
            torch.Generator().manual_seed(3),
        )
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= 0.5 * g
        assert sign * (error().item() - before) > 1e-4


def test_awm_without_cfg_families_keeps_the_rollouts_guidance(monkeypatch):
    adapter, traj = _setup("flux", guidance=3.5)
    seen = []
    velocity = adapter.velocity
    monkeypatch.setattr(adapter, "velocity", lambda *a, **k: seen.append(a[3]) or velocity(*a, **k))
    awm_loss(adapter, _config(), traj, torch.zeros(4, dtype=torch.long), torch.ones(4), torch.Generator())
    assert seen == [3.5]  # FLUX's guidance is an input of the network, not CFG


@pytest.mark.parametrize("kind", ["flux-kontext", "qwenimage", "qwenimage-edit", "wan"])
def test_awm_trains_every_lora_weight_of_the_other_families(kind):
    """Packed (FLUX, Qwen), source-conditioned (editing) and video latents: the loss and its KL are finite and reach
    every adapter weight (SD3 and FLUX: the tests above)."""
    options = {"wan": {"num_frames": 5}, "qwenimage-edit": {"source_area": 32 * 32}}.get(kind, {})  # tiny sizes
    adapter = _with_lora(make_adapter(build_tiny_pipeline(kind, seed=0), **options))
    edit = kind in ("flux-kontext", "qwenimage-edit")
    sources = [str(ROOT / "configs" / "prompts" / "edit_images" / f"{n}.png") for n in ("red_square", "blue_circle")]
    sampler = SamplerConfig(noise_level=0.0, num_steps=3, guidance_scale=2.5)
    traj = rollout(
        adapter,
        ["a red cube", "a blue ball"],
        [0, 1],
        sampler,
        range(0, 0),
        torch.Generator().manual_seed(1),
        height=SIZE,
        width=SIZE,
        sources=sources if edit else None,
        decode=False,
    )
    loss, stats = awm_loss(
        adapter,
        _config("grpo.kl.beta=0.5"),
        traj,
        torch.zeros(2, dtype=torch.long),
        torch.tensor([1.0, -1.0]),
        torch.Generator().manual_seed(0),
    )
    loss.backward()
    assert torch.isfinite(loss) and stats["kl"] > 0
    trained = [(n, p) for n, p in adapter.transformer.named_parameters() if p.requires_grad]
    idle = [n for n, p in trained if p.grad is None or p.grad.abs().sum() == 0]
    # Qwen-Image's last block: its text stream's query feeds nothing the output reads (so also under the clipped loss).
    blocks = getattr(adapter.transformer, "transformer_blocks", ())  # (Wan's are named otherwise)
    qwen_last = f"transformer_blocks.{len(blocks) - 1}.attn.add_q_proj."
    assert len(trained) > 0 and all(kind.startswith("qwenimage") and n.startswith(qwen_last) for n in idle), idle


@pytest.mark.parametrize(
    "override, key",
    [
        ("sampler.same_initial_noise=true", "sampler.same_initial_noise"),
        ("grpo.timestep_fraction=0.5", "grpo.timestep_fraction"),
        ("sampler.post_window.solver=dpmpp_2m", "sampler.post_window.solver"),
        ("sampler.last_step=sde", "sampler.last_step"),
        ("grpo.awm.timesteps=0", "grpo.awm.timesteps"),
        ("grpo.awm.logit_std=0", "grpo.awm.logit_std"),
        ("grpo.objective=ppo", "grpo.objective"),
    ],
)
def test_awm_config_mistakes_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _config(override)


def test_trainer_with_awm_samples_the_ode_and_trains_on_final_latents(tmp_path):
    # No weight decay: whatever moves the adapter is the loss's gradient.
    config = _config(
        f"run.output_dir={tmp_path}", "run.epochs=2", "eval.every=0", "grpo.awm.timesteps=2", "train.weight_decay=0"
    )
    trainer = GRPOTrainer(config)
    lora = {n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters() if p.requires_grad}
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    assert len(rows) == 2 and all(r["window/size"] == 0 for r in rows)
    # 16 images per epoch in micro-batches of 8; a micro-batch's terms (two σ per sample) make one optimizer step.
    assert rows[-1]["global_step"] == 4
    params = dict(trainer.adapter.transformer.named_parameters())
    assert any(not torch.equal(params[n], p) for n, p in lora.items())


def test_resuming_a_run_from_before_the_objective_existed_reports_no_change(tmp_path):
    config = load_config(TINY, ["run.progress=false"])
    old = config.to_dict()
    assert "awm" not in old["grpo"]  # only the active objective's section is written
    del old["grpo"]["objective"]  # a checkpoint written before this key existed
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(old))
    assert recipe_changes(tmp_path, config) == []
    changed = recipe_changes(tmp_path, _config())
    assert "grpo.objective: None -> 'awm'" in changed and "sampler.noise_level: 0.7 -> 0.0" in changed
