"""Flow Policy Optimization (FPO; McAllister et al., arXiv 2507.21053) with the ELBO likelihood ratio, as
``grpo.objective: fpo``.

Settings ``grpo.fpo``. FPO keeps PPO's clipped surrogate and replaces the policy's likelihood ratio, which a flow model
cannot compute, by one built from the conditional flow-matching (CFM) loss, an ELBO of the sample's log-likelihood up
to a constant. Like AWM (:mod:`.awm`) it trains on the forward process of the final samples, so the rollout is the
plain ODE. Per term and sample i, one fresh (σ, ε) (:func:`~.forward.noised_point`), the error under the current
weights θ and under the old ones (the weights the epoch's images were sampled with, :class:`~.nft.OldWeights`), at the
same point::

    x_σ = (1 - σ) x0 + σ ε,   L_θ = mean |v_θ(x_σ, σ) - (ε - x0)|²,   L_old = the same under the old weights
    r_i = exp(w(σ) · (L_old - L_θ))
    ppo_clip:  loss = mean_i -min(r_i A_i, clip(r_i, 1 - ε_c, 1 + ε_c) A_i)  +  β_KL · mean |v_θ - v_ref|²
    reinforce: loss = mean_i -r_i A_i                                       +  β_KL · mean |v_θ - v_ref|²

ε_c = ``grpo.fpo.clip_range``, β_KL = ``grpo.kl.beta`` (the adapter-disabled model, one more forward without
gradient), ``grpo.fpo.timesteps`` terms per sample (each its own draw). ``grpo.fpo.weighting`` sets w(σ), which
turns the CFM loss into a likelihood estimate: ``uniform``, w = 1, FPO's CFM loss as the paper writes it; ``elbo``,
w(σ) = (1 - σ) / (σ + 10⁻³), the weighting of the design-space study (Choi et al., arXiv 2602.04663: its code's
``compute_elbo(..., method="exact")``), which is the continuous-time ELBO of this path: with λ = log SNR =
2 log((1 - σ)/σ), -½ dλ/dσ = 1/(σ(1 - σ)), and the noise error is (1 - σ) times the velocity error, so the ELBO's
density in σ weighs |v - (ε - x0)|² by (1 - σ)/σ (10⁻³ keeps it finite at σ → 0; σ is not importance-weighted
for its logit-normal density, as the study's σ are not for its sampler's schedule). ``grpo.fpo.functional``:
``ppo_clip`` (FPO), or ``reinforce``, no clip, whose gradient -r A ∇(-w L_θ) is that of the study's EPG loss
``-(sg(r) · A · ELBO_θ)``. The old weights are taken when each epoch's training begins, so r is exactly 1 until the
first optimizer step; there the gradient is AWM's, mean_i A_i w(σ_i) ∇L_θ,i (``tests/test_fpo.py``).

Checked against FPO's code (akanazawa/fpo ``playground/src/flow_policy/fpo.py``@7823f45, ``FpoState``): its ratio,
exp(L̂_old - L̂_θ) with L̂ over N_mc draws per action, averages the draws' losses *before* ``exp`` by default
(``average_losses_before_exp=True``, N_mc = ``n_samples_per_action`` = 8): one ratio per action. Here each of the
``grpo.fpo.timesteps`` draws is its own term with its own ratio (its backward is taken alone, as every objective's
here), which is the code's ``average_losses_before_exp=False`` (a ratio per draw, the surrogate averaged over draws) and
what the study's code does (a ratio per trained timestep, ``compute_policy_loss``); without that variant's clip of the
log-ratio to ±3 before ``exp``. Also deliberately different: FPO draws (t, ε) at rollout time, t ~ U(0, 1), and stores
the old loss; here σ ~ the logit-normal of :mod:`.forward` is drawn when training and the old loss recomputed under the
old weights (equal, since the rollout sampled with them). FPO's default ``output_mode="u_but_supervise_as_eps"`` scores
|ε - x̂1|², which is (1 - σ)² times the velocity error; w = 1 here unless ``weighting: elbo``. The study's code samples
with an "old" adapter that trails the trained one (``decay_type``: decay min(0.001 · step, 0.5)) and uses the same
adapter as the ratio's reference; here both are the epoch's sampling weights (decay 0). Its PPO row (``method="grpo"``)
clips at 10⁻³ with advantages clamped to ±5; its flagship runs use the ``adaptive`` ELBO (DiffusionNFT's x0 error over
its mean absolute value), which this module does not offer. Training is conditional-only unless ``grpo.fpo.cfg`` (as
AWM).
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
from .forward import ForwardProcessConfig, compare_to_reference, velocity_kl
from .nft import OldWeightsObjective

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config

WEIGHTINGS = ("uniform", "elbo")
FUNCTIONALS = ("ppo_clip", "reinforce")
ELBO_EPS = 1e-3  # w(σ) = (1 - σ) / (σ + ELBO_EPS), as the design-space study's code


@dataclass
class FPOConfig(ForwardProcessConfig):
    """``grpo.fpo:`` how σ and ε are drawn (as :class:`ForwardProcessConfig`; ``timesteps`` = N_mc draws per sample,
    one term each), the ratio's weighting and the surrogate."""

    clip_range: float = 0.05  # ε of clip(r, 1 - ε, 1 + ε), ppo_clip only (FPO's playground FpoConfig: 0.05)
    weighting: str = "uniform"  # w(σ) on the CFM loss: uniform (1, FPO) | elbo ((1 - σ)/(σ + 1e-3), the study's)
    functional: str = "ppo_clip"  # ppo_clip: PPO's clipped surrogate (FPO) | reinforce: -r·A, no clip (EPG's gradient)


