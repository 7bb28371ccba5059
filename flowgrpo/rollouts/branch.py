"""``sampler.rollout: branch``: TempFlow-GRPO's trajectory branching (He et al., arXiv 2508.04324).

A group's images share the prompt and the initial noise (``sampler.same_initial_noise``, the paper's "seed group").
They follow one deterministic ODE trunk up to the group's branch point ``k``, take ONE stochastic step there
(``sampler.kind``, each image its own noise), then each follows the ODE to t = 0 (design.md §3 notation)::

    x_{i+1}   = x_i + (t_{i+1} - t_i)·v(x_i, t_i)            i < k   the trunk: once per group, not G times
    x_{k+1}^g = mean_k(x_k) + std_k·z^g,   z^g ~ N(0, I)     i = k   the branch, stored: the one trained step
    x_{i+1}^g = x_i^g + (t_{i+1} - t_i)·v(x_i^g, t_i)        i > k   each image's own Euler ODE

Everything that makes a group's rewards differ happened at step ``k``, so its group-relative advantages are a process
reward for that step. Each image stores one transition (a window of one step at its own ``k``: ``step_indices``,
``sigmas`` and ``stds`` are per sample), which any ratio objective re-scores (``grpo.objective: tempflow`` adds the
noise-aware weights, ``clipped`` trains it unweighted). With ``sampler.noise_level: 0`` the result is the plain ODE.

**Branch points** (``sampler.branch``, :func:`branch_points`): a pure function of ``(run.seed, group id)``, so a group
whose images lie on several processes or rollout batches branches at one step everywhere, and a resumed run sees the
same points. ``sweep`` gives group id ``g`` the step ``steps[g mod len(steps)]``: ids are consecutive over the epochs,
so every point gets the same share of groups (the reference trains every point every epoch, see below); ``random``
draws a step uniformly per group. ``steps`` defaults to every step but the last, ``0..T-2``.

**Batching.** This process's slots are ordered by group id (a group's images are neighbours, so its trunk is computed
once in the batch that holds it; a group cut by a batch boundary computes it once in each) and cut into batches of
``sampler.batch_size``. Groups with different branch points share a batch: every step runs ONE forward over the
trunks still before their branch point and the images at or after theirs, so each batch costs ``T`` forwards on every
process whatever its branch points: the same collectives everywhere, as the chain rollout, so FSDP and DeepSpeed
need no refusal (one FSDP2 epoch on two CPU processes with random branch points ran through).
At the branch step the trunk is fanned out first and the velocity is evaluated on the G rows (as the chain rollout's
window does): a batch whose groups share ``k`` re-scores its stored log-probs bit for bit.

**Against the reference** (Shredded-Pork/TempFlow-GRPO @e66824e, ``flow_grpo/diffusers_patch/
sd3_pipeline_with_logprob_perstep.py`` and ``scripts/train_sd3_pr.py``): it samples one ODE trunk per (prompt, seed)
and branches it at EVERY step ``i`` of ``timesteps[:-1]`` with ``exploration_k = 6`` SDE draws each, every branch
followed by the ODE; the 6 images of one (seed, step) are a group (per-prompt stat tracking over one process's rows,
"seed group"), and training visits the steps ``j = 0..int(0.99·T)-1 = 0..T-2`` in order. Here a group is one (prompt,
seed, branch point) and the schedule spreads the epoch's groups over the points, so a trunk serves one point instead
of all T-1 (the same images and points per epoch with ``grpo.groups_per_epoch`` a multiple of the points, at up to
T-1 times the trunk forwards; a prompt's seeds are separate groups). Its FLUX script also branches at the last step
and never trains it; not sampled here. ``train_sd3_pr.py`` samples and trains nothing in its first two epochs (``if
epoch < 2: continue``); not reproduced.

**Refused** (:func:`check_branch`, before anything loads): objectives that train final samples only (nothing stored),
``same_initial_noise: false`` (no shared trunk), noise level 0 (identical branches), ``last_step: sde`` (noise after
the branch point), any ``sampler.window`` / ``sampler.post_window`` setting (the chain rollout's), and Langevin's
``score_eval: reeval`` (a second forward on the branching rows only, a count that differs between processes). Video
and editing models branch like the rest (tests/test_tempflow.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from samplers import get_sde_step, ode_step
from samplers.merge import merged_sde_step

from ..checks import ConfigError, one_of
from ..objectives import get_objective
from ..rollout import Trajectory, _embeds_and_noise, _final_fields, _prefix_rows, _step_kwargs, _velocity_fn
from .base import Collected, RolloutStrategy, register_rollout

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config, SamplerConfig
    from ..data import EpochSample
    from .base import RolloutContext

SCHEDULES = ("sweep", "random")


def branch_step_list(steps: Sequence[int] | None, num_steps: int) -> list[int]:
    """The branch points a schedule picks from: ``steps`` as given, or every step but the last, ``0..num_steps-2``."""
    return list(range(num_steps - 1)) if steps is None else [int(k) for k in steps]


def branch_points(group_ids: Sequence[int], steps: Sequence[int], schedule: str, *, seed: int) -> list[int]:
    """The branch point of each group id (one entry per id given, repeats allowed).

    ``sweep``:  ``k(g) = steps[g mod n]`` (``n = len(steps)``): consecutive group ids take the points in turn.
    ``random``: ``k(g) = steps[r]``, ``r`` the first draw of ``torch.randint(n)`` from a CPU generator seeded with
    ``seed · 1_000_003 + g``. Both depend on ``(seed, g)`` only, never on the process or batch holding the group.
    """
    one_of("sampler.branch.schedule", schedule, SCHEDULES)
    if not steps:
        raise ValueError("branch_points needs at least one branch step")
    n = len(steps)
    if schedule == "sweep":
        return [int(steps[int(g) % n]) for g in group_ids]
    points = []
    for g in group_ids:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + int(g))
        points.append(int(steps[int(torch.randint(0, n, (1,), generator=generator))]))
    return points


@torch.no_grad()
def branch_rollout(
    adapter: PipelineAdapter,
    prompts: Sequence[str],
    group_ids: Tensor | Sequence[int],
    branch_steps: Tensor | Sequence[int],
    sampler: SamplerConfig,
    generator: torch.Generator | None = None,
    *,
    height: int,
    width: int,
    initial_latents: Tensor | None = None,
    decode: bool = True,
    log_prob_reduce: str = "mean",
    metadata: list[dict[str, Any]] | None = None,
    noise_seed: int = 0,
    sources: Sequence[Any] | None = None,
    spans: Tensor | Sequence[int] | None = None,
    store_means: bool = False,
) -> Trajectory:
    """Sample ``len(prompts)`` images, image ``r`` branching at schedule step ``branch_steps[r]`` (the same for the
    images of one group and prompt): the ODE before it (once per group with ``sampler.shared_prefix``, when the
    group's initial latents are equal), one ``sampler.kind`` SDE step at it (stored), the Euler ODE after it.
    The trajectory holds that one transition per image (with ``store_means``, its mean too). Arguments as
    :func:`flowgrpo.rollout.rollout`.

    ``spans`` (E-GRPO's merged steps, :mod:`.merged`; default all 1): image ``r``'s SDE step jumps from
    ``t_k`` to ``t_{k+m}``, ``m = spans[r]`` (:func:`samplers.merge.merged_sde_step`), and its ODE resumes at step
    ``k + m``; stored ``sigmas_next`` is ``t_{k+m}``. A step at which no row needs the network (every image inside
    its merged step) still runs one forward, on one such row, discarded: every batch runs ``T`` forwards."""
    prompts = list(prompts)
    n = len(prompts)
    if not prompts:
        raise ValueError("branch_rollout needs at least one prompt, got an empty list")
    group_ids = torch.as_tensor(list(group_ids) if not isinstance(group_ids, Tensor) else group_ids)
    ks = torch.as_tensor(list(branch_steps) if not isinstance(branch_steps, Tensor) else branch_steps).long().cpu()
    spans = torch.ones_like(ks) if spans is None else torch.as_tensor(spans).long().cpu()
    if group_ids.shape != (n,) or ks.shape != (n,) or spans.shape != (n,):
        raise ValueError(
            f"group_ids {tuple(group_ids.shape)}, branch_steps {tuple(ks.shape)} and spans {tuple(spans.shape)} need "
            f"one entry per prompt ({n})"
        )
    sigmas, _ = adapter.schedule(sampler.num_steps, height, width, time_shift=sampler.time_shift)
    num_steps = len(sigmas) - 1
    ends = ks + spans  # where each image's ODE resumes
    if int(ks.min()) < 0 or int(ks.max()) > num_steps - 2:
        raise ValueError(f"branch steps must lie in 0..{num_steps - 2} (the last step is ODE), got {ks.tolist()}")
    if int(spans.min()) < 1 or int(ends.max()) > num_steps - 1:
        raise ValueError(
            f"merged steps (branch step + span) must end by step {num_steps - 1} (the last step is ODE) with spans "
            f">= 1, got steps {ks.tolist()} and spans {spans.tolist()}"
        )
    get_sde_step(sampler.kind, sampler.log_prob)  # an unknown kind is refused before any network call
    gs = sampler.guidance_scale
    embeds, x = _embeds_and_noise(
        adapter, sampler, prompts, group_ids, initial_latents, generator, height, width, noise_seed, sources
    )
    rows = _prefix_rows(prompts, group_ids, x, drawn=initial_latents is None) if sampler.shared_prefix else None
    unique, fan_out = rows if rows is not None else (torch.arange(n), torch.arange(n))
    if not torch.equal(ks[unique][fan_out], ks) or not torch.equal(spans[unique][fan_out], spans):
        raise ValueError("the images of one group and prompt share their trunk: give them one branch step and span")
    device = x.device
    trunk, trunk_k = x[unique.to(device)], ks[unique]  # one row per (group, prompt) until its branch point
    latents = x.clone()  # each image's own latents from its branch point on
    before, after = torch.empty_like(x), torch.empty_like(x)
    log_probs = torch.zeros(n, device=device)
    stds = torch.zeros(n, device=device)
    means = torch.zeros(x.shape, device=device, dtype=torch.float32) if store_means else None
    t_second = float(sigmas[1])
    for i in range(num_steps):
        t, t_next = sigmas[i], sigmas[i + 1]
        branching = torch.nonzero(ks == i).flatten()
        if len(branching):  # fan out: each image of the group starts its branch from the trunk
            latents[branching.to(device)] = trunk[fan_out[branching].to(device)]
        on_trunk = torch.nonzero(trunk_k > i).flatten()  # groups before their branch point
        off_trunk = torch.nonzero((ks == i) | (ends <= i)).flatten()  # images at theirs, or past their merged step
        if not len(on_trunk) and not len(off_trunk):  # every image inside its merged step: one forward anyway
            inside = torch.nonzero(ks < i).flatten()[:1]  # (FSDP's forwards are collectives), discarded
            _velocity_fn(adapter, embeds.select(inside), sampler, gs)(latents[inside.to(device)], t)
            continue
        inputs = torch.cat([trunk[on_trunk.to(device)], latents[off_trunk.to(device)]])
        rows_embeds = embeds.select(torch.cat([unique[on_trunk], off_trunk]))
        v = _velocity_fn(adapter, rows_embeds, sampler, gs)(inputs, t)
        split = len(on_trunk)
        if split:
            trunk[on_trunk.to(device)] = ode_step(v[:split], inputs[:split], t, t_next)
        at = ks[off_trunk] == i
        if bool(at.any()):
            rows_at = off_trunk[at].to(device)
            x_at = inputs[split:][at.to(device)]
            span = spans[off_trunk[at]]
            step = merged_sde_step(
                sampler.kind,
                v[split:][at.to(device)],
                x_at,
                sigmas,
                i,
                int(span[0]) if bool((span == span[0]).all()) else span,  # one span: t_{i+m} a 0-d tensor as t
                t_second=t_second,
                velocity_fn=_velocity_fn(adapter, embeds.select(off_trunk[at]), sampler, gs),
                generator=generator,
                reduce=log_prob_reduce,
                **_step_kwargs(sampler),
            )
            before[rows_at], after[rows_at], latents[rows_at] = x_at, step.sample, step.sample
            log_probs[rows_at] = step.log_prob.float()
            if means is not None:
                means[rows_at] = step.mean.float()
            std = step.std.float()
            stds[rows_at] = std.reshape(std.shape[0], -1)[:, 0] if std.ndim else std.expand(len(rows_at))
        past = ~at
        if bool(past.any()):
            rows_past = off_trunk[past].to(device)
            latents[rows_past] = ode_step(v[split:][past.to(device)], inputs[split:][past.to(device)], t, t_next)

    column = lambda values: values.reshape(n, 1)  # noqa: E731  one stored step per image
    return Trajectory(
        prompts=prompts,
        group_ids=group_ids,
        embeds=embeds,
        latents=before.unsqueeze(1),
        next_latents=after.unsqueeze(1),
        log_probs=column(log_probs),
        stds=column(stds),
        sigmas=column(sigmas[ks]),
        sigmas_next=column(sigmas[ends]),
        step_indices=column(ks),
        t_second=t_second,
        guidance_scale=gs,
        means=None if means is None else means.unsqueeze(1),
        **_final_fields(adapter, latents, height, width, decode, metadata),
    )


def check_branch(config: Config, rollout: str = "branch") -> None:
    """Refuse settings the branch rollout cannot use, naming the key and the fix (before anything is loaded).
    ``rollout``: the strategy named in the messages (:mod:`.merged` shares these checks)."""
    s = config.sampler
    b = s.branch
    points = "sampler.branch.steps, sampler.branch.schedule" if rollout == "branch" else f"sampler.{rollout}.*"
    one_of("sampler.branch.schedule", b.schedule, SCHEDULES)
    last = s.num_steps - 2
    if b.steps is not None:
        if not b.steps:
            raise ConfigError("sampler.branch.steps is an empty list; list the steps to branch at, or null for all")
        bad = [k for k in b.steps if not 0 <= k <= last]
        if bad:
            raise ConfigError(
                f"sampler.branch.steps {bad} lie outside 0..{last}, the steps before the last of sampler.num_steps="
                f"{s.num_steps} (the last step is ODE); use steps in 0..{last}, or null for all of them"
            )
    objective = get_objective(config.grpo.objective)
    if objective.rollout != "sde_window":
        raise ConfigError(
            f"sampler.rollout={rollout} stores each image's branch step for an objective that re-scores it, but grpo."
            f"objective={config.grpo.objective} trains the final samples of ODE rollouts; use sampler.rollout: chain, "
            "or grpo.objective: tempflow (or clipped)"
        )
    if not s.same_initial_noise:
        raise ConfigError(
            f"sampler.rollout={rollout} needs sampler.same_initial_noise: true: a group's images share one ODE trunk "
            "from one initial noise and differ only by the branch step's noise (the paper's seed group)"
        )
    if s.noise_level <= 0:
        raise ConfigError(
            f"sampler.noise_level={s.noise_level} makes every branch of a group the same image (advantages all 0); "
            "set sampler.noise_level > 0 (Flow-GRPO's SD3 value: 0.7)"
        )
    if s.last_step != "ode":
        raise ConfigError(
            "sampler.last_step=sde adds noise after the branch point, so a group's rewards would no longer be due to "
            f"its branch step alone; set sampler.last_step: ode with sampler.rollout: {rollout}"
        )
    if s.window != type(s.window)():  # every field at its default
        raise ConfigError(
            "sampler.window.* places the chain rollout's SDE window; the branch rollout's one SDE step is each group's "
            f"branch point ({points}): remove sampler.window"
        )
    if s.post_window != type(s.post_window)():
        raise ConfigError(
            "sampler.post_window.* sets the chain rollout's solver after its window; after the branch point every "
            "image follows the Euler ODE, as the reference: remove sampler.post_window"
        )
    if s.kind == "langevin" and s.score_eval == "reeval":
        raise ConfigError(
            "sampler.score_eval=reeval evaluates the network a second time on the images branching at a step, a "
            "number of forwards that differs between processes (it would hang FSDP / DeepSpeed ZeRO-3); set "
            f"sampler.score_eval: frozen with sampler.rollout: {rollout}"
        )


@register_rollout("branch")
class Branch(RolloutStrategy):
    """TempFlow-GRPO's branched groups: ODE trunk, one SDE step at the group's branch point, ODE after it."""

    @classmethod
    def validate(cls, config: Config, world_size: int = 1) -> None:  # noqa: ARG003 (no per-process setting)
        check_branch(config)

    def __init__(self, context: RolloutContext) -> None:
        super().__init__(context)
        cfg = context.config
        self.steps = branch_step_list(cfg.sampler.branch.steps, cfg.sampler.num_steps)

    def plan(self, group_ids: list[int]) -> tuple[list[int], list[int] | None]:
        """Each group id's branch point, and the span of its SDE step (None: every span 1; :mod:`.merged`)."""
        cfg = self.context.config
        return branch_points(group_ids, self.steps, cfg.sampler.branch.schedule, seed=cfg.run.seed), None

    def metrics(self, points: list[int], spans: list[int] | None) -> dict[str, float]:
        ks = torch.tensor(points, dtype=torch.float64)
        metrics = {"branch/step_mean": ks.mean().item(), "branch/step_min": ks.min().item()}
        metrics["branch/step_max"] = ks.max().item()
        return metrics

    def collect(self, epoch: int) -> Collected | None:
        ctx, cfg = self.context, self.context.config
        slots = ctx.epoch_slots(epoch)
        slots = sorted(slots, key=lambda s: s.group_id)  # a group's images side by side: one trunk per batch
        points, spans = self.plan([s.group_id for s in slots])
        size = cfg.sampler.batch_size

        def sample(index: int, batch: list[EpochSample]) -> list[Trajectory]:
            prompts, metadata, sources = self.batch_inputs(batch)
            start = index * size
            trajectory = branch_rollout(
                ctx.adapter,
                prompts,
                [s.group_id for s in batch],
                points[start : start + size],
                cfg.sampler,
                ctx.generator,
                spans=None if spans is None else spans[start : start + size],
                **self.sampling_options(metadata, sources),
            )
            return [self.submit(trajectory)]

        parts = self.sample_batches(slots, epoch, sample)
        return None if parts is None else Collected(Trajectory.cat(parts), self.metrics(points, spans))
