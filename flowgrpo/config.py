"""Experiment configuration: typed sections, YAML presets, ``a.b=c`` overrides, validation before any work.

Every field is documented once, here. A config file holds only the fields it changes; the rest take
the defaults below. Errors are :class:`ConfigError` (the scripts print them and exit with code 2)
naming the key, the value and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from samplers import DIFFUSIONS, KL_CONVENTIONS, LOG_PROBS, SDE_KINDS, SOLVERS, STRATEGIES

from .adapters.registry import (
    FAMILY_OPTIONS,
    FamilyNames,
    available_families,
    families_with_option,
    family_option_error,
)
from .advantages import available_advantage_estimators, estimator_sections, validate_estimator
from .advantages.diversity import DiversityConfig, check_diversity
from .checks import ConfigError, check_num_frames, check_range, check_true_cfg, one_of
from .objectives import get_objective, objective_sections
from .objectives.base import check_whole_groups
from .objectives.forward import ForwardProcessConfig
from .objectives.kl import KLGateConfig, check_kl
from .rollouts import get_rollout, rollout_sections, validate_rollout


@dataclass
class RunConfig:
    """``run:`` where and how a run is recorded."""

    name: str = "flowgrpo"
    output_dir: str = "runs"  # each run gets output_dir/<name>-<time>/ (never overwritten)
    seed: int = 42
    epochs: int = 100  # sampling + training rounds
    max_minutes: float = 0.0  # time budget of a training attempt (0: none): the run ends, checkpointed, after the
    #                           epoch during which it ran out (equal-time method comparisons), on budget_clock
    budget_clock: str = "wall"  # wall: wall-clock | cpu: this process's CPU time over all its threads (time/cpu):
    #                             on one thread (OMP_NUM_THREADS=1) the wall-clock of an idle core, and unmoved by
    #                             other jobs sharing the machine (scripts/compare_methods.py uses it)
    resume: str | None = None  # a checkpoint directory, a run directory, or "latest" (newest run of this name)
    log_every: int = 1  # epochs between console log lines
    trackers: list[str] = field(default_factory=list)  # accelerate trackers: "tensorboard", "wandb"
    image_grid_every: int = 0  # epochs between image grids of sampled groups (0: never)
    progress: bool = True  # progress bars on rank 0
    max_nonfinite_steps: int = 5  # stop after this many NaN/inf losses (one per trained timestep) or gradients in a row
    max_empty_epochs: int = 3  # stop after this many epochs in a row in which grpo.nan_policy=drop dropped every
    #                            group (a judge that never answers): such an epoch takes no optimizer step
    debug_dump: bool = False  # per-rank dumps of groups/rewards/advantages and final adapter weights (tests)


@dataclass
class LoraSettings:
    """``model.lora:`` peft LoRA on the transformer."""

    rank: int = 32
    alpha: float = 64
    target_modules: str | list[str] = "default"  # "default": the family's attention (+FFN for FLUX) layers
    init: str | bool = "gaussian"  # peft init_lora_weights: true (zero B), "gaussian", "pissa", ...
    dropout: float = 0.0


@dataclass
class ModelConfig:
    """``model:`` the pipeline to fine-tune."""

    pretrained: str = "tiny-sd3"  # hub id, local diffusers directory, or "tiny-sd3" / "tiny-flux" / ... (offline)
    kind: str = "auto"  # sd3 | flux | flux-kontext | qwenimage | qwenimage-edit | wan | auto (from model_index.json);
    # flux-kontext and qwenimage-edit edit images (prompt files with an "image" per row), wan makes video
    dtype: str = "fp32"  # weights: bf16 | fp16 | fp32 (sampler maths always fp32; LoRA weights fp32)
    vae_fp32: bool = False  # keep the VAE in float32 whatever model.dtype (fp16 VAEs can overflow)
    resolution: int = 512  # square images, pixels: height = width = resolution (unless model.height / width are set)
    height: int | None = None  # non-square images, pixels (with model.width: both or neither; they replace
    width: int | None = None  # model.resolution), e.g. Flow-GRPO's Wan 240 × 416. null: model.resolution
    lora: LoraSettings = field(default_factory=LoraSettings)
    attention: str = "sdpa"  # sdpa | xformers (CUDA only)
    gradient_checkpointing: bool = False
    compile: bool = False  # torch.compile the transformer (in place): rollout, re-evaluation and KL reference forwards
    #                        all run compiled, so the on-policy ratio stays exactly 1. Costs a compile per graph (grad
    #                        mode × train/eval × adapter on/off) in the first epoch: seconds on a GPU, minutes on a CPU.
    #                        Single process and DDP; not with DeepSpeed or FSDP (they wrap the module themselves)
    negative_prompt: str = ""  # for CFG (SD3; Qwen-Image's true CFG, where Flow-GRPO uses " "; FLUX's true CFG)
    true_cfg_scale: float = 1.0  # flux / flux-kontext / hunyuanvideo: the pipeline's true_cfg_scale. 1: off (presets;
    #                              FLUX.1-dev is guidance-distilled: its guidance, sampler / eval.guidance_scale, is
    #                              an input of the network). Above 1: every forward (rollout, re-scoring, evaluation)
    #                              adds one on model.negative_prompt (then required), neg + s·(cond − neg), as
    #                              pipe(true_cfg_scale=s, negative_prompt=...)
    max_sequence_length: int | None = None  # T5 / Qwen2.5-VL tokens (null: the family's default, SD3 256, FLUX and
    #                                         Qwen-Image 512; shapes-sd3: 16)
    num_frames: int | None = None  # video models (wan, wan-i2v, hunyuanvideo, ltx2) only: frames per clip, 4k + 1
    #                                (the video VAE keeps the first frame and packs every 4 after it into one latent
    #                                frame); null: the pipeline's default (Wan 81, HunyuanVideo 129). Images: null
    source_area: int = 1024 * 1024  # qwenimage-edit(-plus) only: the source image is sized to about this many pixels
    #                                 at its aspect ratio, calculate_dimensions(source_area, W / H), for the Qwen2.5-VL
    #                                 and the VAE alike: QwenImageEditPipeline's 1024² (as Flow-GRPO); Edit-Plus: for
    #                                 the VAE only (its VAE_IMAGE_SIZE; Qwen2.5-VL reads 384², as pipe()). Tiny: 1024
    guidance_scale_2: float | None = None  # wan / wan-i2v with Wan2.2's two experts only: the CFG scale of the
    #                                        low-noise expert's steps (transformer_2), pipe(guidance_scale_2=...);
    #                                        null: the sampler's / evaluation's guidance_scale, as pipe()
    lora_experts: str = "both"  # wan / wan-i2v with Wan2.2's two experts only: both | high_noise (transformer) |
    #                             low_noise (transformer_2) get LoRA; the other's steps then train nothing

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)`` of the generated images in pixels, height first as ``pipe(height=, width=)``:
        ``model.height`` / ``model.width`` when set, else ``model.resolution`` twice."""
        if self.height is None or self.width is None:
            return self.resolution, self.resolution
        return self.height, self.width

    @property
    def size_keys(self) -> str:
        """The keys that set :attr:`size` and their values, for messages: ``model.height=240, model.width=416``, or
        ``model.resolution=512``."""
        if self.height is None or self.width is None:
            return f"model.resolution={self.resolution}"
        return f"model.height={self.height}, model.width={self.width}"


