"""Flow Policy Optimization (FPO; McAllister et al., arXiv 2507.21053) with the ELBO likelihood ratio, as
``grpo.objective: fpo``.

Settings ``grpo.fpo``. FPO keeps PPO's clipped surrogate and replaces the policy's likelihood ratio, which a flow model
cannot compute, by one built from the conditional flow-matching (CFM) loss, an ELBO of the sample's log-likelihood up
to a constant. Like AWM (:mod:`.awm`) it trains on the forward process of the final samples, so the rollout is the
plain ODE (or, the design-space study's other rollout, SDE steps with ``sampler.noise_level > 0``: :mod:`.forward`).
Per term and sample i, one fresh (σ, ε) (:func:`~.forward.noised_point`), the weighted error under the
current weights θ and under the old ones (the weights the epoch's images were sampled with, snapshot when its training
begins), at the same point::

    x_σ = (1 - σ) x0 + σ ε,   e = v(x_σ, σ) - (ε - x0),   ℓ = w · mean e²  (the negative ELBO estimate)
    r_i = exp(ℓ_old - ℓ_θ)
    ppo_clip:  loss = mean_i -min(r_i A_i, clip(r_i, 1 - ε_c, 1 + ε_c) A_i)  +  β_KL · mean |v_θ - v_ref|²
    reinforce: loss = mean_i -r_i A_i                                       +  β_KL · mean |v_θ - v_ref|²

ε_c = ``grpo.fpo.clip_range``, β_KL = ``grpo.kl.beta`` (the adapter-disabled model, one more forward without
gradient), ``grpo.fpo.timesteps`` terms per sample (each its own draw). ``grpo.fpo.weighting`` sets w, which turns the
CFM loss into a likelihood estimate (the design-space study's ``compute_elbo`` methods; Choi et al., arXiv 2602.04663,
``src/utils/__init__.py``): ``uniform``, w = 1, FPO's CFM loss as the paper writes it; ``elbo``, w(σ) = (1 - σ) /
(σ + 10⁻³), its ``method="exact"``, the continuous-time ELBO of this path: with λ = log SNR = 2 log((1 - σ)/σ),
-½ dλ/dσ = 1/(σ(1 - σ)), and the noise error is (1 - σ) times the velocity error, so the ELBO's density in σ weighs
|v - (ε - x0)|² by (1 - σ)/σ (10⁻³ keeps it finite at σ → 0; σ is not importance-weighted for its logit-normal
density, as the study's σ are not for its sampler's schedule); ``adaptive``, its ``method="adaptive"`` (DiffusionNFT's
x0 error over its mean absolute value): with x̂0 = x_σ - σ v, so x̂0 - x0 = -σ e,

    ℓ = mean (x̂0 - x0)² / sg(max(mean |x̂0 - x0|, 10⁻⁵))  =  σ · mean e² / sg(mean |e|)   (above the floor)

each model's ℓ divided by its *own* normaliser (no gradient through either), so log r = ℓ_old - ℓ_θ is not one
weight times a difference of errors (the normaliser in float32, the study's in float64; the study's further division
by the guidance scale is not applied: the ratio trains without CFG unless ``grpo.fpo.cfg``). ``grpo.fpo.functional``:
``ppo_clip`` (FPO), or ``reinforce``, no clip, whose gradient -r A ∇(-ℓ_θ) is that of the study's EPG loss
``-(sg(r) · A · ELBO_θ)``.

**The old weights** are the trainable weights when each epoch's training begins
(:class:`~.nft.OldWeights`). Until the first optimizer step of the epoch they are the current ones: the old
forward is skipped and the current error, detached, stands for the old one, so r is exactly 1 and a term costs one
forward less; there the gradient is mean_i A_i ∇ℓ_θ,i with w held fixed, AWM's (:mod:`.awm`) with each sample's
weight w_i (``tests/test_fpo.py``). Once a step has moved the weights, each term runs the old forward on the
snapshot (one more forward without gradient). So the ratio only acts from an epoch's second optimizer step on, and a
config with one optimizer step per epoch (over all ``train.inner_epochs`` passes) would train AWM plus the KL: it is
refused at validation (:meth:`FPO.validate_updates`).

Checked against FPO's code (akanazawa/fpo ``playground/src/flow_policy/fpo.py``@7823f45, ``FpoState``): its ratio,
exp(L̂_old - L̂_θ) with L̂ over N_mc draws per action, averages the draws' losses *before* ``exp`` by default
(``average_losses_before_exp=True``, N_mc = ``n_samples_per_action`` = 8): one ratio per action. Here each of the
``grpo.fpo.timesteps`` draws is its own term with its own ratio (its backward is taken alone, as every objective's
here), which is the code's ``average_losses_before_exp=False`` (a ratio per draw, the surrogate averaged over draws) and
what the study's code does (a ratio per trained timestep, ``compute_policy_loss``); without that variant's clip of the
log-ratio to ±3 before ``exp``. Also deliberately different: FPO draws (t, ε) at rollout time, t ~ U(0, 1), and stores
the old loss; here σ ~ the logit-normal of :mod:`.forward` is drawn when training and the old loss recomputed under the
old weights (equal, since the rollout sampled with them). FPO's default ``output_mode="u_but_supervise_as_eps"`` scores
|ε - x̂1|², which is (1 - σ)² times the velocity error; w = 1 here unless ``weighting: elbo`` or ``adaptive``. The
study's code samples with an "old" adapter that trails the trained one (after each epoch old ← d·old + (1 - d)·θ,
d = min(0.001 · step, 0.5), ``DECAY_TYPE=1`` in its scripts) and uses the same adapter as the ratio's reference, so
its ratio leaves 1 from the first step even with one optimizer step per epoch; that adapter is not implemented here
(decay 0: both are the epoch's sampling weights). Its PPO row (``method="grpo"``) clips at 10⁻³ with advantages clamped
to ±5. Training is conditional-only unless ``grpo.fpo.cfg`` (as AWM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from ..checks import ConfigError, check_range, one_of
from .base import MicroBatch, register_objective
from .clipped import LossStats, grpo_loss
from .forward import ForwardProcessConfig, NoisedPoint, flow_matching_error, noised_point, velocity, velocity_kl
from .nft import OldWeightsObjective, _adaptive_error

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config

WEIGHTINGS = ("uniform", "elbo", "adaptive")
FUNCTIONALS = ("ppo_clip", "reinforce")
ELBO_EPS = 1e-3  # w(σ) = (1 - σ) / (σ + ELBO_EPS), as the design-space study's code


@dataclass
class FPOConfig(ForwardProcessConfig):
    """``grpo.fpo:`` how σ and ε are drawn (as :class:`ForwardProcessConfig`; ``timesteps`` = N_mc draws per sample,
    one term each), the ratio's weighting and the surrogate."""

    clip_range: float = 0.05  # ε of clip(r, 1 - ε, 1 + ε), ppo_clip only (FPO's playground FpoConfig: 0.05)
    weighting: str = "uniform"  # the CFM loss as an ELBO: uniform (w = 1, FPO) | elbo ((1 - σ)/(σ + 1e-3)) |
    #                             adaptive (x0 error over its own mean |x0 error|): the study's compute_elbo methods
    functional: str = "ppo_clip"  # ppo_clip: PPO's clipped surrogate (FPO) | reinforce: -r·A, no clip (EPG's gradient)


