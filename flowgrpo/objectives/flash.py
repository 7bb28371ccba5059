"""Flash-GRPO (He et al., "Flash-GRPO: Efficient Alignment for Video Diffusion via One-Step Policy Optimization",
arXiv:2605.15980, ICML 2026): ``grpo.objective: flash``, settings ``grpo.flash``.

Three parts, each through its seam:

1. **Single-step training.** Each sample is SDE-sampled and trained at one step: ``sampler.window.size: 1``
   (validated), one loss term per sample.
2. **Iso-temporal grouping.** The whole group is at the same step, drawn per group, so a timestep's difficulty does
   not confound the group's advantages: the rollout strategy ``sampler.rollout: iso_temporal``
   (:mod:`flowgrpo.rollouts.iso`). (With ``sampler.rollout: chain`` and a size-1 random window every group of an
   epoch, or of a rollout batch with ``window.per_batch``, shares one step: iso-temporal too, without the spread.)
3. **Temporal gradient rectification** (this module). On-policy (``r = 1``) the clipped loss's gradient is
   ``-A · ∇_θ log p(x' | x)``. The step is Gaussian, ``x' = μ_θ + σ·z``, and ``σ`` does not depend on θ, so (log-prob
   per element, averaged over the D latent elements)::

       ∇_θ log p = (1/D) Σ (x' - μ)/σ² · ∂μ/∂v · ∇_θ v = (1/D) Σ z · (∂μ/∂v)/σ · ∇_θ v

   The velocity's gradient reaches the loss scaled by ``c(t) = |∂μ/∂v| / σ``, a function of the step alone. For the
   Euler–Maruyama step (docs/design.md §3.1), ``μ = x + dt·(v + g²/(2t)·(x + (1 - t)·v))`` and ``σ = g·√Δ``::

       c(t) = √Δ / g(t) + g(t) · √Δ · (1 - t) / (2t)                (Δ = t - t_next, g the diffusion)

   On a 20-step Wan2.1 schedule ``1/c`` falls from 7.48 at step 0 to 3.78 at step 9, so untreated the early steps
   of a single-step epoch would take steps half as large. Rectification multiplies each sample's policy term by

       w(t) = (1 / c(t)) / Z

   (equivalently its advantage: ``max(-A·w·r, -A·w·clip(r)) = w · max(-A·r, -A·clip(r))`` for ``w > 0``), so every
   step's gradient reaches the weights with the same scale ``1/Z``. ``Z`` (``grpo.flash.rectify``):

   - ``schedule`` (default): the mean of ``1/c`` over the steps the window draws from (starts ``0..max_start`` of
     the sampler's schedule), so the weights average 1 over the draw;
   - ``batch``: the mean of ``1/c`` over the micro-batch (the reference's, per process);
   - ``none``: no rectification (``w = 1``): parts 1 and 2 only, for ablations.

**The formula, as the reference code has it** (github.com/Shredded-Pork/Flash-GRPO @8cfc973; the paper's method
section could not be read from the stored copies, only its abstract). ``wan2_1_pipeline_with_logprob2.py``'s
``sde_step_with_logprob`` returns ``coe = 1 / (sqrt(-dt)/std_dev_t + std_dev_t·sqrt(-dt)·(1 - σ)/(2σ))`` with
``std_dev_t = g(σ) = σ₁·σ`` (the ``flowgrpo_wan`` diffusion, a = 1), i.e. ``coe = 1/c``; ``train_wanx2_1_flash.py``
looks ``coe`` up in a table for the first ten of its 20 timesteps (7.4770 at 999 … 3.7754 at 785, which
:func:`euler_maruyama_gradient_scale` reproduces to 4 decimals, ``tests/test_flash.py``) and uses
``-w·coe·A·r`` (clipped alike) with ``w = 1 / mean(coe)`` over the micro-batch, averaged over processes.

**Differences.** ``Z`` defaults to its expectation over the draw (``schedule``) instead of the batch's mean: a
sample's weight then does not depend on which other samples share its micro-batch or process, and needs no
collective (``batch`` is the reference's per-process form). ``c`` is computed for the configured step rather than
tabulated: for any ``sampler.kind`` whose mean is affine in ``v`` (``euler_maruyama`` with any diffusion, ``cps``,
``langevin`` with ``score_eval: frozen``) ``∂μ/∂v`` is read off the step function itself
(:func:`gradient_scale`); ``langevin``'s ``reeval`` (a second network call inside the mean) and ``cps``'s
``squared_error`` log-prob (another gradient) are refused. The KL term (``grpo.kl.beta``; the reference's is 0) is
not rectified. Everything else is :func:`flowgrpo.objectives.clipped.timestep_loss`, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from samplers import sde_step

from ..checks import ConfigError, one_of
from ..rollout import make_window, plan_rollout
from .base import MicroBatch, Objective, register_objective
from .clipped import step_advantages, timestep_loss

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config, SamplerConfig
    from ..rollout import Trajectory

RECTIFY = ("schedule", "batch", "none")
#: step kinds whose mean is affine in the velocity, so that c(t) is a property of the step alone
AFFINE_KINDS = ("euler_maruyama", "cps", "langevin")


@dataclass
class FlashSettings:
    """``grpo.flash:`` Flash-GRPO's temporal gradient rectification."""

    rectify: str = "schedule"  # schedule: w = (1/c) / mean of 1/c over the window's draw (weights average 1) | batch:
    #                            / the micro-batch's mean (the reference's, per process) | none: w = 1 (ablation)