@dataclass
class WindowConfig:
    """``sampler.window:`` which steps are SDE (and, for a per-step objective, trained); see samplers.SlidingWindow."""

    size: int = 0  # 0: every step but the last (Flow-GRPO); MixGRPO: 4
    strategy: str = "progressive"  # progressive | random | decay | exp_decay
    shift_interval: int = 25  # training iterations (epochs) per window position
    stride: int = 1
    roll_back: bool = False
    max_start: int | None = None  # random: largest start (Flow-GRPO-Fast: about num_steps / 2)
    decay_rate: float = 0.1
    decay_threshold: int = 0
    per_batch: bool = False  # random only: a new window per rollout batch (Flow-GRPO-Fast); false: one per epoch
    end_margin: int = 1  # final steps no window reaches: 1 = only the last (default); 2 = MixGRPO's code (skips T-2)


@dataclass
class PostWindowConfig:
    """``sampler.post_window:`` how the steps after the window are integrated (MixGRPO-Flash)."""

    solver: str = "euler"  # euler | dpmpp_2m
    ratio: float = 1.0  # fraction of the tail's steps kept (Flash: 0.4 with dpmpp_2m)
    carry_history: bool = False  # dpmpp_2m: its first step is 2nd order from the last window step's x0 (MixGRPO-Flash)


@dataclass
class BranchConfig:
    """``sampler.branch:`` where the branch rollout's groups branch (``sampler.rollout: branch``, TempFlow-GRPO;
    flowgrpo/rollouts/branch.py). A group follows the ODE, takes one SDE step at its branch point, then the ODE."""

    steps: list[int] | None = None  # schedule steps a group may branch at; null: every step but the last,
    #                                 0..num_steps-2 (the reference); a step listed twice is chosen twice as often
    schedule: str = "sweep"  # sweep: group id g branches at steps[g mod len(steps)], every point equally often (the
    #                          reference branches every trunk at every step) | random: a uniform draw per group,
    #                          a function of (run.seed, group id)


@dataclass
class SamplerConfig:
    """``sampler:`` how images are sampled during training.

    kind: euler_maruyama (Flow-GRPO / DanceGRPO) | cps (coefficients-preserving) | langevin (LC-GRPO).
    diffusion: flowgrpo (g = a·sqrt(t/(1-t))) | dance (g = a) | flowgrpo_wan (g = a·σ₁·t, σ₁ the schedule's second
        sigma: Flow-GRPO's Wan2.1 script with a = 1), for euler_maruyama and langevin.
    score_eval: langevin only: frozen (1 network call per step) | reeval (2 calls, true corrector).
    noise_level: a (Flow-GRPO SD3 0.7, FLUX 0.9; DanceGRPO 0.3); 0 gives the deterministic ODE.
    time_shift: s sets sigmas = s·t / (1 + (s - 1)·t) on t = linspace(1, 0, T + 1) for every resolution, and feeds
        the network int(1000·sigma), as MixGRPO / DanceGRPO (--shift 3 on FLUX); evaluation always samples with the
        pipeline's own schedule, as pipe() does.
    last_step: sde samples the final step (t_next = 0) with the SDE too, as Flow-GRPO's train_sd3.py / train_flux.py;
        its log-prob is discarded and it is never trained. Only euler_maruyama adds noise there: cps and langevin
        steps into t_next = 0 are deterministic (std 0), i.e. the ODE step.
    """

    rollout: str = "chain"  # how an epoch's samples are produced (flowgrpo.rollouts): chain = one chain per image |
    #                         branch = a group's ODE trunk branched by one SDE step (TempFlow-GRPO, sampler.branch) |
    #                         iso_temporal (Flash-GRPO) | tree (BranchGRPO, sampler.tree) | entropy_merge (E-GRPO,
    #                         sampler.entropy_merge) | dense (TP-GRPO, VGPO: sampler.dense) | offline (groups
    #                         sampled once and served from a store, sampler.offline: GDRO) | any registered one
    kind: str = "euler_maruyama"
    diffusion: str = "flowgrpo"
    score_eval: str = "frozen"
    noise_level: float = 0.7
    num_steps: int = 10
    guidance_scale: float = 4.5  # CFG scale (SD3), guidance embedding (FLUX) or true_cfg_scale (Qwen-Image)
    kappa: float = 0.95  # langevin: step std capped at kappa · t_next
    batch_size: int = 8  # images per rollout batch, per process
    window: WindowConfig = field(default_factory=WindowConfig)
    post_window: PostWindowConfig = field(default_factory=PostWindowConfig)
    branch: BranchConfig = field(default_factory=BranchConfig)  # sampler.rollout: branch only
    same_initial_noise: bool = False  # every image of a group starts from the same noise
    shared_prefix: bool = True  # only active with same_initial_noise and a window starting at step k > 0: the k ODE
    #                             steps before the window, identical for a group's images (same prompt, same noise),
    #                             run once per group of the rollout batch (batched over its groups) and fan out to
    #                             the images at the window; results equal per-image sampling to float tolerance. A
    #                             group spread over rollout batches or processes computes its prefix once in each
    #                             batch, for its own rows. false: every image computes its own prefix (benchmarks)
    time_shift: float | None = None  # null: pipeline's schedule (as pipe() and eval); s: MixGRPO/DanceGRPO FLUX (3)
    last_step: str = "ode"  # ode | sde: untrained final step with noise too (Flow-GRPO train_sd3/flux.py; others ode)
    log_prob: str = "exact"  # exact (Gaussian density) | squared_error (cps only: Flow-GRPO(-Fast)'s -(x'-mean)²)
    antithetic: bool = False  # mirrored window noise: a group's images of a rollout batch pair up (1st-2nd, 3rd-4th,
    #                           ...) and a pair's second takes minus its first's noise at every window step (antithetic
    #                           variates); with same_initial_noise a pair's first steps are mirror images, so the
    #                           per-step policy gradient of a pair whose rewards tie cancels. chain / dense rollouts

    def __post_init__(self) -> None:
        _add_plugin_sections(self)  # sampler.<rollout>: the registered strategies' settings