def elbo_weight(sigma: Tensor, weighting: str) -> Tensor:
    """w(σ) per sample ([B]): 1 (``uniform``) or (1 - σ)/(σ + 10⁻³) (``elbo``)."""
    if weighting == "uniform":
        return torch.ones_like(sigma)
    return (1 - sigma) / (sigma + ELBO_EPS)


def weighted_error(v: Tensor, point: NoisedPoint, weighting: str) -> Tensor:
    """ℓ per sample ([B]), the negative ELBO estimate of velocity ``v`` at ``point``: w(σ) · mean |v - (ε - x0)|²
    (``uniform``, ``elbo``), or ``adaptive``'s mean (x̂0 - x0)² / sg(max(mean |x̂0 - x0|, 10⁻⁵)) with x̂0 = x_σ - σ v,
    normalised by ``v``'s own error. Differentiable through ``v``."""
    if weighting != "adaptive":
        return elbo_weight(point.sigma, weighting) * flow_matching_error(v, point)
    s = point.sigma.view((len(v),) + (1,) * (v.ndim - 1))
    return _adaptive_error(point.noisy - s * v.float(), point.clean)


def ratio_surrogate(
    error: Tensor, old_error: Tensor, advantages: Tensor, settings: FPOConfig, **kl: Tensor | float
) -> tuple[Tensor, LossStats]:
    """The surrogate of per-sample weighted errors ℓ ([B], :func:`weighted_error`) under the current and old weights:
    log r = ℓ_old - ℓ_θ, then PPO's clipped surrogate (:func:`~.clipped.grpo_loss`, which ``kl`` and ``beta`` reach;
    ``reinforce``: an infinite clip range)."""
    clip = settings.clip_range if settings.functional == "ppo_clip" else math.inf
    return grpo_loss(-error, -old_error, advantages, clip_range=clip, **kl)