def euler_maruyama_gradient_scale(t: Tensor, t_next: Tensor, g: Tensor) -> Tensor:
    """Flash-GRPO's time-dependent scale of the Euler–Maruyama step's log-prob gradient,
    ``c(t) = |∂μ/∂v| / σ = √Δ / g + g · √Δ · (1 - t) / (2t)`` with ``Δ = t - t_next`` and ``g = g(t)`` the diffusion
    (the reference's ``1 / coe``). Elementwise over broadcastable tensors."""
    t, t_next, g = (torch.as_tensor(a, dtype=torch.float32) for a in (t, t_next, g))
    root = torch.sqrt(t - t_next)
    return root / g + g * root * (1 - t) / (2 * t)


def gradient_scale(sampler: SamplerConfig, t: Tensor, t_next: Tensor, t_second: float) -> Tensor:
    """``c = |∂μ/∂v| / σ`` of the configured SDE step for each step ``(t[i], t_next[i])``: the factor between the
    velocity's gradient and the step's log-prob gradient, ``∇_θ log p = mean(z · (∂μ/∂v)/σ · ∇_θ v)``.

    The mean is affine in ``v`` for :data:`AFFINE_KINDS` (``langevin`` with ``score_eval: frozen``), so
    ``∂μ/∂v = μ(x=0, v=1) - μ(x=0, v=0)``: both are read off the registered step with the sampler's options
    (``t_second``: the schedule's second sigma). For ``euler_maruyama`` this is
    :func:`euler_maruyama_gradient_scale`; for ``cps``, ``|(1 - t_next)·t - sqrt(t_next² - σ²)·(1 - t)| / σ`` with
    ``σ = t_next·sin(aπ/2)``. Returns ``[B]`` float32."""
    t = torch.as_tensor(t, dtype=torch.float32).reshape(-1)
    t_next = torch.as_tensor(t_next, dtype=torch.float32).reshape(-1).to(t.device)
    x = torch.zeros(len(t), 1, device=t.device)
    options = {
        "noise_level": sampler.noise_level,
        "diffusion": sampler.diffusion,
        "score_eval": sampler.score_eval,
        "kappa": sampler.kappa,
        "t_second": t_second,
        "prev_sample": x,
    }
    unit = sde_step(sampler.kind, torch.ones_like(x), x, t, t_next, **options)
    zero = sde_step(sampler.kind, torch.zeros_like(x), x, t, t_next, **options)
    std = torch.broadcast_to(unit.std, x.shape).reshape(-1)
    return (unit.mean - zero.mean).reshape(-1).abs() / std


def schedule_normalizer(sampler: SamplerConfig, sigmas: Tensor, starts: range) -> float:
    """``Z = mean over k in starts of 1 / c(σ_k, σ_{k+1})``: the rectification weight's expected ``1/c`` when the
    trained step is drawn uniformly from ``starts`` on the schedule ``sigmas`` ([T + 1]) as the rollout resolves it
    (:func:`flowgrpo.rollout.plan_rollout`)."""
    inverse = []
    for k in starts:
        plan = plan_rollout(sampler, range(k, k + 1), sigmas)
        t, t_next = plan.sigmas[k].reshape(1), plan.sigmas[k + 1].reshape(1)
        inverse.append(1.0 / gradient_scale(sampler, t, t_next, plan.t_second))
    return torch.cat(inverse).mean().item()


def rectification_weights(scale: Tensor, normalizer: float | None) -> Tensor:
    """``w = (1 / c) / Z`` for the samples' scales ``c`` ([B]); ``normalizer`` None: ``Z = mean(1 / c)`` over them."""
    inverse = 1.0 / scale
    return inverse / (inverse.mean() if normalizer is None else normalizer)


