"""Negative-aware fine-tuning (DiffusionNFT; Zheng et al., arXiv 2509.16117) as ``grpo.objective: nft``.

Settings ``grpo.nft``. Like AWM (:mod:`.awm`) it trains on the forward process: each image's final latent x0 is
noised afresh, x_σ = (1 - σ) x0 + σ ε, and the rollout is the plain ODE (or SDE steps with ``sampler.noise_level >
0``, :mod:`.forward`). Instead of weighting the flow-matching loss
by the advantage, it fits two implicit policies built from the current velocity v_θ and the *old* one v_old (the weights
the epoch's images were sampled with, frozen for the epoch)::

    v⁺ = (1 - β) v_old + β v_θ            (better than the group: fit the data)
    v⁻ = (1 + β) v_old - β v_θ            (worse: the mirror image fits it, so v_θ moves away)
    r  = clip(A, -c, c) / 2c + 1/2        (the advantage as an optimality probability in [0, 1])
    loss = c/β · mean_i [ r_i ‖x̂0(v⁺) - x0‖² / w⁺_i + (1 - r_i) ‖x̂0(v⁻) - x0‖² / w⁻_i ],   x̂0(v) = x_σ - σ v

with β = ``grpo.nft.beta``, c = ``grpo.nft.adv_clip_max`` and the adaptive weights w = mean|x̂0 - x0| (no gradient,
at least 1e-5), as in the paper's public code. Both terms pull v_θ to a bounded target,
v_old + (2r - 1)(ε - x0 - v_old)/β at the optimum: unlike AWM's negative weights, a bad sample cannot push the model
without limit, and the adaptive weights keep every sample's gradient at the same scale.
With v_θ = v_old (the epoch's first step) the gradient is AWM's with clip(A, -c, c) · σ²/w in place of A.

σ and ε are drawn as for AWM (:mod:`.forward`; ``grpo.nft.timesteps`` terms per sample at ``sigmoid(N(logit_mean,
logit_std²))``, ``grpo.nft.time_shift``; ``grpo.nft.cfg``), and ``grpo.kl.beta`` adds β_KL · mean|v_θ - v_ref|² to
the adapter-disabled model. The old velocity is one more forward without gradient, on the trainable weights as they
were when the epoch's training began (:class:`OldWeights`; the paper's soft "old" update with decay 0); until the
epoch's first optimizer step moves them it is the current velocity, detached, and that forward is skipped. With
``grpo.nft.old_decay_max`` > 0 the old weights follow the paper's soft update instead, θ_old ← η θ_old + (1 - η) θ
before each epoch with η from :func:`old_decay` (its ``return_decay``), and the epoch's rollout samples with them, as
the paper's code does (so the logged rewards and sample grids are the old weights'); they are carried from epoch to
epoch and saved with checkpoints (``old_weights.safetensors``); once η > 0 they differ from the live weights from the
epoch's first term on, so the old forward is not skipped then.
Deliberately simpler than the paper's code: σ comes from the logit-normal above rather than from the sampler's schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from ..checks import ConfigError, check_range
from .base import MicroBatch, register_objective
from .forward import ForwardProcessConfig, ForwardProcessObjective, noised_point, velocity, velocity_kl

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config


@dataclass
class NFTConfig(ForwardProcessConfig):
    """``grpo.nft:`` how σ and ε are drawn (as :class:`ForwardProcessConfig`), and the negative-aware loss's β and c."""

    beta: float = 1.0  # β of the implicit policies v± = v_old ± β (v_θ - v_old): the trust region (DiffusionNFT: 1)
    adv_clip_max: float = 5.0  # c: advantages clipped to ±c, r = A / 2c + 1/2 (DiffusionNFT: 5)
    # DiffusionNFT's soft update of the old weights, which then also sample the epochs: before each epoch's rollout
    # old ← η old + (1 - η) current, η = old_decay(optimizer steps, rate, max, start). max 0: η = 0, the old weights
    # are the current ones (the default). DiffusionNFT decay_type 1: rate 0.001, max 0.5; type 2: 0.0075, 0.999, 75.
    old_decay_rate: float = 0.0  # η's growth per optimizer step
    old_decay_max: float = 0.0  # η's cap, below 1
    old_decay_start: int = 0  # optimizer steps with η = 0 first


