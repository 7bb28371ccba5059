"""Qwen-Image (``QwenImagePipeline``) through ``QwenImageAdapter`` on the tiny offline pipeline: alignment with
``pipe()`` with and without true CFG, masked prompts of different lengths, LoRA targets, refusals, and the trainer's
run / resume / export against plain diffusers in a fresh process. The sampler-by-sampler ratio-exactly-1 checks and
the other adapter contracts run on Qwen-Image through the ``kind`` fixture of test_rollout.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from plain_diffusers import run_plain_diffusers
from safetensors.torch import load_file

from flowgrpo.adapters import QwenImageAdapter, make_adapter
from flowgrpo.config import SamplerConfig, load_config
from flowgrpo.rollout import Trajectory, evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_qwenimage.yaml"
NEGATIVE = " "  # Flow-GRPO's negative prompt for Qwen-Image
# Prompts of different token lengths: the batch is padded and masked, as pipe() pads it.
PROMPTS = ['a sign that says "hello"', "a red cube", "a red cube", "a photo of a cat on a table at night"]


def _adapter(seed: int = 0) -> QwenImageAdapter:
    adapter = make_adapter(build_tiny_pipeline("qwenimage", seed=seed), negative_prompt=NEGATIVE)
    assert isinstance(adapter, QwenImageAdapter)
    return adapter


@pytest.mark.parametrize(
    "steps,cfg,height,width", [(4, 4.0, 32, 32), (5, 1.0, 32, 48), (3, 2.5, 48, 32)], ids=["cfg", "nocfg", "tall"]
)
def test_noise_free_rollout_reproduces_pipe(steps, cfg, height, width):
    adapter = _adapter()
    latents = adapter.initial_noise(len(PROMPTS), height, width, generator=torch.Generator().manual_seed(0))
    expected = adapter.pipe(
        prompt=PROMPTS,
        negative_prompt=NEGATIVE,
        true_cfg_scale=cfg,
        latents=latents.clone(),
        num_inference_steps=steps,
        height=height,
        width=width,
        output_type="pt",
    ).images
    pipe_sigmas = adapter.pipe.scheduler.sigmas.clone()
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=cfg)
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
    assert traj.images.shape == (len(PROMPTS), 3, height, width)
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    # The schedule is pipe()'s own (dynamic exponential shift from the token count, terminal sigma 0.02).
    assert torch.equal(adapter.schedule(steps, height, width)[0], pipe_sigmas)
    # The prompts really were padded and masked, and the negative prompt is used exactly when CFG is on.
    embeds = traj.embeds
    assert embeds.pooled is None and embeds.mask is not None and not bool(embeds.mask.all())
    assert (embeds.negative_embeds is not None) == (cfg > 1)


def test_true_cfg_is_pipes_rescaled_combination():
    adapter = _adapter()
    embeds = adapter.encode_prompts(PROMPTS[:2], with_negative=True)
    x = adapter.initial_noise(2, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cond = adapter.velocity(x, 0.6, embeds, 1.0)
        neg = adapter.velocity(x, 0.6, replace_text(embeds), 1.0)
        guided = adapter.velocity(x, 0.6, embeds, 4.0)
    combined = neg + 4.0 * (cond - neg)
    rescaled = combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(guided, rescaled, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(guided, combined)  # the rescale is really applied


def replace_text(embeds):
    """The negative prompt's embeddings in the conditional slot."""
    from dataclasses import replace

    return replace(embeds, prompt_embeds=embeds.negative_embeds, mask=embeds.negative_mask)


def test_batches_of_different_prompt_lengths_join_and_rescore_exactly():
    adapter = _adapter()
    sampler = SamplerConfig(noise_level=1.2, num_steps=6, guidance_scale=4.0)
    generator = torch.Generator().manual_seed(1)
    short = rollout(adapter, ["a cat", "a dog"], [0, 0], sampler, range(1, 3), generator, height=32, width=32)
    long = rollout(adapter, [PROMPTS[3], "a cat"], [1, 1], sampler, range(1, 3), generator, height=32, width=32)
    joined = Trajectory.cat([short, long])
    assert joined.embeds.prompt_embeds.shape[1] == long.embeds.prompt_embeds.shape[1]
    assert joined.embeds.prompt_embeds.shape[1] > short.embeds.prompt_embeds.shape[1]
    assert joined.embeds.mask[:2].sum(dim=1).tolist() == short.embeds.mask.sum(dim=1).tolist()
    # A micro-batch of the padded trajectory feeds the network what its rollout batch did: ratio exactly 1.
    for part, rows in ((short, [0, 1]), (long, [2, 3])):
        for j in range(2):
            with torch.no_grad():
                again = evaluate_transitions(adapter, joined.select(rows), j, sampler)
            assert torch.equal(again.log_prob, part.log_probs[:, j])
    # A micro-batch mixing both (short rows now padded to the long prompt, with a mask): the masked keys get zero
    # weight, but the attention now reduces over more of them, which some CPUs round differently (measured: equal
    # on a Xeon, 1 ulp = 1.2e-7 on an AMD EPYC). A mask that let padding in would move the log-prob far more.
    with torch.no_grad():
        mixed = evaluate_transitions(adapter, joined.select([0, 2]), 1, sampler)
    expected = torch.stack([short.log_probs[0, 1], long.log_probs[0, 1]])
    torch.testing.assert_close(mixed.log_prob, expected, rtol=0, atol=1e-6)
    # A prompt's embedding does not depend on the prompts it was encoded with (to float noise).
    alone = _adapter().encode_prompts(["a cat"])
    within = joined.embeds.select([0])
    length = int(within.mask.sum())
    torch.testing.assert_close(within.prompt_embeds[:, :length], alone.prompt_embeds, rtol=1e-5, atol=1e-6)


