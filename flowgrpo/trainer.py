"""The GRPO training loop: one loop for every model family and sampler.

    accelerate launch scripts/train.py --config configs/<name>.yaml [key.sub=value ...]

Each epoch: SAMPLING (rollouts with the SDE inside the window, rewards scored in the background),
ADVANTAGES (rewards gathered from every process, group-relative advantages), TRAINING (the ``grpo.objective``:
every stored transition re-scored under the current weights, clipped ratio loss + β·KL to the adapter-disabled
model; or ``awm`` / ``nft``, flow-matching losses on the noised final samples; one backward per term, an
optimizer step per accumulation cycle). Model specifics live in the adapter, sampler specifics in ``samplers``.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, broadcast_object_list, gather_object, set_seed
from diffusers.optimization import get_scheduler
from tqdm.auto import tqdm

from rewards import AsyncReward, FrameReward, apply_nan_policy, build_reward
from samplers import NoWindow, SlidingWindow, transition_kl

from .adapters import PipelineAdapter, build_adapter
from .advantages import compute_advantages
from .awm import awm_loss
from .batching import kept_samples, micro_batches, trained_count, trained_positions
from .checkpoint import (
    CheckpointError,
    RunLock,
    check_model_matches,
    checkpoint_name,
    create_run_dir,
    load_checkpoint,
    recipe_changes,
    resolve_resume,
    rng_state,
    save_checkpoint,
    set_aside_later,
    write_run_config,
)
from .config import VIDEO_KINDS, Config, ConfigError, accumulation_steps, micro_batches_per_pass, validate
from .data import PromptDataset, check_editing, epoch_plan, rank_slice
from .ema import EMA
from .evaluation import evaluate_shard, grid_prompts, image_grid, merge_shards, summarize, write_report
from .loss import LossStats, grpo_loss
from .nft import OldWeights, nft_loss
from .parallel import (
    any_process,
    check_launch,
    cpu_launch_kwargs,
    full_tensor,
    is_deepspeed,
    is_fsdp,
    zero_loss,
    zeroed,
)
from .phases import PhaseTimer
from .report import write_before_after, write_curves
from .rollout import Trajectory, evaluate_transitions, rollout, stored_log_probs


class TrainingError(RuntimeError):
    """Training cannot go on (for example too many non-finite losses in a row)."""


@dataclass
class TrainState:
    """What a checkpoint must restore for an exact resume (besides weights and optimizer)."""

    epoch: int = 0  # next epoch to run; also the sliding window's iteration
    global_step: int = 0  # optimizer steps taken
    nonfinite_in_a_row: int = 0
    best_eval: float | None = None
    best_checkpoint: str | None = None  # name of the checkpoint with the best eval reward (never pruned)


def make_window(config: Config) -> SlidingWindow | NoWindow:
    if not OBJECTIVES[config.grpo.objective].stores_transitions:
        return NoWindow()
    w = config.sampler.window
    return SlidingWindow(
        config.sampler.num_steps, w.size, strategy=w.strategy, shift_interval=w.shift_interval, stride=w.stride,
        roll_back=w.roll_back, seed=config.run.seed, max_start=w.max_start, decay_rate=w.decay_rate,
        decay_threshold=w.decay_threshold, end_margin=w.end_margin,
    )  # fmt: skip


def make_optimizer(config: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    t = config.train
    kwargs = {"lr": t.lr, "weight_decay": t.weight_decay, "betas": tuple(t.betas), "eps": t.eps}
    if t.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError("train.optimizer=adamw8bit needs `pip install bitsandbytes`; or use adamw") from None
        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def make_lr_factor(config: Config, total_steps: int) -> Callable[[int], float]:
    """The factor on ``train.lr`` at an optimizer step: diffusers' ``get_scheduler`` multiplier for
    ``train.lr_schedule`` over ``total_steps`` (run.epochs × the steps per epoch). The trainer sets the lr before
    every backward from the epoch and the accumulation cycle within it, so a resumed run, even on another process
    count, continues the schedule with nothing more to checkpoint, and a skipped non-finite step does not shift it."""
    t = config.train
    if t.lr_schedule != "constant" and t.lr_warmup_steps >= total_steps:
        raise ConfigError(f"train.lr_warmup_steps={t.lr_warmup_steps} is not shorter than the run's {total_steps} "
                          "optimizer steps; lower it")  # fmt: skip
    # get_scheduler wants an optimizer; at train.lr because polynomial's end lr (1e-7) is absolute.
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=t.lr)
    scheduler = get_scheduler(t.lr_schedule, probe, num_warmup_steps=t.lr_warmup_steps, num_training_steps=total_steps)
    return scheduler.lr_lambdas[0]


def timestep_loss(
    adapter: PipelineAdapter,
    cfg: Config,
    sub: Trajectory,
    positions: torch.Tensor,
    advantages: torch.Tensor,
    generator: torch.Generator | None = None,  # noqa: ARG001 (deterministic: the objectives share one signature)
) -> tuple[torch.Tensor, LossStats]:
    """One trained timestep of a micro-batch: re-score the stored transitions at ``positions`` ([B] window positions)
    under the current weights, the KL reference forward when β > 0, and the clipped GRPO loss (scalar, to backward)."""
    new = evaluate_transitions(adapter, sub, positions, cfg.sampler, log_prob_reduce=cfg.grpo.log_prob_reduce)
    kl = None
    if cfg.grpo.kl.beta > 0:  # β = 0 skips the reference forward entirely
        with torch.no_grad(), adapter.adapter_disabled():
            ref = evaluate_transitions(adapter, sub, positions, cfg.sampler, log_prob_reduce=cfg.grpo.log_prob_reduce)
        kl = transition_kl(new, ref.mean, cfg.grpo.kl.convention, cfg.grpo.log_prob_reduce)
    old = stored_log_probs(sub, positions).to(new.log_prob.device)
    return grpo_loss(new.log_prob, old, advantages, clip_range=cfg.grpo.clip_range, kl=kl, beta=cfg.grpo.kl.beta)


@dataclass(frozen=True)
class Objective:
    """A ``grpo.objective``: the loss of one term of a micro-batch, and what the rollout stores for it."""

    loss: Callable[..., tuple[torch.Tensor, LossStats]]  # (adapter, cfg, sub, positions, advantages, generator)
    terms: Callable[[Config, Trajectory], int]  # loss terms (backward passes) per micro-batch and pass
    stores_transitions: bool  # the window's steps are SDE and stored; else every step is ODE (make_window)
    # Extra keyword arguments of ``loss`` for one epoch's training, from the trainable parameters before its first
    # update (nft: the old weights).
    epoch_kwargs: Callable[[list[torch.nn.Parameter]], dict[str, Any]] = lambda params: {}


def _old_weights(params: list[torch.nn.Parameter]) -> dict[str, Any]:
    """nft: the weights the epoch sampled with, before its first update."""
    return {"old_weights": OldWeights(params)}


OBJECTIVES: dict[str, Objective] = {
    "clipped": Objective(timestep_loss, lambda cfg, trajectory: trajectory.num_trained_steps, True),
    "awm": Objective(awm_loss, lambda cfg, trajectory: cfg.grpo.awm.timesteps, False),
    "nft": Objective(nft_loss, lambda cfg, trajectory: cfg.grpo.awm.timesteps, False, _old_weights),
}


class GRPOTrainer:
    """Holds the pieces; ``fit()`` runs the loop. Set up everything (and fail) before the first epoch."""

    def __init__(self, config: Config, run_dir: Path | None = None) -> None:
        self.config = config
        # Trackers need a logging directory at construction; it is pointed at the run directory once that exists.
        project = ProjectConfiguration(project_dir=config.run.output_dir, logging_dir=config.run.output_dir)
        self.accelerator = Accelerator(log_with=config.run.trackers or None, project_config=project,
                                       **cpu_launch_kwargs())  # fmt: skip
        acc = self.accelerator
        validate(config, world_size=acc.num_processes)
        check_launch(acc, config)
        self.train_data = PromptDataset.from_file(config.data.train, "data.train")
        self.test_data = PromptDataset.from_file(config.data.test, "data.test") if config.data.test else None
        set_seed(config.run.seed, device_specific=True)
        # Everything that can fail on a bad config runs before the run directory is created.
        self.reward = build_reward(config.rewards, device=acc.device, nan_policy="drop")
        # A reward with a prompt grammar (shapes) refuses a prompt it cannot score now, not mid-epoch.
        self.reward.check_prompts(self.train_data.prompts + (self.test_data.prompts if self.test_data else []))
        datasets = {"data.train": self.train_data, "data.test": self.test_data}
        check_editing(datasets, reward=self.reward)  # a reward comparing edits with their sources needs source images
        set_seed(config.run.seed)  # the LoRA initialisation is the same on every process, whatever the back-end
        self.adapter = build_adapter(config.model, acc.device)
        check_editing(datasets, adapter=self.adapter)  # source images need an editing model
        framed = [e.key for e in self.reward.entries if isinstance(e.reward, FrameReward)]
        if framed and self.adapter.family not in VIDEO_KINDS:  # else refused only at the first score, after sampling
            raise ConfigError(f"rewards.{framed[0]}.frames says how to score video clips, but model.pretrained is a "
                              f"{self.adapter.family} image pipeline: remove the frames option")  # fmt: skip
        if config.grpo.objective == "nft" and (self.deepspeed or self.fsdp):
            raise ConfigError("grpo.objective=nft swaps the old weights into the trainable parameters for a forward, "
                              "written for parameters that are whole tensors on every process (one process, DDP); "
                              "under DeepSpeed or FSDP use grpo.objective: awm")  # fmt: skip
        if config.model.compile:  # in place, before prepare(): rollout, loss and KL reference all run it compiled
            if self.deepspeed or self.fsdp:
                raise ConfigError("model.compile=true runs on one process or under DDP; DeepSpeed and FSDP wrap the "
                                  "transformer themselves: set model.compile: false")  # fmt: skip
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
        acc.print(f"{steps_per_epoch} optimizer steps per epoch at {acc.num_processes} "
                  f"process(es) (gradient accumulation {self.accumulation}"
                  + ("" if t.updates_per_epoch else "; set train.updates_per_epoch to keep it whatever the count")
                  + ")")  # fmt: skip
        self.objective = OBJECTIVES[config.grpo.objective]
        self.window = make_window(config)
        self.phases = PhaseTimer()  # wall time of each loop phase (time/... metrics, scripts/bench.py epoch)
        self.state = TrainState()
        run = config.run
        warn = lambda message: acc.print(f"warning: {message}")  # noqa: E731
        resume = resolve_resume(run.resume, run.output_dir, run.name, warn=warn) if run.resume else None
        if resume is not None:  # before anything is written: the weights must mean what the config says
            check_model_matches(resume, config)
        self.run_dir = self._make_run_dir(resume.parent.parent if resume is not None else run_dir)
        if resume is not None:
            changes = recipe_changes(resume, config)
            if changes:
                warn(f"resuming with settings that differ from the checkpoint's: {'; '.join(changes)}")
            load_checkpoint(self, resume)
            acc.print(f"resumed from {resume} at epoch {self.state.epoch}")
            stamp = time.strftime("%Y%m%d-%H%M%S")
            if acc.is_main_process:
                moved = set_aside_later(self.run_dir, self.state.epoch, stamp)
                if moved is not None:
                    print(f"the run's output after {resume.name} moved to {moved}")
            self._on_main(lambda: write_run_config(self.run_dir, config, stamp))  # config.yaml stays the first's
        self.stop = StopRequest()
        self.checkpointed_epoch = self.state.epoch if resume is not None else None  # the newest checkpoint's epoch
        # Rollout noise: one generator per process, seeded by (seed, rank) and re-seeded every epoch.
        self.generator = torch.Generator(device="cpu")
        if acc.is_main_process and config.run.progress:
            print("resolved config:\n  " + config.to_yaml().rstrip().replace("\n", "\n  "))
        acc.project_configuration.project_dir = acc.project_configuration.logging_dir = str(self.run_dir)
        # A resume tells TensorBoard to drop the earlier attempt's points from the resumed epoch on (as metrics.jsonl).
        purge = {"tensorboard": {"purge_step": self.state.epoch}} if resume is not None else {}
        acc.init_trackers(config.run.name, config=_flat(config.to_dict()), init_kwargs=purge)

    # ------------------------------------------------------------------ setup helpers
    def _make_run_dir(self, run_dir: Path | None) -> Path:
        """The run directory, locked by rank 0 while this trainer trains (a second trainer on it stops with a
        CheckpointError). A new one is created atomically with its config.yaml, and removed again if that fails
        (a full disk leaves no empty run behind). Every process gets the same path, or the same error."""
        acc, run = self.accelerator, self.config.run
        self.run_lock: RunLock | None = None
        path: Path | None = run_dir

        def create_and_lock() -> None:
            nonlocal path
            created = path is None
            path = create_run_dir(run.output_dir, run.name) if created else Path(path)
            try:
                path.mkdir(parents=True, exist_ok=True)  # an explicit run_dir may not exist yet
                self.run_lock = RunLock(path)
                self.run_lock.acquire()
                if created:
                    write_run_config(path, self.config)
            except (CheckpointError, OSError) as err:
                if self.run_lock is not None:
                    self.run_lock.release()
                if created:
                    shutil.rmtree(path, ignore_errors=True)
                raise err if isinstance(err, CheckpointError) else CheckpointError(f"{path}: {err}") from err

        self._on_main(create_and_lock)
        holder = [str(path) if path is not None else None]
        if acc.num_processes > 1:
            broadcast_object_list(holder)
        return Path(holder[0])

    def _on_main(self, work: Callable[[], Any]) -> None:
        """Run ``work`` on rank 0; if it raises, every process raises (none is left waiting in a collective)."""
        failure: CheckpointError | None = None
        if self.accelerator.is_main_process:
            try:
                work()
            except CheckpointError as err:
                failure = err
        if any_process(self.accelerator, failure is not None):
            raise failure or CheckpointError("rank 0 could not set up the run directory (its error says why)")

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
        cfg, acc = self.config, self.accelerator
        bar = tqdm(range(self.state.epoch, cfg.run.epochs), desc="epochs", initial=self.state.epoch,
                   total=cfg.run.epochs, disable=not (cfg.run.progress and acc.is_main_process))  # fmt: skip
        every, save_every = cfg.eval.every, cfg.checkpoint.every
        if self.run_lock is not None:
            self.run_lock.acquire()  # again, if an earlier fit() of this trainer released it
        if every and self.state.epoch == 0:
            self._log({"epoch": 0, **self.run_eval(0)}, 0)
        with _stop_on_signals(self):
            for epoch in bar:
                self.phases.mark("epoch")
                epoch_rng = rng_state()
                # A signal during the last checkpoint (or before the first epoch): stop before sampling.
                metrics = None if self._agree_to_stop() else self.run_epoch(epoch)
                if metrics is None:  # stopped before training: nothing of this epoch is kept, a resume redoes it
                    if self.checkpointed_epoch != epoch:
                        path = save_checkpoint(self, epoch, rng=epoch_rng)
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
                self._log(metrics, epoch)
                bar.set_postfix(reward=f"{metrics['reward/total/mean']:.4f}")
                done = epoch + 1 == cfg.run.epochs
                stopping = self._agree_to_stop()  # a signal may have reached only some processes since the last step
                if stopping or done or new_best or (save_every and (epoch + 1) % save_every == 0):
                    with self.phases("checkpoint"):
                        path = save_checkpoint(self, epoch + 1)
                    self.checkpointed_epoch = epoch + 1
                    acc.print(f"checkpoint: {path}")
                if stopping:
                    acc.print("stop requested (signal): checkpoint written, exiting")
                    break
        self.phases.mark("end")
        self._finish()
        if self.run_lock is not None:
            self.run_lock.release()  # the run may be resumed now (also by another trainer in this process)
        return self.state

    def run_epoch(self, epoch: int) -> dict[str, float] | None:
        """Sample, score, compute advantages and train one epoch; its metrics, or None when a stop signal was
        agreed during sampling (the epoch is then abandoned before any update)."""
        cfg, acc = self.config, self.accelerator
        timings: dict[str, float] = {}
        window = self.window.steps(epoch)

        # ================================ SAMPLING ================================
        start = time.perf_counter()
        # A fresh prompt cache each epoch bounds its memory (real prompt sets are large) and makes the text
        # embeddings a function of the epoch alone (a batch's composition moves them by ~1e-7): exact resume.
        self.adapter.clear_prompt_cache()
        self.generator.manual_seed(cfg.run.seed * 1_000_003 + epoch * 1_009 + self.rank)
        plan = rank_slice(
            epoch_plan(len(self.train_data), cfg.grpo.group_size, cfg.grpo.groups_per_epoch, seed=cfg.run.seed,
                       epoch=epoch),
            self.rank, acc.num_processes,
        )  # fmt: skip
        scorer = AsyncReward(self.reward, max_pending=2)
        parts: list[Trajectory] = []
        self.adapter.transformer.eval()
        batches = [plan[i : i + cfg.sampler.batch_size] for i in range(0, len(plan), cfg.sampler.batch_size)]
        starts: list[int] = []  # each batch's window start, for the metrics
        for index, batch in enumerate(tqdm(batches, desc=f"sampling e{epoch}", leave=False, disable=not self._bars)):
            prompts = [self.train_data.prompts[s.prompt_index] for s in batch]
            metadata = [dict(self.train_data.metadata[s.prompt_index]) for s in batch]
            sources = self.train_data.sources_of([s.prompt_index for s in batch])  # image editing, else None
            # Flow-GRPO-Fast: a new random window for every batch, a function of (seed, epoch, global batch index).
            batch_window = (self.window.steps(epoch, batch=self.rank * len(batches) + index)
                            if cfg.sampler.window.per_batch else window)  # fmt: skip
            starts.append(batch_window.start if batch_window else -1)
            traj = rollout(
                self.adapter, prompts, [s.group_id for s in batch], cfg.sampler, batch_window, self.generator,
                height=cfg.model.resolution, width=cfg.model.resolution, log_prob_reduce=cfg.grpo.log_prob_reduce,
                metadata=metadata, noise_seed=cfg.run.seed, sources=sources,
            )  # fmt: skip
            # scored while the next batch samples; editing rewards also see each sample's source image
            scorer.submit(traj.images, prompts, metadata, source_images=traj.source_images)
            traj.images = traj.images.cpu()  # kept for image grids only: free the device memory
            parts.append(traj)
            if self._agree_to_stop():  # every process has the same number of batches (validated)
                scorer.close()
                return None
        trajectory = Trajectory.cat(parts)
        window_start = sum(starts) / len(starts) if cfg.sampler.window.per_batch else starts[0]  # mean of the batches'
        timings["time/sampling"] = self.phases.add("sampling", start)
        start = time.perf_counter()
        with scorer:
            local_scores = _cat_scores(scorer.results())
        timings["time/reward_wait"] = self.phases.add("reward_wait", start)

        if cfg.run.image_grid_every and epoch % cfg.run.image_grid_every == 0 and acc.is_main_process:
            self._save_sample_grid(trajectory, local_scores["total"], epoch)

        # ================================ ADVANTAGES ================================
        start = time.perf_counter()
        keys = sorted(local_scores)
        gathered = {k: acc.gather(local_scores[k].to(acc.device)).cpu() for k in keys}
        all_group_ids = acc.gather(trajectory.group_ids.to(acc.device)).cpu()
        keep, dropped = apply_nan_policy(gathered, all_group_ids, cfg.grpo.nan_policy, keys=list(self.reward.weights))
        # Dropped groups (non-finite rewards) get advantage 0 and take no part in the statistics of the others.
        advantages_all = torch.zeros(len(all_group_ids))
        if keep.any():
            advantages_all[keep] = compute_advantages(
                {k: v[keep] for k, v in gathered.items()}, self.reward.weights, all_group_ids[keep],
                std=cfg.grpo.advantage.std, clip=cfg.grpo.advantage.clip, per_reward=cfg.grpo.advantage.per_reward,
                normalize_weights=cfg.grpo.advantage.normalize_weights, eps=cfg.grpo.advantage.std_eps,
            )  # fmt: skip
        n_local = len(trajectory)
        # gather() concatenates in process order, so this process's rows are one contiguous block.
        advantages = advantages_all[self.rank * n_local : (self.rank + 1) * n_local]
        if cfg.run.debug_dump:
            self._dump(f"epoch{epoch}", group_ids=trajectory.group_ids, local_total=local_scores["total"],
                       all_total=gathered["total"], all_group_ids=all_group_ids, advantages=advantages,
                       advantages_all=advantages_all)  # fmt: skip
        self.phases.add("advantages", start)

        # ================================ TRAINING ================================
        start = time.perf_counter()
        stats = self.train_on(trajectory, advantages, epoch)
        timings["time/training"] = self.phases.add("training", start)

        metrics: dict[str, float] = {"epoch": epoch, "global_step": self.state.global_step,
                                     "window/start": window_start, "window/size": len(window),
                                     "reward/dropped_groups": dropped}  # fmt: skip
        for k, v in gathered.items():
            finite = v[torch.isfinite(v)]
            metrics[f"reward/{k}/mean"] = finite.mean().item() if len(finite) else math.nan
            metrics[f"reward/{k}/std"] = finite.std().item() if len(finite) > 1 else 0.0
        metrics.update({"advantage/mean": advantages_all.mean().item(), "advantage/std": advantages_all.std().item(),
                        "advantage/abs_mean": advantages_all.abs().mean().item()})  # fmt: skip
        metrics.update(stats)
        metrics.update(timings)
        metrics["images_per_s"] = len(all_group_ids) / max(timings["time/sampling"] + timings["time/reward_wait"], 1e-9)
        return metrics

    def train_on(self, trajectory: Trajectory, advantages: torch.Tensor, epoch: int) -> dict[str, float]:
        """Inner epochs over this process's samples: micro-batches × trained timesteps, backward per timestep."""
        cfg, acc = self.config, self.accelerator
        model = self.adapter.transformer
        model.train()
        n, steps = len(trajectory), self.objective.terms(cfg, trajectory)
        if steps == 0:
            return {}
        shuffle = torch.Generator().manual_seed(cfg.run.seed * 7_919 + epoch * 31 + self.rank)
        epoch_kwargs = self.objective.epoch_kwargs(self.params)
        num_micro = n // cfg.train.batch_size  # the same on every process (validated), also when samples are dropped
        samples = (kept_samples(advantages, num_micro, shuffle) if cfg.grpo.drop_zero_advantage
                   else torch.arange(n))  # fmt: skip
        trained = trained_count(steps, cfg.grpo.timestep_fraction)
        per_update = trained * self.accumulation  # backward passes per optimizer step
        sums: dict[str, list[float]] = defaultdict(list)
        sums["trained_samples"].append(float(len(samples)))
        backwards = updates = 0
        for _ in range(cfg.train.inner_epochs):
            batches = micro_batches(samples, num_micro, shuffle)
            for mb in tqdm(batches, desc=f"training e{epoch}", leave=False, disable=not self._bars):
                sub, adv = trajectory.select(mb), advantages[mb].to(acc.device)
                positions = trained_positions(len(mb), steps, shuffle, shuffle=cfg.grpo.shuffle_timesteps,
                                              fraction=cfg.grpo.timestep_fraction)  # fmt: skip
                for j in range(trained):
                    # Before the backward: DeepSpeed steps inside the one that ends a cycle.
                    step = epoch * self.steps_per_epoch + backwards // per_update
                    for group in self.optimizer.param_groups:
                        group["lr"] = cfg.train.lr * self.lr_factor(step)
                    backwards += 1
                    sync = backwards % per_update == 0
                    acc.sync_gradients = sync  # DeepSpeed reduces and steps inside the backward that ends a cycle
                    # DDP decides in the forward whether the backward all-reduces, so both run inside no_sync.
                    ctx = contextlib.nullcontext() if sync or acc.num_processes == 1 else acc.no_sync(model)
                    with ctx:
                        loss, stats = self.objective.loss(self.adapter, cfg, sub, positions[:, j], adv, shuffle,
                                                          **epoch_kwargs)  # fmt: skip
                        finite = self._all_finite(loss)
                        if finite:
                            acc.backward(loss / per_update)
                        elif sync and self.deepspeed:
                            # The engine's cycle must still end (and step) on every rank: this micro-step adds
                            # nothing, the update goes ahead with the cycle's finite micro-steps.
                            acc.backward(zero_loss(self.params))
                        elif sync:
                            # DDP / FSDP: the cycle's gradient reduction still runs (the forward has armed it), on a
                            # loss zeroed through its own graph; the update is dropped below.
                            acc.backward(zeroed(loss))
                    if finite:
                        self.state.nonfinite_in_a_row = 0
                        for k, v in stats._asdict().items():
                            sums[k].append(v.item())
                        if updates == 0:  # still on-policy: the ratio must be exactly 1
                            sums["onpolicy_ratio_dev"].append(
                                max(stats.ratio_max.item() - 1.0, 1.0 - stats.ratio_min.item()))
                    else:
                        self._skip_nonfinite()
                    if not sync:
                        continue
                    if finite or self.deepspeed:
                        # DeepSpeed has already clipped and stepped (in the backward) and reports its norm here.
                        grad_norm = float(acc.clip_grad_norm_(self.params, cfg.train.max_grad_norm))
                        # A finite loss can still overflow in its backward. The norm is taken after the reduction,
                        # so every process drops the update alike (clipping would have turned the inf into NaN).
                        # (fp16's gradient scaler skips such steps in step() and lowers its scale: leave it to it.)
                        skip = not self.deepspeed and acc.scaler is None and not math.isfinite(grad_norm)
                        if not skip:
                            self.optimizer.step()
                        if skip or self.optimizer.step_was_skipped:  # (DeepSpeed skips non-finite ones itself)
                            self._skip_nonfinite("gradients")
                        else:
                            sums["grad_norm"].append(grad_norm)
                            self.state.global_step += 1
                            updates += 1
                    # else (DDP, FSDP): every process drops this cycle's gradients alike.
                    self.optimizer.zero_grad(set_to_none=True)
                    if self._agree_to_stop():
                        if self.ema is not None and j == trained - 1:  # the micro-batch is complete: as below
                            self.ema.step(self.params, self.state.global_step)
                        model.eval()
                        return self._summarize(sums)
                if self.ema is not None:  # after every micro-batch, with the optimizer step count (as Flow-GRPO)
                    self.ema.step(self.params, self.state.global_step)
        model.eval()
        return self._summarize(sums)

    def _summarize(self, sums: dict[str, list[float]]) -> dict[str, float]:
        out = {f"train/{k}": sum(v) / len(v) for k, v in sums.items() if v}
        for k, pick in (("ratio_min", min), ("ratio_max", max), ("onpolicy_ratio_dev", max)):
            if sums.get(k):
                out[f"train/{k}"] = pick(sums[k])
        out["train/lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def _all_finite(self, loss: torch.Tensor) -> bool:
        """Whether the loss is finite on every process (all skip a step together, or none does)."""
        return not any_process(self.accelerator, not bool(torch.isfinite(loss.detach())))

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
                self.adapter, self.test_data, self.reward, cfg.eval, resolution=cfg.model.resolution,
                seed=cfg.run.seed, progress=self._bars, shard=(self.rank, acc.num_processes), equal_batches=self.fsdp,
                image_prompts=shown,
            )  # fmt: skip
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
                shown = {k: metrics[k] for k in ("reward/total/mean", "eval/total", "train/loss", "train/ratio_mean",
                                                 "train/clip_fraction", "train/kl", "train/grad_norm") if k in metrics}
                # a verifier's held-out accuracies (e.g. eval/shapes/accuracy/exact), without the per-tag ones
                shown.update({k: v for k, v in metrics.items() if k.startswith("eval/") and "/accuracy/" in k
                              and "/tag/" not in k})  # fmt: skip
                acc.print(f"epoch {epoch}: " + " ".join(f"{k}={v:.4g}" for k, v in shown.items()))  # fmt: skip

    def _save_sample_grid(self, trajectory: Trajectory, totals: torch.Tensor, epoch: int) -> None:
        """This process's sampled images, one row per group, captioned with group id and reward."""
        order = torch.argsort(trajectory.group_ids, stable=True)
        captions = [f"g{int(trajectory.group_ids[i])} {float(totals[i]):.3g}" for i in order]
        folder = self.run_dir / "samples"
        folder.mkdir(exist_ok=True)
        image_grid(trajectory.images[order].cpu(), captions, columns=self.config.grpo.group_size).save(
            folder / f"epoch{epoch:05d}.png")  # fmt: skip

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
            self._dump("final", **{f"p{i}": p for i, p in enumerate(self.params)},
                       **{f"ema{i}": s for i, s in enumerate(shadow)})  # fmt: skip
        acc.wait_for_everyone()
        acc.end_training()