@register_objective("fpo")
class FPO(OldWeightsObjective):
    """FPO's clipped CFM-ratio surrogate: ``grpo.fpo.timesteps`` terms per sample, each a fresh (σ, ε) and its own
    ratio against the weights the epoch sampled with."""

    config_class: ClassVar[type] = FPOConfig

    @classmethod
    def validate(cls, config: Config) -> None:
        super().validate(config)
        s = config.grpo.fpo
        one_of("grpo.fpo.weighting", s.weighting, WEIGHTINGS)
        one_of("grpo.fpo.functional", s.functional, FUNCTIONALS)
        check_range("grpo.fpo.clip_range", s.clip_range, 0, 1, low_open=True, high_open=True)
        if s.functional == "reinforce" and s.clip_range != FPOConfig.clip_range:
            raise ConfigError(
                f"grpo.fpo.clip_range={s.clip_range} does nothing with grpo.fpo.functional=reinforce (no clip); "
                "remove it, or set grpo.fpo.functional: ppo_clip"
            )

    @classmethod
    def validate_updates(cls, config: Config, steps_per_epoch: int) -> None:
        """One optimizer step per epoch: every term runs before it, at the old weights, so r = 1 throughout and the
        clip never acts (AWM plus the KL, at the cost of the ratio). Refused."""
        if steps_per_epoch > 1:
            return
        t = config.train
        per_pass = "null" if t.updates_per_epoch is None else t.updates_per_epoch
        raise ConfigError(
            f"grpo.objective=fpo with {steps_per_epoch} optimizer step per epoch (train.updates_per_epoch={per_pass}, "
            f"train.gradient_accumulation={t.gradient_accumulation}, train.inner_epochs={t.inner_epochs}) computes "
            "every term before it, at the weights the epoch sampled with: the ratio is always 1 and the clip never "
            "acts (AWM plus the KL); set train.updates_per_epoch: 2 or more, or train.inner_epochs: 2 or more, or "
            "use grpo.objective: awm"
        )

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """One term: a fresh (σ, ε) per sample, both weighted errors (the old one without gradient: from the epoch-start
        snapshot once the weights moved, else the current one detached), the surrogate plus β_KL × the velocity KL
        (scalar, to backward); logs the clipped objective's statistics (``loss``, ``policy_loss``, ``kl``,
        ``ratio_mean`` / ``_min`` / ``_max``, ``clip_fraction``, ``approx_kl``)."""
        if self.old_weights is None:
            raise RuntimeError("grpo.objective=fpo compares with the epoch's old weights: call begin_epoch first")
        sub, kl_beta, weighting = batch.trajectory, self.config.grpo.kl.beta, self.settings.weighting
        point = noised_point(adapter, self.settings, sub, batch.generator)
        old = None
        if self.old_weights.moved():  # OldWeights swaps the storage: undone before the backward, as it needs
            with torch.no_grad(), adapter.without_ddp(), self.old_weights.swapped_in():
                old = velocity(adapter, point, sub)
        v = velocity(adapter, point, sub)
        kl = velocity_kl(adapter, kl_beta, point, sub, v)  # to the base model, not the old weights
        error = weighted_error(v, point, weighting)
        old_error = error.detach() if old is None else weighted_error(old, point, weighting)
        advantages = batch.advantages.detach().float().to(error.device)
        loss, stats = ratio_surrogate(error, old_error, advantages, self.settings, kl=kl, beta=kl_beta)
        return loss, stats._asdict()
