"""GRPO-Guard (Wang et al., arXiv 2510.22319): Flow-GRPO's clipped per-step loss with the importance ratio normalised
per step (RatioNorm) and each step's policy loss reweighted by 1/Δt. ``grpo.objective: guard``, settings
``grpo.guard``.

**Why.** A stored transition is ``x' = μ_old + s·z`` (``z ~ N(0, I)``, ``s`` the step's std, which does not depend on
the weights). With ``Δμ = μ_θ - μ_old`` the Gaussian log-ratio per latent element is

    log r_e = [(x'_e - μ_old,e)² - (x'_e - μ_θ,e)²] / (2 s²) = z_e·Δμ_e / s - Δμ_e² / (2 s²)

so after reducing over the latent elements (``grpo.log_prob_reduce``, "mean" as Flow-GRPO; "sum" alike), ``log r`` has
mean ``-red(Δμ²)/(2 s²)`` < 0 and a spread ``∝ |Δμ|/s``: the ratio sits left of 1 and is widest at the steps with the
smallest std (near the data). PPO's symmetric clip ``[1-ε, 1+ε]`` then mostly catches negative-advantage samples and
lets confident positive updates through ("implicit over-optimisation").

**RatioNorm** (the paper's eq. 8) removes the shift and the 1/s scale, step by step::

    log r̂ = s · (log r + red(Δμ²) / (2 s²))          = red(z · Δμ)  =  red((x' - μ_old) · (μ_θ - μ_old)) / s
    r̂     = exp(log r̂)                              (E_z[log r̂] = 0, spread ∝ |Δμ| whatever the step's std)

computed as the left-hand side (:func:`ratio_norm_log_ratio`), as the reference does; the right-hand side is the same
number. On-policy (``Δμ = 0``) ``r̂ = 1`` exactly and ``∇ log r̂ = s · ∇ log r = red(z · ∇μ_θ)``.

**Gradient reweighting** (eq. 12): ``∇ log r̂ = red(z · ∂μ/∂v · ∇v)`` still carries ``∂μ/∂v = dt·(1 + g²(1-t)/(2t))``
(Euler–Maruyama, design.md §3.1), proportional to Δt = t - t_next for Flow-GRPO's diffusion (``g² (1-t)/t = a²``
constant). Each sample's policy term is multiplied by ``w = 1/Δt`` (``grpo.guard.reweight: dt``), so every step pushes
the velocity equally hard::

    loss = mean_i w_i · max(-A_i r̂_i, -A_i clip(r̂_i, 1-ε, 1+ε)) + β · mean_i KL_i        (ε = grpo.clip_range)

Since ``w > 0`` the weight is folded into the advantage, ``A_i w_i``, and the clipped machinery of :mod:`.clipped`
(:func:`~.clipped.grpo_loss`) computes the rest unchanged; with ``ratio_norm: false`` and ``reweight: none`` the
objective is ``clipped``'s, bit for bit.

**The old mean.** ``μ_old`` is the transition's mean under the weights that sampled it. The rollout stores it:
:attr:`Guard.needs_sampling_means` (with RatioNorm) asks every rollout strategy to keep each stored transition's mean,
float32 as the SDE step computed it (``Trajectory.means``, read by :func:`~flowgrpo.rollout.stored_means`), so a term
costs the one forward that builds its graph, whatever the optimizer did, and the stored log-prob and ``μ_old`` come
from the same computation (``log r̂ = red(z·Δμ)`` holds with the stored draw ``z``). Every built-in strategy keeps
them, so sharded parameters (DeepSpeed ZeRO-2, FSDP) are accepted. The float32 copy costs ``4·L`` bytes per stored
step and sample (``L`` latent elements; ``flowgrpo.memory`` counts it): rounded to bf16 latents instead, ``μ_old``'s
error ``e`` (about 2⁻⁹·|μ|) would add ``red(e²)/(2s)`` to every ``log r̂``: 1e-6 to 1e-5 for |μ| ≈ 1 and s from
0.5 to 0.05, against ``sd35m_guard``'s clip range of 3e-5.
A trajectory without means (a strategy that ignores ``sampling_options``) falls back to recomputing ``μ_old``: with
the trainable weights as they were when the epoch's training began (a snapshot, as :mod:`.nft` keeps, taken at the
epoch's first term), one forward without gradient per term once an optimizer step has moved them (before, the current
forward's own mean is the old one); that fallback swaps whole parameters and is refused on FSDP shards.

Against the public implementations (the paper's code is not public; read: Flow-Factory ``GRPOGuardTrainer`` in
``src/flow_factory/trainers/grpo.py``, verl-omni ``GRPOGuardLoss`` in ``verl_omni/trainer/diffusion/
diffusion_algos.py``, TeleBoost ``recipe/teleboost/algorithms/grpo_guard.py``): the ratio is theirs exactly with the
``mean`` reduction; μ_old is stored at rollout time as they store it (Flow-Factory ``next_latents_mean``, verl-omni
``old_prev_sample_mean``); ``s`` is each sample's transition std (theirs ``sqrt(-dt)·std_dev_t``, the same for
Euler–Maruyama; for the CPS and Langevin steps, which they do not define, the derivation above holds with their std);
the weight is per sample (verl-omni: one per micro-batch, its samples share a step) and multiplies the policy term only,
not the KL (as verl-omni; Flow-Factory applies no reweighting). TeleBoost's DanceGRPO form ``(1 + η²(1-t)/(2t))/Δt`` is
not offered. The ratio is on another scale than ``clipped``'s (about ``s`` times smaller), so ``grpo.clip_range`` needs
its own value (the presets say how theirs were chosen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from samplers import reduce_per_sample

from ..checks import ConfigError, one_of
from ..rollout import evaluate_transitions, stored_log_probs, stored_means
from .base import MicroBatch, Objective, register_objective
from .clipped import at_positions, grpo_loss, reference_kl, step_advantages
from .nft import OldWeights

if TYPE_CHECKING:
    from samplers import Transition

    from ..adapters import PipelineAdapter
    from ..config import Config
    from ..rollout import Trajectory

REWEIGHTS = ("dt", "none")


@dataclass
class GuardConfig:
    """``grpo.guard:`` which of GRPO-Guard's two corrections apply (both, as the paper's method)."""

    ratio_norm: bool = True  # RatioNorm (eq. 8): log r̂ = s·(log r + red(Δμ²)/(2s²)); false: the plain ratio
    reweight: str = "dt"  # dt: each step's policy term × 1/(t - t_next) (eq. 12); none: unweighted


def ratio_norm_log_ratio(
    log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor, reduce: str = "mean"
) -> Tensor:
    """RatioNorm's log-ratio ``s · (log_prob - old_log_prob + red((mean - old_mean)²) / (2 s²))`` per sample ``[B]``.

    log_prob, old_log_prob: [B] Gaussian log-probs of the same stored transition under the current and the sampling
    weights; mean, old_mean: [B, ...] the transition's means under them; std: the transition's std s (a scalar, [B] or
    broadcastable [B, 1, ...]); reduce: how the log-probs were reduced over latent elements ("mean" or "sum").
    Equal to ``red(z · (mean - old_mean))`` with ``z = (x' - old_mean)/s`` the stored draw: centred on 0, of spread
    ``|Δμ|`` (not ``|Δμ|/s``). Gradients flow through log_prob and mean; old_log_prob and old_mean are constants. A
    sample with s = 0 (a deterministic step, ratio 1) gets 0.
    """
    s = per_sample_std(std, len(log_prob)).to(log_prob.device)
    positive = s > 0
    s = torch.where(positive, s, torch.ones_like(s))
    shift = reduce_per_sample((mean.float() - old_mean.detach().float()) ** 2, reduce)  # type: ignore[arg-type]
    normalised = s * (log_prob - old_log_prob.detach() + shift / (2 * s**2))
    return torch.where(positive, normalised, torch.zeros_like(normalised))


def step_weights(sigmas: Tensor, sigmas_next: Tensor, reweight: str) -> Tensor:
    """GRPO-Guard's per-step weights ``[B]`` of the policy term: ``1 / (t - t_next)`` for ``dt``, 1 for ``none``.

    sigmas, sigmas_next: [B] each sample's trained step, t > t_next (the sampler's schedule, design.md §3)."""
    one_of("grpo.guard.reweight", reweight, REWEIGHTS)
    if reweight == "none":
        return torch.ones_like(sigmas, dtype=torch.float32)
    delta = sigmas.float() - sigmas_next.float()
    if not bool((delta > 0).all()):
        raise ValueError(f"steps go from noise to data (t > t_next), got t - t_next = {delta.tolist()}")
    return 1.0 / delta


def per_sample_std(std: Tensor, batch: int) -> Tensor:
    """A transition's std (``[]``, ``[B]`` or ``[B, 1, ...]``, constant over latent elements) as ``[B]``."""
    std = torch.as_tensor(std, dtype=torch.float32)
    if std.ndim == 0:
        return std.expand(batch)
    return std.reshape(std.shape[0], -1)[:, 0]