class OldWeights:
    """A copy of the trainable weights (taken when an epoch's training starts, or before its rollout, where
    DiffusionNFT's soft update then mixes it with the previous epoch's); ``swapped_in()`` runs a block on it, and
    ``moved()`` says whether the live weights differ from it (an optimizer step since the copy, or the mix; until then
    the old forward is the current one: the objectives skip it).

    The swap exchanges the parameters' storage (``p.data``: no copy, nothing written into the live storage) and
    restores it on exit. What it requires: a forward without gradient inside the block, and the block closed before
    the backward of any graph built outside it, since a graph holds the parameters, whose storage would be the
    saved one while swapped. Whether the block comes before or after the forward that builds the graph does not
    matter (the objectives run it before, the KL reference after). Autocast caches its casts of parameters by
    tensor, so the cache is cleared on both sides of the swap."""

    def __init__(self, params: list[torch.nn.Parameter], saved: list[Tensor] | None = None) -> None:
        """A copy of ``params`` now, or ``saved`` (a checkpoint's, in ``params``' order) on their devices and dtypes."""
        self.params = params
        if saved is None:
            self.saved = [p.detach().clone() for p in params]
        else:
            self.saved = [s.to(device=p.device, dtype=p.dtype) for s, p in zip(saved, params, strict=True)]
        self._moved = False

    def moved(self) -> bool:
        if not self._moved:  # weights never come back within an epoch: once moved, stays so
            self._moved = any(not torch.equal(p.detach(), s) for p, s in zip(self.params, self.saved, strict=True))
        return self._moved

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        current = [p.data for p in self.params]
        for p, old in zip(self.params, self.saved, strict=True):
            p.data = old
        torch.clear_autocast_cache()
        try:
            yield
        finally:
            for p, now in zip(self.params, current, strict=True):
                p.data = now
            torch.clear_autocast_cache()


def _adaptive_error(prediction: Tensor, target: Tensor) -> Tensor:
    """Per sample: mean squared error over mean absolute error (the latter without gradient, at least 1e-5)."""
    error = (prediction - target).flatten(1)
    weight = error.detach().abs().mean(dim=1).clamp_min(1e-5)
    return error.pow(2).mean(dim=1) / weight


