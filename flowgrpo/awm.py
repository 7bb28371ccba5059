"""Advantage-weighted matching (AWM; Xue et al., arXiv 2509.25050): GRPO's advantages on the pretraining loss.

``grpo.objective: awm``. The clipped objective (Flow-GRPO eq. 8, :func:`flowgrpo.trainer.timestep_loss`) differentiates
the log-prob of each stored SDE transition; its gradient is ``A · ε/σ_t · ∂μ/∂θ``, so the noise ε that made the samples
differ also multiplies every gradient, and on small budgets the signal drowns (the shapes task: the gradients of two
epochs have cosine ≈ 0, README). AWM instead noises each image's final latent x0 afresh and applies the rectified-flow
loss the model was pretrained with, weighted by the image's advantage::

    x_σ = (1 - σ) x0 + σ ε,   loss = mean_i A_i · mean(|v_θ(x_σ, σ) - (ε - x0)|²)

Better-than-group images are made more likely the way pretraining makes data likely, worse ones less. Nothing of the
sampling path is needed (no log-probs, no SDE), so the rollout is the plain ODE; the network sees the conditional
prompt only (no CFG), one forward per term. σ is drawn as in SD3's pretraining, ``sigmoid(N(logit_mean, logit_std²))``,
then shifted by ``grpo.awm.time_shift`` like the model's sampling schedule. The negative weights make the loss
unbounded below (pushing a velocity ever further from a bad sample lowers it): with ``grpo.kl.beta`` β > 0 the
adapter-disabled model's velocity at the same point anchors it, ``+ β · mean_i mean(|v_θ - v_ref|²)`` (one more
forward, without gradient; logged as ``train/kl``).

Against the paper's public code, deliberately simpler: no likelihood ratio or clipping (its logp = -MSE ratio against
the sampling weights; here every step is on the current weights, so keep updates per epoch few or use β); no per-σ
loss weights; advantages are not rescaled to at most 1 (theirs: clipped to 5, divided by 5), so the same lr moves
about 5× further; and training is conditional-only while CFG families sample with CFG (the paper samples without;
``grpo.awm.cfg: true`` fits the guided velocity instead, two forwards per term).
The clipped objective's ratio metrics are logged as 1 (clip fraction, approx KL 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from .loss import LossStats

if TYPE_CHECKING:
    from .adapters import PipelineAdapter
    from .config import Config
    from .rollout import Trajectory


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
    adapter: PipelineAdapter, cfg: Config, sub: Trajectory, generator: torch.Generator | None
) -> NoisedPoint:
    """The forward process on the final latents: σ ~ sigmoid(N(logit_mean, logit_std²)) shifted by
    ``grpo.awm.time_shift`` and ε ~ N(0, I), one each per sample from ``generator`` (CPU); mixed and differenced in
    fp32, only the network's input takes x0's dtype. Guidance: families without CFG take it as an input (FLUX's
    embedded guidance): the rollout's value; CFG families: the conditional branch (1.0), or with grpo.awm.cfg the
    guided velocity the rollout sampled with."""
    awm, x0 = cfg.grpo.awm, sub.final_latents
    n = x0.shape[0]
    sigma = torch.sigmoid(awm.logit_mean + awm.logit_std * torch.randn(n, generator=generator))
    sigma = (awm.time_shift * sigma / (1 + (awm.time_shift - 1) * sigma)).to(x0.device)
    noise = torch.randn(x0.shape, generator=generator).to(x0.device)
    s = sigma.view((n,) + (1,) * (x0.ndim - 1))
    clean = x0.float()
    noisy = (1 - s) * clean + s * noise
    guidance = sub.guidance_scale if awm.cfg or not adapter.uses_cfg else 1.0
    return NoisedPoint(sigma, noise, noisy, clean, noisy.to(x0.dtype), guidance)


def velocity(adapter: PipelineAdapter, point: NoisedPoint, sub: Trajectory) -> Tensor:
    """The network's velocity at ``point`` (fp32), under whatever weights are active."""
    return adapter.velocity(point.model_input, point.sigma, sub.embeds, point.guidance).float()


def velocity_kl(adapter: PipelineAdapter, cfg: Config, point: NoisedPoint, sub: Trajectory, v: Tensor) -> Tensor:
    """β_KL > 0: mean |v - v_ref|² to the adapter-disabled model at the same point (one forward without gradient);
    else 0 without a forward."""
    if cfg.grpo.kl.beta <= 0:
        return torch.zeros((), device=v.device)
    with torch.no_grad(), adapter.adapter_disabled():
        reference = velocity(adapter, point, sub)
    return (v - reference).pow(2).flatten(1).mean(dim=1).mean()


def ratio_free_stats(loss: Tensor, policy_loss: Tensor, kl: Tensor) -> LossStats:
    """The objectives without a likelihood ratio log it as 1 (clip fraction and approx KL 0)."""
    one = torch.ones((), device=loss.device)
    return LossStats(loss=loss.detach(), policy_loss=policy_loss.detach(), kl=kl.detach(), ratio_mean=one,
                     ratio_min=one, ratio_max=one, clip_fraction=0 * one, approx_kl=0 * one)  # fmt: skip


def awm_loss(
    adapter: PipelineAdapter,
    cfg: Config,
    sub: Trajectory,
    positions: Tensor,  # noqa: ARG001 (the clipped objective's window positions; awm trains on the final latents)
    advantages: Tensor,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, LossStats]:
    """One loss term of a micro-batch: a fresh (σ, ε) per sample from ``generator`` (CPU), the advantage-weighted
    flow-matching loss plus β × the velocity KL (scalar, to backward) and its stats (no ratio: logged as 1, clip
    fraction 0)."""
    point = noised_point(adapter, cfg, sub, generator)
    v = velocity(adapter, point, sub)
    error = (v - (point.noise - point.clean)).pow(2).flatten(1).mean(dim=1)  # [B]
    policy_loss = (advantages.detach().float().to(error.device) * error).mean()
    kl = velocity_kl(adapter, cfg, point, sub, v)
    loss = policy_loss + cfg.grpo.kl.beta * kl
    return loss, ratio_free_stats(loss, policy_loss, kl)
