"""The forward process on the final samples, shared by the objectives that train there (``awm``, ``nft``, ``dgpo``,
``dpo``, ``sft``, ``fpo``).

Each loss term noises a sample's final latent x0 afresh, ``x_σ = (1 - σ) x0 + σ ε``, and evaluates the network at
``(x_σ, σ)``. σ is drawn as in SD3's pretraining, ``sigmoid(N(logit_mean, logit_std²))``, then shifted by
``time_shift`` like the model's sampling schedule: ``σ <- s·σ / (1 + (s - 1)·σ)``. Nothing of the sampling path is
needed (no log-probs, no SDE), so these objectives roll out with the plain ODE; with ``sampler.noise_level > 0`` the
window's steps (``sampler.window``; size 0: every step but the last) sample with the SDE instead, the rollout sampler
axis of the ELBO design-space study, and their transitions are not kept. Objectives that compare images
(a DPO pair, a DGPO group) draw one (σ, ε) per pair or group and give it to all its rows (``share``), so that their
losses differ by the images alone, as Diffusion-DPO does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
from torch import Tensor

from ..checks import ConfigError, check_range
from .base import Objective
from .kl import gated_mean, kl_gate

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config
    from ..rollout import Trajectory
    from .nft import OldWeights


@dataclass
class ForwardProcessConfig:
    """How a forward-process objective noises the final samples: terms per sample, the σ distribution, and which
    velocity is fitted."""

    timesteps: int = 1  # loss terms per sample and pass: each a fresh noise level σ and noise ε
    logit_mean: float = 0.0  # σ = sigmoid(N(logit_mean, logit_std²)): SD3's logit-normal pretraining distribution
    logit_std: float = 1.0
    time_shift: float = 1.0  # then σ <- s·σ / (1 + (s - 1)·σ), the shift the model samples with (SD3.5: 3; shapes: 1)
    cfg: bool = False  # CFG families: fit the guided velocity (sampler.guidance_scale, as sampled), not the conditional


class NoisedPoint(NamedTuple):
    """Where a forward-process loss term evaluates the network: σ [B], ε and x_σ = (1 - σ) x0 + σ ε in fp32, x0 in
    fp32, the network's input (x_σ in x0's dtype) and the guidance it is run with."""

    sigma: Tensor
    noise: Tensor
    noisy: Tensor
    clean: Tensor
    model_input: Tensor
    guidance: float


def noised_point(
    adapter: PipelineAdapter,
    settings: ForwardProcessConfig,
    sub: Trajectory,
    generator: torch.Generator | None,
    share: Tensor | None = None,
) -> NoisedPoint:
    """σ ~ sigmoid(N(logit_mean, logit_std²)) shifted by ``time_shift`` and ε ~ N(0, I), one each per sample from
    ``generator`` (CPU); with ``share`` ([B] ids), one per distinct id (in increasing id order), given to every row
    of that id. Mixed and differenced in fp32, only the network's input takes x0's dtype. Guidance: families
    without CFG take it as an input (FLUX's embedded guidance): the rollout's value; CFG families: the conditional
    branch (1.0), or with ``settings.cfg`` the guided velocity the rollout sampled with."""
    x0 = sub.final_latents
    n = x0.shape[0]
    rows = torch.arange(n) if share is None else torch.unique(share.cpu(), return_inverse=True)[1]
    draws = int(rows.max()) + 1 if n else 0
    sigma = torch.sigmoid(settings.logit_mean + settings.logit_std * torch.randn(draws, generator=generator))
    shift = settings.time_shift
    sigma = (shift * sigma / (1 + (shift - 1) * sigma))[rows].to(x0.device)
    noise = torch.randn((draws, *x0.shape[1:]), generator=generator)[rows].to(x0.device)
    s = sigma.view((n,) + (1,) * (x0.ndim - 1))
    clean = x0.float()
    noisy = (1 - s) * clean + s * noise
    guidance = sub.guidance_scale if settings.cfg or not adapter.uses_cfg else 1.0
    return NoisedPoint(sigma, noise, noisy, clean, noisy.to(x0.dtype), guidance)


def velocity(adapter: PipelineAdapter, point: NoisedPoint, sub: Trajectory) -> Tensor:
    """The network's velocity at ``point`` (fp32), under whatever weights are active."""
    return adapter.velocity(point.model_input, point.sigma, sub.embeds, point.guidance).float()


def reference_velocity(adapter: PipelineAdapter, point: NoisedPoint, sub: Trajectory) -> Tensor:
    """The reference model's velocity at ``point`` (fp32), without gradient: the adapter-disabled model, or the reset
    reference's weights (``grpo.kl.reset_every``, :mod:`.reference`)."""
    with torch.no_grad(), adapter.reference():
        return velocity(adapter, point, sub)


def velocity_kl(
    adapter: PipelineAdapter,
    beta: float,
    point: NoisedPoint,
    sub: Trajectory,
    v: Tensor,
    reference: Tensor | None = None,
) -> Tensor:
    """β > 0: mean |v - v_ref|² to the reference model at the same point (one forward without gradient, or
    ``reference`` when the caller has it already), over the micro-batch's samples, with ``grpo.kl.gate`` over its
    gated ones (:func:`~.kl.gated_mean`); else, or with none gated, 0 without a forward. The forward runs without DDP
    (``adapter.reference()``), so a process that skips it issues the same collectives as one that runs it. Called
    after the forward that builds ``v``'s graph: the reference's swap of the parameters' storage is undone before
    the backward (:class:`~.nft.OldWeights`)."""
    gate = kl_gate(sub)
    if beta <= 0 or (gate is not None and not gate.any()):
        return torch.zeros((), device=v.device)
    if reference is None:
        reference = reference_velocity(adapter, point, sub)
    return gated_mean((v - reference).pow(2).flatten(1).mean(dim=1), gate)


def flow_matching_error(v: Tensor, point: NoisedPoint) -> Tensor:
    """Per sample ([B]): the rectified-flow loss mean |v - (ε - x0)|² over the latent's elements."""
    return (v - (point.noise - point.clean)).pow(2).flatten(1).mean(dim=1)


class Compared(NamedTuple):
    """One loss term against a reference model: the point, the velocity being trained (with gradient), the
    reference's (without), and both per-sample flow-matching errors ([B])."""

    point: NoisedPoint
    velocity: Tensor
    reference: Tensor
    error: Tensor
    reference_error: Tensor


def compare_to_reference(
    adapter: PipelineAdapter,
    settings: ForwardProcessConfig,
    sub: Trajectory,
    generator: torch.Generator | None,
    share: Tensor | None = None,
    reference_weights: OldWeights | None = None,
) -> Compared:
    """A fresh (σ, ε) per ``share`` id (:func:`noised_point`), the velocity being trained, and the reference's at the
    same point: ``adapter.reference()``, or the weights ``reference_weights`` holds, swapped in for one forward
    without gradient and without DDP (``adapter.without_ddp()``). The swap is undone before the graph's backward, as
    :class:`~.nft.OldWeights` requires; here it runs before the trained forward."""
    point = noised_point(adapter, settings, sub, generator, share)
    if reference_weights is None:
        reference = reference_velocity(adapter, point, sub)
    else:
        with torch.no_grad(), adapter.without_ddp(), reference_weights.swapped_in():
            reference = velocity(adapter, point, sub)
    v = velocity(adapter, point, sub)
    return Compared(point, v, reference, flow_matching_error(v, point), flow_matching_error(reference, point))


class ForwardProcessObjective(Objective):
    """Base of the objectives that train on the forward process of the final samples: the plain ODE rollout,
    ``grpo.<name>.timesteps`` terms per sample (each a fresh σ, ε), and :func:`check_forward_process`'s refusals
    (subclasses extend :meth:`validate` with their own settings')."""

    config_class: ClassVar[type] = ForwardProcessConfig
    rollout: ClassVar[str] = "ode"
    sde_final_samples: ClassVar[bool] = True  # sampler.noise_level > 0: the study's SDE rollouts

    @classmethod
    def validate(cls, config: Config) -> None:
        check_forward_process(config, cls.name)

    def steps(self, trajectory: Trajectory) -> int:  # noqa: ARG002 (a setting, whatever was sampled)
        return self.settings.timesteps


def check_forward_process(config: Config, name: str) -> None:
    """A forward-process objective trains on the final samples: settings of the transitions' ratio do not apply,
    those of a stochastic rollout only with ``sampler.noise_level > 0`` (on a chain), and its section ``grpo.<name>``
    must draw σ from a proper distribution."""
    s, g = config.sampler, config.grpo
    if s.noise_level > 0 and s.rollout != "chain":  # SDE rollouts (the study's sampler axis) only on plain chains
        raise ConfigError(
            f"grpo.objective={name}: sampler.noise_level={s.noise_level} samples SDE rollouts, which only "
            f"sampler.rollout: chain takes for an objective on the final samples, got {s.rollout!r}; set "
            "sampler.noise_level: 0 (the ODE) or sampler.rollout: chain"
        )
    ode_only = {  # refused under the ODE only: settings of a stochastic rollout, which an SDE rollout may use
        "sampler.same_initial_noise": (s.same_initial_noise, False, "under the ODE a group's images would be equal"),
        "sampler.post_window.solver": (s.post_window.solver, "euler", "it would replace the whole ODE rollout"),
        "sampler.last_step": (s.last_step, "ode", "there is no SDE step"),
    }
    fixes = {
        **(ode_only if s.noise_level == 0 else {}),
        "grpo.timestep_fraction": (g.timestep_fraction, 1.0, f"{name} trains grpo.{name}.timesteps σ per sample"),
    }
    for key, (value, wanted, why) in fixes.items():
        if value != wanted:
            now, fix = (str(v).lower() if isinstance(v, bool) else v for v in (value, wanted))  # YAML's spelling
            raise ConfigError(f"grpo.objective={name}: {key}={now} does not apply ({why}); set {key}: {fix}")
    settings = getattr(g, name)
    check_range(f"grpo.{name}.timesteps", settings.timesteps, 1)
    check_range(f"grpo.{name}.logit_std", settings.logit_std, 0, low_open=True)
    check_range(f"grpo.{name}.time_shift", settings.time_shift, 0, low_open=True)
