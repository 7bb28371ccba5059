"""Rollouts: sample a batch with an SDE inside the trained window and an ODE outside it, keeping the
trained transitions; and the re-evaluation of stored transitions that the GRPO loss needs.

Everything model-specific goes through the adapter; everything stochastic through ``samplers``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from samplers import (
    MULTISTEP_SOLVERS,
    NoWindow,
    SlidingWindow,
    Transition,
    compress_schedule,
    draw_noise,
    get_sde_step,
    get_solver,
    mixgrpo_tail_schedule,
    ode_step,
    sde_step,
    truncated_timesteps,
)
from samplers.solvers import SolverHistory

from .adapters import PipelineAdapter, PromptEmbeds

if TYPE_CHECKING:
    from .config import Config, SamplerConfig  # type hints only: config imports modules that import this one

VelocityFn = Callable[[Tensor, Tensor], Tensor]  # v(x, sigma)
StepFn = Callable[[Tensor, Tensor, Tensor, Tensor], Transition]  # (v, x, t, t_next): sde_step with its options bound
# (i, x_i, t_i, v(x_i, t_i)): a window or post-window step of the plan's schedule, seen before it is taken (read-only)
StepObserver = Callable[[int, Tensor, Tensor, Tensor], None]
StepVelocity = Callable[[Tensor, int], tuple[Tensor, Tensor, Tensor]]  # (x, i) -> (t_i, t_{i+1}, v(x, t_i))


@dataclass
class Trajectory:
    """A sampled batch: the trained (SDE) transitions only, plus what the loss and rewards need.

    latents / next_latents: [B, W, *latent]  before / after each of the W window steps
    log_probs:              [B, W]           float32 log-prob of each transition under the sampling policy
    stds:                   [B, W]           the transitions' std
    sigmas / sigmas_next:   [B, W]           t and t_next of each window step
    step_indices:           [B, W] long      the window's step indices in the (uncompressed) schedule
    means:                  [B, W, *latent]  float32 mean of each transition under the sampling weights, kept only
                                             when the objective asks (``Objective.needs_sampling_means``: GRPO-Guard's
                                             μ_old), else None
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
    means: Tensor | None = None
    metadata: list[dict[str, Any]] = field(default_factory=list)
    # Per-sample tensors a rollout strategy adds for its advantage estimator (first dim B; e.g. rewards of each
    # step's one-step prediction, a sample's node in a tree); the trainer gathers them into AdvantageInputs.extras.
    extras: dict[str, Tensor] = field(default_factory=dict)

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
        keys = [sorted(p.extras) for p in parts]
        if any(k != keys[0] for k in keys):
            raise ValueError(f"Trajectory.cat joins batches with the same extras, got {keys}")
        joined["extras"] = {k: torch.cat([p.extras[k] for p in parts]) for k in keys[0]}
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
        picked["extras"] = {k: v[index.to(v.device)] for k, v in self.extras.items()}
        return replace(self, **picked)


_PER_SAMPLE = (
    "group_ids",
    "latents",
    "next_latents",
    "log_probs",
    "stds",
    "sigmas",
    "sigmas_next",
    "step_indices",
    "final_latents",
    "images",
    "means",
)


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


@dataclass(frozen=True)
class RolloutPlan:
    """What every step of a rollout does, resolved once from the sampler options (:func:`plan_rollout`).

    The schedule's ``S`` steps run in three consecutive parts, ``k`` = the window's start (0 without a window):

    prefix ``range(0, k)``       Euler ODE steps, run once per group of the batch when ``share_prefix``
    window ``range(k, k + W)``   SDE steps (``sampler.kind``), stored and trained
    tail   ``range(k + W, S)``   ``tail_solver`` steps; with ``last_step_sde`` the final one (into t = 0) is an SDE
                                 step instead, never stored (Flow-GRPO), and ``tail`` stops before it

    sigmas:        [S + 1] the schedule the steps follow; a multistep tail solver integrates a thinned tail
                   (MixGRPO-Flash), so ``S`` may be less than ``sampler.num_steps``
    t_second:      the uncompressed schedule's second sigma (Flow-GRPO's diffusion at t = 1)
    carry_history: record the solver history ``(x0_hat, t)`` at every prefix and window step, so the tail's first
                   step is already second order (MixGRPO-Flash's DPMState)
    share_prefix:  asked for (``same_initial_noise``, ``shared_prefix``, k > 0); :func:`_prefix_rows` checks the noise
    """

    sigmas: Tensor
    t_second: float
    prefix: range
    window: range
    tail: range
    tail_solver: str
    last_step_sde: bool
    carry_history: bool
    share_prefix: bool

    @property
    def num_steps(self) -> int:
        return len(self.sigmas) - 1


