"""HunyuanVideo (``HunyuanVideoPipeline``) through ``HunyuanVideoAdapter`` on the tiny offline pipeline: noise-free
rollouts equal ``pipe()`` (latents and clips, square and non-square, embedded guidance with and without true CFG), the
prompt template's crop and the embedded guidance by hand (DanceGRPO's ``guidance=6018.0``), re-scoring gives ratio
exactly 1, LoRA targets against FastVideo's, refusals, and two epochs of the trainer resumed exactly and exported to
plain diffusers."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from diffusers import HunyuanVideoPipeline, UniPCMultistepScheduler
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
from peft import LoraConfig
from resume_helper import train_and_resume

from flowgrpo.adapters import make_adapter
from flowgrpo.adapters.hunyuanvideo import HunyuanVideoAdapter
from flowgrpo.checks import ConfigError
from flowgrpo.config import SamplerConfig, load_config
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_hunyuanvideo.yaml"
PROMPTS = ["a red cube", "a blue ball on a wooden table"]  # different lengths: per-row masks
# FastVideo's LoRA targets for HunyuanVideo (hao-ai-lab/FastVideo fastvideo/train.py @883616a, model_type hunyuan_hf).
FASTVIDEO_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


@pytest.fixture(scope="module")
def pipe() -> HunyuanVideoPipeline:
    return build_tiny_pipeline("hunyuanvideo")


def _adapter(pipe: HunyuanVideoPipeline, **options) -> HunyuanVideoAdapter:
    adapter = make_adapter(pipe, num_frames=5, **options)
    assert type(adapter) is HunyuanVideoAdapter
    return adapter


@pytest.mark.parametrize(
    "height,width,guidance,true_cfg",
    [(32, 32, 6.0, 1.0), (32, 48, 4.5, 1.0), (48, 32, 6.0, 3.0)],
    ids=["32x32", "32x48", "48x32-true-cfg"],
)
def test_noise_free_rollout_reproduces_pipe(pipe, height, width, guidance, true_cfg):
    negative = "blurry" if true_cfg > 1 else ""
    adapter = _adapter(pipe, negative_prompt=negative, true_cfg_scale=true_cfg)
    latents = adapter.initial_noise(2, height, width, generator=torch.Generator().manual_seed(0))
    assert latents.shape == (2, 4, 2, height // 8, width // 8) and latents.dtype == torch.float32
    sampler = SamplerConfig(noise_level=0.0, num_steps=3, guidance_scale=guidance)
    traj = rollout(adapter, PROMPTS, [0, 1], sampler, range(0), height=height, width=width, initial_latents=latents)
    kw = dict(height=height, width=width, num_frames=5, num_inference_steps=3, guidance_scale=guidance)
    if true_cfg > 1:
        kw.update(true_cfg_scale=true_cfg, negative_prompt=[negative] * 2)
    expected = pipe(prompt=PROMPTS, latents=latents.clone(), output_type="latent", **kw).frames
    torch.testing.assert_close(traj.final_latents, expected, rtol=0, atol=1e-6)
    clips = pipe(prompt=PROMPTS, latents=latents.clone(), output_type="pt", **kw).frames
    assert traj.images.shape == clips.shape == (2, 5, 3, height, width)
    torch.testing.assert_close(traj.images, clips, rtol=0, atol=1e-6)
    sigmas, _ = adapter.schedule(3, height, width)
    assert torch.allclose(sigmas[:-1], 7 * (s := torch.linspace(1, 0, 4)[:-1]) / (1 + 6 * s)) and sigmas[-1] == 0


def test_prompts_crop_the_template_and_guidance_is_embedded(pipe):
    adapter = _adapter(pipe)
    tok, llama = pipe.tokenizer, pipe.text_encoder
    template = DEFAULT_PROMPT_TEMPLATE["template"]
    # <|begin_of_text|> and the template before the prompt: the 95 tokens pipe() crops off (crop_start).
    assert len(tok(template.split("{}")[0]).input_ids) == DEFAULT_PROMPT_TEMPLATE["crop_start"] == 95
    embeds = adapter.encode_prompts(PROMPTS)
    assert len(set(embeds.mask.sum(1).tolist())) == 2  # the rows' masks differ, so a shared mask would show
    ids = tok([template.format(p) for p in PROMPTS], padding="max_length", max_length=95 + 256, return_tensors="pt")
    with torch.no_grad():
        hidden = llama(ids.input_ids, attention_mask=ids.attention_mask, output_hidden_states=True).hidden_states[-3]
    torch.testing.assert_close(embeds.prompt_embeds, hidden[:, 95:], rtol=0, atol=0)
    assert embeds.mask.tolist() == ids.attention_mask[:, 95:].tolist()
    # the prompt's own tokens only: a / red / cube + <|eot_id|>; the longer one spelled partly in bytes by the tiny BPE
    assert embeds.mask.sum(1).tolist() == [4, 13]
    assert embeds.pooled.shape == (2, 32) and embeds.prompt_embeds.shape == (2, 256, 32)

    # The embedded guidance: DanceGRPO feeds guidance=6018.0 (train_grpo_hunyuan.py): guidance_scale 6.018 here.
    latents = adapter.initial_noise(2, 32, 32, generator=torch.Generator().manual_seed(1))
    t = torch.full((2,), 750.0)
    with torch.no_grad():
        ours = adapter.velocity(latents, 0.75, embeds, 6.018)
        theirs = pipe.transformer(
            hidden_states=latents,
            timestep=t,
            encoder_hidden_states=embeds.prompt_embeds,
            encoder_attention_mask=embeds.mask.float(),
            pooled_projections=embeds.pooled,
            guidance=torch.tensor([6018.0, 6018.0]),
            return_dict=False,
        )[0]
        assert torch.equal(ours, theirs)
        assert (adapter.velocity(latents, 0.75, embeds, 1.0) - ours).abs().max() > 1e-4  # the scale reaches the net


@pytest.mark.parametrize(
    "sampler_kwargs",
    [
        {"kind": "euler_maruyama", "noise_level": 0.7},
        {"kind": "euler_maruyama", "diffusion": "dance", "noise_level": 0.25, "time_shift": 5.0},  # DanceGRPO's
    ],
    ids=["flowgrpo", "dancegrpo"],
)
def test_rescoring_the_stored_trajectory_gives_ratio_exactly_one(pipe, sampler_kwargs):
    adapter = _adapter(pipe)
    sampler = SamplerConfig(**{"num_steps": 4, "guidance_scale": 6.0, **sampler_kwargs})
    prompts, groups = [*PROMPTS, "a red cube"], [0, 1, 0]
    traj = rollout(
        adapter, prompts, groups, sampler, range(1, 3), torch.Generator().manual_seed(1), height=16, width=32
    )
    assert torch.isfinite(traj.log_probs).all() and (traj.stds > 0).all()
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])


def test_the_dancegrpo_preset_holds_the_references_values():
    """configs/hunyuanvideo_dancegrpo.yaml against DanceGRPO's finetune_hunyuan_grpo.sh (docs/recipes.md)."""
    config = load_config(ROOT / "configs" / "hunyuanvideo_dancegrpo.yaml")
    m, s, g = config.model, config.sampler, config.grpo
    assert (m.size, m.num_frames, m.max_sequence_length) == ((480, 480), 53, 256)  # --h/--w 480, --t 53
    assert (s.diffusion, s.noise_level, s.num_steps, s.time_shift) == ("dance", 0.25, 16, 5.0)  # --eta, --shift
    assert (g.group_size, g.groups_per_epoch, g.clip_range, g.timestep_fraction) == (24, 32, 1e-4, 0.6)
    assert sorted(m.lora.target_modules) == sorted(FASTVIDEO_TARGETS) and (m.lora.rank, m.lora.alpha) == (128, 256)
    # guidance=torch.tensor([6018.0], dtype=bfloat16) there; guidance_scale · 1000 in the bf16 transformer here.
    ours = torch.full((1,), s.guidance_scale, dtype=torch.bfloat16) * 1000.0
    assert m.dtype == "bf16" and torch.equal(ours, torch.tensor([6018.0], dtype=torch.bfloat16))


