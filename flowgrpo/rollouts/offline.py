"""``sampler.rollout: offline``: an epoch's groups come from a store sampled once (:mod:`flowgrpo.offline`), not from
the sampler: GDRO's fully offline setting (:mod:`flowgrpo.objectives.gdro`), open to every objective whose loss does
not assume that the epoch's samples came from the weights being trained
(:attr:`~flowgrpo.objectives.Objective.samples_from_current_weights`) and that trains on final samples
(``rollout = "ode"``).

``sampler.offline.path`` names a store made by ``scripts/sample_offline.py``; null samples one into the run directory
(``<run>/offline``) on the run's first epoch, with the base model, and a resumed run reuses it. Each epoch then
serves ``grpo.groups_per_epoch`` stored groups in the order :func:`flowgrpo.offline.served_groups` gives (a function
of ``(run.seed, epoch)``: a resume replays the same groups in the same order), with their stored rewards (handed to
the trainer as :attr:`Collected.scores`: nothing is scored again) and the prompts' embeddings encoded afresh. The
sampler is never called after the store exists. The trajectories hold no SDE transitions, so objectives that re-score
them (``rollout = "sde_window"``) are refused, as are nft and fpo, whose old weights (and fpo's ratio) stand for the
weights that sampled the epoch (here the base model, long ago). They hold no images, except on the epochs of an image
grid (decoded from the stored latents on the process that draws it) or for ``grpo.advantage.diversity`` (every epoch,
every process).

Config validation (:meth:`Offline.validate`) reads only the store's headers; the strategy's construction, which the
trainer runs before the run directory exists, checks the sha256 of its samples (once per run and process) and the
latents' shape against the model. A store the run samples itself (``path: null``) is opened, or sampled, in the
first epoch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..adapters import PromptEmbeds
from ..checks import ConfigError
from ..data import rank_groups, rank_slice
from ..offline import (
    INFO,
    OfflineConfig,
    StoreInfo,
    build_store,
    check_finite_rewards,
    check_offline_section,
    check_store,
    load_latents,
    load_rewards,
    remove_unfinished,
    served_groups,
)
from ..rollout import Trajectory, plan_rollout
from .base import Collected, RolloutStrategy, register_rollout

if TYPE_CHECKING:
    from ..config import Config
    from .base import RolloutContext


def _tied_to_sampling(objective: type) -> bool:
    """Whether an objective cannot train on a store: it re-scores SDE transitions (none are stored), or says that its
    loss assumes the epoch's samples came from the weights being trained (even an sde_window one that says not)."""
    return objective.rollout != "ode" or objective.samples_from_current_weights


@dataclass(frozen=True)
class Row:
    """One served image: its store group, its place in the group, and the id of the group it trains in."""

    store_group: int
    image: int
    group_id: int