@register_objective("flash")
class Flash(Objective):
    """Flow-GRPO's clipped ratio at one step per sample, each sample's term rectified by ``w(t)``."""

    config_class: ClassVar[type] = FlashSettings
    rollout: ClassVar[str] = "sde_window"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._normalizers: dict[tuple[int, int], float] = {}  # schedule's Z per (height, width)

    @classmethod
    def validate(cls, config: Config) -> None:
        s, w = config.sampler, config.sampler.window
        rectify = config.grpo.flash.rectify
        one_of("grpo.flash.rectify", rectify, RECTIFY)
        if w.size != 1:
            raise ConfigError(
                f"grpo.objective=flash trains each sample at one step (Flash-GRPO's single-step training): set "
                f"sampler.window.size: 1, got {w.size}"
            )
        if w.strategy != "random":
            raise ConfigError(
                "grpo.objective=flash draws each group's step uniformly over starts 0..sampler.window.max_start: set "
                f"sampler.window.strategy: random (with sampler.rollout: iso_temporal), got {w.strategy!r}"
            )
        if not s.noise_level > 0:
            raise ConfigError(
                f"grpo.objective=flash trains an SDE step: sampler.noise_level must be > 0, got {s.noise_level}"
            )
        if rectify == "none":
            return
        fix = "or grpo.flash.rectify: none"
        if s.kind not in AFFINE_KINDS:
            raise ConfigError(
                f"grpo.flash.rectify={rectify} needs a step whose mean is affine in the velocity "
                f"({', '.join(AFFINE_KINDS)}), got sampler.kind={s.kind}; {fix}"
            )
        if s.kind == "langevin" and s.score_eval != "frozen":
            raise ConfigError(
                f"grpo.flash.rectify={rectify}: with sampler.score_eval={s.score_eval} the Langevin mean calls the "
                f"network a second time, so its gradient scale is not a property of the step; set score_eval: "
                f"frozen, {fix}"
            )
        if s.log_prob != "exact":
            raise ConfigError(
                f"grpo.flash.rectify={rectify} rectifies the Gaussian log-prob's gradient, but sampler.log_prob="
                f"{s.log_prob} scores -(x' - μ)² (gradient scale 2σ·|∂μ/∂v|); set log_prob: exact, {fix}"
            )

    def weights(self, adapter: PipelineAdapter, sub: Trajectory, positions: Tensor) -> Tensor:
        """``w(t)`` ([B], float32) of each sample at its trained window position."""
        rows = torch.arange(len(sub), device=sub.sigmas.device)
        positions = positions.to(sub.sigmas.device)
        if self.settings.rectify == "none":
            return torch.ones(len(sub))
        t, t_next = sub.sigmas[rows, positions], sub.sigmas_next[rows, positions]
        scale = gradient_scale(self.config.sampler, t, t_next, sub.t_second)
        normalizer = None if self.settings.rectify == "batch" else self._schedule_normalizer(adapter, sub)
        return rectification_weights(scale, normalizer)

    def _schedule_normalizer(self, adapter: PipelineAdapter, sub: Trajectory) -> float:
        key = (sub.height, sub.width)
        if key not in self._normalizers:
            s = self.config.sampler
            sigmas, _ = adapter.schedule(s.num_steps, sub.height, sub.width, time_shift=s.time_shift)
            starts = range(0, make_window(self.config).max_start + 1)  # the window starts the rollout draws from
            self._normalizers[key] = schedule_normalizer(s, sigmas.detach().float().cpu(), starts)
        return self._normalizers[key]

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """:func:`~flowgrpo.objectives.clipped.timestep_loss` with each sample's advantage times ``w(t)``; logs the
        clipped loss's scalars, ``rectify_weight`` (the micro-batch's mean w) and ``trained_step`` (its mean step
        index)."""
        sub, positions, advantages = batch.trajectory, batch.positions, batch.advantages
        advantages = step_advantages(advantages, positions)  # per-step [B, W]: the trained position's
        weights = self.weights(adapter, sub, positions)
        rectified = advantages * weights.to(device=advantages.device, dtype=advantages.dtype)
        loss, stats = timestep_loss(adapter, self.config, sub, positions, rectified)
        rows = torch.arange(len(sub), device=sub.step_indices.device)
        steps = sub.step_indices[rows, positions.to(sub.step_indices.device)].float()
        return loss, {**stats._asdict(), "rectify_weight": weights.mean(), "trained_step": steps.mean()}