def make_window(config: Config, stochastic: bool = True) -> SlidingWindow | NoWindow:
    """The sampler's window of SDE steps (trained ones, for a per-step objective); :class:`NoWindow` when the rollout
    has none (``stochastic`` False: an objective on the final samples under the ODE)."""
    if not stochastic:
        return NoWindow()
    w = config.sampler.window
    return SlidingWindow(
        config.sampler.num_steps,
        w.size,
        strategy=w.strategy,
        shift_interval=w.shift_interval,
        stride=w.stride,
        roll_back=w.roll_back,
        seed=config.run.seed,
        max_start=w.max_start,
        decay_rate=w.decay_rate,
        decay_threshold=w.decay_threshold,
        end_margin=w.end_margin,
    )


def plan_rollout(sampler: SamplerConfig, window: range, sigmas: Tensor) -> RolloutPlan:
    """Check the options against ``window`` and resolve them on the schedule ``sigmas`` ``[T + 1]`` (the adapter's,
    or the static shifted one with ``sampler.time_shift``). Pure: no model call, nothing drawn."""
    if window.step != 1:
        raise ValueError(f"window must be a range of consecutive steps, got {window}")
    if window and (window.start < 0 or window.stop > sampler.num_steps - 1):
        raise ValueError(f"window {window} must lie within steps 0..{sampler.num_steps - 2} (the last is ODE)")
    if sampler.last_step not in ("ode", "sde"):
        raise ValueError(f"sampler.last_step must be 'ode' or 'sde', got {sampler.last_step!r}")
    solver = sampler.post_window.solver
    if sampler.last_step == "sde" and solver != "euler":
        raise ValueError("sampler.last_step='sde' needs post_window.solver='euler' (the solver owns the final step)")
    get_solver(solver)
    last_step_sde = sampler.last_step == "sde"
    if window or last_step_sde:
        get_sde_step(sampler.kind, sampler.log_prob)  # an unknown kind is refused before any network call
    start, stop = (window.start, window.stop) if window else (0, 0)
    t_second = float(sigmas[1])
    multistep = solver in MULTISTEP_SOLVERS
    if multistep and sampler.time_shift is not None:  # MixGRPO-Flash's own tail: a new grid, uniform in t
        sigmas = mixgrpo_tail_schedule(sigmas, stop, sampler.post_window.ratio, sampler.time_shift)
    elif multistep:  # the pipeline's schedule: a subset of its own sigmas
        sigmas = compress_schedule(sigmas, stop, sampler.post_window.ratio)
    num_steps = len(sigmas) - 1
    return RolloutPlan(
        sigmas=sigmas,
        t_second=t_second,
        prefix=range(0, start),
        window=range(start, stop),
        tail=range(stop, num_steps - 1 if last_step_sde else num_steps),
        tail_solver=solver,
        last_step_sde=last_step_sde,
        carry_history=multistep and sampler.post_window.carry_history,
        share_prefix=sampler.shared_prefix and sampler.same_initial_noise and start > 0,
    )


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
    observe: StepObserver | None = None,
    store_means: bool = False,
    keep_transitions: bool = True,
) -> Trajectory:
    """Sample ``len(prompts)`` images; steps in ``window`` use the SDE and are stored, the rest use the ODE
    (the steps after the window: ``sampler.post_window.solver``; the final step: the SDE too, unstored, when
    ``sampler.last_step == "sde"``). ``sampler.time_shift`` replaces the pipeline's schedule by the static one.
    With ``sampler.same_initial_noise`` and ``sampler.shared_prefix``, the ODE steps before the window run once per
    group of the batch (its images' latents are identical there) and fan out at the window. ``sources`` (editing):
    each prompt's source image (a file path or PIL image), encoded once and carried in the trajectory's embeddings.
    ``observe(i, x, t, v)`` (dense rewards) is called at every window and post-window step ``i`` of the plan's
    schedule before the step is taken, with every image's latents, the step's sigma and the velocity the step
    uses (the forward the rollout makes anyway); it must not modify them. ``store_means``: keep each window step's
    mean in ``Trajectory.means`` (float32, as the step computes it; otherwise None). ``keep_transitions=False``:
    the window's steps still use the SDE but nothing of them is kept (the trajectory has no trained steps), for
    objectives that train the final samples only. ``sampler.antithetic``: the window's noise in mirrored pairs
    (:func:`antithetic_partners`; the untrained final SDE step draws its own). The parts of the schedule:
    :class:`RolloutPlan`."""
    prompts = list(prompts)
    if not prompts:
        raise ValueError("rollout needs at least one prompt, got an empty list")
    group_ids = torch.as_tensor(list(group_ids) if not isinstance(group_ids, Tensor) else group_ids)
    if group_ids.shape != (len(prompts),):
        raise ValueError(f"group_ids must have one id per prompt ({len(prompts)}), got shape {tuple(group_ids.shape)}")
    sigmas, _ = adapter.schedule(sampler.num_steps, height, width, time_shift=sampler.time_shift)
    plan = plan_rollout(sampler, window, sigmas)
    gs = sampler.guidance_scale
    embeds, x = _embeds_and_noise(
        adapter, sampler, prompts, group_ids, initial_latents, generator, height, width, noise_seed, sources
    )
    velocity_fn = _velocity_fn(adapter, embeds, sampler, gs)
    sde_options = {"t_second": plan.t_second, "velocity_fn": velocity_fn, "generator": generator}
    sde = functools.partial(sde_step, sampler.kind, reduce=log_prob_reduce, **sde_options, **_step_kwargs(sampler))
    rows = _prefix_rows(prompts, group_ids, x, drawn=initial_latents is None) if plan.share_prefix else None
    prefix_velocity = velocity_fn if rows is None else _velocity_fn(adapter, embeds.select(rows[0]), sampler, gs)
    mirror = antithetic_partners(group_ids) if sampler.antithetic else None
    with tqdm(total=plan.num_steps, desc="sampling", disable=not progress, leave=False) as bar:
        x, history = _prefix(plan, prefix_velocity, x, rows, bar)  # ODE; once per group of the batch when shared
        at = _observed(plan, velocity_fn, observe)
        noise = functools.partial(_window_noise, generator=generator, mirror=mirror)
        x, history, stored = _window(plan, at, sde, x, history, bar, store_means, keep_transitions, noise)  # SDE
        x = _tail(plan, at, sde, x, history, bar)  # the post-window solver; the final SDE step

    before, after, log_probs, stds, means = stored
    window_idx = list(plan.window) if keep_transitions else []
    n = len(prompts)
    latent_shape = tuple(x.shape[1:])
    stack = lambda items, dtype=x.dtype: (  # noqa: E731
        torch.stack(items, dim=1) if items else x.new_zeros((n, 0, *latent_shape), dtype=dtype)
    )
    per_sample = lambda values: values.unsqueeze(0).repeat(n, 1)  # noqa: E731  [W] -> [B, W]
    return Trajectory(
        prompts=prompts,
        group_ids=group_ids,
        embeds=embeds,
        latents=stack(before),
        next_latents=stack(after),
        log_probs=torch.stack(log_probs, dim=1) if log_probs else torch.zeros(n, 0),
        stds=torch.stack(stds, dim=1) if stds else torch.zeros(n, 0),
        sigmas=per_sample(plan.sigmas[window_idx]),
        sigmas_next=per_sample(plan.sigmas[[i + 1 for i in window_idx]]),
        step_indices=per_sample(torch.tensor(window_idx, dtype=torch.long)),
        t_second=plan.t_second,
        guidance_scale=gs,
        means=stack(means, torch.float32) if store_means else None,
        **_final_fields(adapter, x, height, width, decode, metadata),
    )


