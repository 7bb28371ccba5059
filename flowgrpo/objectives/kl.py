"""GARDO's gated KL, ``grpo.kl.gate``: the KL term applies only to the samples whose reward is least trustworthy.

GARDO (He et al., arXiv 2512.24138, "GARDO: Reinforcing Diffusion Models without Reward Hacking"; code
tinnerhrhe/GARDO) estimates a sample's uncertainty from the disagreement between the reward it trains on and
auxiliary reward models that are scored but not trained on, and penalises the KL of the most uncertain samples only.
Among the epoch's N samples (every process's; the groups the NaN policy kept), with win rates::

    w_i(R) = (#{j: R_j < R_i} + ½·#{j ≠ i: R_j = R_i}) / (N − 1)       i's win rate under the reward R
    U_i    = w_i(total) − mean_k w_i(aux_k)                            (grpo.kl.gate.direction: over; under: −U_i)

``total`` is what the advantages train on (the rewards' weighted sum), ``aux_k`` the rewards named in
``grpo.kl.gate.auxiliary`` (give them weight 0: scored, not trained). U_i > 0 (``over``): the trained reward ranks
the image above where the auxiliary rewards rank it. Among the M samples of U ≥ 0, the gate holds the
``ceil(fraction · M)`` of largest U (ties: the earlier sample first), of those with U > 0 only. A micro-batch's KL term
is then the mean of the per-sample KL over its gated samples, and 0 (without the reference forward) when it holds
none, as GARDO's code computes it (``kl_loss = mean(kl[idx])``); without a gate it is the mean over all of them, as
before. Every objective's KL goes through :func:`gated_mean` (:func:`~.forward.velocity_kl` and
:func:`~.clipped.reference_kl`), so the gate works with each of them. Its reference forward runs on the module DDP
wraps (``adapter.reference()``), so a process whose micro-batch has no gated sample, and skips it, issues the same
collectives as the others.

A non-finite auxiliary score (a ``key/sub`` extra score, which the NaN policy does not look at) counts as missing:
the win rates under that reward rank the other samples among themselves, and the sample's U is its total's win rate
against the mean over the auxiliaries that did score it; with none (or a non-finite total) it has no U and is not
gated, nor counted in M.

GARDO's code ranks each reward in descending order (``torch.sort``, rank 1 the best; ties broken by the sort, i.e.
arbitrarily, where here they share a half-credit win) and gates ``rank_main − mean rank_aux`` above its threshold:
images the trained reward ranks *below* the auxiliary ones, ``direction: under``. ``over`` is this project's own
reading (a proxy reward over-rating an image), not taken from the paper, whose text past its abstract was not read.
The code's threshold is the ``100 − 100·fraction`` percentile of the uncertainties ≥ 0 (about ``fraction · M`` of them
above it, as here); its fraction starts at 0.1 and moves within [0.02, 0.2] (×1.1 or ×0.9 when the epoch's mean
uncertainty leaves the range of the last 20 epochs); here it is fixed (that would be state to checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..checks import ConfigError, check_range, one_of

if TYPE_CHECKING:
    from ..advantages import AdvantageInputs
    from ..config import Config
    from ..rollout import Trajectory

GATE = "kl_gate"  # Trajectory.extras key: [B] 1.0 where the KL applies, 0.0 where it does not
DIRECTIONS = ("over", "under")


@dataclass
class KLGateConfig:
    """``grpo.kl.gate:`` GARDO's gated KL (:mod:`flowgrpo.objectives.kl`): the KL term applies to the epoch's most
    uncertain samples only."""

    auxiliary: list[str] = field(default_factory=list)  # reward keys (or "key/sub", a reward's extra score) whose
    #   disagreement with the trained reward is the uncertainty: scored, not trained (weight 0); GARDO: aesthetic and
    #   imagereward. []: no gate, the KL applies to every sample
    fraction: float = 0.1  # the share of the epoch's samples of uncertainty U ≥ 0 the KL applies to, those of
    #                        largest U > 0 (GARDO: 0.1, adapted within [0.02, 0.2] by its code)
    direction: str = "over"  # over: U = w(total) − mean w(aux), the trained reward ranks the image above the
    #                          auxiliaries (this project's reading) | under: −U (the sign of GARDO's public code)


def check_kl(config: Config) -> None:
    """``grpo.kl.gate`` and ``grpo.kl.reset_every``: ranges, a KL term to act on, auxiliaries that are rewards."""
    from rewards.registry import reward_weights

    kl = config.grpo.kl
    gate = kl.gate
    one_of("grpo.kl.gate.direction", gate.direction, DIRECTIONS)
    check_range("grpo.kl.gate.fraction", gate.fraction, 0, 1, low_open=True, why="a share of the epoch's samples")
    check_range("grpo.kl.reset_every", kl.reset_every, 0, why="epochs between resets of the reference; 0: never")
    if not gate.auxiliary and (gate.fraction, gate.direction) != (KLGateConfig.fraction, KLGateConfig.direction):
        raise ConfigError(
            "grpo.kl.gate.fraction / direction choose which samples the KL applies to and do nothing without "
            "grpo.kl.gate.auxiliary; name the auxiliary rewards (GARDO: [aesthetic, imagereward]) or remove them"
        )
    for key, value in (("grpo.kl.gate.auxiliary", gate.auxiliary), ("grpo.kl.reset_every", kl.reset_every)):
        if value and kl.beta <= 0:
            raise ConfigError(
                f"{key}={value} acts on the KL term, but grpo.kl.beta=0 adds none; set grpo.kl.beta > 0 "
                f"(GARDO: 0.04 on OCR, 0.07 on GenEval), or remove {key}"
            )
    if not gate.auxiliary:
        return
    try:
        weights = reward_weights(config.rewards)
    except ValueError as err:  # a malformed rewards section: build_reward says the same, with the trainer's context
        raise ConfigError(str(err)) from None
    if len(set(gate.auxiliary)) < len(gate.auxiliary):
        raise ConfigError(f"grpo.kl.gate.auxiliary={gate.auxiliary} names a reward twice; name each once")
    for name in gate.auxiliary:
        key = name.split("/", 1)[0]
        if key not in weights:
            raise ConfigError(
                f"grpo.kl.gate.auxiliary names {name!r}, which is not a reward of this config (rewards: "
                f"{', '.join(weights)}); add it to rewards with weight 0 (scored, not trained), e.g. {{{key}: 0.0}}"
            )
    trained = [k for k, w in weights.items() if w]
    if trained and set(trained) <= set(gate.auxiliary):
        raise ConfigError(
            f"grpo.kl.gate.auxiliary={gate.auxiliary} holds every reward the advantages train on "
            f"({', '.join(trained)}), so the trained reward agrees with them on every sample (U = 0, nothing gated); "
            "name rewards scored at weight 0 instead (GARDO: aesthetic and imagereward beside OCR or GenEval)"
        )


def win_rates(rewards: Tensor) -> Tensor:
    """``w_i = (#{j: R_j < R_i} + ½·#{j ≠ i: R_j = R_i}) / (n − 1)``, float64 [N]: each sample's win rate among the n
    samples of finite reward; NaN for a sample whose reward is not finite (it is not ranked)."""
    r = rewards.double()
    finite = torch.isfinite(r)
    f = finite[None, :]
    below = ((r[None, :] < r[:, None]) & f).sum(dim=1)
    ties = ((r[None, :] == r[:, None]) & f).sum(dim=1) - 1
    rates = (below + 0.5 * ties).double() / max(int(finite.sum()) - 1, 1)
    return torch.where(finite, rates, torch.full_like(rates, math.nan))


def uncertainty(scores: Mapping[str, Tensor], auxiliary: list[str], direction: str = "over") -> Tensor:
    """GARDO's uncertainty of each sample (module docstring): ``w(total) − mean_k w(aux_k)``, negated for ``under``;
    the mean over the auxiliaries that scored the sample (a finite score), NaN where none did."""
    missing = [k for k in auxiliary if k not in scores]
    if missing:
        raise ValueError(
            f"grpo.kl.gate.auxiliary names {missing[0]!r}, which the rewards did not return (they returned "
            f"{', '.join(sorted(scores))}); name a reward's key or one of its extra scores"
        )
    u = win_rates(scores["total"]) - torch.stack([win_rates(scores[k]) for k in auxiliary]).nanmean(dim=0)
    return u if direction == "over" else -u


def gated_samples(u: Tensor, fraction: float) -> Tensor:
    """1.0 for the ``ceil(fraction · M)`` samples of largest ``u`` (ties: the earlier first), M the number of samples
    with ``u`` ≥ 0, of those with ``u`` > 0 only; else 0 (NaN: no uncertainty, never gated)."""
    count = math.ceil(round(fraction * int((u >= 0).sum()), 6))  # 0.1 × 30 is 3.0000000000000004 in floats: 3
    ranked = torch.where(torch.isnan(u), torch.full_like(u, -math.inf), u)
    order = torch.sort(ranked, descending=True, stable=True).indices[:count]
    gate = torch.zeros(len(u))
    gate[order] = 1.0
    return gate * (u > 0)


def kl_sample_weights(settings: Any, inputs: AdvantageInputs, keep: Tensor) -> dict[str, Tensor]:
    """Per-sample tensors ``[N]`` the KL term reads from ``Trajectory.extras`` (``settings``: the grpo.kl section):
    ``{GATE: the gate}`` with ``grpo.kl.gate`` (samples outside ``keep`` are never gated), else ``{}``."""
    gate = settings.gate
    if not gate.auxiliary or settings.beta <= 0:
        return {}
    out = torch.zeros(len(inputs.group_ids))
    if keep.any():
        scores = {k: v[keep] for k, v in inputs.scores.items()}
        out[keep] = gated_samples(uncertainty(scores, gate.auxiliary, gate.direction), gate.fraction)
    return {GATE: out}


def kl_gate(sub: Trajectory) -> Tensor | None:
    """The micro-batch's gate ([B], 1.0 where the KL applies), or None without ``grpo.kl.gate`` (every sample)."""
    return sub.extras.get(GATE)


def gated_mean(kl: Tensor, gate: Tensor | None) -> Tensor:
    """The KL term of a micro-batch from its per-sample KL ``[B]``: the mean over its samples, or over the gated ones
    (0 when none is)."""
    if gate is None:
        return kl.mean()
    weights = gate.to(kl.device, kl.dtype)
    return (kl * weights).sum() / weights.sum().clamp_min(1)
