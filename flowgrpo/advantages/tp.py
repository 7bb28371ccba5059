"""``grpo.advantage.estimator: turning_point``: TP-GRPO (Tong et al., "Alleviating Sparse Rewards by Modeling
Step-Wise and Long-Term Sampling Effects in Flow-Based GRPO", arXiv 2602.06422): step-level incremental rewards,
turning points found by sign changes, and the aggregated long-term reward at turning points. Needs
``sampler.rollout: dense`` (its ``extras["step_rewards"]``, a sample's stage values ``V_0 .. V_W``; see
:mod:`flowgrpo.rollouts.dense`). Returns one advantage per sample and window step, ``[N, W]``.

For one sample (all pure functions below)::

    d_j   = V_{j+1} - V_j              the incremental reward of window step j (j = 0 .. W-1): what the step changed
    Δ     = V_W - V_0 = Σ_j d_j        the trajectory's overall trend
    s_j   = sign(d_j) · sign(Δ)        +1: step j moves with the overall trend; -1: against it; 0: no change
    agg_j = V_W - V_j = Σ_{i≥j} d_i    the aggregated long-term reward of step j (its own and every later change)

    turning point, j ≥ 1:  s_{j-1} < 0 and s_j > 0    the local trend flips back to the trajectory's
    turning point, j = 0:  s_0 > 0                    (first_step) the first step sets the trend of what follows
    consistent: a turning point also needs sign(d_j) = sign(V_W - V_{j+1}): the rest of the trajectory keeps step
                j's direction (never true at the last step, where V_W - V_W = 0), the first step included

    form: paper       r_j = agg_j at a turning point, d_j elsewhere
    form: reference   r_j = Δ + 1[turning point] · d_j

    A_{i,j} = (r_{i,j} - mean_g(r_{·,j})) / (std_g(r_{·,j}) + eps), clipped to ±clip, per window step j over the
              samples of i's prompt group g (std: group = unbiased std of the group; global = population std of column
              j over all samples)

A sample whose stage values are not all finite (the reward failed on an intermediate image) gets 0 at every step
and takes no part in the statistics; so does a group left with fewer than 2 such samples.

**Reference** (YunzeTong/TurningPoint-GRPO@f9f6ff4, ``scripts/my_train_sd3_fast_with_op3.py`` and
``config/my_grpo.py:pickscore_sd3_fast_op3``): ``d_t = R_t - R_{t-1}`` over ``[R_ode, R_1, .., R_n]`` (R_ode the
pure ODE, R_i the ODE completion after i SDE steps, R_n the final image), ``s_t = sign(d_t)·sign(Δ_global)``,
indicator ``(s_{t-1} < 0)·(s_t > 0)``, ``indicator_0 = s_0 > 0`` (``apply_first_step_bonus``), the consistency
check ``sign(d_t)·sign(R_sde - R_{t+1}) > 0`` (``consistent`` applies it at every step: the reference's
``select_inter_step_only_from_consistent_trajectory`` for t ≥ 1 together with
``select_first_step_only_from_consistent_trajectory`` at t = 0, which replaces ``s_0 > 0`` there but implies it;
the inter-step flag alone is not offered); per
timestep, per prompt ``PerPromptStatTracker`` (``np.std`` + 1e-4), ``adv_clip_max = 5``. Its released op3 configs
set ``take_delta_global_as_main = True``: ``R_t = Δ_global + η·indicator_t·d_t`` (η = 1): the trajectory's
outcome gain on every step, the step's own increment added at turning points. That is ``form: reference``. The
paper (abstract; summaries of its method) describes the opposite assignment: incremental rewards replace the outcome
reward, and a turning point's reward is replaced by the aggregated long-term one, which is the reference code's
``take_delta_global_as_main = False, use_sde_minus_rt = True, drop_original_reward_when_having_bonus = True`` and
``form: paper`` here, the default. **Deviations**: the group std is unbiased under ``std: group`` (the reference:
``np.std``, ×√((G-1)/G)); the reference's ``use_balanced_bonus``, ``propagate_bonus_to_future_steps``,
``select_only_positive_intermediate_step`` and ``turn_on_bonus_global_step`` options (all off in its configs) are not
offered; the stage values are x̂_0 rewards unless ``sampler.dense.value: ode`` (the reference's ODE completions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import ConfigError, one_of
from .base import AdvantageInputs, register_advantage_estimator
from .group import group_advantages

FORMS = ("paper", "reference")
STDS = ("group", "global")


@dataclass
class TurningPointSettings:
    """``grpo.advantage.turning_point:`` TP-GRPO's step rewards (flowgrpo/advantages/tp.py)."""

    form: str = "paper"  # paper: agg_j replaces d_j at turning points | reference: Δ + 1[turning point]·d_j
    first_step: bool = True  # the first step is a turning point when it moves with the overall trend (reference: on)
    consistent: bool = False  # turning points (the first step's too) also need the rest of the trajectory to keep
    #                           their direction (the reference's two select_*_from_consistent_trajectory flags)
    std: str = "group"  # group: per prompt group and step (the reference's trackers) | global: per step, all samples


def increments(values: Tensor) -> Tensor:
    """``d_j = V_{j+1} - V_j``: ``[N, W + 1]`` stage values -> ``[N, W]`` incremental rewards."""
    if values.ndim != 2 or values.shape[1] < 2:
        raise ValueError(f"stage values must be [N, W + 1] with W >= 1, got shape {tuple(values.shape)}")
    return values[:, 1:] - values[:, :-1]


