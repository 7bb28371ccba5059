"""The forward process on the final samples, shared by the objectives that train there (``awm``, ``nft``).

Each loss term noises a sample's final latent x0 afresh, ``x_σ = (1 - σ) x0 + σ ε``, and evaluates the network at
``(x_σ, σ)``. σ is drawn as in SD3's pretraining, ``sigmoid(N(logit_mean, logit_std²))``, then shifted by
``time_shift`` like the model's sampling schedule: ``σ <- s·σ / (1 + (s - 1)·σ)``. Nothing of the sampling path is
needed (no log-probs, no SDE), so these objectives roll out with the plain ODE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..checks import ConfigError, check_range

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config
    from ..rollout import Trajectory


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
    adapter: PipelineAdapter, settings: ForwardProcessConfig, sub: Trajectory, generator: torch.Generator | None
) -> NoisedPoint:
    """σ ~ sigmoid(N(logit_mean, logit_std²)) shifted by ``time_shift`` and ε ~ N(0, I), one each per sample from
    ``generator`` (CPU); mixed and differenced in fp32, only the network's input takes x0's dtype. Guidance: families
    without CFG take it as an input (FLUX's embedded guidance): the rollout's value; CFG families: the conditional
    branch (1.0), or with ``settings.cfg`` the guided velocity the rollout sampled with."""
    x0 = sub.final_latents
    n = x0.shape[0]
    sigma = torch.sigmoid(settings.logit_mean + settings.logit_std * torch.randn(n, generator=generator))
    shift = settings.time_shift
    sigma = (shift * sigma / (1 + (shift - 1) * sigma)).to(x0.device)
    noise = torch.randn(x0.shape, generator=generator).to(x0.device)
    s = sigma.view((n,) + (1,) * (x0.ndim - 1))
    clean = x0.float()
    noisy = (1 - s) * clean + s * noise
    guidance = sub.guidance_scale if settings.cfg or not adapter.uses_cfg else 1.0
    return NoisedPoint(sigma, noise, noisy, clean, noisy.to(x0.dtype), guidance)


def velocity(adapter: PipelineAdapter, point: NoisedPoint, sub: Trajectory) -> Tensor:
    """The network's velocity at ``point`` (fp32), under whatever weights are active."""
    return adapter.velocity(point.model_input, point.sigma, sub.embeds, point.guidance).float()


def velocity_kl(adapter: PipelineAdapter, beta: float, point: NoisedPoint, sub: Trajectory, v: Tensor) -> Tensor:
    """β > 0: mean |v - v_ref|² to the adapter-disabled model at the same point (one forward without gradient); else
    0 without a forward."""
    if beta <= 0:
        return torch.zeros((), device=v.device)
    with torch.no_grad(), adapter.adapter_disabled():
        reference = velocity(adapter, point, sub)
    return (v - reference).pow(2).flatten(1).mean(dim=1).mean()


def check_forward_process(config: Config, name: str) -> None:
    """A forward-process objective trains on the final samples: settings of the transitions' ratio do not apply, and
    its section ``grpo.<name>`` must draw σ from a proper distribution."""
    s, g = config.sampler, config.grpo
    fixes = {
        "sampler.noise_level": (s.noise_level, 0.0, f"{name} needs no log-probs, so the rollout is the plain ODE"),
        "sampler.same_initial_noise": (s.same_initial_noise, False, "under the ODE a group's images would be equal"),
        "sampler.post_window.solver": (s.post_window.solver, "euler", "it would replace the whole ODE rollout"),
        "sampler.last_step": (s.last_step, "ode", "there is no SDE step"),
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