def guard_timestep_loss(
    adapter: PipelineAdapter,
    cfg: Config,
    sub: Trajectory,
    positions: Tensor,
    advantages: Tensor,
    old_weights: OldWeights | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One trained timestep of a micro-batch: the stored transitions at ``positions`` ([B] window positions) re-scored
    under the current weights, RatioNorm's ratio (``grpo.guard.ratio_norm``) against the old mean, the per-step weights
    (``grpo.guard.reweight``), and the clipped loss of :func:`~.clipped.grpo_loss` (+ β·KL, unweighted). Logs
    :class:`~.clipped.LossStats` (the ratio ones of r̂), ``raw_ratio_mean`` (the plain ratio), ``step_weight`` and, with
    RatioNorm, ``mean_shift`` (red(Δμ²)/(2s²), the plain log-ratio's bias). The old mean is the stored one
    (``sub.means``); without it, recomputed on ``old_weights`` once they moved (None: the current weights are the
    sampling ones). ``advantages``: [B], or [B, W] per step (read at ``positions``)."""
    settings: GuardConfig = cfg.grpo.guard
    reduce = cfg.grpo.log_prob_reduce
    advantages = step_advantages(advantages, positions)
    old_mean = stored_means(sub, positions) if settings.ratio_norm else None
    if settings.ratio_norm and old_mean is None and old_weights is not None and old_weights.moved():
        # OldWeights swaps the parameters' storage for this forward only, undone before the backward.
        with torch.no_grad(), adapter.without_ddp(), old_weights.swapped_in():
            old_mean = evaluate_transitions(adapter, sub, positions, cfg.sampler, log_prob_reduce=reduce).mean
    new = evaluate_transitions(adapter, sub, positions, cfg.sampler, log_prob_reduce=reduce)
    kl = reference_kl(adapter, cfg, sub, positions, new)  # as clipped's (None at β = 0: no reference forward)
    old = stored_log_probs(sub, positions).to(new.log_prob.device)
    extra: dict[str, Tensor] = {}
    if settings.ratio_norm:
        old_mean = new.mean.detach() if old_mean is None else old_mean.to(new.mean.device)
        log_ratio = ratio_norm_log_ratio(new.log_prob, old, new.mean, old_mean, new.std, reduce)
        baseline = torch.zeros_like(log_ratio)  # grpo_loss forms exp(log_ratio - baseline) = r̂
        extra["mean_shift"] = _mean_shift(new, old_mean, reduce).mean()
    else:
        log_ratio, baseline = new.log_prob, old
    weights = step_weights(
        at_positions(sub.sigmas, positions), at_positions(sub.sigmas_next, positions), settings.reweight
    )
    weighted = advantages.to(log_ratio.device) * weights.to(log_ratio.device)  # w > 0: w·max(..A..) = max(..wA..)
    loss, stats = grpo_loss(log_ratio, baseline, weighted, clip_range=cfg.grpo.clip_range, kl=kl, beta=cfg.grpo.kl.beta)
    with torch.no_grad():
        extra["raw_ratio_mean"] = torch.exp(new.log_prob - old).mean()
        extra["step_weight"] = weights.mean()
    return loss, {**stats._asdict(), **extra}


def _mean_shift(new: Transition, old_mean: Tensor, reduce: str) -> Tensor:
    """``red(Δμ²) / (2 s²)`` per sample, without gradient: how far left the plain log-ratio sits."""
    with torch.no_grad():
        s = per_sample_std(new.std, len(new.log_prob)).to(new.log_prob.device)
        shift = reduce_per_sample((new.mean.float() - old_mean.float()) ** 2, reduce)  # type: ignore[arg-type]
        return torch.where(s > 0, shift / (2 * s.clamp_min(1e-30) ** 2), torch.zeros_like(shift))


@register_objective("guard")
class Guard(Objective):
    """GRPO-Guard: RatioNorm and 1/Δt step weights on Flow-GRPO's clipped per-step loss."""

    config_class: ClassVar[type] = GuardConfig
    rollout: ClassVar[str] = "sde_window"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.old_weights: OldWeights | None = None
        self._epoch_params: list[torch.nn.Parameter] = []

    @property
    def needs_sampling_means(self) -> bool:
        """RatioNorm's μ_old: kept by the rollout (module docstring); without RatioNorm no mean is read."""
        return bool(self.settings.ratio_norm)

    @classmethod
    def validate(cls, config: Config) -> None:
        s, g = config.sampler, config.grpo.guard
        one_of("grpo.guard.reweight", g.reweight, REWEIGHTS)
        if s.noise_level <= 0:
            raise ConfigError(
                f"grpo.objective=guard trains stochastic transitions, but sampler.noise_level={s.noise_level} makes "
                "every step deterministic (ratio 1, no gradient; RatioNorm divides by the step's std); set "
                "sampler.noise_level > 0 (Flow-GRPO: 0.7)"
            )
        if g.ratio_norm and s.log_prob != "exact":
            raise ConfigError(
                f"grpo.guard.ratio_norm=true needs sampler.log_prob: exact, got {s.log_prob!r}: RatioNorm's mean-shift "
                "term red(Δμ²)/(2s²) is the Gaussian log-density's, which the squared_error log-prob (no 1/(2s²)) "
                "does not have; set sampler.log_prob: exact, or grpo.guard.ratio_norm: false"
            )

    def begin_epoch(self, params: list[torch.nn.Parameter]) -> None:
        """No snapshot yet: with stored means none is needed; without, :meth:`loss` takes it at the epoch's first term
        (before any optimizer step of the epoch, so still the sampling weights)."""
        self._epoch_params = params if self.settings.ratio_norm else []
        self.old_weights = None

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        if batch.trajectory.means is None and self._epoch_params and self.old_weights is None:
            self.old_weights = _snapshot(self._epoch_params)
        return guard_timestep_loss(
            adapter, self.config, batch.trajectory, batch.positions, batch.advantages, self.old_weights
        )


def _snapshot(params: list[torch.nn.Parameter]) -> OldWeights:
    """The fallback's epoch-start weights; refused on FSDP shards, which the swap would break (the strategy should keep
    the means: ``RolloutStrategy.sampling_options``)."""
    from torch.distributed.tensor import DTensor  # FSDP2's shards (flowgrpo.parallel imports config: a circle)

    if any(isinstance(p, DTensor) for p in params):
        raise RuntimeError(
            "grpo.objective=guard got a trajectory without sampling means (Trajectory.means) on FSDP-sharded "
            "parameters: recomputing the old means swaps whole parameters, which shards are not; the rollout "
            "strategy must pass RolloutStrategy.sampling_options() (store_means) to its rollout function"
        )
    return OldWeights(params)