def test_lora_targets_are_the_blocks_attention_and_mlp_layers():
    adapter = _adapter()
    # diffusers' own tensor-parallel plan of QwenImageTransformer2DModel lists the block Linears: the same twelve.
    plan = getattr(QwenImageTransformer2DModel, "_tp_plan", None)
    if plan:
        assert {key.split("*.", 1)[1] for key in plan} == set(QwenImageAdapter.default_lora_targets)
    adapter.add_lora(rank=2, alpha=2)
    wrapped = {n.split(".lora_A")[0] for n, _ in adapter.transformer.named_parameters() if ".lora_A." in n}
    blocks = len(adapter.transformer.transformer_blocks)
    expected = {f"transformer_blocks.{i}.{t}" for i in range(blocks) for t in QwenImageAdapter.default_lora_targets}
    excluded = set(QwenImageAdapter.lora_exclude(adapter.transformer))
    assert excluded and excluded <= expected  # the last block's text-stream outputs, which the model discards
    assert wrapped == expected - excluded


def test_unsupported_qwen_image_pipelines_and_options_are_refused():
    for name in ("QwenImageInpaintPipeline", "QwenImageImg2ImgPipeline"):  # the Edit pipelines: their own families
        with pytest.raises(ValueError, match=f"{name} is not supported yet.*QwenImagePipeline"):
            make_adapter(type(name, (), {})())
    pipe = build_tiny_pipeline("qwenimage")
    with pytest.raises(ValueError, match="max_sequence_length"):
        QwenImageAdapter(pipe, max_sequence_length=2048)
    pipe.transformer.register_to_config(guidance_embeds=True)
    with pytest.raises(ValueError, match="guidance_embeds"):
        QwenImageAdapter(pipe)
    with pytest.raises(ValueError, match="vae='kl'"):
        build_tiny_pipeline("qwenimage", vae="tiny")
    with pytest.raises(ValueError, match="multiples of 4"):
        _adapter().latent_shape(30, 32)


PLAIN_DIFFUSERS = """
import sys, torch
from diffusers import QwenImagePipeline
base, lora, merged, latents_file, prompts, out = sys.argv[1:]
latents, prompts = torch.load(latents_file), prompts.split("|")
kw = dict(prompt=prompts, negative_prompt=" ", true_cfg_scale=4.0, num_inference_steps=6, height=32, width=32,
          latents=latents, output_type="pt")
pipe = QwenImagePipeline.from_pretrained(base)
pipe.load_lora_weights(lora)
with_lora = pipe(**kw).images
fused = QwenImagePipeline.from_pretrained(merged)(**kw).images
base_images = QwenImagePipeline.from_pretrained(base)(**kw).images
torch.save({"lora": with_lora, "merged": fused, "base": base_images}, out)
"""


def test_train_resume_and_export_match_plain_diffusers(tmp_path):
    from flowgrpo.checkpoint import list_checkpoints
    from flowgrpo.config import WindowConfig
    from flowgrpo.evaluation import ode_sampler
    from flowgrpo.export import adapter_from_checkpoint, export_checkpoint, run_config
    from flowgrpo.trainer import GRPOTrainer

    base = tmp_path / "base"
    build_tiny_pipeline("qwenimage", seed=0).save_pretrained(str(base))
    common = [f"model.pretrained={base}", "run.progress=false", "train.lr=5e-2"]

    def trainer(out, *overrides):
        return GRPOTrainer(load_config(TINY, [f"run.output_dir={out}", *common, *overrides]))

    full = trainer(tmp_path / "a", "run.epochs=2")
    full.fit()
    part = trainer(tmp_path / "b", "run.epochs=1")
    part.fit()
    resumed = trainer(tmp_path / "b", "run.epochs=2", f"run.resume={part.run_dir}")
    assert resumed.state.epoch == 1
    resumed.fit()
    ckpt = list_checkpoints(full.run_dir)[-1]
    a, b = (
        load_file(str(ckpt / "adapter.safetensors")),
        load_file(str(list_checkpoints(part.run_dir)[-1] / "adapter.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    # Shuffled micro-batches mix rows of both rollout batches (padded to different lengths): still exactly on-policy.
    assert len(rows) == 2 and all(r["train/onpolicy_ratio_dev"] == 0.0 for r in rows)

    export_checkpoint(ckpt, tmp_path / "lora")
    export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    config = run_config(ckpt)
    adapter = adapter_from_checkpoint(config, ckpt)
    prompts = ["a red cube", PROMPTS[3]]
    latents = adapter.initial_noise(2, 32, 32, generator=torch.Generator().manual_seed(0))
    sampler = ode_sampler(config.eval)
    sampler.num_steps, sampler.window = 6, WindowConfig(size=0)
    ours = rollout(adapter, prompts, [0, 1], sampler, range(0, 0), height=32, width=32, initial_latents=latents).images

    images = run_plain_diffusers(
        PLAIN_DIFFUSERS, base, tmp_path / "lora", tmp_path / "merged", latents, prompts, tmp_path
    )
    assert (images["base"] - ours).abs().max() > 1e-3  # the adapter really changes the images
    torch.testing.assert_close(images["lora"], ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(images["merged"], ours, rtol=0, atol=1e-4)
    assert isinstance(adapter.pipe, QwenImagePipeline)
