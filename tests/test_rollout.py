"""Adapters and rollouts on tiny random SD3 / FLUX / Qwen-Image pipelines: alignment with pipe(), exact re-scoring,
LoRA (Qwen-Image's own cases: test_qwenimage.py)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from flowgrpo.adapters import make_adapter, unwrap
from flowgrpo.config import ConfigError, PostWindowConfig, SamplerConfig, load_config
from flowgrpo.pipelines import load_pipeline
from flowgrpo.rollout import evaluate_transitions, plan_rollout, rollout, stored_log_probs
from flowgrpo.tiny import build_tiny_pipeline
from samplers import SDE_STEPS, euler_maruyama_step, register_sde_step

SIZE = 32
GUIDANCE = {"sd3": 4.5, "flux": 3.5, "qwenimage": 4.0}  # SD3 with CFG, FLUX its guidance embedding, Qwen true CFG
# The same guidance as pipe() takes it (Qwen-Image: true_cfg_scale, with the adapter's negative prompt, "").
PIPE_GUIDANCE = {
    "sd3": {"guidance_scale": 4.5},
    "flux": {"guidance_scale": 3.5},
    "qwenimage": {"true_cfg_scale": 4.0, "negative_prompt": ""},
}
PROMPTS = ['a sign that says "hello"', "a red cube", "a red cube", "a blue ball"]


@pytest.fixture(scope="module", params=["sd3", "flux", "qwenimage"])
def kind(request):
    return request.param


def _adapter(kind, seed=0):
    return make_adapter(build_tiny_pipeline(kind, seed=seed))


@pytest.mark.parametrize("steps", [4, 7])
def test_noise_free_rollout_reproduces_pipe(kind, steps):
    adapter = _adapter(kind)
    latents = adapter.initial_noise(len(PROMPTS), SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    expected = adapter.pipe(
        prompt=PROMPTS,
        latents=latents.clone(),
        num_inference_steps=steps,
        **PIPE_GUIDANCE[kind],
        height=SIZE,
        width=SIZE,
        output_type="pt",
    ).images
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=GUIDANCE[kind])
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1, 2], sampler, range(0, steps - 1), height=SIZE, width=SIZE, initial_latents=latents
    )
    assert traj.images.shape == (len(PROMPTS), 3, SIZE, SIZE)
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)


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
def test_rescoring_the_stored_trajectory_gives_ratio_exactly_one(kind, sampler_kwargs):
    adapter = _adapter(kind)
    sampler = SamplerConfig(**{"noise_level": 0.7, "num_steps": 6, "guidance_scale": GUIDANCE[kind], **sampler_kwargs})
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1, 2], sampler, range(1, 4), torch.Generator().manual_seed(1), height=SIZE, width=SIZE
    )
    assert traj.num_trained_steps == 3 and traj.log_probs.shape == (4, 3)
    assert torch.isfinite(traj.log_probs).all()
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            again = evaluate_transitions(adapter, traj, j, sampler)
        assert torch.equal(again.log_prob, traj.log_probs[:, j])
        assert torch.equal(torch.exp(again.log_prob - traj.log_probs[:, j]), torch.ones(4))
    # A micro-batch re-scores the same way.
    sub = traj.select([3, 0])
    with torch.no_grad():
        torch.testing.assert_close(evaluate_transitions(adapter, sub, 1, sampler).log_prob, traj.log_probs[[3, 0], 1])


def test_text_encoders_run_once_per_unique_prompt(kind):
    adapter = _adapter(kind)
    pipe = adapter.pipe
    names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    encoders = [m for m in (getattr(pipe, name, None) for name in names) if m]
    rows = {id(e): [] for e in encoders}
    for encoder in encoders:
        encoder.register_forward_hook(
            lambda mod, args, kwargs, out: rows[id(mod)].append((args[0] if args else kwargs["input_ids"]).shape[0]),
            with_kwargs=True,
        )
    sampler = SamplerConfig(num_steps=3, guidance_scale=GUIDANCE[kind])
    for epoch in range(2):
        rollout(
            adapter,
            PROMPTS,
            [0, 1, 1, 2],
            sampler,
            range(0, 1),
            torch.Generator().manual_seed(epoch),
            height=SIZE,
            width=SIZE,
            decode=False,
        )
    unique = len(set(PROMPTS)) + adapter.needs_negative(GUIDANCE[kind])  # CFG adds the (empty) negative prompt
    for encoder in encoders:
        assert rows[id(encoder)] == [unique], (type(encoder).__name__, rows[id(encoder)])
    assert adapter.text_encoder_calls == 1


def test_window_stores_exactly_its_steps_and_mixgrpo_flash_compresses_the_tail(kind):
    adapter = _adapter(kind)
    calls = []
    forward = adapter.velocity
    adapter.velocity = lambda *a, **k: calls.append(1) or forward(*a, **k)
    steps = 10
    for window, solver, ratio, expected_calls in [
        (range(2, 5), "euler", 1.0, steps),
        (range(0, 0), "euler", 1.0, steps),
        (range(2, 5), "dpmpp_2m", 0.4, 5 + max(int((steps - 5) * 0.4), 1)),
    ]:
        calls.clear()
        sampler = SamplerConfig(
            num_steps=steps, guidance_scale=GUIDANCE[kind], post_window=PostWindowConfig(solver=solver, ratio=ratio)
        )
        traj = rollout(
            adapter, PROMPTS[:2], [0, 0], sampler, window, torch.Generator().manual_seed(0), height=SIZE, width=SIZE
        )
        assert traj.num_trained_steps == len(window) == traj.latents.shape[1] == traj.next_latents.shape[1]
        assert traj.step_indices.tolist() == [list(window)] * 2
        assert len(calls) == expected_calls
        assert torch.isfinite(traj.images).all()
        if len(window):
            full, _ = adapter.schedule(steps, SIZE, SIZE)
            torch.testing.assert_close(traj.sigmas, full[list(window)].expand(2, -1))


def test_shared_initial_noise_within_groups_across_batches(kind):
    adapter = _adapter(kind)
    noise = adapter.initial_noise(
        4,
        SIZE,
        SIZE,
        generator=torch.Generator().manual_seed(0),
        group_ids=[5, 5, 9, 9],
        same_within_group=True,
        noise_seed=3,
    )
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[2], noise[3])
    assert not torch.equal(noise[0], noise[2])
    # Another batch (or another process) holding copies of group 9 draws the same noise for them.
    other = adapter.initial_noise(
        2,
        SIZE,
        SIZE,
        generator=torch.Generator().manual_seed(1),
        group_ids=[9, 7],
        same_within_group=True,
        noise_seed=3,
    )
    assert torch.equal(other[0], noise[2])
    reseeded = adapter.initial_noise(1, SIZE, SIZE, group_ids=[9], same_within_group=True, noise_seed=4)
    assert not torch.equal(reseeded[0], noise[2])


def test_lora_trains_only_adapter_weights_and_disabled_adapter_is_the_base_model(kind):
    adapter = _adapter(kind)
    sampler = SamplerConfig(num_steps=4, guidance_scale=GUIDANCE[kind])
    traj = rollout(
        adapter, PROMPTS[:2], [0, 0], sampler, range(0, 3), torch.Generator().manual_seed(0), height=SIZE, width=SIZE
    )
    x, t = traj.latents[:, 1], traj.sigmas[:, 1]
    with torch.no_grad():
        base = adapter.velocity(x, t, traj.embeds, traj.guidance_scale)
    adapter.add_lora(rank=4, alpha=8)
    trainable = adapter.trainable_parameters()
    names = [n for n, p in adapter.transformer.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in names)
    assert all(p.dtype == torch.float32 for p in trainable)
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # make the adapter change the output
        adapted = adapter.velocity(x, t, traj.embeds, traj.guidance_scale)
        with adapter.adapter_disabled():
            reference = adapter.velocity(x, t, traj.embeds, traj.guidance_scale)
    assert not torch.allclose(adapted, base)
    torch.testing.assert_close(reference, base, rtol=0, atol=0)
    # Gradients reach the adapter from the re-scored log-prob, and only the adapter.
    step = evaluate_transitions(adapter, traj, 1, sampler)
    step.log_prob.mean().backward()
    assert all(p.grad is not None for p in trainable)
    assert all(p.grad is None for p in adapter.transformer.parameters() if not p.requires_grad)


def test_reference_forward_under_ddp_wrapper():
    import torch.distributed as dist

    adapter = _adapter("sd3")
    adapter.add_lora(rank=2, alpha=2)
    initialized_here = not dist.is_initialized()
    if initialized_here:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
    try:
        adapter.transformer = torch.nn.parallel.DistributedDataParallel(adapter.transformer)
        assert unwrap(adapter.transformer) is adapter.pipe.transformer
        with torch.no_grad():
            for name, param in unwrap(adapter.transformer).named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.5)
        embeds = adapter.encode_prompts(["a cat"], with_negative=True)
        x = adapter.initial_noise(1, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            with adapter.adapter_disabled():
                reference = adapter.velocity(x, 0.5, embeds, 4.5)
            adapted = adapter.velocity(x, 0.5, embeds, 4.5)
            unwrap(adapter.transformer).disable_adapters()
            base = adapter.velocity(x, 0.5, embeds, 4.5)
            unwrap(adapter.transformer).enable_adapters()
        torch.testing.assert_close(reference, base, rtol=0, atol=0)
        assert not torch.allclose(adapted, base)
    finally:
        if initialized_here:
            dist.destroy_process_group()


def test_bad_inputs_raise_clear_errors():
    adapter = _adapter("sd3")
    sampler = SamplerConfig(num_steps=3)
    with pytest.raises(ValueError, match="multiples of 4"):
        rollout(adapter, ["a"], [0], sampler, range(0, 1), height=30, width=32)
    with pytest.raises(ValueError, match="at least one prompt"):
        rollout(adapter, [], [], sampler, range(0, 1), height=32, width=32)
    with pytest.raises(ValueError, match="one id per prompt"):
        rollout(adapter, ["a", "b"], [0], sampler, range(0, 1), height=32, width=32)
    with pytest.raises(ValueError, match="last is ODE"):
        rollout(adapter, ["a"], [0], sampler, range(0, 3), height=32, width=32)
    with pytest.raises(ValueError, match="sampler kind"):
        rollout(adapter, ["a"], [0], SamplerConfig(kind="ddim", num_steps=3), range(0, 1), height=32, width=32)
    with pytest.raises(ValueError, match="sd3"):
        load_pipeline("tiny-sd3", kind="sdxl")
    with pytest.raises(ValueError, match="no adapter"):
        make_adapter(object())
    with pytest.raises(ValueError, match="target_modules"):
        adapter.add_lora(rank=2, target_modules=["no_such_layer"])
    with pytest.raises(ValueError, match="xformers|CUDA"):
        adapter.set_attention_backend("xformers")


def test_per_sample_shuffled_steps_rescore_exactly(kind):
    adapter = _adapter(kind)
    sampler = SamplerConfig(noise_level=0.7, num_steps=6, guidance_scale=GUIDANCE[kind])
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1, 2], sampler, range(0, 5), torch.Generator().manual_seed(2), height=SIZE, width=SIZE
    )
    steps = torch.tensor([4, 0, 2, 1])
    with torch.no_grad():
        again = evaluate_transitions(adapter, traj, steps, sampler)
    expected = stored_log_probs(traj, steps)
    assert torch.equal(expected, torch.stack([traj.log_probs[i, int(steps[i])] for i in range(4)]))
    torch.testing.assert_close(again.log_prob, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["flux", "flux-kontext", "qwenimage"])
def test_transposed_sizes_keep_their_own_token_positions(family):
    """32x48 and 48x32 images have the same number of packed tokens (FLUX, Kontext, Qwen-Image) but transposed grids:
    a rollout at 48x32 after one at 32x48 equals a fresh adapter's, and re-scoring the 32x48 trajectory afterwards
    gives its stored log-probs (the on-policy ratio stays 1)."""
    guidance = GUIDANCE[family if family != "flux-kontext" else "flux"]
    sampler = SamplerConfig(noise_level=0.7, num_steps=3, guidance_scale=guidance)
    red = Image.new("RGB", (40, 40), (200, 30, 30))
    sources = {"sources": [red, red]} if family == "flux-kontext" else {}

    def sample(adapter, height, width):
        generator = torch.Generator().manual_seed(0)
        args = (adapter, PROMPTS[:2], [0, 1], sampler, range(0, 2), generator)
        return rollout(*args, height=height, width=width, decode=False, **sources)

    adapter = _adapter(family)
    wide = sample(adapter, 32, 48)
    tall = sample(adapter, 48, 32)
    fresh = sample(_adapter(family), 48, 32)
    assert torch.equal(tall.final_latents, fresh.final_latents) and torch.equal(tall.log_probs, fresh.log_probs)
    for j in range(wide.num_trained_steps):
        with torch.no_grad():
            assert torch.equal(evaluate_transitions(adapter, wide, j, sampler).log_prob, wide.log_probs[:, j])


def test_bf16_weights_fp32_vae_and_exact_rescoring():
    from flowgrpo.config import ModelConfig
    from flowgrpo.pipelines import build_adapter

    adapter = build_adapter(ModelConfig(pretrained="tiny-sd3", dtype="bf16", vae_fp32=True, resolution=32))
    assert adapter.dtype == torch.bfloat16 and adapter.vae.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in adapter.trainable_parameters())  # LoRA trains in fp32
    sampler = SamplerConfig(noise_level=0.7, num_steps=4, guidance_scale=4.5)
    traj = rollout(
        adapter, PROMPTS, [0, 1, 1, 2], sampler, range(0, 3), torch.Generator().manual_seed(0), height=SIZE, width=SIZE
    )
    assert traj.latents.dtype == torch.bfloat16 and traj.log_probs.dtype == torch.float32
    assert torch.isfinite(traj.images).all() and traj.images.dtype == torch.float32
    with torch.no_grad():
        again = evaluate_transitions(adapter, traj, 1, sampler)
    assert torch.equal(again.log_prob, traj.log_probs[:, 1])  # same batch, precision and timesteps: ratio 1


@pytest.mark.parametrize("family", ["flux", "flux-kontext"])
def test_flux_true_cfg_reproduces_pipe_and_rescores_exactly(family):
    """model.true_cfg_scale > 1: FluxPipeline's (and FluxKontextPipeline's) true CFG, a second forward on the negative
    prompt, neg + s·(cond − neg), on top of the guidance embedding, in rollouts and re-scoring alike."""
    negative, scale = "blurry, low quality", 3.0
    adapter = make_adapter(build_tiny_pipeline(family), negative_prompt=negative, true_cfg_scale=scale)
    red = Image.new("RGB", (SIZE, SIZE), (200, 30, 30))
    edit = family == "flux-kontext"
    sources = {"sources": [red] * len(PROMPTS)} if edit else {}
    latents = adapter.initial_noise(len(PROMPTS), SIZE, SIZE, generator=torch.Generator().manual_seed(0))

    def pipe(**guidance):
        kontext = {"image": [red] * len(PROMPTS), "max_area": SIZE * SIZE, "_auto_resize": False} if edit else {}
        size = {"height": SIZE, "width": SIZE, "output_type": "pt", **kontext}
        steps = {"num_inference_steps": 4, "guidance_scale": 3.5, **guidance}
        return adapter.pipe(prompt=PROMPTS, latents=latents.clone(), **steps, **size).images

    expected = pipe(negative_prompt=negative, true_cfg_scale=scale)
    sampler = SamplerConfig(noise_level=0.0, num_steps=4, guidance_scale=3.5)
    args = (adapter, PROMPTS, [0, 1, 1, 2], sampler, range(0, 3))
    traj = rollout(*args, height=SIZE, width=SIZE, initial_latents=latents, **sources)
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    assert traj.embeds.negative_embeds is not None and (pipe() - expected).abs().max() > 1e-4  # it really guides
    sampler = SamplerConfig(noise_level=0.7, num_steps=4, guidance_scale=3.5)
    traj = rollout(
        *args[:3], sampler, range(0, 3), torch.Generator().manual_seed(1), height=SIZE, width=SIZE, **sources
    )
    for j in range(traj.num_trained_steps):
        with torch.no_grad():
            assert torch.equal(evaluate_transitions(adapter, traj, j, sampler).log_prob, traj.log_probs[:, j])


def test_true_cfg_is_refused_where_it_cannot_work():
    """True CFG without a negative prompt (FluxPipeline would silently skip it), below 1, on a family without it
    (SD3 / Qwen-Image guide by sampler.guidance_scale), or with a forward-process fit of the unguided velocity."""
    from flowgrpo.pipelines import build_adapter

    kontext = "configs/tiny_flux_kontext.yaml"
    with pytest.raises(ConfigError, match="model.true_cfg_scale=3.0 guides away from a negative prompt, but model.neg"):
        make_adapter(build_tiny_pipeline("flux"), true_cfg_scale=3.0)
    with pytest.raises(ConfigError, match=r"model.true_cfg_scale must be >= 1 \(1 is off, as in pipe\(\)\), got 0.5"):
        load_config(kontext, ["model.true_cfg_scale=0.5", "model.negative_prompt=x"])
    with pytest.raises(ConfigError, match="set model.negative_prompt"):
        load_config(kontext, ["model.true_cfg_scale=2"])
    # the families that take it, FLUX first, then any registered later (hunyuanvideo, ...)
    refused = r"model\.true_cfg_scale=2\.0 is an option of flux, flux-kontext(, [a-z0-9-]+)* only, but the model is "
    with pytest.raises(ConfigError, match=refused + r"qwenimage \(QwenImagePipeline\)"):
        make_adapter(build_tiny_pipeline("qwenimage"), negative_prompt="x", true_cfg_scale=2.0)
    with pytest.raises(ConfigError, match=refused + "sd3: remove model.true_cfg_scale"):
        load_config("configs/tiny_sd3.yaml", ["model.kind=sd3", "model.true_cfg_scale=2", "model.negative_prompt=x"])
    with pytest.raises(ConfigError, match="grpo.awm.cfg=false fits the unguided velocity, but model.true_cfg_scale=2"):
        load_config(kontext, ["model.true_cfg_scale=2", "model.negative_prompt=x", "grpo.objective=awm"])
    guided = build_adapter(load_config(kontext, ["model.true_cfg_scale=2", 'model.negative_prompt=" "']).model)
    assert guided.true_cfg_scale == 2.0 and guided.negative_prompt == " " and guided.needs_negative(1.0)
    assert build_adapter(load_config(kontext).model).true_cfg_scale == 1  # the default: off


def test_flux_without_guidance_embedding_like_schnell_matches_pipe_and_rescores_exactly():
    """FLUX.1-schnell's layout: no guidance embedding (the adapter passes guidance=None) and an unshifted schedule."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    pipe = build_tiny_pipeline("flux")
    config = {**pipe.transformer.config, "guidance_embeds": False}
    torch.manual_seed(3)
    pipe.transformer = FluxTransformer2DModel.from_config(config).eval()
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    adapter = make_adapter(pipe)
    sigmas, _ = adapter.schedule(4, SIZE, SIZE)
    assert sigmas.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    latents = adapter.initial_noise(2, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    expected = pipe(
        prompt=PROMPTS[:2],
        latents=latents.clone(),
        num_inference_steps=4,
        guidance_scale=0.0,
        height=SIZE,
        width=SIZE,
        output_type="pt",
    ).images
    traj = rollout(
        adapter,
        PROMPTS[:2],
        [0, 1],
        SamplerConfig(noise_level=0.0, num_steps=4, guidance_scale=0.0),
        range(0, 3),
        height=SIZE,
        width=SIZE,
        initial_latents=latents,
    )
    torch.testing.assert_close(traj.images, expected, rtol=0, atol=1e-5)
    sampler = SamplerConfig(noise_level=0.9, num_steps=4, guidance_scale=0.0)
    traj = rollout(
        adapter, PROMPTS[:2], [0, 1], sampler, range(0, 3), torch.Generator().manual_seed(1), height=SIZE, width=SIZE
    )
    for j in range(3):
        with torch.no_grad():
            assert torch.equal(evaluate_transitions(adapter, traj, j, sampler).log_prob, traj.log_probs[:, j])


def dance_step(v, x, t, t_next, *, noise_level, noise=None, generator=None, prev_sample=None, reduce="mean"):
    """A step kind registered from this file: DanceGRPO's constant-diffusion Euler–Maruyama step."""
    draw = {"noise": noise, "generator": generator, "prev_sample": prev_sample, "reduce": reduce}
    return euler_maruyama_step(v, x, t, t_next, noise_level=noise_level, diffusion="dance", **draw)


def test_a_step_kind_registered_in_a_test_file_samples_rescores_and_validates():
    """A new ``sampler.kind`` is one registered function: the config accepts it, the rollout samples its window with
    it (here the same maths as euler_maruyama with the dance diffusion, so the same trajectory bit for bit) and the
    stored transitions re-score exactly; removed from the registry, the config refuses it again."""
    register_sde_step("test_dance")(dance_step)
    try:
        assert load_config(None, ["sampler.kind=test_dance"]).sampler.kind == "test_dance"
        adapter = _adapter("sd3")
        common = {"noise_level": 0.3, "num_steps": 5, "guidance_scale": GUIDANCE["sd3"]}
        sampler = SamplerConfig(kind="test_dance", **common)
        trajectories = [
            rollout(
                adapter,
                PROMPTS,
                [0, 1, 1, 2],
                s,
                range(1, 3),
                torch.Generator().manual_seed(1),
                height=SIZE,
                width=SIZE,
                decode=False,
            )
            for s in (sampler, SamplerConfig(kind="euler_maruyama", diffusion="dance", **common))
        ]
        traj, reference = trajectories
        assert torch.equal(traj.log_probs, reference.log_probs)
        assert torch.equal(traj.final_latents, reference.final_latents)
        with torch.no_grad():
            for position in (0, 1, torch.tensor([1, 0, 0, 1])):
                again = evaluate_transitions(adapter, traj, position, sampler).log_prob
                assert torch.equal(again, stored_log_probs(traj, position))
    finally:
        del SDE_STEPS["test_dance"]
    with pytest.raises(ConfigError, match="sampler.kind must be one of euler_maruyama, cps, langevin"):
        load_config(None, ["sampler.kind=test_dance"])


FLASH = {"post_window": PostWindowConfig(solver="dpmpp_2m", ratio=0.4)}  # 5 steps after the window -> int(5 · 0.4)


@pytest.mark.parametrize(
    ("window", "options", "parts"),
    [
        (range(2, 5), {}, (range(0, 2), range(2, 5), range(5, 10))),
        (range(0, 0), {}, (range(0, 0), range(0, 0), range(0, 10))),
        (range(0, 9), {"last_step": "sde"}, (range(0, 0), range(0, 9), range(9, 9))),
        (range(3, 5), {"last_step": "sde"}, (range(0, 3), range(3, 5), range(5, 9))),
        (range(2, 5), FLASH, (range(0, 2), range(2, 5), range(5, 7))),
    ],
)
def test_the_plan_splits_the_schedule_into_prefix_window_and_tail(window, options, parts):
    sampler = SamplerConfig(num_steps=10, same_initial_noise=True, **options)
    sigmas = torch.linspace(1, 0, 11)
    plan = plan_rollout(sampler, window, sigmas)
    assert (plan.prefix, plan.window, plan.tail) == parts
    assert plan.num_steps == parts[2].stop + plan.last_step_sde == len(plan.sigmas) - 1
    assert plan.share_prefix == (len(parts[0]) > 0) and plan.t_second == float(sigmas[1])
    assert torch.equal(plan.sigmas[: window.stop + 1], sigmas[: window.stop + 1])


def test_the_plan_refuses_bad_options_before_any_network_call():
    sigmas = torch.linspace(1, 0, 7)
    for sampler, window, match in [
        (SamplerConfig(num_steps=6), range(0, 6), "within steps 0..4"),
        (SamplerConfig(num_steps=6), range(0, 4, 2), "consecutive"),
        (SamplerConfig(num_steps=6, kind="ddim"), range(0, 2), "euler_maruyama, cps, langevin"),
        (SamplerConfig(num_steps=6, post_window=PostWindowConfig(solver="rk4")), range(0, 2), "euler, dpmpp_2m"),
        (
            SamplerConfig(num_steps=6, last_step="sde", post_window=PostWindowConfig(solver="dpmpp_2m")),
            range(0, 2),
            "last_step='sde'",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            plan_rollout(sampler, window, sigmas)
    plan_rollout(SamplerConfig(num_steps=6, kind="ddim"), range(0, 0), sigmas)  # no SDE step: the kind is unused
