"""The training loop: one loop for every model family, sampler and objective.

    accelerate launch scripts/train.py --config configs/<name>.yaml [key.sub=value ...]

Each epoch: COLLECT (the ``sampler.rollout`` strategy samples this process's share; rewards are scored in the
background meanwhile), SCORE (the rewards gathered from every process, the NaN policy), ADVANTAGES (one call to the
``grpo.advantage.estimator``), TRAIN (the ``grpo.objective``'s terms over micro-batches, one backward each, an
optimizer step per accumulation cycle: :mod:`flowgrpo.stepping`). The loop names no method and no model family:
objectives live in :mod:`flowgrpo.objectives`, advantage estimators in :mod:`flowgrpo.advantages`, rollout
strategies in :mod:`flowgrpo.rollouts`, families in :mod:`flowgrpo.adapters`, rewards in :mod:`rewards`.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, broadcast_object_list, gather_object, set_seed
from tqdm.auto import tqdm

from rewards import AsyncReward, FrameReward, apply_nan_policy, build_reward
from rewards.base import accepts_source_images

from .advantages import AdvantageInputs, advantage_extras, compute_advantages
from .checkpoint import (
    CheckpointParts,
    check_resume,
    checkpoint_name,
    on_main,
    open_run_dir,
    resolve_resume,
    resume_run,
    resume_run_dir,
    rng_state,
    save_checkpoint,
)
from .checks import check_trackers
from .config import VIDEO_KINDS, Config, ConfigError, accumulation_steps, micro_batches_per_pass, validate
from .data import PromptDataset, check_editing, small_prompt_set_warning
from .ema import EMA
from .evaluation import evaluate_shard, grid_prompts, image_grid, merge_shards, summarize, write_report
from .memory import check_memory
from .objectives import get_objective
from .objectives.kl import kl_sample_weights
from .objectives.reference import KLReference, check_sharded
from .optim import make_lr_factor, make_optimizer
from .parallel import any_process, check_launch, cpu_launch_kwargs, full_tensor, is_deepspeed, is_fsdp
from .phases import PhaseTimer
from .pipelines import build_adapter
from .report import write_before_after, write_curves
from .rollout import Trajectory
from .rollouts import RolloutContext, get_rollout
from .signals import StopRequest, stop_on_signals
from .stepping import AccumulatingStepper


class TrainingError(RuntimeError):
    """Training cannot go on (for example too many non-finite losses in a row)."""


@dataclass
class TrainState:
    """What a checkpoint must restore for an exact resume (besides weights and optimizer)."""

    epoch: int = 0  # next epoch to run; also the sliding window's iteration
    global_step: int = 0  # optimizer steps taken
    nonfinite_in_a_row: int = 0
    empty_epochs_in_a_row: int = 0  # epochs whose every group the NaN policy dropped
    best_eval: float | None = None
    best_checkpoint: str | None = None  # name of the checkpoint with the best eval reward (never pruned)


class GRPOTrainer:
    """Holds the pieces; ``fit()`` runs the loop. Set up everything (and fail) before the first epoch."""

    def __init__(self, config: Config, run_dir: Path | None = None) -> None:
        self.config = config
        check_trackers(config.run.trackers)  # before accelerate, which raises on an unknown name, skips a missing one
        # Trackers need a logging directory at construction; it is pointed at the run directory once that exists.
        project = ProjectConfiguration(project_dir=config.run.output_dir, logging_dir=config.run.output_dir)
        self.accelerator = Accelerator(
            log_with=config.run.trackers or None, project_config=project, **cpu_launch_kwargs()
        )
        acc = self.accelerator
        validate(config, world_size=acc.num_processes)
        check_launch(acc, config)
        self.objective = get_objective(config.grpo.objective)(config)
        if self.objective.refuses_sharded and (self.deepspeed or self.fsdp):
            raise ConfigError(f"grpo.objective={config.grpo.objective} {self.objective.refuses_sharded}")
        check_sharded(config, self.deepspeed or self.fsdp)  # grpo.kl.reset_every swaps parameters' storage, as nft
        self.train_data = PromptDataset.from_file(config.data.train, "data.train")
        self.test_data = PromptDataset.from_file(config.data.test, "data.test") if config.data.test else None
        few = small_prompt_set_warning(
            len(self.train_data),
            config.model.pretrained,
            config.data.train,
            groups_per_epoch=config.grpo.groups_per_epoch,
        )
        if few:  # a preset's sample prompt file on a real model
            acc.print(f"warning: {few}")
        for note in self.train_data.notes + (self.test_data.notes if self.test_data else []):
            acc.print(f"note: {note}")  # source images converted (16-bit, float, transparency, ...)
        set_seed(config.run.seed, device_specific=True)
        # Everything that can fail on a bad config runs before the run directory is created.
        self.reward = build_reward(config.rewards, device=acc.device, nan_policy="drop")
        # A reward with a prompt grammar (shapes) refuses a prompt it cannot score now, not mid-epoch.
        self.reward.check_prompts(self.train_data.prompts + (self.test_data.prompts if self.test_data else []))
        datasets = {"data.train": self.train_data, "data.test": self.test_data}
        check_editing(datasets, reward=self.reward)  # a reward comparing edits with their sources needs source images
        set_seed(config.run.seed)  # the LoRA initialisation is the same on every process, whatever the back-end
        self.adapter = build_adapter(config.model, acc.device)
        self.kl_reference = KLReference(config, self.adapter)  # grpo.kl.reset_every
        check_editing(datasets, adapter=self.adapter)  # source images need an editing model
        # Latents and rollout buffers that cannot fit are refused now, not by a failed allocation in the first epoch.
        stores = self.objective.rollout == "sde_window"
        means = stores and self.objective.needs_sampling_means  # GRPO-Guard's μ_old, kept by the rollout
        check_memory(config, self.adapter, world_size=acc.num_processes, stores_transitions=stores, stores_means=means)
        framed = [e.key for e in self.reward.entries if isinstance(e.reward, FrameReward)]
        if framed and self.adapter.family not in VIDEO_KINDS:  # else refused only at the first score, after sampling
            raise ConfigError(
                f"rewards.{framed[0]}.frames says how to score video clips, but model.pretrained is a "
                f"{self.adapter.family} image pipeline: remove the frames option"
            )
        if config.model.compile:  # in place, before prepare(): rollout, loss and KL reference all run it compiled
            if self.deepspeed or self.fsdp:
                raise ConfigError(
                    "model.compile=true runs on one process or under DDP; DeepSpeed and FSDP wrap the "
                    "transformer themselves: set model.compile: false"
                )
            self.adapter.compile()
        set_seed(config.run.seed, device_specific=True)
        self.params = self.adapter.trainable_parameters()
        self.optimizer = make_optimizer(config, self.params)
        self.adapter.transformer, self.optimizer = acc.prepare(self.adapter.transformer, self.optimizer)
        self.params = self.adapter.trainable_parameters()  # the same tensors, whatever wrapper prepare() added
        # After prepare, from the (sharded) parameters the optimizer updates; the same everywhere (seeded init).
        t = config.train
        self.ema = EMA(self.params, t.ema, update_every=t.ema_update_every, warmup=t.ema_warmup) if t.ema > 0 else None
        self.accumulation = accumulation_steps(config, acc.num_processes)  # micro-batches per optimizer step
        per_pass = micro_batches_per_pass(config, acc.num_processes)
        self.steps_per_epoch = steps_per_epoch = per_pass * t.inner_epochs // self.accumulation
        self.lr_factor = make_lr_factor(config, config.run.epochs * steps_per_epoch)
        acc.print(
            f"{steps_per_epoch} optimizer steps per epoch at {acc.num_processes} "
            f"process(es) (gradient accumulation {self.accumulation}"
            + ("" if t.updates_per_epoch else "; set train.updates_per_epoch to keep it whatever the count")
            + ")"
        )
        self.phases = PhaseTimer()  # wall time of each loop phase (time/... metrics, scripts/bench.py epoch)
        self.state = TrainState()
        run = config.run
        warn = lambda message: acc.print(f"warning: {message}")  # noqa: E731
        resume = resolve_resume(run.resume, run.output_dir, run.name, warn=warn) if run.resume else None
        if resume is not None:  # before anything is written: the weights must mean what the config says, and fit
            check_resume(resume, config, self.adapter.transformer, ema=self.ema is not None)
            run_dir = resume_run_dir(resume, warn)  # the checkpoint's own run if it proves it, else None: a new run
        # Rollout noise: one generator per process, seeded by (seed, rank) and re-seeded every epoch.
        self.generator = torch.Generator(device="cpu")
        self.scorer: AsyncReward | None = None  # the epoch's background scoring
        rollout_context = RolloutContext(
            config,
            self.adapter,
            self.train_data,
            self.objective,
            self.generator,
            self.rank,
            acc.num_processes,
            submit=lambda images, prompts, metadata, sources: self.scorer.submit(
                images, prompts, metadata, source_images=sources
            ),
            should_stop=self._agree_to_stop,
            progress=self._bars,
            score=self._score_now,
        )
        # Built before the run directory exists, so that what a strategy refuses (an offline store) leaves none.
        self.rollouts = get_rollout(config.sampler.rollout)(rollout_context)
        self.run_dir = rollout_context.run_dir = self._make_run_dir(run_dir)
        if resume is not None:  # a failure here removes what _make_run_dir made (a new run, the lock file)
            parts = CheckpointParts(
                accelerator=acc,
                transformer=self.adapter.transformer,
                params=self.params,
                optimizer=self.optimizer,
                ema=self.ema,
                state=self.state,
                config=config,
                run_dir=self.run_dir,
                family=self.adapter.family,
                reference=self.kl_reference,
                objective=self.objective,
            )
            resume_run(parts, resume, self.run_lock, new_run=run_dir is None, warn=warn)
        self.stop = StopRequest()
        self.checkpointed_epoch = self.state.epoch if resume is not None else None  # the newest checkpoint's epoch
        self.stepper = AccumulatingStepper(
            acc,
            self.adapter.transformer,
            self.optimizer,
            self.params,
            per_update=0,
            steps_per_epoch=steps_per_epoch,
            lr=t.lr,
            lr_factor=self.lr_factor,
            max_grad_norm=t.max_grad_norm,
        )
        if acc.is_main_process and config.run.progress:
            print("resolved config:\n  " + config.to_yaml().rstrip().replace("\n", "\n  "))
        acc.project_configuration.project_dir = acc.project_configuration.logging_dir = str(self.run_dir)
        # A resume tells TensorBoard to drop the earlier attempt's points from the resumed epoch on (as metrics.jsonl).
        purge = {"tensorboard": {"purge_step": self.state.epoch}} if resume is not None else {}
        try:
            acc.init_trackers(config.run.name, config=_flat(config.to_dict()), init_kwargs=purge)
        except BaseException:  # a tracker that cannot start (a login, a server): no run directory left behind
            if self.run_lock is not None:
                self.run_lock.abandon()
            raise

    # ------------------------------------------------------------------ setup helpers
    def _make_run_dir(self, run_dir: Path | None) -> Path:
        """The run directory, locked by rank 0 while this trainer trains (:func:`flowgrpo.checkpoint.open_run_dir`)."""
        path, self.run_lock = open_run_dir(self.accelerator, self.config, run_dir)
        return path

    def _on_main(self, work: Callable[[], Any]) -> None:
        """Run ``work`` on rank 0; if it raises, every process raises (none is left waiting in a collective)."""
        on_main(self.accelerator, work)

    @property
    def deepspeed(self) -> bool:
        return is_deepspeed(self.accelerator)

    @property
    def fsdp(self) -> bool:
        return is_fsdp(self.accelerator)

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainState:
        """Train from ``state.epoch`` to ``run.epochs``; the run's lock is released however it ends (a failed fit
        leaves the run resumable at once, also from this process)."""
        if self.run_lock is not None:
            self.run_lock.acquire()  # again, if an earlier fit() of this trainer released it
        try:
            return self._fit()
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def _fit(self) -> TrainState:
        cfg, acc = self.config, self.accelerator
        bar = tqdm(
            range(self.state.epoch, cfg.run.epochs),
            desc="epochs",
            initial=self.state.epoch,
            total=cfg.run.epochs,
            disable=not (cfg.run.progress and acc.is_main_process),
        )
        every, save_every = cfg.eval.every, cfg.checkpoint.every
        parts = CheckpointParts(  # what save_checkpoint writes
            accelerator=acc,
            transformer=self.adapter.transformer,
            params=self.params,
            optimizer=self.optimizer,
            ema=self.ema,
            state=self.state,
            config=cfg,
            run_dir=self.run_dir,
            family=self.adapter.family,
            reference=self.kl_reference,
            objective=self.objective,
        )
        if every and self.state.epoch == 0:
            self._log({"epoch": 0, **self.run_eval(0)}, 0)
        started, cpu_started = time.perf_counter(), time.process_time()
        budget = cfg.run.max_minutes * 60 if cfg.run.max_minutes else math.inf
        with stop_on_signals(self.stop):
            for epoch in bar:
                self.phases.mark("epoch")
                epoch_rng = rng_state()
                # A signal during the last checkpoint (or before the first epoch): stop before sampling.
                metrics = None if self._agree_to_stop() else self.run_epoch(epoch)
                if metrics is None:  # stopped before training: nothing of this epoch is kept, a resume redoes it
                    if self.checkpointed_epoch != epoch:
                        path = save_checkpoint(parts, epoch, rng=epoch_rng)
                        acc.print(f"checkpoint: {path}")
                    acc.print("stop requested (signal): checkpoint written, exiting")
                    break
                self.state.epoch = epoch + 1
                new_best = False
                # A stop skips this epoch's evaluation: a launcher kills its workers soon after forwarding a
                # signal (torchrun: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default).
                if every and (epoch + 1) % every == 0 and not self._agree_to_stop():
                    best_before = self.state.best_eval
                    with self.phases("eval"):
                        metrics.update(self.run_eval(epoch + 1))
                    new_best = self.state.best_eval is not None and self.state.best_eval != best_before
                    if new_best:
                        self.state.best_checkpoint = checkpoint_name(epoch + 1)
                # this attempt's wall-clock and CPU time (all its threads), evaluations included
                metrics["time/elapsed"] = time.perf_counter() - started
                metrics["time/cpu"] = time.process_time() - cpu_started
                elapsed = metrics["time/cpu" if cfg.run.budget_clock == "cpu" else "time/elapsed"]
                self._log(metrics, epoch)
                bar.set_postfix(reward=f"{metrics['reward/total/mean']:.4f}")
                # every process decides together (clocks differ): a collective each epoch when a budget is set
                out_of_time = budget < math.inf and any_process(acc, elapsed >= budget)
                if out_of_time:
                    acc.print(
                        f"run.max_minutes={cfg.run.max_minutes:g} ({cfg.run.budget_clock} clock) reached after epoch "
                        f"{epoch}: finishing"
                    )
                done = epoch + 1 == cfg.run.epochs or out_of_time
                stopping = self._agree_to_stop()  # a signal may have reached only some processes since the last step
                if stopping or done or new_best or (save_every and (epoch + 1) % save_every == 0):
                    with self.phases("checkpoint"):
                        path = save_checkpoint(parts, epoch + 1)
                    self.checkpointed_epoch = epoch + 1
                    acc.print(f"checkpoint: {path}")
                if stopping:
                    acc.print("stop requested (signal): checkpoint written, exiting")
                    break
                if done:
                    break
        self.phases.mark("end")
        acc.print(self.phases.summary())
        self._finish()
        return self.state

    @torch.no_grad()
    def _score_now(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict], sources: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """The reward's scores of a batch, computed now (rollouts that score intermediate predictions)."""
        extra = {"source_images": sources} if sources is not None and accepts_source_images(self.reward) else {}
        return self.reward(images, prompts, metadata, **extra)

    def run_epoch(self, epoch: int) -> dict[str, float] | None:
        """Collect, score, compute advantages and train one epoch; its metrics, or None when a stop signal was
        agreed during sampling (the epoch is then abandoned before any update)."""
        cfg, acc = self.config, self.accelerator
        timings: dict[str, float] = {}

        # ================================ COLLECT ================================
        start = time.perf_counter()
        # A fresh prompt cache each epoch bounds its memory (real prompt sets are large) and makes the text
        # embeddings a function of the epoch alone (a batch's composition moves them by ~1e-7): exact resume.
        self.adapter.clear_prompt_cache()
        self.generator.manual_seed(cfg.run.seed * 1_000_003 + epoch * 1_009 + self.rank)
        self.scorer = AsyncReward(self.reward, max_pending=2)
        self.adapter.transformer.eval()
        with self.objective.sampling_weights(self.params, self.state.global_step):
            collected = self.rollouts.collect(epoch)
        if collected is None:
            self.scorer.close()
            return None
        trajectory = collected.trajectory
        timings["time/sampling"] = self.phases.add("sampling", start)

        # ================================ SCORE ================================
        start = time.perf_counter()
        with self.scorer:
            # a strategy may bring its samples' rewards (an offline store's): then nothing was submitted
            local_scores = _cat_scores(self.scorer.results()) if collected.scores is None else collected.scores
        timings["time/reward_wait"] = self.phases.add("reward_wait", start)
        if cfg.run.image_grid_every and epoch % cfg.run.image_grid_every == 0 and acc.is_main_process:
            self._save_sample_grid(trajectory, local_scores["total"], epoch)

        # ================================ ADVANTAGES ================================
        start = time.perf_counter()
        keys = sorted(local_scores)
        trajectory.extras.update(advantage_extras(cfg.grpo.advantage, trajectory))  # e.g. diversity's features
        gathered = {k: acc.gather(local_scores[k].to(acc.device)).cpu() for k in keys}
        all_group_ids = acc.gather(trajectory.group_ids.to(acc.device)).cpu()
        keep, dropped = apply_nan_policy(gathered, all_group_ids, cfg.grpo.nan_policy, keys=list(self.reward.weights))
        # Dropped groups (non-finite rewards) get advantage 0 and take no part in the statistics of the others.
        extras = {k: acc.gather(v.to(acc.device)).cpu() for k, v in sorted(trajectory.extras.items())}
        inputs = AdvantageInputs(gathered, self.reward.weights, all_group_ids, trajectory.num_trained_steps, extras)
        advantages_all = compute_advantages(cfg.grpo.advantage, inputs, keep)
        n_local = len(trajectory)
        # gather() concatenates in process order, so this process's rows are one contiguous block.
        advantages = advantages_all[self.rank * n_local : (self.rank + 1) * n_local]
        kl_weights = kl_sample_weights(cfg.grpo.kl, inputs, keep)  # the KL's per-sample gate (grpo.kl.gate)
        for k, v in kl_weights.items():
            trajectory.extras[k] = v[self.rank * n_local : (self.rank + 1) * n_local]
        if cfg.run.debug_dump:
            self._dump(
                f"epoch{epoch}",
                group_ids=trajectory.group_ids,
                local_total=local_scores["total"],
                all_total=gathered["total"],
                all_group_ids=all_group_ids,
                advantages=advantages,
                advantages_all=advantages_all,
                **{k: trajectory.extras[k] for k in kl_weights},  # this process's gate
            )
        self.phases.add("advantages", start)

        # ================================ TRAIN ================================
        start = time.perf_counter()
        # Nothing usable (every group dropped): no optimizer step, which would still move the weights (Adam's
        # weight decay, a momentum left from earlier epochs) on no signal at all.
        stats = self.train_on(trajectory, advantages, epoch) if self._usable(keep, dropped) else {}
        timings["time/training"] = self.phases.add("training", start)

        metrics: dict[str, float] = {
            "epoch": epoch,
            "global_step": self.state.global_step,
            **collected.metrics,
            "reward/dropped_groups": dropped,
        }
        for k, v in gathered.items():
            finite = v[torch.isfinite(v)]
            metrics[f"reward/{k}/mean"] = finite.mean().item() if len(finite) else math.nan
            metrics[f"reward/{k}/std"] = finite.std().item() if len(finite) > 1 else 0.0
        metrics.update(
            {
                "advantage/mean": advantages_all.mean().item(),
                "advantage/std": advantages_all.std().item(),
                "advantage/abs_mean": advantages_all.abs().mean().item(),
            }
        )
        metrics.update(stats)
        metrics.update(timings)
        metrics["images_per_s"] = len(all_group_ids) / max(timings["time/sampling"] + timings["time/reward_wait"], 1e-9)
        return metrics

    def train_on(self, trajectory: Trajectory, advantages: torch.Tensor, epoch: int) -> dict[str, float]:
        """Inner epochs over this process's samples: micro-batches × the objective's terms, a backward per term."""
        cfg, acc = self.config, self.accelerator
        model = self.adapter.transformer
        model.train()
        n, terms = len(trajectory), self.objective.num_terms(trajectory)
        if terms == 0:
            return {}
        shuffle = torch.Generator().manual_seed(cfg.run.seed * 7_919 + epoch * 31 + self.rank)
        self.objective.begin_epoch(self.params)
        self.kl_reference.begin_epoch(epoch, self.params)  # grpo.kl.reset_every: the reference may become the weights
        num_micro = n // cfg.train.batch_size  # the same on every process (validated), also when samples are dropped
        samples = self.objective.select_samples(advantages, num_micro, shuffle, trajectory.group_ids)
        self.stepper.per_update = terms * self.accumulation  # backward passes per optimizer step
        self.stepper.start_epoch(epoch)
        sums: dict[str, list[float]] = defaultdict(list)
        sums["trained_samples"].append(float(len(samples)))
        updates = 0

        def record(stats: dict[str, torch.Tensor] | None) -> None:
            if stats is None:
                self._skip_nonfinite()
                return
            self.state.nonfinite_in_a_row = 0
            for k, v in stats.items():
                sums[k].append(v.item())
            if updates == 0 and "ratio_max" in stats:  # still on-policy: a likelihood ratio must be exactly 1
                sums["onpolicy_ratio_dev"].append(max(stats["ratio_max"].item() - 1.0, 1.0 - stats["ratio_min"].item()))

        per_step = cfg.train.ema_stepping == "optimizer_step"

        def step_ema(stepped: bool) -> None:
            """After every micro-batch, with the optimizer step count (Flow-GRPO), or only after one that ended an
            optimizer step (``train.ema_stepping: optimizer_step``)."""
            if self.ema is not None and (stepped or not per_step):
                self.ema.step(self.params, self.state.global_step)

        for _ in range(cfg.train.inner_epochs):
            batches = self.objective.micro_batches(samples, trajectory.group_ids, num_micro, shuffle)
            for mb in tqdm(batches, desc=f"training e{epoch}", leave=False, disable=not self._bars):
                sub, adv = trajectory.select(mb), advantages[mb].to(acc.device)
                stepped = False  # whether this micro-batch ended an optimizer step (train.ema_stepping)
                for j, batch in enumerate(self.objective.terms(sub, adv, shuffle)):
                    outcome = self.stepper.term(lambda batch=batch: self.objective.loss(self.adapter, batch), record)
                    if outcome.update_skipped:
                        self._skip_nonfinite("gradients")
                    elif outcome.grad_norm is not None:
                        sums["grad_norm"].append(outcome.grad_norm)
                        self.state.global_step += 1
                        updates += 1
                        stepped = True
                    if outcome.cycle_ended and self._agree_to_stop():
                        if j == terms - 1:  # the micro-batch is complete: as below
                            step_ema(stepped)
                        model.eval()
                        return self._summarize(sums)
                step_ema(stepped)
        model.eval()
        return self._summarize(sums)

    def _summarize(self, sums: dict[str, list[float]]) -> dict[str, float]:
        out = {f"train/{k}": sum(v) / len(v) for k, v in sums.items() if v}
        # extremes, as the objectives' metric convention says (keys ending in _min / _max), and the on-policy check
        for k, values in sums.items():
            pick = min if k.endswith("_min") else max if k.endswith(("_max", "_dev")) else None
            if values and pick is not None:
                out[f"train/{k}"] = pick(values)
        out["train/lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def _agree_to_stop(self) -> bool:
        """Whether any process got SIGTERM/SIGINT; every process agrees, so all stop after the same step."""
        before = self.stop.agreed
        if self.stop.agree(lambda received: any_process(self.accelerator, received)) and not before:
            self.accelerator.print("stop signal received: checkpointing and exiting")
        return self.stop.agreed

    def run_eval(self, epoch: int) -> dict[str, float]:
        """ODE sampling on the test prompts, split over processes; ``eval/...`` metrics and a report (rank 0)."""
        acc, cfg = self.accelerator, self.config
        if self.test_data is None:
            return {}
        # The bare model: no DDP collectives in these forwards, so shards of unequal size are fine. FSDP's
        # forwards gather weights (collectives), so there every process runs as many batches.
        self.adapter.clear_prompt_cache()  # as scripts/evaluate.py: test prompts encoded in eval batches
        shown = grid_prompts(cfg.eval.samples_per_prompt)
        weights = self.ema.applied(self.params) if cfg.eval.use_ema else contextlib.nullcontext()
        with self.adapter.unwrapped(), weights:
            indices, images, scores = evaluate_shard(
                self.adapter,
                self.test_data,
                self.reward,
                cfg.eval,
                resolution=cfg.model.size,
                seed=cfg.run.seed,
                progress=self._bars,
                shard=(self.rank, acc.num_processes),
                equal_batches=self.fsdp,
                image_prompts=shown,
            )
        self.adapter.clear_prompt_cache()
        parts = [(indices, images, scores)]  # images: only the grid's (the first prompts'), scores: all
        if acc.num_processes > 1:
            parts = gather_object(parts)
        metrics: dict[str, float] = {}
        if acc.is_main_process:
            indices, images, scores = merge_shards(parts, shown)  # back to the unsharded order
            summary = summarize(self.test_data, indices, scores)
            prompts = [self.test_data.prompts[i] for i in indices]
            write_report(self.run_dir / "eval", summary, images, prompts, scores, name=f"epoch{epoch:05d}")
            metrics = {f"eval/{k}": v for k, v in summary.items()}
            total = summary.get("total")
            # NaN is never a best (NaN != NaN would make every later evaluation a new best, each a checkpoint)
            finite = total is not None and math.isfinite(total)
            if finite and (self.state.best_eval is None or total > self.state.best_eval):
                self.state.best_eval = total
        if acc.num_processes > 1:  # every process must agree on the best (it decides who checkpoints)
            shared = [metrics, self.state.best_eval]
            broadcast_object_list(shared)
            metrics, self.state.best_eval = shared
        return metrics

    def _usable(self, keep: torch.Tensor, dropped: int) -> bool:
        """Whether any group survived the NaN policy; stop after ``run.max_empty_epochs`` epochs in a row with none."""
        if keep.any():
            self.state.empty_epochs_in_a_row = 0
            return True
        self.state.empty_epochs_in_a_row += 1
        n, limit = self.state.empty_epochs_in_a_row, self.config.run.max_empty_epochs
        self.accelerator.print(f"warning: every group ({dropped}) had a non-finite reward: no update ({n} in a row)")
        if n >= limit:
            raise TrainingError(
                f"{n} epochs in a row had a non-finite reward in every group (grpo.nan_policy=drop left nothing to "
                f"train on): a reward returns NaN for every image, e.g. a judge whose replies never parse or never "
                f"arrive. Check the reward (its log lines above name it), or raise run.max_empty_epochs ({limit})"
            )
        return False

    def _skip_nonfinite(self, what: str = "loss") -> None:
        self.state.nonfinite_in_a_row += 1
        n = self.state.nonfinite_in_a_row
        self.accelerator.print(f"warning: non-finite {what}, step skipped ({n} in a row)")
        if n >= self.config.run.max_nonfinite_steps:
            raise TrainingError(
                f"{n} non-finite losses or gradients in a row: lower train.lr, check the rewards, "
                f"or raise run.max_nonfinite_steps"
            )

    # ------------------------------------------------------------------ logging and output
    @property
    def _bars(self) -> bool:
        return self.config.run.progress and self.accelerator.is_main_process

    def _log(self, metrics: dict[str, float], epoch: int) -> None:
        acc = self.accelerator
        acc.log(metrics, step=epoch)
        if acc.is_main_process:
            with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(metrics) + "\n")
            if epoch % self.config.run.log_every == 0:
                shown = {
                    k: metrics[k]
                    for k in (
                        "reward/total/mean",
                        "eval/total",
                        "train/loss",
                        "train/ratio_mean",
                        "train/clip_fraction",
                        "train/kl",
                        "train/grad_norm",
                    )
                    if k in metrics
                }
                # a verifier's held-out accuracies (e.g. eval/shapes/accuracy/exact), without the per-tag ones
                shown.update(
                    {
                        k: v
                        for k, v in metrics.items()
                        if k.startswith("eval/") and "/accuracy/" in k and "/tag/" not in k
                    }
                )
                acc.print(f"epoch {epoch}: " + " ".join(f"{k}={v:.4g}" for k, v in shown.items()))

    def _save_sample_grid(self, trajectory: Trajectory, totals: torch.Tensor, epoch: int) -> None:
        """This process's sampled images, one row per group, captioned with group id and reward."""
        order = torch.argsort(trajectory.group_ids, stable=True)
        captions = [f"g{int(trajectory.group_ids[i])} {float(totals[i]):.3g}" for i in order]
        folder = self.run_dir / "samples"
        folder.mkdir(exist_ok=True)
        image_grid(trajectory.images[order].cpu(), captions, columns=self.config.grpo.group_size).save(
            folder / f"epoch{epoch:05d}.png"
        )

    def _dump(self, name: str, **tensors: torch.Tensor) -> None:
        folder = self.run_dir / "debug"
        folder.mkdir(exist_ok=True)
        # Whole tensors (FSDP2 shards are gathered: every process calls this).
        whole = {k: full_tensor(v.detach()).cpu() for k, v in tensors.items()}
        torch.save(whole, folder / f"{name}_rank{self.rank}.pt")

    def _finish(self) -> None:
        acc = self.accelerator
        if acc.is_main_process and (self.run_dir / "metrics.jsonl").is_file():
            write_curves(self.run_dir)
            write_before_after(self.run_dir)
        if self.config.run.debug_dump:
            shadow = self.ema.shadow if self.ema is not None else []
            self._dump(
                "final",
                **{f"p{i}": p for i, p in enumerate(self.params)},
                **{f"ema{i}": s for i, s in enumerate(shadow)},
            )
        acc.wait_for_everyone()
        acc.end_training()


def _cat_scores(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([b[k] for b in batches]).float() for k in batches[0]}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v if isinstance(v, int | float | str | bool) else str(v)
    return out
