"""Rollouts: sample a batch with an SDE inside the trained window and an ODE outside it, keeping the
trained transitions; and the re-evaluation of stored transitions that the GRPO loss needs.

Everything model-specific goes through the adapter; everything stochastic through ``samplers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from samplers import (
    Transition,
    compress_schedule,
    mixgrpo_tail_schedule,
    ode_step,
    sde_step,
    solver_step,
    truncated_timesteps,
)

from .adapters import PipelineAdapter, PromptEmbeds
from .config import SamplerConfig


@dataclass
class Trajectory:
    """A sampled batch: the trained (SDE) transitions only, plus what the loss and rewards need.

    latents / next_latents: [B, W, *latent]  before / after each of the W window steps
    log_probs:              [B, W]           float32 log-prob of each transition under the sampling policy
    stds:                   [B, W]           the transitions' std
    sigmas / sigmas_next:   [B, W]           t and t_next of each window step
    step_indices:           [B, W] long      the window's step indices in the (uncompressed) schedule
    images:                 [B, 3, H, W] in [0, 1], video models [B, F, 3, H, W] (None when not decoded);
                            final_latents [B, *latent] (video: the latents' frame axis is part of *latent)

    The per-step fields are per sample, so batches sampled with different windows of the same size (a new
    window per rollout batch, Flow-GRPO-Fast) join into one trajectory.
    """

    prompts: list[str]
    group_ids: Tensor
    embeds: PromptEmbeds
    latents: Tensor
    next_latents: Tensor
    log_probs: Tensor
    stds: Tensor
    sigmas: Tensor
    sigmas_next: Tensor
    step_indices: Tensor
    t_second: float
    guidance_scale: float
    height: int
    width: int
    final_latents: Tensor
    images: Tensor | None = None
    metadata: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def source_images(self) -> Tensor | None:
        """Editing: the source images ``[B, 3, h, w]`` in [0, 1] (CPU) the samples were conditioned on, else None."""
        return self.embeds.source_images

    @property
    def num_trained_steps(self) -> int:
        return self.step_indices.shape[1]

    @staticmethod
    def cat(parts: Sequence[Trajectory]) -> Trajectory:
        """Join rollout batches taken with the same schedule and windows of the same size into one trajectory."""
        if not parts:
            raise ValueError("Trajectory.cat needs at least one trajectory")
        first = parts[0]
        sizes = sorted({p.num_trained_steps for p in parts})
        if len(sizes) > 1:
            raise ValueError(f"Trajectory.cat joins batches whose windows have the same size, got sizes {sizes}")
        joined: dict[str, Any] = {}
        for name in _PER_SAMPLE:
            values = [getattr(p, name) for p in parts]
            joined[name] = None if any(v is None for v in values) else torch.cat(values)
        joined["prompts"] = [p for part in parts for p in part.prompts]
        joined["metadata"] = [m for part in parts for m in part.metadata]
        joined["embeds"] = PromptEmbeds.cat([p.embeds for p in parts])
        return replace(first, **joined)

    def select(self, index: Tensor | Sequence[int]) -> Trajectory:
        """The samples ``index`` (a micro-batch)."""
        index = torch.as_tensor(list(index) if not isinstance(index, Tensor) else index, dtype=torch.long)
        picked: dict[str, Any] = {}
        for name in _PER_SAMPLE:
            value = getattr(self, name)
            if value is not None:
                picked[name] = value[index.to(value.device)]
        picked["prompts"] = [self.prompts[i] for i in index.tolist()]
        picked["embeds"] = self.embeds.select(index)
        if self.metadata:
            picked["metadata"] = [self.metadata[i] for i in index.tolist()]
        return replace(self, **picked)


_PER_SAMPLE = (
    "group_ids", "latents", "next_latents", "log_probs", "stds", "sigmas", "sigmas_next", "step_indices",
    "final_latents", "images",
)  # fmt: skip


def _step_kwargs(sampler: SamplerConfig) -> dict[str, Any]:
    return {
        "noise_level": sampler.noise_level,
        "diffusion": sampler.diffusion,
        "score_eval": sampler.score_eval,
        "kappa": sampler.kappa,
        "log_prob": sampler.log_prob,
    }


def _velocity_fn(adapter: PipelineAdapter, embeds: PromptEmbeds, sampler: SamplerConfig, guidance_scale: float):
    """``v(x, sigma)`` as the rollout calls it. With ``sampler.time_shift`` the network sees ``int(1000 σ)``, as in
    MixGRPO's / DanceGRPO's code, while the step maths keeps the exact sigma."""
    if sampler.time_shift is None:
        return lambda y, s: adapter.velocity(y, s, embeds, guidance_scale)
    return lambda y, s: adapter.velocity(y, s, embeds, guidance_scale, timestep=truncated_timesteps(s))


@torch.no_grad()
def rollout(
    adapter: PipelineAdapter,
    prompts: Sequence[str],
    group_ids: Tensor | Sequence[int],
    sampler: SamplerConfig,
    window: range,
    generator: torch.Generator | None = None,
    *,
    height: int,
    width: int,
    initial_latents: Tensor | None = None,
    decode: bool = True,
    log_prob_reduce: str = "mean",
    metadata: list[dict[str, Any]] | None = None,
    noise_seed: int = 0,
    progress: bool = False,
    sources: Sequence[Any] | None = None,
) -> Trajectory:
    """Sample ``len(prompts)`` images; steps in ``window`` use the SDE and are stored, the rest use the ODE
    (the steps after the window: ``sampler.post_window.solver``; the final step: the SDE too, unstored, when
    ``sampler.last_step == "sde"``). ``sampler.time_shift`` replaces the pipeline's schedule by the static one.
    With ``sampler.same_initial_noise`` and ``sampler.shared_prefix``, the ODE steps before the window run once per
    group of the batch (its images' latents are identical there) and fan out at the window. ``sources`` (editing):
    each prompt's source image (a file path or PIL image), encoded once and carried in the trajectory's embeddings."""
    prompts = list(prompts)
    if not prompts:
        raise ValueError("rollout needs at least one prompt, got an empty list")
    group_ids = torch.as_tensor(list(group_ids) if not isinstance(group_ids, Tensor) else group_ids)
    if group_ids.shape != (len(prompts),):
        raise ValueError(f"group_ids must have one id per prompt ({len(prompts)}), got shape {tuple(group_ids.shape)}")
    if window and (window.start < 0 or window.stop > sampler.num_steps - 1):
        raise ValueError(f"window {window} must lie within steps 0..{sampler.num_steps - 2} (the last is ODE)")
    if sampler.last_step not in ("ode", "sde"):
        raise ValueError(f"sampler.last_step must be 'ode' or 'sde', got {sampler.last_step!r}")
    if sampler.last_step == "sde" and sampler.post_window.solver != "euler":
        raise ValueError("sampler.last_step='sde' needs post_window.solver='euler' (the solver owns the final step)")
    embeds = adapter.encode_conditions(prompts, with_negative=adapter.needs_negative(sampler.guidance_scale),
                                       sources=sources, height=height, width=width)  # fmt: skip
    sigmas, _ = adapter.schedule(sampler.num_steps, height, width, time_shift=sampler.time_shift)
    t_second = float(sigmas[1])
    after = window.stop if window else 0
    multistep = sampler.post_window.solver == "dpmpp_2m"
    if multistep and sampler.time_shift is not None:  # MixGRPO-Flash's own tail: a new grid, uniform in t
        sigmas = mixgrpo_tail_schedule(sigmas, after, sampler.post_window.ratio, sampler.time_shift)
    elif multistep:  # the pipeline's schedule: a subset of its own sigmas
        sigmas = compress_schedule(sigmas, after, sampler.post_window.ratio)
    final = len(sigmas) - 2  # index of the step into t = 0
    if initial_latents is None:
        x = adapter.initial_noise(
            len(prompts), height, width, generator=generator, group_ids=group_ids,
            same_within_group=sampler.same_initial_noise, noise_seed=noise_seed,
        )  # fmt: skip
    else:
        expected = (len(prompts), *adapter.latent_shape(height, width))
        if tuple(initial_latents.shape) != expected:
            raise ValueError(f"initial_latents must have shape {expected}, got {tuple(initial_latents.shape)}")
        x = initial_latents.to(device=adapter.device, dtype=adapter.latent_dtype)

    gs = sampler.guidance_scale
    velocity_fn = _velocity_fn(adapter, embeds, sampler, gs)
    carry = multistep and sampler.post_window.carry_history
    before, after_, log_probs, stds = [], [], [], []
    history = None  # multistep state of the post-window solver
    prefix = window.start if window else 0  # the deterministic ODE steps before the window
    rows = None
    if sampler.shared_prefix and sampler.same_initial_noise and prefix > 0:
        rows = _prefix_rows(prompts, group_ids, x, drawn=initial_latents is None)
    if rows is not None:
        # Shared prefix: a group's images have the same prompt and noise, so steps 0..k-1 (ODE) give them the same
        # latents. The loop runs them once per group of this batch, batched over its groups, and fans out at the window.
        unique, fan_out = rows
        prefix_fn = _velocity_fn(adapter, embeds.select(unique), sampler, gs)
        x = x[unique.to(x.device)]
    for i in tqdm(range(len(sigmas) - 1), desc="sampling", disable=not progress, leave=False):
        t, t_next = sigmas[i], sigmas[i + 1]
        if rows is not None and i == prefix:  # fan out: every image continues from its group's latents
            x = x[fan_out.to(x.device)]
            if history is not None:
                history = (history[0][fan_out.to(history[0].device)], history[1])
        v = (prefix_fn if rows is not None and i < prefix else velocity_fn)(x, t)
        if carry and i < after:
            # MixGRPO-Flash's DPMState also records the x0 of every step up to the window's end, so the solver's
            # first step after the window is already second order.
            history = (x.float() - t.float() * v.float(), torch.as_tensor(t))
        if i in window:
            step = sde_step(
                sampler.kind, v, x, t, t_next, t_second=t_second, velocity_fn=velocity_fn, generator=generator,
                reduce=log_prob_reduce, **_step_kwargs(sampler),
            )  # fmt: skip
            before.append(x)
            after_.append(step.sample)
            log_probs.append(step.log_prob)
            std = step.std.float()  # one per step ([]) or per sample ([B, 1, ...])
            stds.append(std.reshape(std.shape[0], -1)[:, 0] if std.ndim else std.expand(len(prompts)))
            x = step.sample
        elif i == final and sampler.last_step == "sde":
            # Flow-GRPO samples its final step with the SDE as well; it is never trained, so nothing is stored.
            x = sde_step(
                sampler.kind, v, x, t, t_next, t_second=t_second, velocity_fn=velocity_fn, generator=generator,
                reduce=log_prob_reduce, **_step_kwargs(sampler),
            ).sample  # fmt: skip
        elif i >= after:
            x, history = solver_step(sampler.post_window.solver, v, x, t, t_next, history)
        else:
            x = ode_step(v, x, t, t_next)

    window_idx = list(window)
    n = len(prompts)
    latent_shape = tuple(x.shape[1:])
    stack = lambda items: torch.stack(items, dim=1) if items else x.new_zeros((n, 0, *latent_shape))  # noqa: E731
    per_sample = lambda values: values.unsqueeze(0).repeat(n, 1)  # noqa: E731  [W] -> [B, W]
    return Trajectory(
        prompts=prompts,
        group_ids=group_ids,
        embeds=embeds,
        latents=stack(before),
        next_latents=stack(after_),
        log_probs=torch.stack(log_probs, dim=1) if log_probs else torch.zeros(n, 0),
        stds=torch.stack(stds, dim=1) if stds else torch.zeros(n, 0),
        sigmas=per_sample(sigmas[window_idx]),
        sigmas_next=per_sample(sigmas[[i + 1 for i in window_idx]]),
        step_indices=per_sample(torch.tensor(window_idx, dtype=torch.long)),
        t_second=t_second,
        guidance_scale=gs,
        height=height,
        width=width,
        final_latents=x,
        images=adapter.decode(x, height, width) if decode else None,
        metadata=list(metadata) if metadata is not None else [],
    )


def _prefix_rows(prompts: list[str], group_ids: Tensor, x: Tensor, *, drawn: bool) -> tuple[Tensor, Tensor] | None:
    """``(unique [U], fan_out [B])`` for a shared prefix: one row per (group, prompt) of the batch, in order of first
    appearance, and each row's position in ``unique`` (``x[unique][fan_out]`` is ``x``). The rows a group shares must
    really start identical: checked on the noise itself. ``None`` (no sharing) when a group's rows differ in the
    caller's ``initial_latents``; with noise drawn here (``same_within_group``) that is a bug and raises."""
    slots: dict[tuple[int, str], int] = {}
    fan_out = [slots.setdefault((int(g), p), len(slots)) for g, p in zip(group_ids.tolist(), prompts, strict=True)]
    first_row: dict[int, int] = {}
    for i, slot in enumerate(fan_out):
        first_row.setdefault(slot, i)  # slots are numbered in order of first appearance
    unique = torch.tensor(list(first_row.values()), dtype=torch.long)
    fan_out = torch.tensor(fan_out, dtype=torch.long)
    device = x.device
    if not torch.equal(x[unique.to(device)][fan_out.to(device)], x):
        if drawn:
            raise RuntimeError("same_initial_noise drew different noise for images of one group (shared prefix)")
        return None
    return unique, fan_out


def evaluate_transitions(
    adapter: PipelineAdapter,
    trajectory: Trajectory,
    step: int | Tensor,
    sampler: SamplerConfig,
    *,
    log_prob_reduce: str = "mean",
) -> Transition:
    """Re-score stored transitions under the current weights.

    ``step`` is a position in the window, shared by the batch (int) or per sample (``[B]`` long tensor,
    for shuffled timesteps). Runs the same forward path as the rollout (same guidance, precision and
    sigmas), so with unchanged weights ``log_prob`` equals the stored one exactly. Gradients flow to the
    adapter unless called under ``torch.no_grad()``; wrap in ``adapter.adapter_disabled()`` for the reference.
    """
    x, t, t_next, prev = _stored(trajectory, step)
    velocity_fn = _velocity_fn(adapter, trajectory.embeds, sampler, trajectory.guidance_scale)
    return sde_step(
        sampler.kind, velocity_fn(x, t), x, t, t_next, t_second=trajectory.t_second, velocity_fn=velocity_fn,
        prev_sample=prev, reduce=log_prob_reduce, **_step_kwargs(sampler),
    )  # fmt: skip


def stored_log_probs(trajectory: Trajectory, step: int | Tensor) -> Tensor:
    """The rollout's log-probs ``[B]`` at window position ``step`` (int or per-sample ``[B]``)."""
    if isinstance(step, int):
        return trajectory.log_probs[:, step]
    return trajectory.log_probs[torch.arange(len(trajectory)), step.to(trajectory.log_probs.device)]


def _stored(trajectory: Trajectory, step: int | Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if isinstance(step, int):
        return (trajectory.latents[:, step], trajectory.sigmas[:, step], trajectory.sigmas_next[:, step],
                trajectory.next_latents[:, step])  # fmt: skip
    if step.shape != (len(trajectory),):
        raise ValueError(f"per-sample steps must have shape ({len(trajectory)},), got {tuple(step.shape)}")
    rows = torch.arange(len(trajectory), device=trajectory.latents.device)
    step = step.to(trajectory.latents.device)
    sigma_rows, sigma_step = rows.to(trajectory.sigmas.device), step.to(trajectory.sigmas.device)
    return (trajectory.latents[rows, step], trajectory.sigmas[sigma_rows, sigma_step],
            trajectory.sigmas_next[sigma_rows, sigma_step], trajectory.next_latents[rows, step])  # fmt: skip
