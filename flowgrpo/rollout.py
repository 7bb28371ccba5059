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

from samplers import Transition, compress_schedule, ode_step, sde_step, solver_step

from .adapters import PipelineAdapter, PromptEmbeds
from .config import SamplerConfig


@dataclass
class Trajectory:
    """A sampled batch: the trained (SDE) transitions only, plus what the loss and rewards need.

    latents / next_latents: [B, W, *latent]  before / after each of the W window steps
    log_probs:              [B, W]           float32 log-prob of each transition under the sampling policy
    stds:                   [W]              the transitions' std
    sigmas / sigmas_next:   [W]              t and t_next of each window step
    step_indices:           the window's step indices in the (uncompressed) schedule
    images:                 [B, 3, H, W] in [0, 1] (None when not decoded); final_latents [B, *latent]
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
    step_indices: list[int]
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
    def num_trained_steps(self) -> int:
        return len(self.step_indices)

    @staticmethod
    def cat(parts: Sequence[Trajectory]) -> Trajectory:
        """Join rollout batches taken with the same window and schedule into one trajectory."""
        if not parts:
            raise ValueError("Trajectory.cat needs at least one trajectory")
        first = parts[0]
        joined: dict[str, Any] = {}
        for name in _PER_SAMPLE:
            values = [getattr(p, name) for p in parts]
            joined[name] = None if any(v is None for v in values) else torch.cat(values)
        joined["prompts"] = [p for part in parts for p in part.prompts]
        joined["metadata"] = [m for part in parts for m in part.metadata]
        joined["embeds"] = PromptEmbeds.cat([p.embeds for p in parts])
        return replace(first, **joined)

    def select(self, index: Tensor | Sequence[int]) -> Trajectory:
        """The samples ``index`` (a micro-batch), sharing the per-step fields."""
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


_PER_SAMPLE = ("group_ids", "latents", "next_latents", "log_probs", "final_latents", "images")


def _step_kwargs(sampler: SamplerConfig) -> dict[str, Any]:
    return {
        "noise_level": sampler.noise_level,
        "diffusion": sampler.diffusion,
        "score_eval": sampler.score_eval,
        "kappa": sampler.kappa,
    }


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
) -> Trajectory:
    """Sample ``len(prompts)`` images; steps in ``window`` use the SDE and are stored, the rest use the ODE."""
    prompts = list(prompts)
    if not prompts:
        raise ValueError("rollout needs at least one prompt, got an empty list")
    group_ids = torch.as_tensor(list(group_ids) if not isinstance(group_ids, Tensor) else group_ids)
    if group_ids.shape != (len(prompts),):
        raise ValueError(f"group_ids must have one id per prompt ({len(prompts)}), got shape {tuple(group_ids.shape)}")
    if window and (window.start < 0 or window.stop > sampler.num_steps - 1):
        raise ValueError(f"window {window} must lie within steps 0..{sampler.num_steps - 2} (the last is ODE)")
    embeds = adapter.encode_prompts(prompts, with_negative=adapter.needs_negative(sampler.guidance_scale))
    sigmas, _ = adapter.schedule(sampler.num_steps, height, width)
    t_second = float(sigmas[1])
    after = window.stop if window else 0
    if sampler.post_window.solver == "dpmpp_2m":
        sigmas = compress_schedule(sigmas, after, sampler.post_window.ratio)
    if initial_latents is None:
        x = adapter.initial_noise(
            len(prompts), height, width, generator=generator, group_ids=group_ids,
            same_within_group=sampler.same_initial_noise, noise_seed=noise_seed,
        )  # fmt: skip
    else:
        expected = (len(prompts), *adapter.latent_shape(height, width))
        if tuple(initial_latents.shape) != expected:
            raise ValueError(f"initial_latents must have shape {expected}, got {tuple(initial_latents.shape)}")
        x = initial_latents.to(device=adapter.device, dtype=adapter.dtype)

    gs = sampler.guidance_scale
    velocity_fn = lambda y, s: adapter.velocity(y, s, embeds, gs)  # noqa: E731
    before, after_, log_probs, stds = [], [], [], []
    history = None  # multistep state of the post-window solver
    for i in tqdm(range(len(sigmas) - 1), desc="sampling", disable=not progress, leave=False):
        t, t_next = sigmas[i], sigmas[i + 1]
        v = velocity_fn(x, t)
        if i in window:
            step = sde_step(
                sampler.kind, v, x, t, t_next, t_second=t_second, velocity_fn=velocity_fn, generator=generator,
                reduce=log_prob_reduce, **_step_kwargs(sampler),
            )  # fmt: skip
            before.append(x)
            after_.append(step.sample)
            log_probs.append(step.log_prob)
            stds.append(step.std.reshape(-1)[0])  # one std per step: the batch shares t
            x = step.sample
        elif i >= after:
            x, history = solver_step(sampler.post_window.solver, v, x, t, t_next, history)
        else:
            x = ode_step(v, x, t, t_next)

    window_idx = list(window)
    latent_shape = tuple(x.shape[1:])
    stack = lambda items: torch.stack(items, dim=1) if items else x.new_zeros((len(prompts), 0, *latent_shape))  # noqa: E731
    return Trajectory(
        prompts=prompts,
        group_ids=group_ids,
        embeds=embeds,
        latents=stack(before),
        next_latents=stack(after_),
        log_probs=torch.stack(log_probs, dim=1) if log_probs else torch.zeros(len(prompts), 0),
        stds=torch.stack(stds).float() if stds else torch.zeros(0),
        sigmas=sigmas[window_idx] if window_idx else sigmas[:0],
        sigmas_next=sigmas[[i + 1 for i in window_idx]] if window_idx else sigmas[:0],
        step_indices=window_idx,
        t_second=t_second,
        guidance_scale=gs,
        height=height,
        width=width,
        final_latents=x,
        images=adapter.decode(x, height, width) if decode else None,
        metadata=list(metadata) if metadata is not None else [],
    )


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
    embeds, gs = trajectory.embeds, trajectory.guidance_scale
    velocity_fn = lambda y, s: adapter.velocity(y, s, embeds, gs)  # noqa: E731
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
        return (trajectory.latents[:, step], trajectory.sigmas[step], trajectory.sigmas_next[step],
                trajectory.next_latents[:, step])  # fmt: skip
    if step.shape != (len(trajectory),):
        raise ValueError(f"per-sample steps must have shape ({len(trajectory)},), got {tuple(step.shape)}")
    rows = torch.arange(len(trajectory), device=trajectory.latents.device)
    step = step.to(trajectory.latents.device)
    sigma_step = step.to(trajectory.sigmas.device)
    return (trajectory.latents[rows, step], trajectory.sigmas[sigma_step], trajectory.sigmas_next[sigma_step],
            trajectory.next_latents[rows, step])  # fmt: skip
