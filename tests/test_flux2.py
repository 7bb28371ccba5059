"""FLUX.2 (``Flux2KleinPipeline``: ``flux2-klein``; ``Flux2Pipeline``, [dev]: ``flux2``) through the FLUX.2 adapters on
the tiny offline pipelines: noise-free rollouts against ``pipe()`` with and without guidance, square and non-square
on one adapter (latents and images), the on-policy ratio exactly 1, the step-distilled Klein, LoRA targets against
diffusers' DreamBooth trainers (the adapters' defaults) and the presets' against their recipes' (both streams'
attention and feed-forwards), refusals, and the trainer's run / resume / export against plain diffusers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import init_empty_weights
from diffusers import Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel
from peft import LoraConfig
from resume_helper import export_and_sample, train_and_resume

from flowgrpo.adapters import make_adapter
from flowgrpo.adapters.flux2 import Flux2Adapter, Flux2KleinAdapter
from flowgrpo.checks import ConfigError
from flowgrpo.config import SamplerConfig, load_config
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_flux2_klein.yaml"
PROMPTS = ['a sign that says "hello"', "a red cube", "a red cube"]
GROUPS = [0, 1, 1]
# Shorter than pipe()'s 512 (the tiny prompts are a few tokens), long enough for [dev]'s system message, which the
# tiny BPE spells mostly in single bytes: the prompt must survive the truncation.
MAX_LENGTH = {"flux2-klein": 64, "flux2": 256}
# diffusers' DreamBooth LoRA trainers' default targets (examples/dreambooth/, huggingface/diffusers):
# train_dreambooth_lora_flux2_klein.py @027e8ee and train_dreambooth_lora_flux2.py @04c6304.
KLEIN_REFERENCE_TARGETS = [
    "to_k",
    "to_q",
    "to_v",
    "to_out.0",
    "to_qkv_mlp_proj",
    *[f"single_transformer_blocks.{i}.attn.to_out" for i in range(24)],
]
DEV_REFERENCE_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


def _adapter(kind: str, **options) -> Flux2Adapter:
    adapter = make_adapter(build_tiny_pipeline(kind), max_sequence_length=MAX_LENGTH[kind], **options)
    assert type(adapter) is {"flux2-klein": Flux2KleinAdapter, "flux2": Flux2Adapter}[kind]
    return adapter


def _unpacked(adapter: Flux2Adapter, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed ``[B, rows · cols, 4C]`` -> what ``pipe(latents=...)`` takes, ``[B, 4C, rows, cols]``."""
    m = adapter.size_multiple
    return latents.unflatten(1, (height // m, width // m)).permute(0, 3, 1, 2).contiguous()


def _pipe(adapter: Flux2Adapter, latents: torch.Tensor, height: int, width: int, steps: int, guidance: float, **kw):
    kind = adapter.family
    return adapter.pipe(
        prompt=PROMPTS,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=guidance,
        max_sequence_length=MAX_LENGTH[kind],
        latents=_unpacked(adapter, latents, height, width),
        **kw,
    ).images


@pytest.mark.parametrize("kind", ["flux2-klein", "flux2"])
def test_noise_free_rollout_reproduces_pipe_square_and_both_non_square_ways(kind):
    """One adapter, in this order: 32x32 guided, 32x48 unguided, 48x32 guided (the same token count as 32x48: its
    position ids must be its own). Klein guides by CFG with the empty prompt, [dev] by its guidance embedding."""
    adapter = _adapter(kind)
    assert not torch.allclose(adapter.vae.bn.running_var, torch.ones(16))  # so that the BatchNorm step is tested
    steps = 4
    for height, width, guidance in ((32, 32, 4.0), (32, 48, 1.0), (48, 32, 4.0)):
        latents = adapter.initial_noise(3, height, width, generator=torch.Generator().manual_seed(height))
        expected = _pipe(adapter, latents, height, width, steps, guidance, output_type="pt")
        expected_latents = _pipe(adapter, latents, height, width, steps, guidance, output_type="latent")
        pipe_sigmas = adapter.pipe.scheduler.sigmas.clone()
        sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=guidance)
        traj = rollout(
            adapter, PROMPTS, GROUPS, sampler, range(0, steps - 1), height=height, width=width, initial_latents=latents
        )
        assert traj.final_latents.shape == (3, (height // 4) * (width // 4), 16)
        # Klein's pipe(output_type="latent") returns the VAE's latents (unpacked, BatchNorm undone, unpatchified);
        # [dev]'s the packed ones.
        final = traj.final_latents
        if kind == "flux2-klein":
            final = adapter._latents_to_vae(final, height, width)
        torch.testing.assert_close(final, expected_latents, rtol=0, atol=1e-5)
        torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
        assert traj.images.shape == (3, 3, height, width) and traj.images.std() > 1e-3
        assert torch.equal(adapter.schedule(steps, height, width)[0], pipe_sigmas)  # compute_empirical_mu's shift
        assert traj.embeds.pooled is None
        assert (traj.embeds.negative_embeds is not None) == (kind == "flux2-klein" and guidance > 1)
    # 32x48 and 48x32 have 96 tokens each; their ids are cached per grid, and differ.
    wide, tall = adapter._ids_for(8, 12), adapter._ids_for(12, 8)
    assert wide.shape == tall.shape == (96, 4) and not torch.equal(wide, tall)
    assert torch.equal(tall, Flux2KleinPipeline._prepare_latent_ids(torch.empty(1, 1, 12, 8))[0])


def test_guidance_is_cfg_for_klein_and_the_embedding_for_dev():
    klein = _adapter("flux2-klein")
    embeds = klein.encode_conditions(PROMPTS[:2], with_negative=True, height=32, width=32)
    x = klein.initial_noise(2, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cond = klein.velocity(x, 0.6, embeds, 1.0)
        neg = klein._forward(x, klein._ids_for(8, 8), torch.full([2], 0.6), None, embeds.negative_embeds)
        guided = klein.velocity(x, 0.6, embeds, 4.0)
    torch.testing.assert_close(guided, neg + 4.0 * (cond - neg), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(guided, cond)
    dev = _adapter("flux2")
    embeds = dev.encode_conditions(PROMPTS[:2], with_negative=dev.needs_negative(4.0), height=32, width=32)
    assert embeds.negative_embeds is None and not dev.needs_negative(4.0)
    with torch.no_grad():
        low, high = dev.velocity(x, 0.6, embeds, 1.0), dev.velocity(x, 0.6, embeds, 4.0)
    assert (low - high).abs().max() > 1e-4  # the guidance embedding is fed


def test_a_step_distilled_klein_ignores_guidance_as_pipe_does():
    pipe = build_tiny_pipeline("flux2-klein")
    pipe.register_to_config(is_distilled=True)  # FLUX.2-klein-4B / -9B (the "base" checkpoints: False)
    adapter = make_adapter(pipe, max_sequence_length=MAX_LENGTH["flux2-klein"])
    assert not adapter.uses_cfg and not adapter.needs_negative(4.0)
    latents = adapter.initial_noise(3, 32, 48, generator=torch.Generator().manual_seed(5))
    expected = _pipe(adapter, latents, 32, 48, 3, 4.0, output_type="pt")
    sampler = SamplerConfig(noise_level=0.0, num_steps=3, guidance_scale=4.0)
    traj = rollout(adapter, PROMPTS, GROUPS, sampler, range(0, 2), height=32, width=48, initial_latents=latents)
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    assert traj.embeds.negative_embeds is None
    with pytest.raises(ConfigError, match="model.negative_prompt=' ': .*remove model.negative_prompt"):
        make_adapter(pipe, negative_prompt=" ")
    with pytest.raises(ConfigError, match="Flux2Pipeline here samples without a negative prompt"):
        make_adapter(build_tiny_pipeline("flux2"), negative_prompt="blurry")


@pytest.mark.parametrize(
    "kind,sampler_kwargs",
    [
        ("flux2-klein", {"kind": "euler_maruyama"}),
        ("flux2-klein", {"kind": "euler_maruyama", "diffusion": "dance", "noise_level": 0.3}),
        ("flux2-klein", {"kind": "cps"}),
        ("flux2-klein", {"kind": "langevin", "score_eval": "reeval"}),
        ("flux2", {"kind": "euler_maruyama"}),
    ],
    ids=["klein-em", "klein-dance", "klein-cps", "klein-lc-reeval", "dev-em"],
)
def test_rescoring_the_stored_trajectory_gives_ratio_exactly_one(kind, sampler_kwargs):
    adapter = _adapter(kind)
    sampler = SamplerConfig(**{"noise_level": 0.7, "num_steps": 5, "guidance_scale": 4.0, **sampler_kwargs})
    traj = rollout(
        adapter, PROMPTS, GROUPS, sampler, range(1, 3), torch.Generator().manual_seed(1), height=32, width=48
    )
    assert traj.latents.shape == (3, 2, 96, 16)  # [B, W, tokens, 4C]
    assert torch.isfinite(traj.log_probs).all() and (traj.stds > 0).all()
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])
    positions = torch.tensor([1, 0, 1])  # per-sample window positions (shuffled timesteps)
    with torch.no_grad():
        again = evaluate_transitions(adapter, traj, positions, sampler)
    assert torch.equal(again.log_prob, traj.log_probs[torch.arange(3), positions])


def _wrapped(transformer: torch.nn.Module) -> set[str]:
    return {n.split(".lora_A")[0] for n, _ in transformer.named_parameters() if ".lora_A." in n}


@pytest.mark.parametrize(
    "kind,reference", [("flux2-klein", KLEIN_REFERENCE_TARGETS), ("flux2", DEV_REFERENCE_TARGETS)], ids=["klein", "dev"]
)
def test_lora_targets_are_diffusers_dreambooth_trainers(kind, reference):
    adapter = _adapter(kind)
    adapter.add_lora(rank=2, alpha=2)
    plain = build_tiny_pipeline(kind).transformer
    plain.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=reference))  # the trainer's own list, in peft
    assert _wrapped(adapter.transformer) == _wrapped(plain)
    double = {f"transformer_blocks.0.attn.{name}" for name in ("to_k", "to_q", "to_v", "to_out.0")}
    single = {f"single_transformer_blocks.0.attn.{name}" for name in ("to_qkv_mlp_proj", "to_out")}
    assert _wrapped(plain) == (double | single if kind == "flux2-klein" else double)


# Pref-GRPO's FLUX.2-klein GRPO trainer's default LoRA targets (CodeGoat24/Pref-GRPO fastvideo/train_flux2_klein.py
# @83a7602): both streams' attention and feed-forwards, and the single blocks' fused input projection.
PREF_GRPO_KLEIN_TARGETS = [
    *[f"attn.{name}" for name in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj")],
    "attn.to_add_out",
    *[f"{ff}.{name}" for ff in ("ff", "ff_context") for name in ("linear_in", "linear_out")],
    "attn.to_qkv_mlp_proj",
]


@pytest.mark.parametrize("preset,kind", [("flux2_dev_pickscore", "flux2"), ("flux2_klein_pickscore", "flux2-klein")])
def test_presets_train_both_streams_attention_and_feed_forwards(preset, kind):
    """The presets' sources (flux_dev_pickscore, qwenimage_pickscore) train both streams' attention and feed-forwards:
    on FLUX.2 every Linear of the double blocks' attn / ff / ff_context, and both Linears of the single blocks, whose
    attention and MLP share them: Pref-GRPO's Klein list plus the single blocks' attn.to_out."""
    targets = load_config(ROOT / "configs" / f"{preset}.yaml").model.lora.target_modules
    model = build_tiny_pipeline(kind).transformer
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    model.add_adapter(LoraConfig(r=2, target_modules=list(targets), exclude_modules=Flux2Adapter.lora_exclude(model)))
    double = {
        n
        for n in linears
        if n.split(".")[0] == "transformer_blocks" and n.split(".")[2] in ("attn", "ff", "ff_context")
    }
    single = {n for n in linears if n.startswith("single_transformer_blocks.")}
    assert len(double) == 12 and single == {
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
        "single_transformer_blocks.0.attn.to_out",
    }
    assert _wrapped(model) == double | single
    pref_grpo = build_tiny_pipeline(kind).transformer
    pref_grpo.add_adapter(LoraConfig(r=2, target_modules=PREF_GRPO_KLEIN_TARGETS))
    assert _wrapped(model) == _wrapped(pref_grpo) | {"single_transformer_blocks.0.attn.to_out"}


def test_klein_targets_reach_every_single_block_whatever_the_depth():
    """The trainer names single blocks 0..23 (FLUX.2-klein-9B's 24; -4B has 20); ``attn.to_out`` with the
    double-stream ModuleLists excluded names them all: here 2 double and 26 single blocks (FLUX.2 [dev] has 48)."""
    with init_empty_weights():
        model = Flux2Transformer2DModel(
            in_channels=16,
            num_layers=2,
            num_single_layers=26,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=48,
            axes_dims_rope=(4, 4, 4, 4),
        )
        exclude = Flux2KleinAdapter.lora_exclude(model)
        targets = list(Flux2KleinAdapter.default_lora_targets)
        model.add_adapter(LoraConfig(r=2, target_modules=targets, exclude_modules=exclude))
    wrapped = _wrapped(model)
    assert exclude == ["transformer_blocks.0.attn.to_out", "transformer_blocks.1.attn.to_out"]
    assert {f"single_transformer_blocks.{i}.attn.to_out" for i in range(26)} <= wrapped
    assert {f"transformer_blocks.{i}.attn.to_out.0" for i in range(2)} <= wrapped
    assert len(wrapped) == 2 * 4 + 26 * 2


def test_siblings_and_bad_sizes_are_refused():
    for name in ("Flux2KleinInpaintPipeline", "Flux2KleinKVPipeline"):
        with pytest.raises(ValueError, match=f"{name} is not supported yet.*Flux2KleinPipeline"):
            make_adapter(type(name, (), {})())
    with pytest.raises(ValueError, match="multiples of 4"):
        _adapter("flux2-klein").latent_shape(30, 32)
    with pytest.raises(ValueError, match="max_sequence_length must be >= 1"):
        Flux2Adapter(build_tiny_pipeline("flux2"), max_sequence_length=0)
    with pytest.raises(ValueError, match="vae='kl'"):
        build_tiny_pipeline("flux2-klein", vae="tiny")


def _plain_diffusers(base: Path, lora: Path, merged: Path, latents: torch.Tensor, prompts: list[str]) -> dict:
    """What plain diffusers samples from the exported LoRA, the merged export and the base: ``from_pretrained``,
    ``load_lora_weights`` and ``__call__`` only (in this process: a fresh interpreter would cost more than the rest)."""
    kw = dict(
        prompt=prompts,
        guidance_scale=4.0,
        num_inference_steps=6,
        height=32,
        width=32,
        max_sequence_length=64,
        output_type="pt",
    )
    pipe = Flux2KleinPipeline.from_pretrained(base)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(lora)
    out = {"lora": pipe(**kw, latents=latents.clone()).images}
    for name, path in (("merged", merged), ("base", base)):
        plain = Flux2KleinPipeline.from_pretrained(path)
        plain.set_progress_bar_config(disable=True)
        out[name] = plain(**kw, latents=latents.clone()).images
    return out


def test_train_resume_and_export_match_plain_diffusers(tmp_path):
    base = tmp_path / "base"
    build_tiny_pipeline("flux2-klein", seed=0).save_pretrained(str(base))
    # 8 images an epoch in two micro-batches: two optimizer steps an epoch, for the resume to restore.
    small = ["grpo.groups_per_epoch=2", "sampler.batch_size=4", "train.batch_size=4"]
    common = [f"model.pretrained={base}", "run.progress=false", "train.lr=5e-2", *small]

    ckpt, _ = train_and_resume(TINY, tmp_path, common)  # the resume is exact, every epoch on-policy
    prompts = ["a red cube", PROMPTS[0]]
    adapter, latents, ours = export_and_sample(ckpt, tmp_path, prompts, steps=6)

    plain_latents = _unpacked(adapter, latents, 32, 32)
    images = _plain_diffusers(base, tmp_path / "lora", tmp_path / "merged", plain_latents, prompts)
    assert (images["base"] - ours).abs().max() > 1e-3  # the adapter really changes the images
    torch.testing.assert_close(images["lora"], ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(images["merged"], ours, rtol=0, atol=1e-4)
    assert isinstance(adapter.pipe, Flux2KleinPipeline) and not isinstance(adapter.pipe, Flux2Pipeline)
