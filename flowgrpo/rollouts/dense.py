"""``sampler.rollout: dense``: the chain rollout plus a reward for every stage of the trained window (dense step
rewards, for TP-GRPO's and VGPO's advantage estimators: ``grpo.advantage.estimator: turning_point | vgpo``).

The images are sampled exactly as ``sampler.rollout: chain`` samples them (:class:`.chain.Chain`, whose epoch loop
this class reuses: it only adds to each rollout batch), and each sample gets ``Trajectory.extras``:

    step_rewards  [B, W + 1]  V_0 .. V_W: V_j the value of the state BEFORE window step j (j < W), V_W the value of
                              the state AFTER the last window step; window step j's effect is V_{j+1} - V_j
    step_indices  [B, W]      the window steps' indices in the schedule (VGPO's anchor applies to early steps only)

The value of a state x_i at schedule step i (sigma t_i) is the reward (``RolloutContext.score``: the run's reward,
its weighted ``total``, computed now) of a clean image predicted from it, per ``sampler.dense.value``:

``x0`` (the issue's choice, VGPO's eq. 9): the one-step prediction, decoded::

    x̂_0 = x_i - t_i · v(x_i, t_i)        (flow matching: x_t = (1 - t)·x_0 + t·ε, v = ε - x_0)

  computed as the Euler step to t = 0 (:func:`one_step_x0`). The velocity is the one the rollout computes for step i
  anyway (the window's SDE steps i = k..k+W-1 and the first post-window step i = k+W, handed over by the rollout's
  ``observe`` hook, :func:`flowgrpo.rollout.rollout`): NO extra forward. Cost per rollout batch: W + 1 decodes and
  W + 1 reward calls of B images. When the window ends at step S - 2 and the last step is the Euler ODE step
  (``sampler.last_step: ode``, ``post_window.solver: euler``), x̂_0 after the last window step IS that step's result:
  V_W equals the final image's reward exactly.

``ode`` (TP-GRPO's reference): the Euler ODE from x_i to t = 0 on the rollout's schedule ("SDE step followed by ODE
  sampling"): V_j for j < W completes the state before window step j (V_0 = the pure ODE sample from the same
  noise: the prefix is the ODE already), V_W is the final image's own reward (the chain after the window IS the
  ODE). Cost per rollout batch: sum_{j<W} (S - k - j) extra forwards of B images, W decodes, W + 1 reward calls.
  Needs ``sampler.post_window.solver: euler`` and ``sampler.last_step: ode``.

The stored transitions, log-probs and final images are the chain rollout's, bit for bit: the hook only reads
(``tests/test_dense_rewards.py``: ratio exactly 1 on-policy). Device memory: the W + 1 predicted latents of one
rollout batch are kept until the batch is sampled (``x0``), then decoded one stage at a time.

**Refused** (:meth:`Dense.validate`): objectives that train final samples only (nothing stored to credit), an unknown
``sampler.dense.value``, ``value: ode`` with a post-window solver other than euler or ``last_step: sde`` (V_W would
not be an ODE completion) and ``value: ode`` with ``sampler.window.per_batch`` under FSDP (the completions' forwards
depend on each batch's window start, which differs between processes; FSDP's forwards are collectives).

References: TP-GRPO (Tong et al., arXiv 2602.06422; YunzeTong/TurningPoint-GRPO@f9f6ff4,
``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_fast_my.py``): ``pipeline_mixed_sampling_with_intermediate_ode``
completes every state after a window step with the ODE, and ``pipeline_ode_sampling`` draws R_0 (the pure ODE);
there, with ``same_latent: False``, R_0 is sampled from NEW noise (``generator=None``), not the trajectory's: here V_0
completes the trajectory's own state, which is what its comment ("same generator for consistent initial noise")
intends. VGPO (Shao et al., arXiv 2512.12387; code not public): "instant rewards" from the one-step ODE projection
of each intermediate latent (its eq. 9, as its ICLR 2026 reviews describe it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from samplers import ode_step

from ..checks import ConfigError, one_of
from ..rollout import Trajectory, _velocity_fn, plan_rollout
from .base import Collected, register_rollout
from .chain import Chain

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config, SamplerConfig
    from .base import RolloutContext

VALUES = ("x0", "ode")
Score = Callable[[Tensor, list[str], list[dict[str, Any]], Tensor | None], dict[str, Tensor]]


@dataclass
class DenseSettings:
    """``sampler.dense:`` how the dense rollout values each stage of the window."""

    value: str = "x0"  # x0: reward of the decoded one-step prediction x̂0 = x - t·v (no extra forward) |
    #                    ode: reward of the Euler ODE completion to t = 0 (TP-GRPO's reference; extra forwards)


def one_step_x0(v: Tensor, x: Tensor, t: Tensor | float) -> Tensor:
    """The one-step prediction of the clean sample, ``x̂_0 = x_t - t · v(x_t, t)``: under ``x_t = (1 - t)·x_0 + t·ε``
    the velocity is ``v = ε - x_0``, so ``x_t - t·v = x_0`` exactly for the true velocity. Computed as the Euler step
    from t to 0 (:func:`samplers.ode_step`: ``x + (0 - t)·v`` in float32, cast to x's dtype), so it is bit for bit
    the sample a final Euler step from the same state produces."""
    return ode_step(v, x, t, 0.0)


class StageValues:
    """A rollout's ``observe`` hook that keeps ``x̂_0`` of the schedule steps ``window.start .. window.stop`` (the W
    window steps and the step after the last one): the velocity is the rollout's own."""

    def __init__(self, window: range) -> None:
        self.steps = range(window.start, window.stop + 1)
        self.predictions: dict[int, Tensor] = {}

    def __call__(self, i: int, x: Tensor, t: Tensor, v: Tensor) -> None:
        if i in self.steps:
            self.predictions[i] = one_step_x0(v, x, t)

    def stages(self) -> list[Tensor]:
        missing = [i for i in self.steps if i not in self.predictions]
        if missing:  # the rollout reports every window and post-window step: a window at the schedule's end?
            raise RuntimeError(f"the rollout reported no velocity at steps {missing} of the window's stages")
        return [self.predictions[i] for i in self.steps]