@register_rollout("offline")
class Offline(RolloutStrategy):
    """Serves the groups of an offline store; samples the store first when the run makes its own."""

    config_class = OfflineConfig

    @classmethod
    def validate(cls, config: Config, world_size: int = 1) -> None:
        from ..objectives import OBJECTIVES, get_objective

        check_offline_section(config)
        name = config.grpo.objective
        objective = get_objective(name)
        if _tied_to_sampling(objective):
            usable = ", ".join(sorted(n for n, c in OBJECTIVES.items() if not _tied_to_sampling(c)))
            why = (
                "re-scores the SDE window's transitions against the log-probs they were sampled with"
                if objective.rollout == "sde_window"
                else "compares with old weights that stand for the weights the epoch's samples were drawn with (the "
                "epoch's starting weights), not the model that sampled the store"
            )
            raise ConfigError(
                f"sampler.rollout=offline serves final samples drawn once by the base model (no SDE transitions, no "
                f"log-probs), but grpo.objective={name} {why}; set grpo.objective to one that trains on samples from "
                f"another model ({usable}), or sampler.rollout: chain"
            )
        path = config.sampler.offline.path
        if path is None and world_size > 1:
            raise ConfigError(
                f"sampler.offline.path=null samples the store inside the run on one process, and this run has "
                f"{world_size}; sample it first (python scripts/sample_offline.py --config <your config> --out DIR) "
                "and set sampler.offline.path: DIR"
            )
        if path is not None:
            check_store(config, Path(path))  # the headers only: the hash when the run opens it

    def __init__(self, context: RolloutContext) -> None:
        super().__init__(context)
        self.info: StoreInfo | None = None
        self.rewards: dict[str, torch.Tensor] = {}
        self.built_s = 0.0  # seconds this run spent sampling and scoring its own store
        path = context.config.sampler.offline.path
        self.out: Path | None = None if path is None else Path(path)  # null: <run>/offline, known in the first epoch
        if self.out is not None:  # before the run directory exists: its samples' hash, its latents' shape
            self._open(check_store(context.config, self.out, verify=True))

    def _own_store(self) -> bool:
        """The run's own store (``path: null``), in its first epoch: opened when a resumed run made it, else sampled
        and scored now; False when a stop was agreed meanwhile."""
        ctx = self.context
        if ctx.run_dir is None:
            raise ValueError("sampler.offline.path=null keeps the store in the run directory, and the context has none")
        self.out = Path(ctx.run_dir) / "offline"
        if (self.out / INFO).exists():  # a resumed run: its own store
            self._open(check_store(ctx.config, self.out, verify=True))
            return True
        remove_unfinished(self.out)
        return self._build()

    def _open(self, info: StoreInfo) -> None:
        cfg = self.context.config
        expected = tuple(self.context.adapter.latent_shape(*cfg.model.size))
        if info.latent_shape != expected:
            raise ConfigError(
                f"sampler.offline.path={info.path} holds latents of shape {list(info.latent_shape)}, and this model "
                f"makes {list(expected)} at {cfg.model.size_keys}; sample a store for this model "
                "(python scripts/sample_offline.py --config <your config> --out NEW_DIR)"
            )
        self.info, self.rewards = info, load_rewards(info)
        if self.context.rank == 0:
            print(f"offline store {info.path}: {info.groups} groups × {info.group_size} images, {info.cost}; served")

    def _build(self) -> bool:
        """Sample and score this run's store (its first epoch); False when a stop was agreed meanwhile."""
        ctx = self.context
        if ctx.score is None:
            raise ValueError("sampler.rollout=offline samples its store through the context's score function")
        assert self.out is not None
        start = time.perf_counter()
        built = build_store(
            ctx.config, ctx.adapter, ctx.data, ctx.score, self.out, progress=ctx.progress, should_stop=ctx.should_stop
        )
        if built is None:
            return False
        self.built_s = time.perf_counter() - start
        check_finite_rewards(ctx.config, built, load_rewards(built)["total"])  # grpo.nan_policy: error refuses it now
        self._open(built)
        return True

    def collect(self, epoch: int) -> Collected | None:
        ctx, cfg = self.context, self.context.config
        built_now = self.info is None  # the run's own store, opened or sampled in this (its first) epoch
        if built_now and not self._own_store():
            return None
        info = self.info
        assert info is not None
        g, k = cfg.grpo, info.group_size
        chosen = served_groups(info.groups, g.groups_per_epoch, seed=cfg.run.seed, epoch=epoch)
        first_id = epoch * g.groups_per_epoch  # unique across epochs, as the sampled rollouts' ids
        plan = [Row(group, i, first_id + j) for j, group in enumerate(chosen) for i in range(k)]
        deal = rank_groups if ctx.objective.needs_whole_groups(cfg) else rank_slice
        rows: list[Row] = deal(plan, ctx.rank, ctx.num_processes)  # type: ignore[arg-type]  (needs .group_id only)
        touched = list(dict.fromkeys(r.store_group for r in rows))
        where = {group: n for n, group in enumerate(touched)}
        latents = load_latents(info, touched)[[where[r.store_group] * k + r.image for r in rows]]
        stored = torch.tensor([r.store_group * k + r.image for r in rows])
        indices = [info.prompt_indices[r.store_group] for r in rows]
        trajectory = self._trajectory(rows, indices, latents.to(ctx.adapter.device), info.guidance_scale, epoch)
        scores = {key: values[stored] for key, values in self.rewards.items()}
        metrics = {
            "offline/groups": float(info.groups),
            "offline/passes": (epoch + 1) * g.groups_per_epoch / info.groups,
            "offline/sampling_once_s": info.raw["timing"]["sampling_s"] + info.raw["timing"]["scoring_s"],
            "offline/built_s": self.built_s if built_now else 0.0,
        }
        return Collected(trajectory, metrics, scores=scores)

    def _trajectory(
        self, rows: list[Row], indices: list[int], latents: torch.Tensor, guidance: float, epoch: int
    ) -> Trajectory:
        """The served rows as a trajectory without window steps: prompts encoded afresh in rollout batches of
        ``sampler.batch_size``, images decoded only for an image grid on the process that draws it."""
        ctx, cfg = self.context, self.context.config
        adapter, data, size = ctx.adapter, ctx.data, cfg.sampler.batch_size
        height, width = cfg.model.size
        prompts = [data.prompts[i] for i in indices]
        negative = adapter.needs_negative(guidance)
        embeds = PromptEmbeds.cat(
            [
                adapter.encode_conditions(
                    prompts[i : i + size],
                    with_negative=negative,
                    sources=data.sources_of(indices[i : i + size]),
                    height=height,
                    width=width,
                )
                for i in range(0, len(prompts), size)
            ]
        )
        every = cfg.run.image_grid_every
        images = None
        grid = every and epoch % every == 0 and ctx.rank == 0
        if grid or cfg.grpo.advantage.diversity.enabled:  # GARDO's diversity shaping reads every process's images
            images = torch.cat(
                [adapter.decode(latents[i : i + size], height, width).cpu() for i in range(0, len(rows), size)]
            )
        sigmas, _ = adapter.schedule(cfg.sampler.num_steps, height, width, time_shift=cfg.sampler.time_shift)
        n, empty = len(rows), latents.new_zeros((len(rows), 0, *latents.shape[1:]))
        no_steps = torch.zeros(n, 0)
        metadata: list[dict[str, Any]] = [dict(data.metadata[i]) for i in indices]
        return Trajectory(
            prompts=prompts,
            group_ids=torch.tensor([r.group_id for r in rows]),
            embeds=embeds,
            latents=empty,
            next_latents=empty,
            log_probs=no_steps,
            stds=no_steps,
            sigmas=no_steps,
            sigmas_next=no_steps,
            step_indices=torch.zeros(n, 0, dtype=torch.long),
            t_second=plan_rollout(cfg.sampler, range(0, 0), sigmas).t_second,
            guidance_scale=guidance,
            height=height,
            width=width,
            final_latents=latents,
            images=images,
            metadata=metadata,
        )