@dataclass
class DataConfig:
    """``data:`` prompt files: .txt (one prompt a line) or .jsonl ({"prompt": ..., other keys -> metadata})."""

    train: str = "prompts/train.txt"
    test: str | None = None


@dataclass
class AdvantageConfig:
    """``grpo.advantage:`` which estimator turns the epoch's rewards into advantages (flowgrpo.advantages), and its
    settings. The built-in group estimators compute A = (R - mean_group) / (std + std_eps), clipped to ±clip;
    ``centered`` leaves out the std (A = R - mean_group, clipped to ±clip in the rewards' units)."""

    estimator: str = "group"  # group: unbiased std of the group (DanceGRPO, MixGRPO) | global_std: population std of
    #                           all the epoch's rewards (np.std, Flow-GRPO's global_std=True) | per_reward: advantages
    #                           per reward, summed with the reward weights (MixGRPO) | centered: R - group mean, no
    #                           std (Dr. GRPO; GDRO's reward softmax) | any registered estimator
    clip: float = 5.0  # > 0: advantages are clipped to ±clip
    normalize_weights: bool = False  # per_reward: weights divided by their sum first (MixGRPO); else summed as given
    std_eps: float = 1.0e-4  # A = (R - mean) / (std + std_eps): Flow-GRPO 1e-4, DanceGRPO / MixGRPO 1e-8
    diversity: DiversityConfig = field(default_factory=DiversityConfig)  # GARDO: positive advantages × the image's
    #                                   distance to its group's nearest other image over the group's mean of it

    def __post_init__(self) -> None:
        _add_plugin_sections(self)  # grpo.advantage.<estimator>: the registered estimators' settings


@dataclass
class KLConfig:
    """``grpo.kl:`` KL to the reference model, the adapter-disabled one (objectives awm, nft, fpo: mean squared velocity
    difference); GARDO's gate and reset of the reference (flowgrpo.objectives.kl, flowgrpo.objectives.reference)."""

    beta: float = 0.0  # 0 skips the reference forward entirely
    convention: str = "flowgrpo"  # exact | flowgrpo (std without sqrt(Δ), as Flow-GRPO's published β); clipped only
    gate: KLGateConfig = field(default_factory=KLGateConfig)  # GARDO: the KL only on the most uncertain samples
    reset_every: int = 0  # GARDO: every N epochs the reference becomes the current LoRA weights (0: never; GARDO 16)


@dataclass
class GRPOConfig:
    """``grpo:`` groups, advantages and the objective. Each registered objective with settings adds its section,
    ``grpo.<name>`` (``grpo.awm``, ``grpo.nft``: see flowgrpo.objectives), built from its ``config_class``."""

    group_size: int = 24  # images per prompt (k)
    groups_per_epoch: int = 48  # prompts per epoch, over all processes
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    clip_range: float = 1.0e-4  # ε of the ratio clip (mean-reduced log-probs, Flow-GRPO scale)
    kl: KLConfig = field(default_factory=KLConfig)
    log_prob_reduce: str = "mean"  # mean | sum over latent elements
    shuffle_timesteps: bool = True  # each sample visits its trained steps in a random order
    timestep_fraction: float = 1.0  # each sample trains int(fraction × window) of its steps: a random subset with
    #                                 shuffle_timesteps, else the first ones (DanceGRPO 0.6, shuffled)
    drop_zero_advantage: bool = False  # Flow-GRPO: samples with advantage exactly 0 are not trained; the epoch keeps
    #                                    its number of micro-batches, which shrink (zero-advantage fill-ins pad the
    #                                    kept count to a multiple of it)
    nan_policy: str = "error"  # non-finite rewards: error | drop (the affected groups get advantage 0)
    objective: str = "clipped"  # clipped: the ratio of the stored SDE steps' log-probs (Flow-GRPO eq. 8) | awm: the
    #                             flow-matching loss on each final sample, weighted by its advantage (ODE rollouts at
    #                             sampler.noise_level 0; > 0: the window's steps SDE, not kept) | nft: DiffusionNFT's
    #                             negative-aware loss on the same noised samples | fpo: FPO's clipped ratio of
    #                             flow-matching losses (an ELBO ratio) on them | any registered objective
    #                             (flowgrpo.objectives)

    def __post_init__(self) -> None:
        _add_plugin_sections(self)  # grpo.<objective>: the registered objectives' settings