def _final_fields(
    adapter: PipelineAdapter,
    final_latents: Tensor,
    height: int,
    width: int,
    decode: bool,
    metadata: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """The :class:`Trajectory` fields of a batch's end, the same for every rollout function: the final latents, their
    decoded images (None unless ``decode``), the size and a copy of the metadata list."""
    return {
        "height": height,
        "width": width,
        "final_latents": final_latents,
        "images": adapter.decode(final_latents, height, width) if decode else None,
        "metadata": list(metadata) if metadata is not None else [],
    }


def _embeds_and_noise(
    adapter: PipelineAdapter,
    sampler: SamplerConfig,
    prompts: list[str],
    group_ids: Tensor,
    initial_latents: Tensor | None,
    generator: torch.Generator | None,
    height: int,
    width: int,
    noise_seed: int,
    sources: Sequence[Any] | None,
) -> tuple[PromptEmbeds, Tensor]:
    """The start of every rollout function: the batch's conditioning (with the negative prompt's where the guidance
    needs it; ``sources``: editing's source images), then its initial latents: the caller's ``initial_latents``
    (shape-checked), else noise drawn by the adapter (``same_initial_noise``: one draw per group)."""
    negative = adapter.needs_negative(sampler.guidance_scale)
    embeds = adapter.encode_conditions(prompts, with_negative=negative, sources=sources, height=height, width=width)
    n = len(group_ids)
    if initial_latents is None:
        noise = adapter.initial_noise(
            n,
            height,
            width,
            generator=generator,
            group_ids=group_ids,
            same_within_group=sampler.same_initial_noise,
            noise_seed=noise_seed,
        )
        return embeds, noise
    expected = (n, *adapter.latent_shape(height, width))
    if tuple(initial_latents.shape) != expected:
        raise ValueError(f"initial_latents must have shape {expected}, got {tuple(initial_latents.shape)}")
    return embeds, initial_latents.to(device=adapter.device, dtype=adapter.latent_dtype)


def _record(plan: RolloutPlan, x: Tensor, t: Tensor, v: Tensor, history: SolverHistory) -> SolverHistory:
    """MixGRPO-Flash's DPMState records ``(x0_hat, t)`` at every step up to the window's end, so the solver's first
    step after the window is already second order; otherwise the history is left as it is."""
    if not plan.carry_history:
        return history
    return x.float() - t.float() * v.float(), torch.as_tensor(t)


def _prefix(
    plan: RolloutPlan, velocity_fn: VelocityFn, x: Tensor, rows: tuple[Tensor, Tensor] | None, bar: tqdm
) -> tuple[Tensor, SolverHistory]:
    """The Euler ODE steps before the window, ``x + dt · v``. With ``rows = (unique, fan_out)`` (a shared prefix,
    :func:`_prefix_rows`) they run on one row per group, a group's images having the same prompt and noise and so the
    same latents until the window (``velocity_fn`` is then the unique rows' one), and every image continues from its
    group's latents (and solver history) at the window."""
    history: SolverHistory = None
    if rows is not None:
        x = x[rows[0].to(x.device)]
    for i in plan.prefix:
        t, t_next = plan.sigmas[i], plan.sigmas[i + 1]
        v = velocity_fn(x, t)
        history = _record(plan, x, t, v, history)
        x = ode_step(v, x, t, t_next)
        bar.update()
    if rows is not None:
        fan_out = rows[1]
        x = x[fan_out.to(x.device)]
        if history is not None:
            history = (history[0][fan_out.to(history[0].device)], history[1])
    return x, history


def _observed(plan: RolloutPlan, velocity_fn: VelocityFn, observe: StepObserver | None) -> StepVelocity:
    """``at(x, i)``: step ``i``'s ``(t_i, t_{i+1}, v(x, t_i))``, shown to ``observe`` (when given) before the step."""

    def at(x: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        t, t_next = plan.sigmas[i], plan.sigmas[i + 1]
        v = velocity_fn(x, t)
        if observe is not None:
            observe(i, x, t, v)
        return t, t_next, v

    return at


def _window(
    plan: RolloutPlan,
    at: StepVelocity,
    sde: StepFn,
    x: Tensor,
    history: SolverHistory,
    bar: tqdm,
    store_means: bool = False,
    keep: bool = True,
    noise: Callable[[Tensor], Tensor | None] = lambda x: None,
) -> tuple[Tensor, SolverHistory, tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[Tensor]]]:
    """The SDE steps of the window; returns the latents, the history and the stored ``(before, after, log_probs,
    stds, means)``, one entry per step (std: ``[B]``, from one per step ``[]`` or per sample ``[B, 1, ...]``; means:
    float32 ``[B, *latent]``, only with ``store_means``, else no entry); with ``keep=False`` every list is empty.
    ``noise(x)``: each step's ``z`` (None: the step draws its own)."""
    before, after, log_probs, stds, means = [], [], [], [], []
    for i in plan.window:
        t, t_next, v = at(x, i)
        history = _record(plan, x, t, v, history)
        step = sde(v, x, t, t_next, noise=noise(x))
        if keep:
            before.append(x)
            after.append(step.sample)
            log_probs.append(step.log_prob)
            std = step.std.float()
            stds.append(std.reshape(std.shape[0], -1)[:, 0] if std.ndim else std.expand(len(x)))
            if store_means:
                means.append(step.mean.float())
        x = step.sample
        bar.update()
    return x, history, (before, after, log_probs, stds, means)


def antithetic_partners(group_ids: Tensor) -> Tensor:
    """``sampler.antithetic``'s pairs: each group's rows, in batch order, pair up first with second, third with
    fourth, ...; returns ``[B]`` long, the row of its pair's first for the second of each pair and -1 for every other
    row (a pair's first, a group's odd last row). Pure."""
    mirror = torch.full((len(group_ids),), -1, dtype=torch.long)
    waiting: dict[int, int] = {}  # group id -> the row of an open pair's first
    for row, gid in enumerate(group_ids.tolist()):
        first = waiting.pop(gid, None)
        if first is None:
            waiting[gid] = row
        else:
            mirror[row] = first
    return mirror


def _window_noise(x: Tensor, *, generator: torch.Generator | None, mirror: Tensor | None) -> Tensor | None:
    """A window step's ``z``: None (the step draws it) without ``mirror``; else ``z ~ N(0, I)`` drawn as the step
    would draw it (so every other row is sampled exactly as without pairs), each pair's second row taking ``-z`` of
    its first (antithetic variates: the pair's two steps are mirror images about the same kind of mean)."""
    if mirror is None:
        return None
    z = draw_noise(x, None, generator)
    second = (mirror >= 0).to(z.device)
    return torch.where(second.view(-1, *[1] * (z.ndim - 1)), -z[mirror.clamp(min=0).to(z.device)], z)


def _tail(plan: RolloutPlan, at: StepVelocity, sde: StepFn, x: Tensor, history: SolverHistory, bar: tqdm) -> Tensor:
    """The steps after the window: the post-window solver's (from the carried history, if any); then, with
    ``last_step_sde``, the final step with the SDE, as Flow-GRPO samples it (never trained: nothing is stored)."""
    solver = get_solver(plan.tail_solver)
    for i in plan.tail:
        t, t_next, v = at(x, i)
        x, history = solver(v, x, t, t_next, history)
        bar.update()
    if plan.last_step_sde:
        t, t_next, v = at(x, plan.num_steps - 1)
        x = sde(v, x, t, t_next).sample
        bar.update()
    return x


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
    adapter unless called under ``torch.no_grad()``; wrap in ``adapter.reference()`` for the reference.
    """
    x, t, t_next, prev = _stored(trajectory, step)
    velocity_fn = _velocity_fn(adapter, trajectory.embeds, sampler, trajectory.guidance_scale)
    return sde_step(
        sampler.kind,
        velocity_fn(x, t),
        x,
        t,
        t_next,
        t_second=trajectory.t_second,
        velocity_fn=velocity_fn,
        prev_sample=prev,
        reduce=log_prob_reduce,
        **_step_kwargs(sampler),
    )


def stored_log_probs(trajectory: Trajectory, step: int | Tensor) -> Tensor:
    """The rollout's log-probs ``[B]`` at window position ``step`` (int or per-sample ``[B]``)."""
    return _at_step(trajectory.log_probs, step)


def stored_means(trajectory: Trajectory, step: int | Tensor) -> Tensor | None:
    """The transitions' means under the sampling weights ``[B, *latent]`` (float32) at window position ``step`` (int
    or per-sample ``[B]``); None when the rollout kept none (``Trajectory.means``)."""
    return None if trajectory.means is None else _at_step(trajectory.means, step)


def _at_step(values: Tensor, step: int | Tensor) -> Tensor:
    """``values[i, step]`` (a shared int) or ``values[i, step[i]]`` of a per-step field ``[B, W, ...]``."""
    if isinstance(step, int):
        return values[:, step]
    return values[torch.arange(len(values), device=values.device), step.to(values.device)]


def _stored(trajectory: Trajectory, step: int | Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if isinstance(step, int):
        return (
            trajectory.latents[:, step],
            trajectory.sigmas[:, step],
            trajectory.sigmas_next[:, step],
            trajectory.next_latents[:, step],
        )
    if step.shape != (len(trajectory),):
        raise ValueError(f"per-sample steps must have shape ({len(trajectory)},), got {tuple(step.shape)}")
    rows = torch.arange(len(trajectory), device=trajectory.latents.device)
    step = step.to(trajectory.latents.device)
    sigma_rows, sigma_step = rows.to(trajectory.sigmas.device), step.to(trajectory.sigmas.device)
    return (
        trajectory.latents[rows, step],
        trajectory.sigmas[sigma_rows, sigma_step],
        trajectory.sigmas_next[sigma_rows, sigma_step],
        trajectory.next_latents[rows, step],
    )