class SoftUpdate:
    """Mixin of the objectives that carry old weights from epoch to epoch by DiffusionNFT's soft update and sample
    each epoch with them (nft's ``grpo.nft.old_decay_*``, lagged's ``grpo.lagged.old_decay_*``): before each epoch's
    rollout θ_old ← η θ_old + (1 - η) θ with η from :meth:`old_decay`, swapped in for the rollout
    (:meth:`sampling_weights`), kept as :attr:`old_weights` (nft's loss reads them; lagged's reads the log-probs the
    rollout stored with them) and the next epoch's mix from :meth:`begin_epoch` on, and saved with checkpoints
    (:meth:`checkpoint_weights`). Without a soft update (:meth:`old_decay` None) the old weights are the trainable ones
    as each epoch's training begins and nothing is carried. The hooks do not call ``super()``: the class it is mixed
    into must have only :class:`~.base.Objective`'s defaults for them (an objective with a ``begin_epoch`` of its own
    calls this one, as lagged does)."""

    name: ClassVar[str]

    def __init__(self, config: Config) -> None:
        super().__init__(config)  # type: ignore[call-arg]  (the Objective it is mixed into)
        self.old_weights: OldWeights | None = None  # the last trained epoch's, once one trained
        self._sampled: OldWeights | None = None  # this epoch's soft-updated ones, from its rollout to its training

    def old_decay(self, step: int) -> float | None:  # noqa: ARG002 (the default has no soft update)
        """η of the soft update after ``step`` optimizer steps; None: no soft update (the old weights are the current
        ones at each epoch's start). Subclasses read their section's ``old_decay_*`` (:func:`settings_decay`)."""
        return None

    @property
    def soft_update(self) -> bool:
        """Whether the old weights are carried from epoch to epoch (:meth:`old_decay` is not None)."""
        return self.old_decay(0) is not None

    def sampling_weights(self, params: list[torch.nn.Parameter], step: int) -> AbstractContextManager[None]:
        """With a soft update, the epoch's old weights η θ_old + (1 - η) θ (θ_old: the last trained epoch's), swapped in
        for the rollout and kept for the epoch's loss (:meth:`begin_epoch`). Without one, the current weights.
        Computed from the last *trained* epoch's old weights, so an epoch abandoned during sampling and redone after
        a resume mixes the same ones."""
        eta = self.old_decay(step)
        if eta is None:
            return contextlib.nullcontext()
        self._sampled = OldWeights(params)
        if eta > 0 and self.old_weights is not None:
            for mixed, old in zip(self._sampled.saved, self.old_weights.saved, strict=True):  # in place: no more copies
                mixed.mul_(1 - eta).add_(old, alpha=eta)
        return self._sampled.swapped_in() if self._sampled.moved() else contextlib.nullcontext()

    def begin_epoch(self, params: list[torch.nn.Parameter]) -> None:
        sampled, self._sampled = self._sampled, None
        self.old_weights = sampled if sampled is not None else OldWeights(params)

    def checkpoint_weights(self) -> list[Tensor] | None:
        return self.old_weights.saved if self.soft_update and self.old_weights is not None else None

    def restore_weights(self, saved: list[Tensor] | None, params: list[torch.nn.Parameter]) -> str | None:
        self._sampled = None
        if saved is None or not self.soft_update:
            self.old_weights = None
            if self.soft_update:
                return (
                    f"the checkpoint holds no old weights for grpo.objective={self.name}'s soft update "
                    f"(grpo.{self.name}.old_decay_max); they restart from the current weights"
                )
            return None
        self.old_weights = OldWeights(params, saved)
        return None


class OldWeightsObjective(SoftUpdate, ForwardProcessObjective):
    """Base of the forward-process objectives that compare with the old weights (``nft``, ``fpo``): the weights the
    epoch's samples were drawn with (:class:`OldWeights`), the trainable weights as each epoch's training begins
    unless a soft update (:class:`SoftUpdate`, nft's ``grpo.nft.old_decay_*``) mixes in the previous epoch's."""

    refuses_sharded: ClassVar[str | None] = (
        "swaps the old weights into the trainable parameters for a forward, written for parameters that are whole "
        "tensors on every process (one process, DDP); under DeepSpeed or FSDP use grpo.objective: awm"
    )
    samples_from_current_weights: ClassVar[bool] = True  # the old weights stand for the ones that sampled the epoch


