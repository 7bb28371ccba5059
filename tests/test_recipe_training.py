"""Training-side options that reproduce the references' recipes, each against a small computation written the way
the reference code does it: Flow-GRPO (``flow_grpo/stat_tracking.py``, ``flow_grpo/ema.py``,
``scripts/train_sd3.py``), MixGRPO (``fastvideo/train_grpo_flux.py``, ``advantage_aggr``) and DanceGRPO
(``timestep_fraction``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgrpo.advantages import AdvantageInputs, compute_advantages, group_advantages
from flowgrpo.batching import kept_samples, micro_batches, trained_count, trained_positions
from flowgrpo.config import AdvantageConfig, ConfigError, accumulation_steps, load_config
from flowgrpo.ema import EMA

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_sd3.yaml"


# ---------------------------------------------------------------- advantages
def _flowgrpo_advantages(prompts: list[str], rewards: np.ndarray, global_std: bool) -> np.ndarray:
    """PerPromptStatTracker.update (type 'grpo') for one epoch, then train_sd3.py's clamp at adv_clip_max 5."""
    prompts_ = np.array(prompts)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts_):
        prompt_rewards = rewards[prompts_ == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        std = (np.std(rewards, axis=0, keepdims=True) if global_std else np.std(prompt_rewards, axis=0)) + 1e-4
        advantages[prompts_ == prompt] = (prompt_rewards - mean) / std
    return np.clip(advantages, -5, 5)


def test_global_std_is_flowgrpo_population_std():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=24) * np.repeat([0.1, 1.0, 5.0], 8)
    groups = np.repeat([4, 9, 2], 8)
    ours = group_advantages(torch.tensor(rewards), torch.tensor(groups), std="global", clip=5.0)
    reference = _flowgrpo_advantages([f"p{g}" for g in groups], rewards, global_std=True)
    np.testing.assert_allclose(ours.numpy(), reference, rtol=1e-6, atol=1e-6)
    # the unbiased std (the former behaviour) would be off by sqrt(n / (n - 1)) = 2.2%
    assert not np.allclose(ours.numpy() * math.sqrt(24 / 23), reference, rtol=1e-3)


