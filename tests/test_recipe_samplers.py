"""Sampler options that reproduce the published recipes exactly, each checked against a small computation written
after the reference code (Flow-GRPO: yifan123/flow_grpo; MixGRPO: Tencent-Hunyuan/MixGRPO (mirrored as
zqqqqz2000/MixGRPO); DanceGRPO: XueZeyue/DanceGRPO). Tiny offline pipelines, CPU, a few seconds each."""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.adapters import make_adapter
from flowgrpo.config import ConfigError, PostWindowConfig, SamplerConfig, WindowConfig, load_config
from flowgrpo.rollout import Trajectory, evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline
from samplers import (
    SlidingWindow,
    compress_schedule,
    cps_step,
    euler_maruyama_step,
    langevin_step,
    mixgrpo_tail_schedule,
    ode_step,
    pipeline_schedule,
    sde_step,
    static_shift_schedule,
)

SIZE = 32
PROMPTS = ['a sign that says "hello"', "a red cube", "a red cube", "a blue ball"]
GUIDANCE = {"sd3": 4.5, "flux": 3.5}


@pytest.fixture(scope="module")
def adapters():
    return {kind: make_adapter(build_tiny_pipeline(kind, seed=0)) for kind in ("sd3", "flux")}


def _noise(adapter, n=4, seed=0):
    return adapter.initial_noise(n, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def _rescores_exactly(adapter, traj, sampler, exact=True):
    """Every stored transition, re-scored with unchanged weights (shared and per-sample positions): ratio exactly 1.

    ``exact=False`` for a micro-batch of another size than the rollout's: CPU kernels may then split the work
    differently (multi-threaded matmuls), so only agreement to float32 rounding is guaranteed."""
    n, steps = len(traj), traj.num_trained_steps

    def same(a, b):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    with torch.no_grad():
        for j in range(steps):
            same(evaluate_transitions(adapter, traj, j, sampler).log_prob, traj.log_probs[:, j])
        positions = torch.arange(n) % steps
        again = evaluate_transitions(adapter, traj, positions, sampler).log_prob
    same(again, traj.log_probs[torch.arange(n), positions])


# ------------------------------------------------------------------ reference computations
def ref_sd3_time_shift(shift, t):
    """MixGRPO fastvideo/utils/sampling_utils.py::sd3_time_shift (= DanceGRPO fastvideo/train_grpo_flux.py)."""
    return (shift * t) / (1 + (shift - 1) * t)


def ref_flowgrpo_sde(model_output, sample, sigma, sigma_prev, sigma_max, noise_level, variance_noise):
    """Flow-GRPO flow_grpo/diffusers_patch/sd3_sde_with_logprob.py::sde_step_with_logprob, sde_type='sde'."""
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = (
        sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    return prev_sample, prev_sample_mean, std_dev_t * torch.sqrt(-1 * dt)


def ref_flowgrpo_cps(model_output, sample, sigma, sigma_prev, noise_level, prev_sample=None, variance_noise=None):
    """Flow-GRPO sd3_sde_with_logprob.py::sde_step_with_logprob, sde_type='cps' ("remove all constants")."""
    std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
    pred_original_sample = sample - sigma * model_output
    noise_estimate = sample + model_output * (1 - sigma)
    prev_sample_mean = pred_original_sample * (1 - sigma_prev) + noise_estimate * torch.sqrt(
        sigma_prev**2 - std_dev_t**2
    )
    if prev_sample is None:
        prev_sample = prev_sample_mean + std_dev_t * variance_noise
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


# ------------------------------------------------------------------ 1. sampler.time_shift
@pytest.mark.parametrize(("num_steps", "shift"), [(25, 3.0), (16, 3.0), (6, 1.0), (10, 0.5)])
def test_static_shift_schedule_is_mixgrpo_and_dancegrpo_schedule_bit_for_bit(num_steps, shift):
    """MixGRPO train_grpo_flux.py::sample_reference_model / DanceGRPO train_grpo_flux.py::sample_reference_model:
    ``sd3_time_shift(shift, linspace(1, 0, T + 1))``; timesteps ``int(sigma * 1000)`` (MixGRPO train_one_step)."""
    sigma_schedule = ref_sd3_time_shift(shift, torch.linspace(1, 0, num_steps + 1))
    timestep_value = [int(sigma * 1000) for sigma in sigma_schedule][:num_steps]
    sigmas, timesteps = static_shift_schedule(num_steps, shift)
    assert torch.equal(sigmas, sigma_schedule) and sigmas.dtype == torch.float32
    assert timesteps.tolist() == [float(v) for v in timestep_value]
    assert sigmas[0] == 1 and sigmas[-1] == 0


def test_time_shift_rollout_reproduces_the_dancegrpo_sampling_loop(adapters):
    """DanceGRPO train_grpo_flux.py::run_sample_step (= MixGRPO sampling_utils.py::run_sample_step outside the
    window) with eta = 0: the network gets ``int(sigma * 1000) / 1000`` as FLUX timestep, the step uses the exact
    sigma (``flux_step``: ``latents + dsigma * model_output``)."""
    adapter, steps, shift = adapters["flux"], 8, 3.0
    latents = _noise(adapter)
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=3.5, time_shift=shift)
    traj = rollout(
        adapter,
        PROMPTS,
        [0, 1, 1, 2],
        sampler,
        range(0, 0),
        height=SIZE,
        width=SIZE,
        initial_latents=latents,
        decode=False,
    )

    embeds = adapter.encode_prompts(PROMPTS)
    pipe, transformer = adapter.pipe, adapter.pipe.transformer
    side = math.isqrt(adapter.latent_shape(SIZE, SIZE)[0])  # packed latents: side × side tokens
    image_ids = pipe._prepare_latent_image_ids(1, side, side, adapter.device, adapter.dtype)
    text_ids = torch.zeros(embeds.prompt_embeds.shape[1], 3)
    sigma_schedule = ref_sd3_time_shift(shift, torch.linspace(1, 0, steps + 1))
    z = latents.clone()
    with torch.no_grad():
        for i in range(steps):
            sigma = sigma_schedule[i]
            timesteps = torch.full([z.shape[0]], int(sigma * 1000), dtype=torch.long)
            pred = transformer(
                hidden_states=z,
                encoder_hidden_states=embeds.prompt_embeds,
                timestep=timesteps / 1000,
                guidance=torch.full([z.shape[0]], 3.5),
                txt_ids=text_ids,
                pooled_projections=embeds.pooled,
                img_ids=image_ids,
                return_dict=False,
            )[0]
            z = z + (sigma_schedule[i + 1] - sigma) * pred
    torch.testing.assert_close(traj.final_latents, z, rtol=0, atol=1e-6)
    # The pipeline's own schedule (what pipe() and evaluation use) is another one.
    pipeline_sigmas, _ = adapter.schedule(steps, SIZE, SIZE)
    assert not torch.allclose(pipeline_sigmas, sigma_schedule)


def test_time_shift_rescores_with_the_same_truncated_timesteps(adapters):
    adapter = adapters["sd3"]
    sampler = SamplerConfig(noise_level=0.7, num_steps=6, guidance_scale=4.5, time_shift=3.0)
    traj = rollout(
        adapter,
        PROMPTS,
        [0, 1, 1, 2],
        sampler,
        range(0, 5),
        torch.Generator().manual_seed(3),
        height=SIZE,
        width=SIZE,
        decode=False,
    )
    torch.testing.assert_close(traj.sigmas[0], static_shift_schedule(6, 3.0)[0][:5], rtol=0, atol=0)
    _rescores_exactly(adapter, traj, sampler)


# ------------------------------------------------------------------ 2. sampler.last_step
def test_flowgrpo_flux_last_step_numbers_and_every_kind_is_defined_at_t_next_zero():
    """Flow-GRPO config/grpo.py::pickscore_flux (6 steps, 512 px, noise 0.9) samples its final step with
    sd3_sde_with_logprob.py::sde_step_with_logprob too: from sigma ≈ 0.273 with std ≈ 0.29."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler config
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    sigmas, _ = pipeline_schedule(scheduler, 6, family="flux", image_seq_len=(512 // 16) ** 2)
    sigma = sigmas[-2]
    assert sigmas[-1] == 0 and abs(float(sigma) - 0.273) < 1e-3
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(2, 16, 8, generator=g) for _ in range(3))
    ours = euler_maruyama_step(v, x, sigma, 0.0, noise_level=0.9, t_second=sigmas[1], noise=z)
    sample, mean, std = ref_flowgrpo_sde(v, x, sigma, torch.tensor(0.0), sigmas[1], 0.9, z)
    assert abs(float(std) - 0.29) < 0.005
    torch.testing.assert_close(ours.std, std, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.mean, mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.sample, sample, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(ours.log_prob).all()
    # cps and langevin are defined at t_next = 0 too, and deterministic there: the Euler (ODE) step.
    ode = ode_step(v, x, sigma, 0.0)
    for step in (
        cps_step(v, x, sigma, 0.0, noise_level=0.8, noise=z),
        cps_step(v, x, sigma, 0.0, noise_level=0.8, noise=z, log_prob="squared_error"),
        langevin_step(v, x, sigma, 0.0, noise_level=0.9, t_second=sigmas[1], noise=z),
    ):
        assert float(step.std.max()) == 0 and torch.equal(step.sample, ode) and torch.isfinite(step.log_prob).all()


def test_last_step_sde_adds_the_reference_noise_and_is_the_ode_without_noise(adapters):
    """Flow-GRPO flux_pipeline_with_logprob.py::pipeline_with_logprob calls sde_step_with_logprob on every step,
    the last included (train_flux.py trains only the first int(0.99 T)); our final step must be that step."""
    adapter, steps, seed = adapters["flux"], 6, 5
    latents = _noise(adapter)
    common = {"num_steps": steps, "guidance_scale": 3.5}

    def run(**kw):
        generator = torch.Generator().manual_seed(seed)
        sampler = SamplerConfig(**common, **kw)
        return rollout(
            adapter,
            PROMPTS,
            [0, 1, 1, 2],
            sampler,
            range(0, steps - 1),
            generator,
            height=SIZE,
            width=SIZE,
            initial_latents=latents,
            decode=False,
        )

    # No noise: the same images as the ODE last step.
    quiet = run(noise_level=0.0, last_step="sde")
    assert torch.equal(quiet.final_latents, run(noise_level=0.0, last_step="ode").final_latents)
    # With noise: the final step is Flow-GRPO's SDE step (same draw: the generator's draw after the window's).
    ode, sde = run(noise_level=0.9, last_step="ode"), run(noise_level=0.9, last_step="sde")
    assert torch.equal(sde.next_latents, ode.next_latents) and torch.equal(sde.log_probs, ode.log_probs)
    assert sde.num_trained_steps == steps - 1  # nothing stored for the final step
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps - 1):
        torch.randn(latents.shape, generator=generator)
    variance_noise = torch.randn(latents.shape, generator=generator)
    sigmas, _ = adapter.schedule(steps, SIZE, SIZE)
    x = sde.next_latents[:, -1]
    with torch.no_grad():
        model_output = adapter.velocity(x, sigmas[-2], sde.embeds, 3.5)
    expected, _, std = ref_flowgrpo_sde(model_output, x, sigmas[-2], sigmas[-1], sigmas[1], 0.9, variance_noise)
    assert float(std) > 0.1
    torch.testing.assert_close(sde.final_latents, expected, rtol=1e-5, atol=1e-5)
    assert (sde.final_latents - ode.final_latents).abs().mean() > 0.05


# ------------------------------------------------------------------ 3. sampler.window.per_batch
def test_per_batch_windows_are_seeded_per_batch_and_flowgrpo_fast_uniform():
    """Flow-GRPO sd3_pipeline_with_logprob_fast.py::pipeline_with_logprob draws
    ``start = random.randint(sde_window_range[0], sde_window_range[1] - sde_window_size)`` on every call, i.e. for
    every rollout batch (scripts/train_sd3_fast.py); config geneval_sd3_fast_nocfg: size 3, range (0, T // 2)."""
    window = SlidingWindow(10, 3, strategy="random", seed=7, max_start=10 // 2 - 3)
    again = SlidingWindow(10, 3, strategy="random", seed=7, max_start=10 // 2 - 3)
    starts = [[window.start(it, b) for b in range(6)] for it in range(300)]
    assert starts == [[again.start(it, b) for b in range(6)] for it in range(300)]  # resume sees the same windows
    assert all(row[0] == window.start(it) for it, row in enumerate(starts))  # batch 0 = the per-epoch window
    assert sum(len(set(row)) > 1 for row in starts) > 250  # batches of one iteration differ
    flat = torch.tensor(starts).flatten()
    assert set(flat.tolist()) == {0, 1, 2}  # randint(0, 5 - 3)
    assert ((torch.bincount(flat) / len(flat)) - 1 / 3).abs().max() < 0.03
    assert all(len(window.steps(it, b)) == 3 for it in range(20) for b in range(4))
    with pytest.raises(ValueError, match="random"):
        SlidingWindow(10, 3, strategy="progressive").steps(0, batch=1)


def test_batches_with_different_windows_join_and_rescore_exactly(adapters):
    adapter, steps = adapters["sd3"], 8
    window = SlidingWindow(steps, 2, strategy="random", seed=0)
    w0, w1 = window.steps(0, batch=0), window.steps(0, batch=1)
    assert w0 != w1
    sampler = SamplerConfig(
        noise_level=0.7,
        num_steps=steps,
        guidance_scale=4.5,
        window=WindowConfig(size=2, strategy="random", per_batch=True),
    )
    generator = torch.Generator().manual_seed(1)
    parts = [
        rollout(
            adapter, PROMPTS[2 * b : 2 * b + 2], [b, b], sampler, w, generator, height=SIZE, width=SIZE, decode=False
        )
        for b, w in enumerate((w0, w1))
    ]
    traj = Trajectory.cat(parts)
    assert traj.step_indices.tolist() == [list(w0)] * 2 + [list(w1)] * 2
    full, _ = adapter.schedule(steps, SIZE, SIZE)
    assert torch.equal(traj.sigmas, full[traj.step_indices])
    assert torch.equal(traj.sigmas_next, full[traj.step_indices + 1])
    assert traj.stds.shape == (4, 2) and (traj.stds > 0).all()
    _rescores_exactly(adapter, traj, sampler)
    _rescores_exactly(adapter, traj.select([3, 0, 2]), sampler, exact=False)  # a micro-batch across both windows
    with pytest.raises(ValueError, match="same size"):
        Trajectory.cat(
            [
                parts[0],
                rollout(
                    adapter, PROMPTS[:2], [0, 0], sampler, range(0, 3), generator, height=SIZE, width=SIZE, decode=False
                ),
            ]
        )


def test_trainer_draws_a_window_per_batch_and_stays_on_policy(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    import flowgrpo.rollouts.chain as chain_module
    import flowgrpo.trainer as trainer_module

    root = Path(__file__).resolve().parent.parent
    config = load_config(
        root / "configs" / "tiny_sd3.yaml",
        [
            f"run.output_dir={tmp_path}",
            "run.progress=false",
            "run.epochs=1",
            "eval.every=0",
            "run.seed=0",
            "sampler.window.size=2",
            "sampler.window.strategy=random",
            "sampler.window.per_batch=true",
        ],
    )
    windows = []
    real_rollout = chain_module.rollout
    monkeypatch.setattr(chain_module, "rollout", lambda *a, **k: windows.append(a[4]) or real_rollout(*a, **k))
    trainer = trainer_module.GRPOTrainer(config)
    trainer.fit()
    reference = SlidingWindow(6, 2, strategy="random", seed=0)
    assert windows == [reference.steps(0, batch=0), reference.steps(0, batch=1)] and windows[0] != windows[1]
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "train/loss" in r)
    assert row["train/onpolicy_ratio_dev"] == 0.0
    assert row["window/start"] == (windows[0].start + windows[1].start) / 2


# ------------------------------------------------------------------ 4. sampler.log_prob
def test_squared_error_log_prob_is_flowgrpo_cps_convention():
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(3, 4, 6, 6, generator=g) for _ in range(3))
    sigma = torch.tensor([0.9, 0.6, 0.35]).view(-1, 1, 1, 1)
    sigma_prev = torch.tensor([0.8, 0.45, 0.2]).view(-1, 1, 1, 1)
    ours = cps_step(v, x, sigma.flatten(), sigma_prev.flatten(), noise_level=0.8, noise=z, log_prob="squared_error")
    prev, log_prob, mean, std = ref_flowgrpo_cps(v, x, sigma, sigma_prev, 0.8, variance_noise=z)
    torch.testing.assert_close(ours.sample, prev, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.mean, mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.std, std, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.log_prob, log_prob, rtol=1e-5, atol=1e-7)
    # Scoring a stored sample (training): the reference's prev_sample path.
    stored = torch.randn(x.shape, generator=g)
    rescored = cps_step(
        v, x, sigma.flatten(), sigma_prev.flatten(), noise_level=0.8, prev_sample=stored, log_prob="squared_error"
    )
    torch.testing.assert_close(rescored.log_prob, ref_flowgrpo_cps(v, x, sigma, sigma_prev, 0.8, stored)[1])
    exact = cps_step(v, x, sigma.flatten(), sigma_prev.flatten(), noise_level=0.8, noise=z)
    assert not torch.allclose(exact.log_prob, ours.log_prob)
    with pytest.raises(ValueError, match="cps"):
        sde_step("euler_maruyama", v, x, 0.5, 0.4, noise_level=0.7, log_prob="squared_error")


def test_squared_error_flows_through_rollout_and_rescoring(adapters):
    adapter = adapters["flux"]
    sampler = SamplerConfig(kind="cps", noise_level=0.8, num_steps=6, guidance_scale=3.5, log_prob="squared_error")
    traj = rollout(
        adapter,
        PROMPTS,
        [0, 1, 1, 2],
        sampler,
        range(0, 3),
        torch.Generator().manual_seed(2),
        height=SIZE,
        width=SIZE,
        decode=False,
    )
    for j in range(3):
        with torch.no_grad():
            mean = evaluate_transitions(adapter, traj, j, sampler).mean
        stored = -((traj.next_latents[:, j].float() - mean) ** 2).mean(dim=tuple(range(1, mean.ndim)))
        assert torch.equal(traj.log_probs[:, j], stored)  # the rollout stored the squared-error convention
    _rescores_exactly(adapter, traj, sampler)


# ------------------------------------------------------------------ MixGRPO details
class RefGRPOTrainingStates:
    """MixGRPO fastvideo/utils/grpo_states.py::GRPOTrainingStates, progressive strategy with prog_overlap (as its
    finetune_flux_grpo_MixGRPO*.sh), and max_timesteps = sampling_steps - 2 as train_grpo_flux.py::main sets it."""

    def __init__(self, iters_per_group, group_size, max_timesteps, prog_overlap_step, roll_back):
        self.iters_per_group, self.group_size, self.max_timesteps = iters_per_group, group_size, max_timesteps
        self.prog_overlap_step, self.roll_back = prog_overlap_step, roll_back
        self.cur_timestep = self.cur_iter_in_group = 0

    def update_iteration(self):
        self.cur_iter_in_group += 1
        if self.cur_iter_in_group >= self.iters_per_group:
            self.cur_iter_in_group = 0
            self.cur_timestep += self.prog_overlap_step
        if self.cur_timestep > self.max_timesteps:
            if self.roll_back:
                self.cur_timestep = self.cur_iter_in_group = 0
            else:
                self.cur_timestep = self.max_timesteps

    def get_current_timesteps(self):
        return list(range(self.cur_timestep, min(self.cur_timestep + self.group_size, self.max_timesteps)))


@pytest.mark.parametrize(("num_steps", "size", "interval"), [(25, 4, 25), (25, 4, 20), (10, 4, 3)])
def test_end_margin_two_is_mixgrpo_window(num_steps, size, interval):
    """train_grpo_flux.py::main: ``timesteps_train = grpo_states.get_current_timesteps()`` then
    ``update_iteration()``; the window never holds index T - 2. Compared over every position where the reference
    window is not empty (at start T - 2 it is, see the report)."""
    ref = RefGRPOTrainingStates(interval, size, num_steps - 2, 1, roll_back=True)
    ours = SlidingWindow(num_steps, size, shift_interval=interval, stride=1, end_margin=2)
    default = SlidingWindow(num_steps, size, shift_interval=interval, stride=1)
    iterations = interval * (num_steps - 2)  # starts 0 .. T - 3
    differs = False
    for it in range(iterations):
        expected = ref.get_current_timesteps()
        ref.update_iteration()
        assert list(ours.steps(it)) == expected, it
        differs |= list(default.steps(it)) != expected
    assert differs  # the default (only the last step excluded) trains index T - 2
    # random: rng.integers(0, max_timesteps - group_size + 1), a window of full size before T - 2
    rand = SlidingWindow(num_steps, size, strategy="random", seed=3, end_margin=2)
    assert {rand.start(i) for i in range(2000)} == set(range(0, num_steps - 2 - size + 1))


def ref_mixgrpo_flash(velocity, z, sigma_schedule, last_false_index):
    """MixGRPO sampling_utils.py::run_sample_step with dpm_algorithm_type dpmsolver++, dpm_apply_strategy post,
    dpm_solver_order 2, dpm_solver_type midpoint, flow_grpo_sampling, eta 0 (dpm_step, DPMState,
    dpm_solver_first_order_update, multistep_dpm_solver_second_order_update). Takes the already rebuilt schedule
    (:func:`ref_post_sigma_schedule`)."""
    model_outputs, lower_order_nums = [None, None], 0

    def lam(s):
        return torch.log(1 - s) - torch.log(s)

    for i in range(len(sigma_schedule) - 1):
        pred = velocity(z, sigma_schedule[i])
        x_0 = z - sigma_schedule[i] * pred  # convert_model_output
        model_outputs = [model_outputs[1], x_0]  # dpm_state.update
        if i <= last_false_index:  # flow_grpo_step, deterministic at eta 0
            z = z + (sigma_schedule[i + 1] - sigma_schedule[i]) * pred
        else:
            sigma_t, sigma_s0 = sigma_schedule[i + 1], sigma_schedule[i]
            alpha_t = 1 - sigma_t
            h = lam(sigma_t) - lam(sigma_s0)
            if lower_order_nums < 1 or i == len(sigma_schedule) - 2:  # lower_order_final
                z = (sigma_t / sigma_s0) * z - (alpha_t * (torch.exp(-h) - 1.0)) * x_0
            else:
                h_0 = lam(sigma_s0) - lam(sigma_schedule[i - 1])
                r0 = h_0 / h
                d0, d1 = model_outputs[1], (1.0 / r0) * (model_outputs[1] - model_outputs[0])
                z = (
                    (sigma_t / sigma_s0) * z
                    - (alpha_t * (torch.exp(-h) - 1.0)) * d0
                    - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1
                )
        lower_order_nums = min(lower_order_nums + 1, 2)  # dpm_state.update_lower_order
    return z


def ref_post_sigma_schedule(sigma_schedule, determistic, dpm_post_compress_ratio, shift):
    """MixGRPO sampling_utils.py::run_sample_step, ``dpm_apply_strategy == "post"``: the rebuilt sigma schedule,
    line by line. Returns ``(sigma_schedule, last_false_index)``."""
    last_false_index = next((i for i, value in enumerate(reversed(determistic)) if not value), None)
    if last_false_index is not None:
        last_false_index = len(determistic) - 1 - last_false_index
    num_post_steps = int(max((sigma_schedule.size(0) - 1 - last_false_index) * dpm_post_compress_ratio, 1))
    # rebuild post sigma schedule
    post_time_step = torch.linspace(1, 0, sigma_schedule.size(0))[last_false_index + 1].item()
    post_sigma_schedule = torch.linspace(post_time_step, 0, num_post_steps)
    post_sigma_schedule = ref_sd3_time_shift(shift, post_sigma_schedule)
    sigma_schedule = torch.cat([sigma_schedule[: last_false_index + 1], post_sigma_schedule], dim=0)
    return sigma_schedule, last_false_index


def _determistic(num_steps, window):
    """train_grpo_flux.py::sample_reference_model, training_strategy "part": False on the trained steps."""
    determistic = [True] * num_steps
    for i in window:
        determistic[i] = False
    return determistic


@pytest.mark.parametrize(
    "window", [range(0, 4), range(1, 4), range(5, 9), range(10, 14), range(16, 20), range(17, 21), range(19, 23)]
)
def test_time_shift_tail_is_mixgrpo_flash_post_schedule(window):
    """MixGRPO-Flash (T = 25, shift 3, dpm_post_compress_ratio 0.4): the tail is ``int((T - last) · 0.4)`` points
    of ``sd3_time_shift(3, linspace(t_{last+1}, 0, n))`` (t unshifted), after the unchanged sigmas up to the window's
    end; ``compress_schedule``'s rule (a subset of the original sigmas) is another schedule."""
    steps, shift, ratio = 25, 3.0, 0.4
    sigma_schedule = ref_sd3_time_shift(shift, torch.linspace(1, 0, steps + 1))
    expected, last = ref_post_sigma_schedule(sigma_schedule, _determistic(steps, window), ratio, shift)
    assert last == window.stop - 1
    full, _ = static_shift_schedule(steps, shift)
    ours = mixgrpo_tail_schedule(full, window.stop, ratio, shift)
    assert torch.equal(ours[: window.stop + 1], full[: window.stop + 1])  # the window's steps keep their sigmas
    assert ours[-1] == 0 and (ours[1:] < ours[:-1]).all()
    if int((steps - last) * ratio) >= 2:
        assert torch.equal(ours, expected)
        if len(expected) - window.stop > 2:  # more than one tail step: not the pipelines' rule
            assert not torch.equal(ours, compress_schedule(full, window.stop, ratio))
    else:  # the reference stops at sigma_{last+1} > 0 (num_post_steps = 1); ours takes one more step, into 0
        assert len(expected) == window.stop + 1 and expected[-1] > 0
        assert torch.equal(ours, torch.cat([expected, torch.zeros(1)]))


def test_time_shift_tail_numbers_and_edges():
    full, _ = static_shift_schedule(25, 3.0)
    ours = mixgrpo_tail_schedule(full, 4, 0.4, 3.0)  # window ending at index 3
    tail = [0.9403, 0.8852, 0.8182, 0.7347, 0.6279, 0.4865, 0.2903, 0.0]  # 8 points: 7 steps instead of 21
    torch.testing.assert_close(ours[4:], torch.tensor(tail), rtol=0, atol=1e-4)
    assert len(compress_schedule(full, 4, 0.4)) - 1 - 4 == 8  # the pipelines' rule keeps int(21 · 0.4) steps
    assert torch.equal(mixgrpo_tail_schedule(full, 25, 0.4, 3.0), full)  # no tail
    # ratio 1: as many steps as before, on the same grid up to float32 rounding of the second linspace
    torch.testing.assert_close(mixgrpo_tail_schedule(full, 4, 1.0, 3.0), full, rtol=0, atol=1e-6)
    # no window (the reference would fail on last_false_index = None): the tail starts at t = 1
    no_window = mixgrpo_tail_schedule(full, 0, 0.4, 3.0)
    assert len(no_window) == int(26 * 0.4) and no_window[0] == 1 and no_window[-1] == 0
    with pytest.raises(ValueError, match="static shifted schedule"):
        mixgrpo_tail_schedule(static_shift_schedule(25, 2.0)[0], 4, 0.4, 3.0)


def _ref_flux_velocity(adapter, embeds, guidance=3.5):
    """MixGRPO run_sample_step's transformer call: ``timestep_value = int(sigma * 1000)``, fed divided by 1000."""
    pipe, transformer = adapter.pipe, adapter.pipe.transformer
    side = math.isqrt(adapter.latent_shape(SIZE, SIZE)[0])  # packed latents: side × side tokens
    image_ids = pipe._prepare_latent_image_ids(1, side, side, adapter.device, adapter.dtype)
    text_ids = torch.zeros(embeds.prompt_embeds.shape[1], 3)

    def velocity(z, sigma):
        timesteps = torch.full([z.shape[0]], int(sigma * 1000), dtype=torch.long)
        return transformer(
            hidden_states=z,
            encoder_hidden_states=embeds.prompt_embeds,
            timestep=timesteps / 1000,
            guidance=torch.full([z.shape[0]], guidance),
            txt_ids=text_ids,
            pooled_projections=embeds.pooled,
            img_ids=image_ids,
            return_dict=False,
        )[0]

    return velocity


@pytest.mark.parametrize("window", [range(0, 4), range(8, 12)])
def test_carry_history_is_mixgrpo_flash_solver_state(adapters, window):
    """The whole MixGRPO-Flash rollout (time shift 3, DPM-Solver++(2M) on the rebuilt tail, history carried from
    the window) against run_sample_step written out, at eta 0."""
    adapter, steps, shift = adapters["flux"], 25, 3.0
    latents = _noise(adapter, 2)
    embeds = adapter.encode_prompts(PROMPTS[:2])
    sigma_schedule = ref_sd3_time_shift(shift, torch.linspace(1, 0, steps + 1))
    sigma_schedule, last = ref_post_sigma_schedule(sigma_schedule, _determistic(steps, window), 0.4, shift)
    with torch.no_grad():
        expected = ref_mixgrpo_flash(_ref_flux_velocity(adapter, embeds), latents.clone(), sigma_schedule, last)

    def run(carry):
        post = PostWindowConfig(solver="dpmpp_2m", ratio=0.4, carry_history=carry)
        sampler = SamplerConfig(
            noise_level=0.0, num_steps=steps, guidance_scale=3.5, post_window=post, time_shift=shift
        )
        return rollout(
            adapter,
            PROMPTS[:2],
            [0, 0],
            sampler,
            window,
            torch.Generator().manual_seed(0),
            height=SIZE,
            width=SIZE,
            initial_latents=latents,
            decode=False,
        ).final_latents

    torch.testing.assert_close(run(True), expected, rtol=1e-5, atol=1e-5)
    assert (run(False) - expected).abs().max() > 1e-3  # first order after the window: not the reference


def test_carry_history_on_the_pipeline_schedule_uses_compress_schedule(adapters):
    """Without a time shift (the pipeline's schedule, which MixGRPO never uses) the tail is ``compress_schedule``'s;
    the solver and its carried history are the reference's."""
    adapter, steps, window = adapters["flux"], 10, range(1, 4)
    latents = _noise(adapter, 2)
    embeds = adapter.encode_prompts(PROMPTS[:2])
    full, _ = adapter.schedule(steps, SIZE, SIZE)
    sigmas = compress_schedule(full, window.stop, 0.4)
    with torch.no_grad():
        expected = ref_mixgrpo_flash(
            lambda y, s: adapter.velocity(y, s, embeds, 3.5), latents.clone(), sigmas, window.stop - 1
        )
    post = PostWindowConfig(solver="dpmpp_2m", ratio=0.4, carry_history=True)
    sampler = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=3.5, post_window=post)
    got = rollout(
        adapter,
        PROMPTS[:2],
        [0, 0],
        sampler,
        window,
        torch.Generator().manual_seed(0),
        height=SIZE,
        width=SIZE,
        initial_latents=latents,
        decode=False,
    ).final_latents
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_mixgrpo_flash_tail_leaves_the_window_and_the_ratio_alone(adapters):
    """With noise: the rebuilt tail changes only what comes after the window; the stored transitions are those of
    the Euler tail, at the full schedule's sigmas, and re-score with ratio exactly 1."""
    adapter, steps, window = adapters["flux"], 25, range(5, 9)
    latents = _noise(adapter)

    def run(solver):
        post = PostWindowConfig(
            solver=solver, ratio=0.4 if solver == "dpmpp_2m" else 1.0, carry_history=solver == "dpmpp_2m"
        )
        sampler = SamplerConfig(noise_level=0.9, num_steps=steps, guidance_scale=3.5, post_window=post, time_shift=3.0)
        traj = rollout(
            adapter,
            PROMPTS,
            [0, 0, 1, 1],
            sampler,
            window,
            torch.Generator().manual_seed(3),
            height=SIZE,
            width=SIZE,
            initial_latents=latents,
            decode=False,
        )
        return traj, sampler

    flash, sampler = run("dpmpp_2m")
    euler, _ = run("euler")
    for name in ("latents", "next_latents", "log_probs", "stds", "sigmas", "sigmas_next", "step_indices"):
        assert torch.equal(getattr(flash, name), getattr(euler, name)), name
    full, _ = static_shift_schedule(steps, 3.0)
    assert torch.equal(flash.sigmas[0], full[5:9]) and torch.equal(flash.sigmas_next[0], full[6:10])
    assert not torch.equal(flash.final_latents, euler.final_latents)
    _rescores_exactly(adapter, flash, sampler)


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sampler.log_prob=squared_error"], "sampler.log_prob=squared_error .* sampler.kind: cps"),
        (["sampler.window.per_batch=true"], "sampler.window.per_batch=true .*sampler.window.strategy: random"),
        (["sampler.time_shift=0"], "sampler.time_shift must be > 0"),
        (["sampler.last_step=noisy"], "sampler.last_step must be one of ode, sde"),
        (["sampler.last_step=sde", "sampler.post_window.solver=dpmpp_2m"], "post_window.solver: euler"),
        (["sampler.post_window.carry_history=true"], "carry_history=true .*post_window.solver: dpmpp_2m"),
        (["sampler.window.end_margin=0"], "sampler.window.end_margin must be >= 1"),
        (["sampler.window.end_margin=2", "sampler.window.size=10", "sampler.num_steps=11"], "at most 9 steps"),
    ],
)
def test_recipe_option_errors_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_recipe_options_accept_the_published_settings():
    flowgrpo_fast = load_config(
        None,
        [
            "sampler.kind=cps",
            "sampler.noise_level=0.8",
            "sampler.log_prob=squared_error",
            "sampler.window.size=3",
            "sampler.window.strategy=random",
            "sampler.window.max_start=2",
            "sampler.window.per_batch=true",
        ],
    )
    assert flowgrpo_fast.sampler.window.per_batch and flowgrpo_fast.sampler.log_prob == "squared_error"
    mixgrpo = load_config(
        None,
        [
            "sampler.num_steps=25",
            "sampler.time_shift=3",
            "sampler.window.size=4",
            "sampler.window.end_margin=2",
            "sampler.post_window.solver=dpmpp_2m",
            "sampler.post_window.ratio=0.4",
            "sampler.post_window.carry_history=true",
        ],
    )
    assert mixgrpo.sampler.time_shift == 3.0
    assert load_config(None, ["sampler.last_step=sde"]).sampler.last_step == "sde"