def _wrapped(transformer: torch.nn.Module) -> set[str]:
    return {n.split(".lora_A")[0] for n, _ in transformer.named_parameters() if ".lora_A." in n}


def _with(pipe: HunyuanVideoPipeline, **components) -> HunyuanVideoPipeline:
    """The module's pipeline with some components replaced (by default a copy of its transformer, to change)."""
    return HunyuanVideoPipeline(**{**pipe.components, "transformer": copy.deepcopy(pipe.transformer), **components})


def test_lora_targets_are_fastvideos(pipe):
    adapter = _adapter(_with(pipe))
    adapter.add_lora(rank=2, alpha=2)
    plain = copy.deepcopy(pipe.transformer)
    plain.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=FASTVIDEO_TARGETS))  # FastVideo's list, in peft
    assert _wrapped(adapter.transformer) == _wrapped(plain)
    qkv = ("to_q", "to_k", "to_v")
    refiner = {f"context_embedder.token_refiner.refiner_blocks.0.attn.{n}" for n in (*qkv, "to_out.0")}
    dual = {f"transformer_blocks.0.attn.{n}" for n in (*qkv, "to_out.0")}  # the text side's add_*_proj: none
    single = {f"single_transformer_blocks.0.attn.{n}" for n in qkv}  # pre_only: no to_out (proj_out does it)
    assert _wrapped(plain) == refiner | dual | single


