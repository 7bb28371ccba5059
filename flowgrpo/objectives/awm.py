"""Advantage-weighted matching (AWM; Xue et al., arXiv 2509.25050): GRPO's advantages on the pretraining loss.

``grpo.objective: awm``, settings ``grpo.awm``. The clipped objective (Flow-GRPO eq. 8, :mod:`.clipped`)
differentiates the log-prob of each stored SDE transition; its gradient is ``A · ε/σ_t · ∂μ/∂θ``, so the noise ε that
made the samples differ also multiplies every gradient, and on small budgets the signal drowns (the shapes task: the
gradients of two epochs have cosine ≈ 0, docs/shapes.md §3). AWM instead noises each image's final latent x0 afresh
and applies the rectified-flow loss the model was pretrained with, weighted by the image's advantage::

    x_σ = (1 - σ) x0 + σ ε,   loss = mean_i A_i · mean(|v_θ(x_σ, σ) - (ε - x0)|²)

Better-than-group images are made more likely the way pretraining makes data likely, worse ones less. Nothing of the
sampling path is needed (no log-probs, no SDE), so the rollout is the plain ODE (or SDE steps with
``sampler.noise_level > 0``, :mod:`.forward`); the network sees the conditional prompt only (no CFG), one forward per
term. σ is drawn as in SD3's pretraining, ``sigmoid(N(logit_mean, logit_std²))``,
then shifted by ``grpo.awm.time_shift`` like the model's sampling schedule (:mod:`.forward`). The negative weights make
the loss unbounded below (pushing a velocity ever further from a bad sample lowers it): with ``grpo.kl.beta`` β > 0 the
adapter-disabled model's velocity at the same point anchors it, ``+ β · mean_i mean(|v_θ - v_ref|²)`` (one more
forward, without gradient; logged as ``train/kl``).

Against the paper's public code, deliberately simpler: no likelihood ratio or clipping (its logp = -MSE ratio against
the sampling weights; here every step is on the current weights, so keep updates per epoch few or use β); no per-σ
loss weights; advantages are not rescaled to at most 1 (theirs: clipped to 5, divided by 5), so the same lr moves
about 5× further; and training is conditional-only while CFG families sample with CFG (the paper samples without;
``grpo.awm.cfg: true`` fits the guided velocity instead, two forwards per term).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .base import MicroBatch, register_objective
from .forward import ForwardProcessObjective, flow_matching_error, noised_point, velocity, velocity_kl

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter


@register_objective("awm")
class AWM(ForwardProcessObjective):
    """Advantage-weighted matching: ``grpo.awm.timesteps`` terms per sample, each a fresh (σ, ε)."""

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """A fresh (σ, ε) per sample from the batch's generator, the advantage-weighted flow-matching loss plus β ×
        the velocity KL (scalar, to backward); logs ``loss``, ``policy_loss`` and ``kl``."""
        sub, beta = batch.trajectory, self.config.grpo.kl.beta
        point = noised_point(adapter, self.settings, sub, batch.generator)
        v = velocity(adapter, point, sub)
        error = flow_matching_error(v, point)  # [B]
        policy_loss = (batch.advantages.detach().float().to(error.device) * error).mean()
        kl = velocity_kl(adapter, beta, point, sub, v)
        loss = policy_loss + beta * kl
        return loss, {"loss": loss.detach(), "policy_loss": policy_loss.detach(), "kl": kl.detach()}