def elbo_weight(sigma: Tensor, weighting: str) -> Tensor:
    """w(σ) per sample ([B]): 1 (``uniform``) or (1 - σ)/(σ + 10⁻³) (``elbo``)."""
    if weighting == "uniform":
        return torch.ones_like(sigma)
    return (1 - sigma) / (sigma + ELBO_EPS)


def ratio_surrogate(
    error: Tensor, old_error: Tensor, sigma: Tensor, advantages: Tensor, settings: FPOConfig, **kl: Tensor | float
) -> tuple[Tensor, LossStats]:
    """The surrogate of per-sample CFM errors ([B]) at noise levels ``sigma`` under the current and old weights:
    log r = w(σ) · (L_old - L_θ), then PPO's clipped surrogate (:func:`~.clipped.grpo_loss`, which ``kl`` and ``beta``
    reach; ``reinforce``: an infinite clip range)."""
    weight = elbo_weight(sigma, settings.weighting)
    clip = settings.clip_range if settings.functional == "ppo_clip" else math.inf
    return grpo_loss(-weight * error, -weight * old_error, advantages, clip_range=clip, **kl)


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

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """One term: a fresh (σ, ε) per sample, both CFM errors (the old one without gradient), the surrogate plus
        β_KL × the velocity KL (scalar, to backward); logs the clipped objective's statistics (``loss``,
        ``policy_loss``, ``kl``, ``ratio_mean`` / ``_min`` / ``_max``, ``clip_fraction``, ``approx_kl``)."""
        if self.old_weights is None:
            raise RuntimeError("grpo.objective=fpo compares with the epoch's old weights: call begin_epoch first")
        sub, kl_beta = batch.trajectory, self.config.grpo.kl.beta
        c = compare_to_reference(adapter, self.settings, sub, batch.generator, reference_weights=self.old_weights)
        kl = velocity_kl(adapter, kl_beta, c.point, sub, c.velocity)  # to the base model, not the old weights
        advantages = batch.advantages.detach().float().to(c.error.device)
        loss, stats = ratio_surrogate(
            c.error, c.reference_error, c.point.sigma, advantages, self.settings, kl=kl, beta=kl_beta
        )
        return loss, stats._asdict()