@dataclass
class TrainConfig:
    """``train:`` optimisation. One optimizer step per ``batch_size × accumulation`` samples × trained steps."""

    batch_size: int = 8  # samples per training micro-batch, per process
    gradient_accumulation: int = 1  # micro-batches per optimizer step (each contributes all its timesteps)
    updates_per_epoch: int | None = None  # optimizer steps per inner epoch, whatever the process count (Flow-GRPO 2):
    #                                       derives gradient_accumulation (which must then stay 1); null: as given
    inner_epochs: int = 1  # passes over each epoch's samples
    lr: float = 3.0e-4
    weight_decay: float = 1.0e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1.0e-8
    max_grad_norm: float = 1.0
    optimizer: str = "adamw"  # adamw | adamw8bit (bitsandbytes)
    lr_schedule: str = "constant"  # diffusers' get_scheduler over train.lr_schedule_steps: constant |
    #                                constant_with_warmup | linear | cosine | cosine_with_restarts | polynomial. A
    #                                function of the optimizer steps taken, so a resumed run continues it
    lr_warmup_steps: int = 0  # optimizer steps of linear warmup from lr 0 (every schedule but constant)
    lr_schedule_steps: int | None = None  # the schedule's length in optimizer steps, held at its last value after;
    #                                       null: run.epochs × the steps per epoch. Set it where the epoch count is
    #                                       open (run.max_minutes, scripts/compare_methods.py); a resume on another
    #                                       process count keeps its place only with train.updates_per_epoch set
    ema: float = 0.0  # EMA decay of the adapter weights (0: off; Flow-GRPO 0.9). Stepped (train.ema_stepping) with
    #                   the optimizer step count s, as Flow-GRPO's EMAModuleWrapper.step
    ema_update_every: int = 1  # the EMA moves only when (s + 1) % this == 0 (Flow-GRPO 8)
    ema_warmup: bool = False  # decay min((1 + s) / (10 + s), ema) (Flow-GRPO); false: ema throughout
    ema_stepping: str = "micro_batch"  # micro_batch: after every micro-batch (Flow-GRPO) | optimizer_step: once per
    #                                    optimizer step, after it (DiffusionNFT; a skipped non-finite update moves it
    #                                    not). The same where a step is one micro-batch and every update is finite


@dataclass
class EvalConfig:
    """``eval:`` noise-free sampling on the test prompts."""

    every: int = 0  # epochs between evaluations (0: never during training)
    num_steps: int = 40
    guidance_scale: float = 4.5
    batch_size: int = 8
    max_prompts: int | None = None  # evaluate the first N test prompts (>= 1); null: all of them
    samples_per_prompt: int = 1  # images per test prompt, each from its own fixed noise (GenEval: 4): means over all;
    #                              accuracies also as pass@k (any of a prompt's k right)
    use_ema: bool = False  # evaluate with the EMA weights (needs train.ema > 0; Flow-GRPO does)


@dataclass
class CheckpointConfig:
    """``checkpoint:`` saving."""

    every: int = 20  # epochs between checkpoints (0: only at the end)
    keep_last: int = 3


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: Any = field(default_factory=lambda: {"jpeg_compressibility": 1.0})  # {name: weight} or a list
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        """Every setting, with only the chosen plugins' sections (``grpo.<objective>``, ``sampler.<rollout>``,
        ``grpo.advantage.<estimator>``): the others sit at their defaults (anything else is refused), and a saved
        config must load where another plugin is not registered."""
        out = dataclasses.asdict(self)
        for owner, path in _plugin_owners(self):
            active = getattr(owner, _PLUGIN_CHOICE[type(owner)][0])
            if active in _plugin_sections(type(owner)):
                _node(out, path)[active] = dataclasses.asdict(getattr(owner, active))
        return out

    @staticmethod
    def with_every_section(data: dict[str, Any]) -> dict[str, Any]:
        """``data`` (a ``to_dict()``) with every registered plugin's section added at its defaults, as older runs
        saved them."""
        out = copy.deepcopy(data)
        for cls, (_, _, path, _) in _PLUGIN_CHOICE.items():
            node = _node(out, path)
            for name, section in _plugin_sections(cls).items():
                node.setdefault(name, dataclasses.asdict(section()))
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# Plugin sections: a registry's entries with settings add a section to the config class that chooses among them.
# config class -> (the key that chooses, the registry's sections, the section's path, what an entry is called)
_PLUGIN_CHOICE: dict[type, tuple[str, Callable[[], dict[str, type]], str, str]] = {
    GRPOConfig: ("objective", objective_sections, "grpo", "objective"),
    SamplerConfig: ("rollout", rollout_sections, "sampler", "rollout strategy"),
    AdvantageConfig: ("estimator", estimator_sections, "grpo.advantage", "advantage estimator"),
}


# ---------------------------------------------------------------------------- building from dicts
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _check_value(path: str, value: Any, tp: Any) -> Any:
    """Light type check with the conversions YAML needs (int -> float)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            try:
                return _check_value(path, value, option)
            except ConfigError as err:
                errors.append(str(err))
        names = " or ".join(_type_name(t) for t in typing.get_args(tp))
        raise ConfigError(f"{path}: expected {names}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: expected null, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp) or (Any,)
        return [_check_value(f"{path}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float's range
            number = math.inf
        if not math.isfinite(number):  # NaN would pass every range check (all its comparisons are False)
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return number
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def _type_name(tp: Any) -> str:
    return {type(None): "null", str: "a string", int: "an integer", float: "a number", bool: "true/false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _plugin_sections(cls: type) -> dict[str, type]:
    """``{name: settings class}`` of the registered plugins that ``cls`` chooses among ({} for other classes)."""
    if cls not in _PLUGIN_CHOICE:
        return {}
    _, sections_of, path, kind = _PLUGIN_CHOICE[cls]
    sections = sections_of()
    clash = sorted(set(sections) & {f.name for f in dataclasses.fields(cls)})
    if clash:
        raise ConfigError(f"{kind} {clash[0]!r} cannot have a settings section: {path}.{clash[0]} is a {path} key")
    return sections


def _add_plugin_sections(owner: Any) -> None:
    """The registered plugins' sections, at their defaults unless the config gave them (see _build)."""
    for name, section in _plugin_sections(type(owner)).items():
        owner.__dict__.setdefault(name, section())


def _plugin_owners(config: Config) -> list[tuple[Any, str]]:
    """``(section object, its path)`` of every config class that chooses among plugins (paths from _PLUGIN_CHOICE)."""
    owners = []
    for _, _, path, _ in _PLUGIN_CHOICE.values():
        owner: Any = config
        for key in path.split("."):
            owner = getattr(owner, key)
        owners.append((owner, path))
    return owners