class StopRequest:
    """A pre-emption request. Signal handlers set it at any instant, also while this process waits inside a
    collective; the processes agree on it only at step boundaries, and once agreed it stays set.

    A signal that lands during an agreement's all-gather counts at the next one: read once before the gather,
    never overwritten by its result (overwriting lost the request when every process got it mid-gather).
    """

    #: a second SIGINT at least this long after the first stops at once (a person pressing Ctrl-C again);
    #: quicker repeats are the same request delivered twice (the terminal and then the launcher).
    interrupt_again_after_s = 2.0

    def __init__(self) -> None:
        self.first_signal_at: float | None = None
        self.agreed = False

    @property
    def received(self) -> bool:
        return self.first_signal_at is not None

    def on_signal(self, signum: int) -> bool:
        """Record a signal; True when it asks to stop now rather than after the current step."""
        now = time.monotonic()
        if self.first_signal_at is None:
            self.first_signal_at = now
            return False
        # SIGTERM never escalates: schedulers and launchers may each deliver it, and they SIGKILL after a grace.
        return signum == signal.SIGINT and now - self.first_signal_at >= self.interrupt_again_after_s

    def agree(self, any_process: Callable[[bool], bool]) -> bool:
        """Whether any process has received a signal (``any_process``: a collective); the same answer everywhere."""
        self.agreed = self.agreed or any_process(self.received)
        return self.agreed


@contextlib.contextmanager
def _stop_on_signals(trainer: GRPOTrainer):
    """SIGTERM / SIGINT: finish the current optimizer step, checkpoint, exit cleanly (pre-emption)."""

    def request_stop(signum, frame):  # noqa: ARG001
        # No printing here: a handler that runs inside print() would make a reentrant call on stdout.
        if trainer.stop.on_signal(signum):
            raise KeyboardInterrupt

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, request_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