@register_objective("nft")
class NFT(OldWeightsObjective):
    """DiffusionNFT's negative-aware loss; the old weights are the trainable weights as the epoch's training began, or
    with ``grpo.nft.old_decay_max`` > 0 the paper's soft update of them, which also samples the epoch."""

    config_class: ClassVar[type] = NFTConfig

    @classmethod
    def validate(cls, config: Config) -> None:
        super().validate(config)
        s = config.grpo.nft
        check_range("grpo.nft.beta", s.beta, 0, low_open=True)
        check_range("grpo.nft.adv_clip_max", s.adv_clip_max, 0, low_open=True)
        check_soft_update("grpo.nft", s)

    def old_decay(self, step: int) -> float | None:
        return settings_decay(self.settings, step)

    def loss(self, adapter: PipelineAdapter, batch: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return nft_loss(adapter, self.settings, self.config.grpo.kl.beta, batch, self.old_weights)


def settings_decay(settings: Any, step: int) -> float | None:
    """η after ``step`` optimizer steps from a section's ``old_decay_rate / old_decay_max / old_decay_start``; None
    when ``old_decay_max`` is 0 (no soft update)."""
    s = settings
    return old_decay(step, s.old_decay_rate, s.old_decay_max, s.old_decay_start) if s.old_decay_max > 0 else None


def check_soft_update(section: str, settings: Any) -> None:
    """Refuse a section's soft-update settings that do nothing or never move the old weights (a
    :class:`ConfigError` naming ``<section>.old_decay_*`` and the fix)."""
    s = settings
    check_range(f"{section}.old_decay_rate", s.old_decay_rate, 0)
    check_range(f"{section}.old_decay_max", s.old_decay_max, 0, 1, high_open=True)
    check_range(f"{section}.old_decay_start", s.old_decay_start, 0)
    if s.old_decay_start and not s.old_decay_max:
        raise ConfigError(
            f"{section}.old_decay_start={s.old_decay_start} does nothing without the soft update: set "
            f"{section}.old_decay_rate and {section}.old_decay_max > 0 too (DiffusionNFT's decay_type 2: 0.0075, "
            "0.999, start 75), or old_decay_start: 0"
        )
    if (s.old_decay_max > 0) != (s.old_decay_rate > 0):
        keys = ("old_decay_max", "old_decay_rate")
        set_, unset = keys if s.old_decay_max > 0 else keys[::-1]
        raise ConfigError(
            f"{section}.{set_}={getattr(s, set_)} needs {section}.{unset} > 0 too (η grows by old_decay_rate per "
            f"optimizer step up to old_decay_max; DiffusionNFT's decay_type 1: 0.001 and 0.5); or set both to 0"
        )


def old_decay(step: int, rate: float, cap: float, start: int = 0) -> float:
    """DiffusionNFT's soft-update coefficient after ``step`` optimizer steps (its ``return_decay``)::

        η = 0                                   step < start
        η = min((step - start) · rate, cap)     otherwise

    Its decay_type 1 is rate 0.001, cap 0.5, start 0 (its SD3.5 configs); type 2 is 0.0075, 0.999, 75."""
    return 0.0 if step < start else min((step - start) * rate, cap)


def nft_loss(
    adapter: PipelineAdapter,
    settings: NFTConfig,
    kl_beta: float,
    batch: MicroBatch,
    old_weights: OldWeights | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One loss term of a micro-batch: a fresh (σ, ε) per sample from the batch's generator (CPU), the old and
    (``kl_beta`` > 0) reference velocities without gradient, then the NFT loss plus ``kl_beta`` × the velocity KL
    (scalar, to backward); logs ``loss``, ``policy_loss`` and ``kl``. ``old_weights=None``, or weights no optimizer
    step has moved yet: the current velocity, detached, is the old one (one forward less)."""
    sub = batch.trajectory
    point = noised_point(adapter, settings, sub, batch.generator)
    old = None
    if old_weights is not None and old_weights.moved():  # before the epoch's first step the old forward is this one
        with torch.no_grad(), adapter.without_ddp(), old_weights.swapped_in():  # no DDP: no buffer broadcast needed
            old = velocity(adapter, point, sub)
    v = velocity(adapter, point, sub)
    old = v.detach() if old is None else old
    kl = velocity_kl(adapter, kl_beta, point, sub, v)

    beta, clip = settings.beta, settings.adv_clip_max
    r = batch.advantages.detach().float().to(v.device).clamp(-clip, clip) / (2 * clip) + 0.5
    s = point.sigma.view((len(sub),) + (1,) * (v.ndim - 1))
    positive = beta * v + (1 - beta) * old
    negative = (1 + beta) * old - beta * v
    fit = _adaptive_error(point.noisy - s * positive, point.clean)
    mirror = _adaptive_error(point.noisy - s * negative, point.clean)
    policy_loss = ((r * fit + (1 - r) * mirror) * clip / beta).mean()
    loss = policy_loss + kl_beta * kl
    return loss, {"loss": loss.detach(), "policy_loss": policy_loss.detach(), "kl": kl.detach()}
