"""``sampler.rollout: entropy_merge``: E-GRPO's merged high-entropy SDE steps (Zhang et al., arXiv:2601.00423).

The branch rollout (:mod:`.branch`, TempFlow-GRPO) with one change: a group's one stochastic step may span several
schedule steps. A group's images share the prompt and the initial noise, follow one ODE trunk to the group's merged
step ``(k, m)``, take ONE SDE transition from ``t_k`` to ``t_{k+m}`` there (each image its own noise), then each
follows the Euler ODE from step ``k + m`` to ``t = 0``::

    x_{i+1}   = x_i + (t_{i+1} - t_i)·v(x_i, t_i)              i < k       the trunk, once per group
    x_{k+m}^g = mean_{k,m}(x_k) + std_{k,m}·z^g,  z^g ~ N(0, I)  the merged step, stored: the one trained transition
    x_{i+1}^g = x_i^g + (t_{i+1} - t_i)·v(x_i^g, t_i)          i >= k + m  each image's own Euler ODE

``mean_{k,m}``, ``std_{k,m} = g(t_k)·sqrt(t_k - t_{k+m})``: :func:`samplers.merge.merged_sde_step`, the
Euler–Maruyama step over the merged interval (``sampler.kind: euler_maruyama``, the reference's). Merging ``m`` low
entropy steps gives one step of higher entropy (``h = ½ log(2πe std²)`` grows with ``Δ``), and a group's rewards
differ only through it: one clean credit per group. The stored transition has ``sigmas = t_k``,
``sigmas_next = t_{k+m}``, so every ratio objective re-scores it with the unchanged step maths (ratio 1 before the
first update; ``grpo.objective: clipped`` is the reference's loss).

**The plan** (``sampler.entropy_merge``, :class:`EntropyMergeConfig`): the merged steps ``[(k, m), ...]`` groups are
spread over, either listed (``steps`` and ``spans``: the reference's ``--eta_step_list`` / ``--eta_step_merge_list``)
or chosen by entropy (``threshold`` τ, nats per latent element; ``max_end``): :func:`samplers.merge.entropy_merge_plan`
tiles the schedule from step 0, each merged step the shortest whose Gaussian entropy reaches τ, up to step
``max_end``. ``schedule`` (``sweep`` | ``random``) gives each group one entry of the plan, a pure function of
``(run.seed, group id)`` (:func:`.branch.branch_points` over the entries' indices), as the branch rollout does.

**Advantages.** The paper's "multi-step group normalised advantage" normalises rewards among the samples that share
one merged SDE step. Here a group IS the samples that share one: the same prompt, initial noise and trunk, and one
merged step ``(k, m)``; so ``grpo.advantage.estimator: group`` computes exactly it, ``(R - mean_G) / (std_G + ε)``
with the unbiased std (the reference's ``torch.std`` + 1e-8) clipped to ±5 (its ``adv_clip_max``). No new estimator.

**Against the reference** (shengjun-zhang/VisualGRPO @809e8f7: ``fastvideo/workers/sampler/flux_sampler.py``,
``fastvideo/workers/rollout_buffer.py``, ``fastvideo/trainer/grpo_trainer.py``,
``scripts/finetune/finetune_g2rpo_hps_merge.sh``): it samples one ODE "anchor" per prompt and branches it at EVERY
entry of ``eta_step_list`` with the merged step ``merge_step`` long, ``num_generations`` images each; the images of
one (prompt, entry) are normalised together and each entry takes one optimizer step. Here a group is one (prompt,
noise, plan entry) and the sweep spreads the epoch's groups over the entries (as :mod:`.branch` against TempFlow's
reference). After a merged step the reference's ``_run_ode_sample`` restarts its Euler loop at schedule index
``k + 1`` whatever ``m`` is (its latents are at ``t_{k+m}``); here the ODE resumes at ``t_{k+m}``, where the merged
step left the latents. Its multi-granularity rewards (``granular_list``: an ODE completion per granularity and summed
advantages, from Granular-GRPO) are not reproduced; E-GRPO's launch script uses ``granular_list 1``, one completion.
The reference draws one initial noise per sampling call shared by its prompts; here one per group. The adaptive
threshold rule is our reading of the paper's (its text was not available; see :mod:`samplers.merge`).

**Refused** (before anything loads): everything :func:`.branch.check_branch` refuses (objectives that store nothing,
``same_initial_noise: false``, noise level 0, ``last_step: sde``, the chain rollout's window settings, Langevin's
``reeval``), kinds other than ``euler_maruyama`` (a cps jump to ``t_{k+m}`` has std ``t_{k+m}·sin(aπ/2)``, LOWER for
a longer merge), a plan given both ways or neither, merged steps past the last step (which stays ODE), and an
unreachable threshold (checked at start-up from the model's schedule when ``sampler.time_shift`` is null).
Every rollout batch runs ``T`` forwards whatever its plan (see :func:`.branch.branch_rollout`), so FSDP and
DeepSpeed need no refusal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from samplers import static_shift_schedule
from samplers.merge import entropy_merge_plan

from ..checks import ConfigError, one_of
from .base import register_rollout
from .branch import SCHEDULES, Branch, branch_points, check_branch

if TYPE_CHECKING:
    from ..config import Config
    from .base import RolloutContext

NAME = "entropy_merge"


@dataclass
class EntropyMergeConfig:
    """``sampler.entropy_merge:`` E-GRPO's merged SDE steps (``sampler.rollout: entropy_merge``; give ``steps`` or
    ``threshold``)."""

    steps: list[int] | None = None  # where each merged SDE step starts (reference --eta_step_list, e.g. [0, 1, 2, 4])
    spans: list[int] | None = None  # schedule steps each one covers, m >= 1 (--eta_step_merge_list); null: all 1
    threshold: float | None = None  # τ, nats per latent element: the plan tiles the schedule from step 0, each merged
    #                                  step the shortest with ½·log(2πe·std²) >= τ (samplers.merge.entropy_merge_plan)
    max_end: int | None = None  # threshold only: merged steps end by this step (null: num_steps - 1, the last is ODE)
    schedule: str = "sweep"  # sweep: group id g takes plan entry g mod n | random: a uniform draw per group


def explicit_plan(steps: list[int], spans: list[int] | None) -> list[tuple[int, int]]:
    """``[(k, m), ...]`` from the listed starts and spans (spans null: every span 1)."""
    return list(zip(steps, spans if spans is not None else [1] * len(steps), strict=True))


def resolve_plan(config: Config, sigmas: Tensor) -> list[tuple[int, int]]:
    """The run's merged steps ``[(k, m), ...]`` on the schedule ``sigmas`` ``[T + 1]`` (a ConfigError if the threshold
    cannot be reached)."""
    s, m = config.sampler, getattr(config.sampler, NAME)
    if m.steps is not None:
        return explicit_plan(m.steps, m.spans)
    try:
        return entropy_merge_plan(
            sigmas,
            m.threshold,
            kind=s.kind,
            noise_level=s.noise_level,
            max_end=m.max_end,
            diffusion=s.diffusion,
            t_second=float(sigmas[1]),
        )
    except ValueError as err:
        raise ConfigError(f"sampler.{NAME}.threshold={m.threshold}: {err}") from None


def check_entropy_merge(config: Config) -> None:
    """Refuse settings the merged-step rollout cannot use, naming key and fix (module docstring)."""
    check_branch(config, rollout=NAME)
    s, m, key = config.sampler, getattr(config.sampler, NAME), f"sampler.{NAME}"
    one_of(f"{key}.schedule", m.schedule, SCHEDULES)
    if s.kind != "euler_maruyama":
        raise ConfigError(
            f"sampler.rollout={NAME} merges steps into one Euler–Maruyama step over t_k..t_(k+m) (E-GRPO); "
            f"sampler.kind={s.kind} would take another step there (cps: std t_(k+m)·sin(aπ/2), lower for a longer "
            f"merge); set sampler.kind: euler_maruyama, or use sampler.rollout: branch"
        )
    if (m.steps is None) == (m.threshold is None):
        raise ConfigError(
            f"{key} needs its merged steps one way: {key}.steps (and spans) lists them, or {key}.threshold chooses "
            "them by entropy; set exactly one (the reference: steps [0, 1, 2, 4], spans [1, 1, 2, 3])"
        )
    last = s.num_steps - 1
    if m.steps is not None:
        if m.max_end is not None:
            raise ConfigError(f"{key}.max_end bounds the threshold's plan; with {key}.steps listed, remove it")
        if not m.steps:
            raise ConfigError(f"{key}.steps is an empty list; list the steps the merged SDE steps start at")
        if m.spans is not None and len(m.spans) != len(m.steps):
            raise ConfigError(f"{key}.spans needs one entry per step of {key}.steps ({len(m.steps)}), got {m.spans}")
        plan = explicit_plan(m.steps, m.spans)
        bad = [(k, span) for k, span in plan if k < 0 or span < 1 or k + span > last]
        if bad:
            raise ConfigError(
                f"{key}: merged steps (start, span) {bad} do not fit sampler.num_steps={s.num_steps}: a start >= 0 "
                f"and a span >= 1 ending by step {last} (the last step, into t = 0, is ODE); shorten them"
            )
        return
    if m.spans is not None:
        raise ConfigError(f"{key}.spans goes with {key}.steps; with {key}.threshold the spans are chosen: remove it")
    if not math.isfinite(m.threshold):
        raise ConfigError(f"{key}.threshold must be a finite number of nats, got {m.threshold}")
    if m.max_end is not None and not 1 <= m.max_end <= last:
        raise ConfigError(f"{key}.max_end must lie in 1..{last} (the last step is ODE), got {m.max_end}")
    if s.time_shift is not None:  # the schedule is known before the model loads
        resolve_plan(config, static_shift_schedule(s.num_steps, s.time_shift)[0])


@register_rollout(NAME)
class EntropyMerge(Branch):
    """E-GRPO: ODE trunk, one merged SDE step ``t_k → t_{k+m}`` per group, ODE after it."""

    config_class = EntropyMergeConfig

    @classmethod
    def validate(cls, config: Config, world_size: int = 1) -> None:  # noqa: ARG003 (no per-process setting)
        check_entropy_merge(config)

    def __init__(self, context: RolloutContext) -> None:
        super().__init__(context)
        cfg = context.config
        sigmas, _ = context.adapter.schedule(cfg.sampler.num_steps, *cfg.model.size, time_shift=cfg.sampler.time_shift)
        self.merges = resolve_plan(cfg, sigmas.detach().float().cpu())

    def plan(self, group_ids: list[int]) -> tuple[list[int], list[int]]:
        """Each group's merged step: entry ``branch_points(ids, 0..n-1)`` of the plan, as ``(starts, spans)``."""
        cfg = self.context.config
        entries = list(range(len(self.merges)))
        picks = branch_points(group_ids, entries, getattr(cfg.sampler, NAME).schedule, seed=cfg.run.seed)
        return [self.merges[j][0] for j in picks], [self.merges[j][1] for j in picks]

    def metrics(self, points: list[int], spans: list[int] | None) -> dict[str, float]:
        ks, ms = torch.tensor(points, dtype=torch.float64), torch.tensor(spans, dtype=torch.float64)
        return {
            "merge/step_mean": ks.mean().item(),
            "merge/step_min": ks.min().item(),
            "merge/step_max": ks.max().item(),
            "merge/span_mean": ms.mean().item(),
            "merge/span_max": ms.max().item(),
            "merge/plan_size": float(len(self.merges)),
        }