def aggregated_rewards(values: Tensor) -> Tensor:
    """``agg_j = V_W - V_j = Σ_{i≥j} d_i``: ``[N, W + 1]`` -> ``[N, W]``, step j's own change and every later one."""
    return values[:, -1:] - values[:, :-1]


def turning_points(values: Tensor, *, first_step: bool = True, consistent: bool = False) -> Tensor:
    """``[N, W]`` bool: the window steps that are turning points of each sample's stage values ``[N, W + 1]``.

    ``s_j = sign(d_j)·sign(V_W - V_0)``; step j ≥ 1 turns when ``s_{j-1} < 0 < s_j``; step 0 when ``s_0 > 0`` and
    ``first_step``. ``consistent``: additionally ``sign(d_j)·sign(V_W - V_{j+1}) > 0``."""
    d = increments(values)
    s = torch.sign(d) * torch.sign(values[:, -1:] - values[:, :1])
    points = torch.zeros_like(d, dtype=torch.bool)
    points[:, 1:] = (s[:, :-1] < 0) & (s[:, 1:] > 0)
    if first_step:
        points[:, 0] = s[:, 0] > 0
    if consistent:
        rest = values[:, -1:] - values[:, 1:]  # V_W - V_{j+1}: what the trajectory does after step j
        points &= torch.sign(d) * torch.sign(rest) > 0
    return points


def turning_point_rewards(
    values: Tensor, *, form: str = "paper", first_step: bool = True, consistent: bool = False
) -> Tensor:
    """``[N, W]`` step rewards r_j (module docstring): ``paper`` agg_j at turning points and d_j elsewhere;
    ``reference`` Δ + 1[turning point]·d_j."""
    one_of("grpo.advantage.turning_point.form", form, FORMS)
    d = increments(values)
    points = turning_points(values, first_step=first_step, consistent=consistent)
    if form == "paper":
        return torch.where(points, aggregated_rewards(values), d)
    trend = values[:, -1:] - values[:, :1]
    return trend + points.to(d.dtype) * d


def per_step_group_advantages(
    rewards: Tensor, group_ids: Tensor, *, std: str = "group", clip: float = 5.0, eps: float = 1e-4
) -> Tensor:
    """``[N, W]``: :func:`group_advantages` of every column separately (step j's rewards against the same step of
    the other samples of the group). Rows with a non-finite reward get 0 and stay out of the statistics; so does a
    group left with fewer than 2 rows."""
    if rewards.ndim != 2 or group_ids.shape != rewards.shape[:1]:
        raise ValueError(f"rewards must be [N, W], group_ids [N]; got {tuple(rewards.shape)}, {tuple(group_ids.shape)}")
    out = torch.zeros(rewards.shape, dtype=torch.float32)
    valid = torch.isfinite(rewards).all(dim=1)
    _, inverse, counts = torch.unique(group_ids[valid], return_inverse=True, return_counts=True)
    rows = torch.nonzero(valid).flatten()[counts[inverse] >= 2]
    if len(rows) == 0:
        return out
    for j in range(rewards.shape[1]):
        out[rows, j] = group_advantages(rewards[rows, j], group_ids[rows], std=std, clip=clip, eps=eps)
    return out


def step_values(inputs: AdvantageInputs, estimator: str) -> Tensor:
    """``extras["step_rewards"]`` [N, W + 1] of a dense rollout, checked against the window's W steps."""
    values = inputs.extras.get("step_rewards")
    if values is None:
        raise ValueError(
            f"grpo.advantage.estimator={estimator} needs each sample's stage rewards (extras['step_rewards']), which "
            "sampler.rollout: dense adds; set sampler.rollout: dense"
        )
    if values.ndim != 2 or values.shape[1] != inputs.num_steps + 1:
        raise ValueError(
            f"extras['step_rewards'] has shape {tuple(values.shape)}; {estimator} needs [N, W + 1] for the "
            f"{inputs.num_steps} trained steps of the window"
        )
    return values.double()


def require_dense(config: Any, estimator: str) -> None:
    """Refuse a run whose rollout adds no stage rewards (before anything loads)."""
    if config.sampler.rollout != "dense":
        raise ConfigError(
            f"grpo.advantage.estimator={estimator} credits each window step from the rewards of every stage's "
            f"prediction (extras['step_rewards']), which only sampler.rollout: dense computes, but sampler.rollout="
            f"{config.sampler.rollout}; set sampler.rollout: dense (sampler.dense.value: x0 or ode)"
        )


def _check(config: Any) -> None:
    require_dense(config, "turning_point")
    settings = config.grpo.advantage.turning_point
    one_of("grpo.advantage.turning_point.form", settings.form, FORMS)
    one_of("grpo.advantage.turning_point.std", settings.std, STDS)


@register_advantage_estimator("turning_point", config_class=TurningPointSettings, validate=_check)
def turning_point(inputs: AdvantageInputs, settings: Any) -> Tensor:
    """TP-GRPO's per-step advantages ``[N, W]`` (module docstring)."""
    tp: TurningPointSettings = settings.turning_point
    values = step_values(inputs, "turning_point")
    rewards = turning_point_rewards(values, form=tp.form, first_step=tp.first_step, consistent=tp.consistent)
    return per_step_group_advantages(rewards, inputs.group_ids, std=tp.std, clip=settings.clip, eps=settings.std_eps)