@torch.no_grad()
def ode_completion(
    adapter: PipelineAdapter, trajectory: Trajectory, sampler: SamplerConfig, stage: int, sigmas: Tensor
) -> Tensor:
    """The Euler ODE from the state before window position ``stage`` (``trajectory.latents[:, stage]``, at schedule
    step ``k = trajectory.step_indices[0, stage]``) to t = 0 on ``sigmas`` (the rollout's schedule): S - k forwards."""
    x = trajectory.latents[:, stage]
    start = int(trajectory.step_indices[0, stage])
    velocity_fn = _velocity_fn(adapter, trajectory.embeds, sampler, trajectory.guidance_scale)
    for i in range(start, len(sigmas) - 1):
        t, t_next = sigmas[i], sigmas[i + 1]
        x = ode_step(velocity_fn(x, t), x, t, t_next)
    return x


def score_total(score: Score, images: Tensor, trajectory: Trajectory) -> Tensor:
    """The reward's weighted total of ``images`` (one per sample of ``trajectory``), float32 on the CPU."""
    scores = score(images, trajectory.prompts, trajectory.metadata, trajectory.source_images)
    return scores["total"].detach().float().cpu().reshape(len(trajectory))


@register_rollout("dense")
class Dense(Chain):
    """The chain rollout, plus each sample's stage values ``extras["step_rewards"]`` [B, W + 1] (module docstring)."""

    config_class = DenseSettings

    @classmethod
    def validate(cls, config: Config, world_size: int = 1) -> None:  # noqa: ARG003 (no per-process setting)
        from ..objectives import get_objective

        s = config.sampler
        one_of("sampler.dense.value", s.dense.value, VALUES)
        objective = config.grpo.objective
        if get_objective(objective).rollout != "sde_window":
            raise ConfigError(
                f"sampler.rollout=dense rewards each step of the trained SDE window, but grpo.objective={objective} "
                "trains the final samples of ODE rollouts (no window, nothing stored); use sampler.rollout: chain, or "
                "grpo.objective: clipped"
            )
        if s.dense.value != "ode":
            return
        if s.post_window.solver != "euler":
            raise ConfigError(
                f"sampler.dense.value=ode completes each stage with the Euler ODE and takes the final image as the "
                f"last stage's completion, but sampler.post_window.solver={s.post_window.solver} integrates the steps "
                "after the window differently; set sampler.post_window.solver: euler, or sampler.dense.value: x0"
            )
        if s.last_step != "ode":
            raise ConfigError(
                "sampler.dense.value=ode takes the final image as the ODE completion of the last stage, but "
                "sampler.last_step=sde adds noise at the final step; set sampler.last_step: ode, or "
                "sampler.dense.value: x0"
            )
        if s.window.per_batch and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            raise ConfigError(
                "sampler.dense.value=ode with sampler.window.per_batch=true cannot run under FSDP: the completions "
                "take S - k - j forwards for a batch whose window starts at k, the windows differ between processes, "
                "and FSDP's forwards are collectives; set sampler.window.per_batch: false, sampler.dense.value: x0, "
                "or launch with DDP (configs/accelerate/multi_gpu.yaml)"
            )

    def __init__(self, context: RolloutContext) -> None:
        super().__init__(context)
        if context.score is None:
            raise RuntimeError("sampler.rollout=dense scores intermediate images: RolloutContext.score must be set")
        self.settings: DenseSettings = context.config.sampler.dense
        self.counts = {"decodes": 0, "reward_calls": 0, "extra_forwards": 0}

    def collect(self, epoch: int) -> Collected | None:
        self.counts = dict.fromkeys(self.counts, 0)
        collected = super().collect(epoch)
        if collected is None:
            return None
        values = collected.trajectory.extras["step_rewards"]
        metrics = {f"dense/{k}": float(v) for k, v in self.counts.items()}
        finite = torch.isfinite(values).all(dim=1)
        if bool(finite.any()):
            metrics["dense/value_first"] = values[finite, 0].mean().item()
            metrics["dense/value_last"] = values[finite, -1].mean().item()
        collected.metrics.update(metrics)
        return collected

    def sample_batch(
        self,
        prompts: list[str],
        group_ids: list[int],
        metadata: list[dict[str, Any]],
        sources: list[Any] | None,
        window: range,
        observe: Any = None,
    ) -> Trajectory:
        ctx, cfg = self.context, self.context.config
        recorder = StageValues(window) if self.settings.value == "x0" else None
        trajectory = super().sample_batch(prompts, group_ids, metadata, sources, window, observe=recorder)
        h, w = cfg.model.size
        if recorder is not None:
            stages = [score_total(ctx.score, ctx.adapter.decode(x0, h, w), trajectory) for x0 in recorder.stages()]
            self.counts["decodes"] += len(stages)
            self.counts["reward_calls"] += len(stages)
        else:
            sigmas, _ = ctx.adapter.schedule(cfg.sampler.num_steps, h, w, time_shift=cfg.sampler.time_shift)
            plan = plan_rollout(cfg.sampler, window, sigmas)
            stages = []
            for j in range(trajectory.num_trained_steps):
                x = ode_completion(ctx.adapter, trajectory, cfg.sampler, j, plan.sigmas)
                stages.append(score_total(ctx.score, ctx.adapter.decode(x, h, w), trajectory))
                self.counts["extra_forwards"] += plan.num_steps - (window.start + j)
                self.counts["decodes"] += 1
            stages.append(score_total(ctx.score, trajectory.images, trajectory))  # the chain after the window: ODE
            self.counts["reward_calls"] += len(stages)
        trajectory.extras["step_rewards"] = torch.stack(stages, dim=1)
        trajectory.extras["step_indices"] = trajectory.step_indices.detach().cpu().long()
        return trajectory