def _node(data: dict[str, Any], path: str) -> dict[str, Any]:
    for key in path.split("."):
        data = data[key]
    return data


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping of keys, got {data!r}")
    sections = _plugin_sections(cls)
    types_ = {**_field_types(cls), **sections}
    kwargs, built_sections = {}, {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in types_:
            close = difflib.get_close_matches(str(key), list(types_), n=1)
            hint = f"; did you mean '{(path + '.') if path else ''}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{full}'{hint} (valid keys here: {', '.join(types_)})")
        tp = types_[key]
        target = built_sections if key in sections else kwargs
        target[key] = _build(tp, value, full) if _is_dataclass_type(tp) else _check_value(full, value, tp)
    built = cls(**kwargs)
    built.__dict__.update(built_sections)
    return built


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "rewards":
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=[x, y]"]`` -> nested dict; values parsed as YAML (numbers, booleans, lists)."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value (for example train.lr=1e-4)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override '{item}': '{key}' is not a key; write key.sub=value (e.g. train.lr=1e-4)")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = nested
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # e.g. "train=5 train.lr=1": a value where a section is needed
                section = ".".join(parts[: depth + 1])
                raise ConfigError(
                    f"override '{item}' conflicts with '{section}={node!r}' given before it: {section} is a "
                    f"section of keys; drop the '{section}=' override"
                )
        node[parts[-1]] = value
    return nested


