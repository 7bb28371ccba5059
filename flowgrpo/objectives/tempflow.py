"""TempFlow-GRPO's noise-aware weighting (He et al., arXiv 2508.04324): ``grpo.objective: tempflow``, settings
``grpo.tempflow``.

Flow-GRPO's clipped per-step loss (:mod:`.clipped`) with each sample's policy term scaled by the noise its trained
step injected, normalised so that the weights average 1 over the schedule::

    s_i  = std of sample i's stored transition; Euler–Maruyama with Flow-GRPO's diffusion (design.md §3.1):
           s = a·sqrt(t / (1 - t))·sqrt(t - t_next), t = 1 read as t₁ (the schedule's second sigma)
    c    = 1 / mean_{j = 0..T-2} s_j        the same std at every step of the schedule but the last
           (or c = grpo.tempflow.weight_scale when set)
    w_i  = c · s_i
    loss = mean_i w_i · max(-A_i r_i, -A_i clip(r_i, 1 - ε, 1 + ε)) + β · mean_i KL_i

with ``r_i`` the ratio of the re-scored to the stored log-prob and ε = ``grpo.clip_range``. Steps that inject much
noise (early, large t) weigh more, where the group's rewards spread most; the nearly deterministic last steps weigh
little. Since ``w > 0``, ``w·max(-A r, -A clip r) = max(-wA r, -wA clip r)``: the weight is folded into the advantage
and :func:`~.clipped.timestep_loss` computes the rest unchanged. The KL term (``grpo.kl``) is not weighted. The weights
use each sample's own stored std, so they hold for any ``sampler.kind`` (CPS: ``s = t_next·sin(aπ/2)``) and for the
chain rollout's window too (Flow-GRPO with noise-aware weights); TempFlow-GRPO pairs them with the branch rollout
(``sampler.rollout: branch``, :mod:`flowgrpo.rollouts.branch`), where each sample's one stored step is its group's
branch point.

**The reference** (Shredded-Pork/TempFlow-GRPO @e66824e): ``scripts/train_sd3_pr.py`` computes
``unclipped_loss = -2.25 * std_dev_t * advantages * ratio`` (and the clipped twin), ``std_dev_t`` being the fourth
value of ``sde_step_with_logprob`` in ``flow_grpo/diffusers_patch/sd3_sde_with_logprob_perstep.py``,
``0.7·sqrt(σ/(1 - σ))·sqrt(-dt)`` (σ = 1 read as ``sigmas[1]``): ``s`` above. Its ``scripts/train_flux_pr.py`` uses
1.73. Those constants are ``c`` of the formula, to 3 digits: SD3.5-Medium's schedule (shift 3, 10 steps, a = 0.7) gives
1 / mean s = 2.2522, FLUX.1-dev's at 1024 px (dynamic shift, a = 0.9) 1.7260. Its KL,
``mean((μ - μ_ref)²) / (2 s²)`` times β, is unweighted (``grpo.kl.convention: exact``).

**Deviations.** ``c`` is computed from the run's schedule and noise level (null ``weight_scale``) rather than typed
in, so it stays "mean weight 1" at other step counts, noise levels and resolutions; ``weight_scale: 2.25`` gives the
reference's number exactly. The weight is per sample: the reference multiplies a ``[B, 1, 1, 1]`` std by ``[B]``
advantages, which broadcasts to ``[B, 1, 1, B]`` with mean ``c·mean_i(s_i)·mean_k(max(...)_k)``; that equals the
per-sample form there because all rows it trains together share the step (no timestep shuffling), and is what the
per-sample form generalises to micro-batches whose samples sit at different steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from samplers import sde_step

from ..checks import ConfigError, check_range
from ..rollout import _step_kwargs
from .base import MicroBatch, Objective, register_objective
from .clipped import at_positions, step_advantages, timestep_loss

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config, SamplerConfig


@dataclass
class TempFlowConfig:
    """``grpo.tempflow:`` the noise-aware weights ``w = c·s`` of the policy term."""

    weight_scale: float | None = None  # c; null: 1 / the mean transition std over steps 0..T-2 of the sampler's
    #                                    schedule (SD3.5-M, 10 steps, a = 0.7: 2.2522; the reference types 2.25)


def schedule_stds(sampler: SamplerConfig, sigmas: Tensor) -> Tensor:
    """``[T - 1]`` float32: the std ``s_j`` of the sampler's SDE step ``j → j + 1`` for ``j = 0..T-2`` of the
    schedule ``sigmas`` ``[T + 1]`` (the steps a branch or window can train), from the step kind itself
    (``sampler.kind``, noise level, diffusion, κ), with ``t₁ = sigmas[1]``. Euler–Maruyama with Flow-GRPO's
    diffusion: ``s_j = a·sqrt(t_j / (1 - t_j))·sqrt(t_j - t_{j+1})``, ``t_0 = 1`` read as ``t₁``."""
    zero = torch.zeros(1, 1)
    stds = []
    for j in range(len(sigmas) - 2):
        step = sde_step(
            sampler.kind,
            zero,
            zero,
            sigmas[j],
            sigmas[j + 1],
            t_second=float(sigmas[1]),
            velocity_fn=lambda y, t: torch.zeros_like(y),
            noise=zero,
            **_step_kwargs(sampler),
        )
        stds.append(torch.as_tensor(step.std, dtype=torch.float32).reshape(-1)[0])
    return torch.stack(stds)


def noise_aware_weights(stds: Tensor, reference_stds: Tensor | None = None, scale: float | None = None) -> Tensor:
    """``w_i = c·s_i`` for the stds ``s`` ``[B]`` of the trained transitions, with ``c = scale`` when given, else
    ``c = 1 / mean(reference_stds)`` (:func:`schedule_stds`: the weights then average 1 over the schedule)."""
    if scale is None:
        if reference_stds is None or not float(reference_stds.float().mean()) > 0:
            raise ValueError("noise_aware_weights needs a scale or reference stds with a positive mean")
        scale = 1.0 / float(reference_stds.float().mean())
    return scale * stds.float()


@register_objective("tempflow")
class TempFlow(Objective):
    """Flow-GRPO's clipped ratio with TempFlow-GRPO's noise-aware weight on each sample's policy term."""

    config_class: ClassVar[type] = TempFlowConfig
    rollout: ClassVar[str] = "sde_window"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._scales: dict[tuple[int, int], float] = {}

    @classmethod
    def validate(cls, config: Config) -> None:
        check_range(
            "grpo.tempflow.weight_scale",
            config.grpo.tempflow.weight_scale,
            0,
            low_open=True,
            why="null: 1 / the schedule's mean step std",
        )
        if config.sampler.noise_level <= 0:
            raise ConfigError(
                f"grpo.objective=tempflow weights each step by the noise it injects, but sampler.noise_level="
                f"{config.sampler.noise_level} injects none; set sampler.noise_level > 0 (Flow-GRPO's SD3 value: 0.7)"
            )

    def weight_scale(self, adapter: PipelineAdapter, height: int, width: int) -> float:
        """``c``: the setting, or ``1 / mean(schedule_stds)`` on the adapter's schedule at this size (cached)."""
        if self.settings.weight_scale is not None:
            return self.settings.weight_scale
        key = (height, width)
        if key not in self._scales:
            s = self.config.sampler
            sigmas, _ = adapter.schedule(s.num_steps, height, width, time_shift=s.time_shift)
            self._scales[key] = 1.0 / float(schedule_stds(s, sigmas.float().cpu()).mean())
        return self._scales[key]

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The clipped loss of :func:`~.clipped.timestep_loss` with ``w_i·A_i`` for ``A_i``; logs its statistics and
        ``noise_weight`` (mean, ``_min``, ``_max`` over the epoch's terms)."""
        sub, positions, advantages = batch.trajectory, batch.positions, batch.advantages
        advantages = step_advantages(advantages, positions)  # per-step ones: each sample's at its trained position
        stds = at_positions(sub.stds, positions)
        weights = noise_aware_weights(stds, scale=self.weight_scale(adapter, sub.height, sub.width))
        weights = weights.to(advantages.device)
        loss, stats = timestep_loss(adapter, self.config, sub, positions, weights * advantages)
        extra = {"noise_weight": weights.mean(), "noise_weight_min": weights.min(), "noise_weight_max": weights.max()}
        return loss, {**stats._asdict(), **extra}