def test_what_hunyuanvideo_refuses(pipe, tmp_path):
    import diffusers

    for name in ("HunyuanVideoImageToVideoPipeline", "HunyuanSkyreelsImageToVideoPipeline"):
        cls = getattr(diffusers, name)
        with pytest.raises(ValueError, match=f"{name} is not supported yet.*HunyuanVideoPipeline"):
            make_adapter(cls.__new__(cls))
    with pytest.raises(ConfigError, match=r"^num_frames=6 is not a frame count the video VAE can take.* 5 and 9"):
        make_adapter(pipe, num_frames=6)
    with pytest.raises(ConfigError, match=r"model\.true_cfg_scale=2.0 guides away from a negative prompt"):
        _adapter(pipe, true_cfg_scale=2.0)
    with pytest.raises(ConfigError, match=r"model\.guidance_scale_2=3.0 is an option of wan, wan-i2v only"):
        _adapter(pipe, guidance_scale_2=3.0)
    with pytest.raises(ValueError, match="max_sequence_length must be >= 1"):
        _adapter(pipe, max_sequence_length=0)
    with pytest.raises(ValueError, match="hunyuanvideo generates from text alone"):
        _adapter(pipe).encode_conditions(PROMPTS, sources=["x.png", "y.png"], height=32, width=32)
    image_to_video = _with(pipe)
    image_to_video.transformer.register_to_config(image_condition_type="latent_concat")
    with pytest.raises(ValueError, match="image_condition_type='latent_concat'.*image-to-video is not supported"):
        _adapter(image_to_video)
    unipc = _with(pipe, scheduler=UniPCMultistepScheduler())
    with pytest.raises(ValueError, match="scheduler is UniPCMultistepScheduler.*FlowMatchEulerDiscreteScheduler"):
        _adapter(unipc)
    with pytest.raises(ConfigError, match=r"^model\.num_frames=6 is not a frame count"):
        load_config(TINY, [f"run.output_dir={tmp_path}", "model.num_frames=6"])
    assert not any(tmp_path.iterdir())


def test_two_epochs_resume_exactly_and_export_matches_plain_diffusers(tmp_path, monkeypatch):
    from flowgrpo.config import WindowConfig
    from flowgrpo.evaluation import ode_sampler
    from flowgrpo.export import adapter_from_checkpoint, export_checkpoint, run_config

    base = tmp_path / "base"
    build_tiny_pipeline("hunyuanvideo").save_pretrained(str(base))
    overrides = [f"model.pretrained={base}", "run.progress=false", "train.lr=5e-2", "eval.every=0"]
    overrides += ["grpo.groups_per_epoch=2", "grpo.group_size=2", "sampler.batch_size=4", "train.batch_size=4"]
    overrides += ["sampler.num_steps=3"]
    # The run report's plots (matplotlib, seconds a run on a shared CPU) are not what this test checks.
    monkeypatch.setattr("flowgrpo.trainer.write_curves", lambda run_dir: None)
    monkeypatch.setattr("flowgrpo.trainer.write_before_after", lambda run_dir: None)
    ckpt, weights = train_and_resume(TINY, tmp_path, overrides)
    assert any("single_transformer_blocks.0.attn.to_q.lora_B" in k and weights[k].abs().max() > 0 for k in weights)

    export_checkpoint(ckpt, tmp_path / "lora")
    export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    config = run_config(ckpt)
    adapter = adapter_from_checkpoint(config, ckpt)
    latents = adapter.initial_noise(2, 32, 32, generator=torch.Generator().manual_seed(0))
    sampler = ode_sampler(config.eval)
    sampler.num_steps, sampler.window = 4, WindowConfig(size=0)
    assert sampler.guidance_scale == 6.0 and sampler.time_shift is None  # evaluation: pipe()'s own schedule
    ours = rollout(adapter, PROMPTS, [0, 1], sampler, range(0, 0), height=32, width=32, initial_latents=latents).images

    kw = dict(prompt=PROMPTS, guidance_scale=6.0, num_inference_steps=4, height=32, width=32, num_frames=5)
    outputs = {}
    for name, path, lora in [("base", base, False), ("lora", base, True), ("merged", tmp_path / "merged", False)]:
        plain = HunyuanVideoPipeline.from_pretrained(str(path))
        plain.set_progress_bar_config(disable=True)
        if lora:
            plain.load_lora_weights(str(tmp_path / "lora"))
        outputs[name] = plain(latents=latents.clone(), output_type="pt", **kw).frames
    assert (outputs["base"] - ours).abs().max() > 1e-3  # the adapter really changes the clips
    torch.testing.assert_close(outputs["lora"], ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(outputs["merged"], ours, rtol=0, atol=1e-4)