def _mixgrpo_advantages(rewards: dict[str, torch.Tensor], weights: dict[str, float], k: int) -> torch.Tensor:
    """train_grpo_flux.py, multi_reward_mix='advantage_aggr': per-reward group advantages with torch's unbiased std
    + 1e-8, merged with the normalised weights, clamped at adv_clip_max in the loss."""
    total_weight = sum(weights.values())
    merged = torch.zeros_like(next(iter(rewards.values())))
    for name, model_rewards in rewards.items():
        advantages = torch.zeros_like(model_rewards)
        for i in range(len(model_rewards) // k):
            group = model_rewards[i * k : (i + 1) * k]
            advantages[i * k : (i + 1) * k] += (group - group.mean()) / (group.std() + 1e-8)
        merged += advantages * (weights[name] / total_weight)
    return merged.clamp(-5.0, 5.0)


def test_per_reward_normalized_weights_follow_mixgrpo():
    torch.manual_seed(0)
    k = 6
    rewards = {
        "hpsv2": 0.25 + 0.01 * torch.randn(18),
        "pickscore": 21 + torch.randn(18),
        "clipscore": 0.3 + 0.05 * torch.randn(18),
    }
    # One group with a single outlier: its unclipped per-reward advantage exceeds 5 (only the sum is clipped).
    rewards["pickscore"][12:18] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    weights = {"hpsv2": 1.0, "pickscore": 1.0, "clipscore": 2.0}
    scores = {**rewards, "total": sum(w * rewards[n] for n, w in weights.items())}
    groups = torch.arange(18) // k
    everyone = torch.ones(18, dtype=torch.bool)

    def per_reward(weights, normalize):
        settings = AdvantageConfig(estimator="per_reward", normalize_weights=normalize, std_eps=1e-8)
        return compute_advantages(settings, AdvantageInputs(scores, weights, groups, 0), everyone)

    ours = per_reward(weights, True)
    torch.testing.assert_close(ours, _mixgrpo_advantages(rewards, weights, k), rtol=1e-5, atol=1e-5)
    summed = per_reward(weights, False)
    assert summed.abs().max() > ours.abs().max() * 2  # without normalisation: a sum of three, nearer the clip
    with pytest.raises(ValueError, match="positive sum"):
        per_reward({"hpsv2": 0.0}, True)


# ---------------------------------------------------------------- dropping zero-advantage samples
def _flowgrpo_mask(advantages: torch.Tensor, num_batches: int, generator: torch.Generator) -> torch.Tensor:
    """train_sd3.py: keep non-zero advantages; pad the count to a multiple of num_batches with random others."""
    mask = advantages != 0
    true_count = mask.sum()
    if true_count % num_batches != 0:
        false_indices = torch.where(~mask)[0]
        num_to_change = num_batches - (true_count % num_batches)
        if len(false_indices) >= num_to_change:
            random_indices = torch.randperm(len(false_indices), generator=generator)[:num_to_change]
            mask[false_indices[random_indices]] = True
    return mask


@pytest.mark.parametrize("zero_groups", [0, 1, 3, 4])
def test_zero_advantage_samples_are_dropped_as_flowgrpo(zero_groups):
    num_batches, n = 4, 32
    advantages = torch.randn(n)
    advantages[: zero_groups * 8] = 0.0  # whole groups that scored alike
    ours = kept_samples(advantages.clone(), num_batches, torch.Generator().manual_seed(1))
    reference = torch.nonzero(_flowgrpo_mask(advantages.clone(), num_batches, torch.Generator().manual_seed(1)))
    if zero_groups < 4:
        torch.testing.assert_close(ours, reference.flatten(), rtol=0, atol=0)
    else:  # all zero: the reference would reshape an empty batch (an error); one filler per micro-batch instead
        assert len(ours) == num_batches and bool((advantages[ours] == 0).all())
    assert set(torch.nonzero(advantages).flatten().tolist()) <= set(ours.tolist())
    batches = micro_batches(ours, num_batches, torch.Generator().manual_seed(2))
    assert len(batches) == num_batches and len({len(b) for b in batches}) == 1
    assert sorted(torch.cat(batches).tolist()) == sorted(ours.tolist())


def test_trainer_trains_only_nonzero_advantages(tmp_path, monkeypatch):
    """One epoch where half the groups get advantage 0: the trainer trains on the other half only."""
    import flowgrpo.trainer as trainer_module
    from flowgrpo.trainer import GRPOTrainer

    real = trainer_module.compute_advantages

    def half_zero(settings, inputs, keep):
        advantages = real(settings, inputs, keep)
        return torch.where(inputs.group_ids % 2 == 0, torch.zeros_like(advantages), advantages)

    monkeypatch.setattr(trainer_module, "compute_advantages", half_zero)
    rows = {}
    for drop in (False, True):
        overrides = [
            f"run.output_dir={tmp_path / str(drop)}",
            "run.progress=false",
            "run.epochs=1",
            "eval.every=0",
            "train.batch_size=4",
            f"grpo.drop_zero_advantage={drop}",
        ]
        config = load_config(TINY, overrides)
        trainer = GRPOTrainer(config)
        trainer.fit()
        rows[drop] = json.loads((trainer.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert rows[False]["train/trained_samples"] == 16
    assert rows[True]["train/trained_samples"] == 8  # 2 of 4 groups kept; 4 micro-batches of 2
    assert rows[True]["global_step"] == rows[False]["global_step"] == 4  # as many updates, on smaller batches


# ---------------------------------------------------------------- timesteps, accumulation
def test_timestep_fraction_matches_dancegrpo():
    """DanceGRPO trains int(len(sigma_schedule) · 0.6) = int(17 · 0.6) = 10 of 16 steps, a random subset per sample
    (torch.randperm per sample, first train_timesteps positions)."""
    steps = 16
    dance = int(len(torch.linspace(1, 0, steps + 1)) * 0.6)
    assert trained_count(steps, 0.625) == dance == 10
    positions = trained_positions(5, steps, torch.Generator().manual_seed(0), fraction=0.625)
    reference_gen = torch.Generator().manual_seed(0)
    reference = torch.stack([torch.randperm(steps, generator=reference_gen) for _ in range(5)])[:, :dance]
    assert torch.equal(positions, reference)
    assert all(len(set(row.tolist())) == 10 for row in positions)
    assert torch.equal(
        trained_positions(2, 4, torch.Generator(), shuffle=False, fraction=0.5), torch.tensor([[0, 1], [0, 1]])
    )
    assert trained_count(3, 0.1) == 1
    assert trained_count(50, 0.58) == int(50 * 0.58) == 28  # int() as DanceGRPO, no rounding up


def test_updates_per_epoch_do_not_depend_on_the_process_count():
    config = load_config(
        TINY,
        [
            "grpo.group_size=8",
            "grpo.groups_per_epoch=12",
            "sampler.batch_size=4",
            "train.batch_size=4",
            "train.updates_per_epoch=3",
        ],
    )
    for world in (1, 2, 4, 8):  # 24, 12, 6, 3 micro-batches per process
        micro_per_process = 96 // world // 4
        accumulation = accumulation_steps(config, world)
        assert micro_per_process // accumulation == 3 and micro_per_process % accumulation == 0
    fixed = load_config(TINY, ["train.gradient_accumulation=2"])
    assert accumulation_steps(fixed, 1) == accumulation_steps(fixed, 2) == 2
    from flowgrpo.config import validate

    with pytest.raises(ConfigError, match=r"train.updates_per_epoch=3 must divide .* valid values here: \[1, 2, 4\]"):
        validate(config, world_size=6)  # 96 / 6 = 16 samples = 4 micro-batches per process
    with pytest.raises(ConfigError, match="remove train.gradient_accumulation=2"):
        load_config(TINY, ["train.updates_per_epoch=1", "train.gradient_accumulation=2"])


# ---------------------------------------------------------------- EMA
class _FlowGrpoEMA:
    """flow_grpo/ema.py, EMAModuleWrapper: decay min((1 + s) / (10 + s), decay), moved when (s + 1) % interval == 0."""

    def __init__(self, params, decay, update_step_interval):
        self.ema_parameters = [p.clone().detach() for p in params]
        self.decay, self.update_step_interval = decay, update_step_interval

    def step(self, params, optimization_step):
        one_minus_decay = 1 - min((1 + optimization_step) / (10 + optimization_step), self.decay)
        if (optimization_step + 1) % self.update_step_interval == 0:
            for ema_parameter, parameter in zip(self.ema_parameters, params, strict=True):
                ema_parameter.add_(one_minus_decay * (parameter - ema_parameter))


def test_ema_warmup_and_interval_follow_flowgrpo():
    """train_sd3.py calls ema.step(params, global_step) after every micro-batch; with accumulation 3 the step count
    moves every third call. 200 calls cover the warm-up (decay reaches 0.9 at s = 80) and the interval."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    ours = EMA(params, 0.9, update_every=8, warmup=True)
    reference = _FlowGrpoEMA(params, 0.9, update_step_interval=8)
    global_step = 0
    for micro_batch in range(200):
        if micro_batch % 3 == 2:  # an optimizer step ends this micro-batch
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen))
            global_step += 1
        ours.step(params, global_step)
        reference.step(params, global_step)
    for s, r in zip(ours.shadow, reference.ema_parameters, strict=True):
        torch.testing.assert_close(s, r, rtol=1e-6, atol=1e-6)
    assert ours.current_decay(0) == pytest.approx(0.1) and ours.current_decay(1000) == 0.9
    plain = EMA(params, 0.9)
    assert plain.current_decay(0) == 0.9


def _ema_trainer(tmp_path, stepping: str):
    """tiny_sd3 with an EMA of 0.5: four micro-batches an epoch, two to an optimizer step."""
    from flowgrpo.trainer import GRPOTrainer

    overrides = ["train.ema=0.5", f"train.ema_stepping={stepping}", "train.gradient_accumulation=2"]
    return GRPOTrainer(
        load_config(TINY, [f"run.output_dir={tmp_path}", "run.progress=false", "grpo.groups_per_epoch=8", *overrides])
    )


@pytest.mark.parametrize("stepping", ["micro_batch", "optimizer_step"])
def test_ema_stepping_after_every_micro_batch_or_once_per_optimizer_step(tmp_path, stepping):
    """Flow-GRPO's train_sd3.py steps its EMA after every micro-batch; DiffusionNFT's train_nft_sd3.py once per
    optimizer step, after it (``train.ema_stepping``). Four micro-batches, two to a step, decay 0.5, weights p0 → p1 →
    p2: after every micro-batch the shadow is p0/8 + 3p1/8 + p2/2 (p0, p1, p1, p2), once per step p0/4 + p1/4 + p2/2."""
    trainer = _ema_trainer(tmp_path, stepping)
    weights = [[p.detach().float().clone() for p in trainer.params]]
    optimizer_step, ema_update, moves = trainer.optimizer.step, trainer.ema.update, []

    def recorded_step(*args, **kwargs):
        optimizer_step(*args, **kwargs)
        weights.append([p.detach().float().clone() for p in trainer.params])

    def counted_update(params, decay=None):
        moves.append(decay)
        ema_update(params, decay)

    trainer.optimizer.step, trainer.ema.update = recorded_step, counted_update
    trainer.run_epoch(0)
    assert len(weights) == 3  # two optimizer steps
    share = {"micro_batch": (1 / 8, 3 / 8, 1 / 2), "optimizer_step": (1 / 4, 1 / 4, 1 / 2)}[stepping]
    assert len(moves) == {"micro_batch": 4, "optimizer_step": 2}[stepping]
    for i, shadow in enumerate(trainer.ema.shadow):
        expected = sum(c * w[i] for c, w in zip(share, weights, strict=True))
        torch.testing.assert_close(shadow, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(weights[1][0], weights[2][0])  # the weights moved at each step: the cases differ


def test_ema_stepping_per_optimizer_step_when_the_budget_stops_an_epoch(tmp_path):
    """run.max_minutes ends the epoch after the first optimizer step: the EMA has moved once, toward p1."""
    trainer = _ema_trainer(tmp_path, "optimizer_step")
    start = [p.detach().float().clone() for p in trainer.params]
    trainer._agree_to_stop = lambda: True
    trainer.run_epoch(0)
    assert trainer.state.global_step == 1
    for shadow, p0, p1 in zip(trainer.ema.shadow, start, trainer.params, strict=True):
        torch.testing.assert_close(shadow, (p0 + p1.detach().float()) / 2, rtol=1e-5, atol=1e-6)


def test_eval_uses_ema_weights(tmp_path):
    """eval.use_ema: evaluation sees the EMA weights; training resumes with its own weights afterwards."""
    from flowgrpo.trainer import GRPOTrainer

    config = load_config(
        TINY,
        [
            f"run.output_dir={tmp_path}",
            "run.progress=false",
            "train.ema=0.9",
            "eval.use_ema=true",
            "eval.max_prompts=2",
        ],
    )
    trainer = GRPOTrainer(config)
    trained = [p.detach().clone() for p in trainer.params]
    with torch.no_grad():
        trainer.ema.shadow = [s + 0.5 * torch.randn_like(s) for s in trainer.ema.shadow]
    with_ema = trainer.run_eval(0)
    assert all(torch.equal(p, t) for p, t in zip(trainer.params, trained, strict=True))  # restored
    trainer.config.eval.use_ema = False
    raw = trainer.run_eval(0)
    with torch.no_grad():
        for p, s in zip(trainer.params, trainer.ema.shadow, strict=True):
            p.copy_(s)
    manual = trainer.run_eval(0)
    assert with_ema["eval/total"] == manual["eval/total"] != raw["eval/total"]
    with pytest.raises(ConfigError, match="eval.use_ema needs an EMA"):
        load_config(TINY, ["eval.use_ema=true"])


# ---------------------------------------------------------------- LoRA dropout
def test_lora_dropout_is_refused_because_it_breaks_the_onpolicy_ratio():
    with pytest.raises(ConfigError, match="model.lora.dropout=0.05 is not supported.*on-policy ratio"):
        load_config(TINY, ["model.lora.dropout=0.05"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["grpo.advantage.normalize_weights=true"], "only applies to per-reward advantages"),
        (["train.ema_update_every=8"], "train.ema_update_every needs an EMA"),
        (["train.ema_warmup=true"], "train.ema_warmup needs an EMA"),
        (["train.ema_stepping=optimizer_step"], "train.ema_stepping needs an EMA"),
        (["train.ema=0.9", "train.ema_stepping=per_step"], "train.ema_stepping must be one of"),
        (["grpo.timestep_fraction=0"], "grpo.timestep_fraction must lie in"),
        (["train.updates_per_epoch=0"], "train.updates_per_epoch must be >= 1"),
    ],
)
def test_recipe_options_that_would_do_nothing_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_export_and_evaluate_point_at_the_ema_weights_the_run_evaluated():
    from flowgrpo.export import ema_hint

    with_ema = load_config(TINY, ["train.ema=0.9", "eval.use_ema=true"])
    assert "pass --ema" in ema_hint(with_ema, ema=False)
    assert ema_hint(with_ema, ema=True) is None
    assert ema_hint(load_config(TINY, ["train.ema=0.9"]), ema=False) is None