def _renamed_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Keys that were renamed, in a config file, an override or an older run's config.yaml, read as the new ones:
    ``grpo.advantage.std: global`` is ``estimator: global_std``, ``per_reward: true`` is ``estimator: per_reward``."""
    grpo = data.get("grpo")
    advantage = grpo.get("advantage") if isinstance(grpo, dict) else None
    if not isinstance(advantage, dict) or not ({"std", "per_reward"} & set(advantage)):
        return data
    advantage = dict(advantage)
    std, per = advantage.pop("std", "group"), advantage.pop("per_reward", False)
    one_of("grpo.advantage.std (now grpo.advantage.estimator)", std, ("group", "global"))
    if not isinstance(per, bool):
        raise ConfigError(f"grpo.advantage.per_reward: expected true or false, got {per!r}")
    if per and std == "global":
        raise ConfigError(
            "grpo.advantage.per_reward=true with std=global is not an estimator; per-reward advantages "
            "use each group's std: set grpo.advantage.estimator: per_reward (and drop std)"
        )
    implied = "per_reward" if per else ("global_std" if std == "global" else "group")
    given = advantage.setdefault("estimator", implied)
    if given != implied:
        raise ConfigError(
            f"grpo.advantage.estimator={given} contradicts the older keys std={std} / "
            f"per_reward={str(per).lower()} (they mean estimator: {implied}); remove std and per_reward"
        )
    return {**data, "grpo": {**grpo, "advantage": advantage}}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *, training: bool = True) -> Config:
    """Read a YAML preset, apply ``key=value`` overrides, build and validate the config (``training``: see
    :func:`validate`)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory; pass a YAML file (see configs/ for presets)")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist (see configs/ for presets)")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        except (OSError, UnicodeDecodeError) as err:  # unreadable, or not text
            raise ConfigError(f"config file {path} cannot be read as UTF-8 text: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    data = _merge(data, parse_overrides(overrides or []))
    config = _build(Config, _renamed_keys(data), "")
    validate(config, training=training)
    return config


def _check_recipe_sampler(s: SamplerConfig) -> None:
    """The sampler's recipe options: each alone, then the settings each one needs."""
    w = s.window
    one_of("sampler.last_step", s.last_step, ("ode", "sde"))
    one_of("sampler.log_prob", s.log_prob, LOG_PROBS)
    if not isinstance(s.shared_prefix, bool):  # a config built in code skips the loader's type check
        raise ConfigError(f"sampler.shared_prefix must be true or false, got {s.shared_prefix!r}")
    check_range("sampler.time_shift", s.time_shift, 0, low_open=True, why="null: the pipeline's own schedule")
    check_range("sampler.window.end_margin", w.end_margin, 1, why="the last step is never in the window")
    if s.log_prob == "squared_error" and s.kind != "cps":
        raise ConfigError(
            f"sampler.log_prob=squared_error is Flow-GRPO's convention for its cps step only, got sampler.kind="
            f"{s.kind}; set sampler.kind: cps, or sampler.log_prob: exact"
        )
    if w.per_batch and w.strategy != "random":
        raise ConfigError(
            f"sampler.window.per_batch=true draws a random window for every rollout batch (Flow-GRPO-Fast) and needs "
            f"sampler.window.strategy: random, got {w.strategy!r}; set the strategy to random or per_batch: false"
        )
    if s.rollout != "branch" and s.branch != BranchConfig():
        raise ConfigError(
            f"sampler.branch.* places the branch rollout's branch points and does nothing with sampler.rollout="
            f"{s.rollout}; set sampler.rollout: branch, or remove sampler.branch"
        )
    if s.last_step == "sde" and s.post_window.solver != "euler":
        raise ConfigError(
            f"sampler.last_step=sde replaces the final step by an SDE step, but sampler.post_window.solver="
            f"{s.post_window.solver} integrates the steps after the window; set post_window.solver: euler, or "
            "last_step: ode"
        )
    if s.post_window.carry_history and s.post_window.solver != "dpmpp_2m":
        raise ConfigError(
            f"sampler.post_window.carry_history=true seeds the multistep solver's history and does nothing with "
            f"sampler.post_window.solver={s.post_window.solver}; set post_window.solver: dpmpp_2m, or "
            "carry_history: false"
        )


def _check_antithetic(s: SamplerConfig, group_size: int) -> None:
    """``sampler.antithetic``: mirrored pairs need window noise, a chain of images per image, and even groups and
    rollout batches (a pair never split)."""
    if not isinstance(s.antithetic, bool):  # a config built in code skips the loader's type check
        raise ConfigError(f"sampler.antithetic must be true or false, got {s.antithetic!r}")
    if not s.antithetic:
        return
    if s.rollout not in ("chain", "dense"):
        raise ConfigError(
            f"sampler.antithetic=true pairs the window noise of the chain rollout's images, but sampler.rollout="
            f"{s.rollout} draws its own; set sampler.rollout: chain (or dense), or sampler.antithetic: false"
        )
    if s.batch_size % 2:
        raise ConfigError(
            f"sampler.antithetic=true samples a group's images in pairs within a rollout batch, but sampler.batch_size="
            f"{s.batch_size} is odd; set an even sampler.batch_size"
        )
    if s.noise_level == 0:
        raise ConfigError(
            "sampler.antithetic=true mirrors the SDE noise, but sampler.noise_level=0 samples the ODE (no noise); set "
            "a sampler.noise_level > 0, or sampler.antithetic: false"
        )
    if group_size % 2:
        raise ConfigError(
            f"sampler.antithetic=true samples a group's images in pairs, but grpo.group_size={group_size} is odd; "
            "set an even grpo.group_size"
        )


def validate(config: Config, world_size: int = 1, *, training: bool = True) -> None:
    """Checks that need no model: choices, ranges, and the batch arithmetic for ``world_size`` processes.
    ``training=False`` (a run's config read to evaluate or export its weights, which samples no rollout) skips the
    rollout strategy's checks, and with them the files only training reads (an offline store)."""
    s, g, t = config.sampler, config.grpo, config.train
    kinds = ("auto", *available_families())  # the registered model families (flowgrpo/adapters/<family>.py)
    one_of("model.kind", config.model.kind, kinds)
    if config.model.num_frames is not None:
        if config.model.kind not in ("auto", *VIDEO_KINDS):
            raise ConfigError(
                f"model.num_frames={config.model.num_frames} is for video models ({', '.join(VIDEO_KINDS)}), but "
                f"model.kind={config.model.kind} generates images; set model.num_frames: null"
            )
        check_num_frames(config.model.num_frames)
    _check_family_options(config)
    one_of("model.dtype", config.model.dtype, ("bf16", "fp16", "fp32"))
    one_of("model.attention", config.model.attention, ("sdpa", "xformers"))
    one_of("sampler.kind", s.kind, SDE_KINDS)
    one_of("sampler.diffusion", s.diffusion, tuple(DIFFUSIONS))
    one_of("sampler.score_eval", s.score_eval, ("frozen", "reeval"))
    one_of("sampler.window.strategy", s.window.strategy, STRATEGIES)
    one_of("sampler.post_window.solver", s.post_window.solver, SOLVERS)
    # Sampler options that reproduce published recipes: time_shift, last_step, log_prob, window.per_batch /
    # end_margin, post_window.carry_history (choices, ranges and the combinations they need).
    _check_recipe_sampler(s)
    _check_antithetic(s, g.group_size)
    one_of("grpo.advantage.estimator", g.advantage.estimator, available_advantage_estimators())
    one_of("grpo.kl.convention", g.kl.convention, KL_CONVENTIONS)
    check_kl(config)  # grpo.kl.gate, grpo.kl.reset_every (GARDO)
    check_diversity(config)  # grpo.advantage.diversity (GARDO)
    one_of("grpo.log_prob_reduce", g.log_prob_reduce, ("mean", "sum"))
    one_of("grpo.nan_policy", g.nan_policy, ("error", "drop"))
    check_size(config.model)  # before the rollout's checks, whose messages read the size
    objective = get_objective(g.objective)
    _check_other_sections(config)
    objective.validate(config)
    if objective.needs_whole_groups(config):
        check_whole_groups(config, world_size)
    if training:
        validate_rollout(config, world_size)
    else:
        get_rollout(s.rollout)  # the name only
    validate_estimator(config)
    one_of("train.optimizer", t.optimizer, ("adamw", "adamw8bit"))
    one_of("train.ema_stepping", t.ema_stepping, ("micro_batch", "optimizer_step"))
    one_of("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    check_range("train.lr_warmup_steps", t.lr_warmup_steps, 0)
    if t.lr_warmup_steps and t.lr_schedule == "constant":
        raise ConfigError(
            f"train.lr_warmup_steps={t.lr_warmup_steps} does nothing with train.lr_schedule=constant; "
            "set train.lr_schedule: constant_with_warmup (or another schedule)"
        )
    check_range("train.lr_schedule_steps", t.lr_schedule_steps, 1, why="null: run.epochs × the steps per epoch")
    if t.lr_schedule_steps is not None and t.lr_schedule in LENGTHLESS_LR_SCHEDULES:
        raise ConfigError(
            f"train.lr_schedule_steps={t.lr_schedule_steps} does nothing with train.lr_schedule={t.lr_schedule}; "
            "set a decaying train.lr_schedule (e.g. cosine) or drop train.lr_schedule_steps"
        )
    if t.lr_schedule_steps is not None and t.lr_warmup_steps >= t.lr_schedule_steps:
        raise ConfigError(
            f"train.lr_warmup_steps={t.lr_warmup_steps} is not shorter than train.lr_schedule_steps="
            f"{t.lr_schedule_steps}; lower train.lr_warmup_steps or raise train.lr_schedule_steps"
        )
    _check_ranges(config)
    total = g.group_size * g.groups_per_epoch
    per_round = s.batch_size * world_size
    if total % per_round:
        raise ConfigError(
            f"grpo.group_size × grpo.groups_per_epoch = {g.group_size} × {g.groups_per_epoch} = {total} images per "
            f"epoch must divide evenly into rollout batches of sampler.batch_size × processes = {s.batch_size} × "
            f"{world_size} = {per_round}; change grpo.groups_per_epoch or sampler.batch_size"
        )
    local = total // world_size
    if local % t.batch_size:
        raise ConfigError(
            f"each process trains on {local} samples per epoch ({total} / {world_size} processes), which "
            f"train.batch_size={t.batch_size} does not divide; pick a divisor of {local}"
        )
    micro_batches = local // t.batch_size * t.inner_epochs
    if t.updates_per_epoch is not None:
        per_pass = local // t.batch_size
        if t.gradient_accumulation != 1:
            raise ConfigError(
                f"train.updates_per_epoch={t.updates_per_epoch} derives train.gradient_accumulation from the process "
                f"count; remove train.gradient_accumulation={t.gradient_accumulation} (or set updates_per_epoch: null)"
            )
        if per_pass % t.updates_per_epoch:
            divisors = [d for d in range(1, per_pass + 1) if per_pass % d == 0]
            raise ConfigError(
                f"train.updates_per_epoch={t.updates_per_epoch} must divide the {per_pass} micro-batches each process "
                f"trains per pass at {world_size} process(es) ({local} samples / train.batch_size {t.batch_size}); "
                f"valid values here: {divisors}, or change train.batch_size / grpo.groups_per_epoch"
            )
    elif micro_batches % t.gradient_accumulation:
        raise ConfigError(
            f"train.gradient_accumulation={t.gradient_accumulation} must divide the {micro_batches} micro-batches each "
            f"process trains per epoch ({local} samples / train.batch_size {t.batch_size} × train.inner_epochs "
            f"{t.inner_epochs}), or the last optimizer step of an epoch would be incomplete"
        )
    objective.validate_updates(config, optimizer_steps_per_epoch(config, world_size))


def check_size(model: ModelConfig) -> None:
    """``model.height`` / ``model.width``: both or neither; the sides in use (those two, else ``model.resolution``)
    positive multiples of 16, the VAE factor × patch size of every supported model (SD3, FLUX, Qwen-Image: 8 × 2; Wan:
    16). The family's own multiple (``PipelineAdapter.size_multiple``) is checked when the model loads."""
    if (model.height is None) != (model.width is None):
        given, missing = ("model.height", "model.width") if model.width is None else ("model.width", "model.height")
        raise ConfigError(
            f"{given}={model.height if model.width is None else model.width} without {missing}: non-square images "
            f"need both; set {missing} too (e.g. model.height: 240 and model.width: 416), or neither "
            "(model.resolution: N for N × N images)"
        )
    sides = (
        {"model.resolution": model.resolution}
        if model.height is None
        else {"model.height": model.height, "model.width": model.width}
    )
    for key, value in sides.items():
        check_range(key, value, 1)
        if value % 16:
            raise ConfigError(f"{key} must be a multiple of 16, got {value}; try {max(16, value // 16 * 16)}")


def _check_family_options(config: Config) -> None:
    """Some families' own options (``FAMILY_OPTIONS``): their ranges, and refused for another named ``model.kind``
    before the model loads (with ``auto``, ``make_adapter`` refuses them once the pipeline is known)."""
    model, grpo = config.model, config.grpo
    check_range("model.source_area", model.source_area, 32 * 32, why="calculate_dimensions rounds sides to 32")
    check_true_cfg(model.true_cfg_scale, model.negative_prompt)
    fit = getattr(grpo, grpo.objective, None)
    if model.true_cfg_scale > 1 and isinstance(fit, ForwardProcessConfig) and not fit.cfg:
        key = f"grpo.{grpo.objective}.cfg"
        raise ConfigError(
            f"{key}=false fits the unguided velocity, but model.true_cfg_scale={model.true_cfg_scale} guides every "
            f"forward, the fits too; set {key}: true (fit the velocity the rollout sampled with), or "
            "model.true_cfg_scale: 1"
        )
    defaults = ModelConfig()
    for option in FAMILY_OPTIONS:
        value = getattr(model, option)
        if value != getattr(defaults, option) and model.kind not in ("auto", *families_with_option(option)):
            raise family_option_error(option, value, model.kind)


VIDEO_KINDS = FamilyNames(video=True)  # model kinds that generate clips (model.num_frames), from the registry
# diffusers.optimization.get_scheduler's names that need nothing but warmup and total steps (piecewise_constant
# takes step rules: not offered).
LR_SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")
LENGTHLESS_LR_SCHEDULES = ("constant", "constant_with_warmup")  # flat after any warmup: no length to set


def accumulation_steps(config: Config, world_size: int) -> int:
    """Micro-batches per optimizer step at ``world_size`` processes: ``train.gradient_accumulation``, or derived from
    ``train.updates_per_epoch`` so that the optimizer steps per epoch do not change with the process count."""
    t = config.train
    if t.updates_per_epoch is None:
        return t.gradient_accumulation
    return micro_batches_per_pass(config, world_size) // t.updates_per_epoch


def optimizer_steps_per_epoch(config: Config, world_size: int) -> int:
    """Optimizer steps each epoch takes at ``world_size`` processes, over its ``train.inner_epochs`` passes."""
    per_epoch = micro_batches_per_pass(config, world_size) * config.train.inner_epochs
    return per_epoch // accumulation_steps(config, world_size)


def micro_batches_per_pass(config: Config, world_size: int) -> int:
    """Training micro-batches each of ``world_size`` processes runs per pass over the epoch's samples."""
    return config.grpo.group_size * config.grpo.groups_per_epoch // world_size // config.train.batch_size


def _check_other_sections(config: Config) -> None:
    """A setting in another plugin's section does nothing: refuse it, naming the chosen plugin's key if it has one
    (``grpo.awm.timesteps`` under nft: did you mean ``grpo.nft.timesteps``?)."""
    for owner, path in _plugin_owners(config):
        choice_key = _PLUGIN_CHOICE[type(owner)][0]
        chosen = getattr(owner, choice_key)
        active = getattr(owner, chosen, None)
        for name, section in _plugin_sections(type(owner)).items():
            if name == chosen:
                continue
            given, default = dataclasses.asdict(getattr(owner, name)), dataclasses.asdict(section())
            for key, value in given.items():
                if value == default.get(key):
                    continue
                shown = str(value).lower() if isinstance(value, bool) else value
                hint = (
                    f"did you mean {path}.{chosen}.{key}?"
                    if active is not None and hasattr(active, key)
                    else f"remove it, or set {path}.{choice_key}: {name}"
                )
                raise ConfigError(
                    f"{path}.{name}.{key}={shown} is a setting of {path}.{choice_key}={name}, but "
                    f"{path}.{choice_key}={chosen}; {hint}"
                )


def _check_ranges(config: Config) -> None:
    """The range of every numeric field (NaN and inf are already refused while the config is built)."""
    r, m, s, g, t, e = config.run, config.model, config.sampler, config.grpo, config.train, config.eval
    w = s.window
    check_range("run.seed", r.seed, 0, 2**32 - 1, why="numpy's seed range")
    check_range("run.max_minutes", r.max_minutes, 0)
    one_of("run.budget_clock", r.budget_clock, ("wall", "cpu"))
    at_least_one = {
        "run.epochs": r.epochs,
        "run.log_every": r.log_every,
        "run.max_nonfinite_steps": r.max_nonfinite_steps,
        "run.max_empty_epochs": r.max_empty_epochs,
        "model.resolution": m.resolution,
        "model.lora.rank": m.lora.rank,
        "sampler.batch_size": s.batch_size,
        "sampler.window.shift_interval": w.shift_interval,
        "sampler.window.stride": w.stride,
        "grpo.groups_per_epoch": g.groups_per_epoch,
        "train.batch_size": t.batch_size,
        "train.gradient_accumulation": t.gradient_accumulation,
        "train.inner_epochs": t.inner_epochs,
        "train.ema_update_every": t.ema_update_every,
        "eval.num_steps": e.num_steps,
        "eval.batch_size": e.batch_size,
        "eval.samples_per_prompt": e.samples_per_prompt,
        "checkpoint.keep_last": config.checkpoint.keep_last,
    }
    non_negative = {
        "run.image_grid_every": r.image_grid_every,
        "eval.every": e.every,
        "checkpoint.every": config.checkpoint.every,
        "sampler.window.decay_threshold": w.decay_threshold,
        "sampler.window.decay_rate": w.decay_rate,
        "sampler.guidance_scale": s.guidance_scale,
        "eval.guidance_scale": e.guidance_scale,
        "grpo.kl.beta": g.kl.beta,
        "train.weight_decay": t.weight_decay,
    }
    for key, value in at_least_one.items():
        check_range(key, value, 1)
    for key, value in non_negative.items():
        check_range(key, value, 0)
    check_range("eval.max_prompts", e.max_prompts, 1, why="null evaluates every test prompt")
    check_range("model.max_sequence_length", m.max_sequence_length, 1, why="null: the family's default")
    check_range("model.lora.alpha", m.lora.alpha, 0, low_open=True)
    check_range("model.lora.dropout", m.lora.dropout, 0, 1, high_open=True)
    if m.lora.dropout > 0:
        raise ConfigError(
            f"model.lora.dropout={m.lora.dropout} is not supported: dropout is active when the loss re-scores the "
            "samples (training mode) but not when they were sampled, so the on-policy ratio would not be 1 and "
            "the clipped objective would clip noise; set model.lora.dropout: 0"
        )
    if s.num_steps < 2:
        raise ConfigError(f"sampler.num_steps must be >= 2 (the last step is always ODE), got {s.num_steps}")
    if s.noise_level < 0 or (s.kind == "cps" and s.noise_level > 1):
        raise ConfigError(f"sampler.noise_level must be >= 0 (<= 1 for cps), got {s.noise_level}")
    check_range("sampler.kappa", s.kappa, 0, low_open=True, why="Langevin's step cap, κ·t_next")
    trainable = s.num_steps - w.end_margin  # steps a window may cover (window.end_margin checked in validate)
    if trainable < 1:
        raise ConfigError(
            f"sampler.window.end_margin={w.end_margin} leaves no trainable step of sampler.num_steps={s.num_steps}; "
            f"use num_steps > {w.end_margin} or a smaller end_margin"
        )
    if w.size > trainable or w.size < 0:
        margin = "the last is always ODE" if w.end_margin == 1 else f"window.end_margin={w.end_margin}"
        raise ConfigError(
            f"sampler.window.size={w.size} does not fit sampler.num_steps={s.num_steps}: at most "
            f"{trainable} steps can be trained ({margin}); set window.size <= {trainable}"
        )
    # The window's last possible start: a window of `size` steps must end before the final (ODE) step(s).
    last_start = trainable - (w.size or trainable)
    check_range("sampler.window.max_start", w.max_start, 0, last_start, why="the window ends before the last step")
    check_range("sampler.post_window.ratio", s.post_window.ratio, 0, 1, low_open=True)
    if g.group_size < 2:
        raise ConfigError(f"grpo.group_size must be >= 2 (advantages compare images of one prompt), got {g.group_size}")
    check_range("grpo.advantage.clip", g.advantage.clip, 0, low_open=True, why="advantages are clipped to ±clip")
    check_range("grpo.advantage.std_eps", g.advantage.std_eps, 0, low_open=True, why="a group of equal rewards")
    check_range("grpo.clip_range", g.clip_range, 0, 1, low_open=True, high_open=True, why="ratios clip to 1 ± ε")
    check_range("train.lr", t.lr, 0, low_open=True)
    check_range("train.eps", t.eps, 0, low_open=True)
    check_range("train.max_grad_norm", t.max_grad_norm, 0, low_open=True, why="gradient-norm clipping")
    check_range("train.ema", t.ema, 0, 1, high_open=True)
    check_range("train.updates_per_epoch", t.updates_per_epoch, 1, why="null: train.gradient_accumulation as given")
    check_range("grpo.timestep_fraction", g.timestep_fraction, 0, 1, low_open=True)
    if g.advantage.normalize_weights and g.advantage.estimator != "per_reward":
        raise ConfigError(
            "grpo.advantage.normalize_weights=true only applies to per-reward advantages (the other estimators read "
            "the weighted total as given); set grpo.advantage.estimator: per_reward or normalize_weights: false"
        )
    ema_options = {
        "train.ema_warmup": t.ema_warmup,
        "eval.use_ema": config.eval.use_ema,
        "train.ema_update_every": t.ema_update_every != 1,
        "train.ema_stepping": t.ema_stepping != "micro_batch",
    }
    if t.ema == 0 and (set_without_ema := [key for key, is_set in ema_options.items() if is_set]):
        key = set_without_ema[0]
        raise ConfigError(f"{key} needs an EMA: set train.ema > 0 (Flow-GRPO 0.9) or leave {key} at its default")
    if len(t.betas) != 2:
        raise ConfigError(f"train.betas must be two numbers [beta1, beta2] (AdamW), got {t.betas}")
    for i, beta in enumerate(t.betas):
        check_range(f"train.betas[{i}]", beta, 0, 1, high_open=True)
