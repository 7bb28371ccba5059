"""The GRPO trainer end to end on tiny pipelines: runs, learning, on-policy ratio, CLI errors (several processes:
test_distributed.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_helper import load_script

from flowgrpo.config import load_config
from flowgrpo.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny_sd3.yaml"


def _train(tmp_path, *overrides):
    config = load_config(TINY, [f"run.output_dir={tmp_path}", "run.progress=false", *overrides])
    trainer = GRPOTrainer(config)
    base = {n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters()}
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, base, [r for r in rows if "train/loss" in r]


def _changed(trainer, base):
    lora = [n for n, p in trainer.adapter.transformer.named_parameters() if p.requires_grad]
    frozen = [n for n, p in trainer.adapter.transformer.named_parameters() if not p.requires_grad]
    params = dict(trainer.adapter.transformer.named_parameters())
    return (
        any(not torch.equal(params[n], base[n]) for n in lora),
        all(torch.equal(params[n], base[n]) for n in frozen),
    )


def test_tiny_sd3_run_with_kl_window_flash_tail_per_reward_ema(tmp_path):
    trainer, base, rows = _train(
        tmp_path,
        "run.epochs=3",
        "grpo.kl.beta=0.04",
        "sampler.window.size=3",
        "sampler.window.shift_interval=1",
        "sampler.post_window.solver=dpmpp_2m",
        "sampler.post_window.ratio=0.5",
        "rewards={brightness: 1.0, jpeg_compressibility: 0.01}",
        "grpo.advantage.per_reward=true",
        "train.ema=0.9",
        "train.gradient_accumulation=2",
        "train.batch_size=8",
        "grpo.shuffle_timesteps=false",
        "eval.every=0",
    )
    assert len(rows) == 3
    assert [r["window/start"] for r in rows] == [0, 1, 2] and [r["window/size"] for r in rows] == [3, 3, 3]
    for r in rows:
        assert all(torch.isfinite(torch.tensor(v)) for v in r.values())
        # First micro-batch, same batch size and timesteps as the rollout: exactly on-policy.
        assert r["train/onpolicy_ratio_dev"] == 0.0
        assert r["train/kl"] >= 0 and "reward/jpeg_compressibility/mean" in r
    assert rows[-1]["global_step"] == 3  # 16 samples per epoch = 2 micro-batches of 8 = one accumulated update
    assert rows[1]["train/kl"] > 0  # the adapter moved away from the reference
    lora_moved, frozen_kept = _changed(trainer, base)
    assert lora_moved and frozen_kept
    ema_shadow = trainer.ema.shadow
    assert any(not torch.equal(s, p.detach().float()) for s, p in zip(ema_shadow, trainer.params, strict=True))
    assert (trainer.run_dir / "config.yaml").is_file()


def test_tiny_flux_run_guidance_free_langevin_random_window(tmp_path):
    trainer, base, rows = _train(
        tmp_path,
        "model.pretrained=tiny-flux",
        "sampler.guidance_scale=3.5",
        "sampler.kind=langevin",
        "sampler.score_eval=reeval",
        "sampler.noise_level=0.9",
        "sampler.window.size=2",
        "sampler.window.strategy=random",
        "grpo.advantage.std=global",
        "run.epochs=2",
        "eval.every=0",
    )
    assert len(rows) == 2 and all(r["window/size"] == 2 for r in rows)
    assert all(r["train/onpolicy_ratio_dev"] == 0.0 for r in rows)  # shuffled per-sample timesteps, still exact
    lora_moved, frozen_kept = _changed(trainer, base)
    assert lora_moved and frozen_kept


@pytest.mark.slow
def test_brightness_reward_rises_on_fixed_prompts(tmp_path):
    """The tiny learning check: 30 epochs on tiny SD3 make every test image brighter (ODE, fixed noise).

    Rollouts of 4 steps: the preset's 6 cost twice as much for margins no larger. Measured (eval gain,
    min(after) - max(before), training reward's rise; thresholds 0.005, 0, 0.005), with tiny_sd3.yaml's 16 T5 tokens:
    30 epochs, seeds 0/1/2: +0.0090/+0.0056/+0.0087, +0.0057/+0.0027/+0.0063, +0.0070/+0.0037/+0.0045 (seed 2's
    rise under its threshold: seed 0 runs here); 45 epochs: +0.0100/+0.0054/+0.0094, +0.0191/+0.0170/+0.0180,
    +0.0191/+0.0155/+0.0183. (With SD3's 256 tokens, 3x the time, seed 0 read +0.0152/+0.0090/+0.0166.)"""
    trainer, _, rows = _train(tmp_path, "eval.every=30", "sampler.num_steps=4")
    before = json.loads((trainer.run_dir / "eval" / "epoch00000.json").read_text())
    after = json.loads((trainer.run_dir / "eval" / "epoch00030.json").read_text())
    b = [img["brightness"] for img in before["images"]]
    a = [img["brightness"] for img in after["images"]]
    assert after["summary"]["total"] - before["summary"]["total"] > 0.005, (b, a)
    assert min(a) > max(b), (b, a)
    assert rows[-1]["reward/total/mean"] > rows[0]["reward/total/mean"] + 0.005
    assert (trainer.run_dir / "eval" / "epoch00030.png").is_file()


def _cli(*args, cwd=ROOT, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "scripts/train.py", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "overrides, message, via_cli",
    [
        (["train.lrr=1e-3"], "did you mean 'train.lr'", True),
        (["grpo.group_size=3", "grpo.groups_per_epoch=3"], "9 images per epoch", False),
        (["data.train=configs/prompts/missing.txt"], "does not exist", False),
        (["rewards={brightnes: 1.0}"], "did you mean 'brightness'", False),
        (["model.resolution=24"], "multiple of 16", False),
    ],
)
def test_bad_configs_exit_with_code_2_and_one_paragraph(tmp_path, capsys, overrides, message, via_cli):
    """One case through the command line (its exit code); the others through train.py's main() in this process,
    the same code without a new interpreter's imports (8 s each)."""
    argv = ["--config", str(TINY), f"run.output_dir={tmp_path}", *overrides]
    if via_cli:
        result = _cli(*argv)
        code, err = result.returncode, result.stderr
    else:
        code, err = _train_script().main(argv), capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and err.count("error:") == 1
    assert message in " ".join(err.split())
    assert not list(tmp_path.iterdir())  # nothing written before validation passed


def _train_script():
    return load_script("train")


def test_nonfinite_rewards_drop_their_groups_or_stop_clearly(tmp_path):
    from rewards import NonFiniteRewardError

    spec = "rewards={nan_reward_helper:NanForCats: 1.0}"
    # 8 prompts, 4 groups per epoch drawn without replacement: over 3 epochs the cat prompt shows up.
    trainer, _, rows = _train(
        tmp_path, spec, "grpo.nan_policy=drop", "run.epochs=3", "eval.every=0", "run.debug_dump=true"
    )
    dropped = [r["reward/dropped_groups"] for r in rows]
    assert sum(dropped) >= 1 and all(d <= 1 for d in dropped)
    for epoch in range(3):
        dump = torch.load(trainer.run_dir / "debug" / f"epoch{epoch}_rank0.pt")
        bad = ~torch.isfinite(dump["all_total"])
        assert torch.equal(dump["advantages_all"][bad], torch.zeros(int(bad.sum())))
        assert torch.isfinite(dump["advantages_all"]).all()
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rows)
    with pytest.raises(NonFiniteRewardError, match="non-finite"):
        _train(tmp_path, spec, "run.epochs=3", "eval.every=0")


def test_epochs_with_no_usable_group_take_no_step_and_stop_clearly(tmp_path):
    """Every reward NaN under nan_policy=drop: before, training went on for ever (exit 0, checkpoints) and the
    optimizer stepped on nothing (the adapter moved by weight decay and momentum)."""
    from flowgrpo.trainer import TrainingError

    config = load_config(
        TINY,
        [f"run.output_dir={tmp_path}", "run.progress=false", "rewards={nan_reward_helper:NanAlways: 1.0}"]
        + ["grpo.nan_policy=drop", "run.epochs=6", "eval.every=0", "run.max_empty_epochs=2", "train.lr=0.01"],
    )
    trainer = GRPOTrainer(config)
    before = [p.detach().clone() for p in trainer.params]
    with pytest.raises(TrainingError, match=r"2 epochs in a row .* raise run\.max_empty_epochs \(2\)"):
        trainer.fit()
    assert trainer.state.epoch == 1 and trainer.state.global_step == 0 and trainer.state.empty_epochs_in_a_row == 2
    assert all(torch.equal(p.detach(), b) for p, b in zip(trainer.params, before, strict=True))
    # The failed fit released the run's lock (before: held until the trainer was collected, "in use" meanwhile).
    assert not trainer.run_lock.held
    # One usable epoch between empty ones resets the count (the cat prompt's groups alone are NaN).
    trainer, _, rows = _train(
        tmp_path,
        "rewards={nan_reward_helper:NanForCats: 1.0}",
        "grpo.nan_policy=drop",
        "run.epochs=2",
        "eval.every=0",
        "run.max_empty_epochs=1",
    )
    assert len(rows) == 2 and trainer.state.empty_epochs_in_a_row == 0


def test_a_time_budget_ends_the_run_checkpointed_after_the_epoch_that_spent_it(tmp_path):
    trainer, _, rows = _train(tmp_path, "run.epochs=5", "run.max_minutes=1e-4", "eval.every=0", "checkpoint.every=0")
    assert trainer.state.epoch == 1 and len(rows) == 1 and rows[0]["time/elapsed"] > 1e-4 * 60
    assert [p.name for p in (trainer.run_dir / "checkpoints").iterdir()] == ["epoch-00001"]


def test_a_cpu_time_budget_counts_this_process_cpu_seconds_not_the_wall_clock(tmp_path, monkeypatch):
    """run.budget_clock=cpu: other jobs on the machine (the wall-clock) do not spend the budget; this process's CPU
    time does. With the CPU clock frozen the same tiny budget that ends a wall-clock run after one epoch never runs
    out."""
    import flowgrpo.trainer as trainer_module

    monkeypatch.setattr(trainer_module.time, "process_time", lambda: 123.0)
    budget = ("run.epochs=2", "run.max_minutes=1e-4", "eval.every=0", "checkpoint.every=0")
    trainer, _, rows = _train(tmp_path, *budget, "run.budget_clock=cpu")
    assert trainer.state.epoch == 2 and [r["time/cpu"] for r in rows] == [0.0, 0.0]
    assert all(r["time/elapsed"] > 1e-4 * 60 for r in rows)


def test_a_nan_eval_reward_is_never_a_new_best(tmp_path, monkeypatch):
    import flowgrpo.trainer as trainer_module

    real = trainer_module.summarize
    monkeypatch.setattr(trainer_module, "summarize", lambda *a: {**real(*a), "total": float("nan")})
    trainer, _, _ = _train(tmp_path, "run.epochs=3", "eval.every=1", "checkpoint.every=0", "eval.max_prompts=2")
    assert trainer.state.best_eval is None and trainer.state.best_checkpoint is None
    # Only the final checkpoint. Before: NaN became the best, and NaN != NaN made every later evaluation a new
    # best, each with a checkpoint (epoch-00001, epoch-00002, ...).
    assert [p.name for p in (trainer.run_dir / "checkpoints").iterdir()] == ["epoch-00003"]


def test_a_data_error_during_training_ends_the_cli_with_one_paragraph(tmp_path, monkeypatch, capsys):
    """A source image broken after the run started raises DataError mid-epoch: before, a traceback."""
    from flowgrpo.data import DataError

    script = _train_script()

    def broken(self):
        raise DataError("data.train: rows.jsonl:2: the source image x.png cannot be read as an image")

    monkeypatch.setattr(GRPOTrainer, "fit", broken)
    code = script.main(["--config", str(TINY), f"run.output_dir={tmp_path}", "run.progress=false"])
    err = capsys.readouterr().err
    assert code == 1 and "error: data.train: rows.jsonl:2: the source image" in err and "Traceback" not in err


def test_epoch_metrics_ending_in_min_or_max_are_extremes_not_means():
    """The objectives' convention (objectives/base.py): ``*_min`` / ``*_max`` reduce by min / max over the epoch's
    terms (tempflow's noise_weight_min/max were averaged before), the rest by the mean."""
    from types import SimpleNamespace

    from flowgrpo.trainer import GRPOTrainer

    fake = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"lr": 0.5}]))
    sums = {
        "loss": [1.0, 3.0],
        "noise_weight_min": [0.2, 0.1],
        "noise_weight_max": [2.0, 4.0],
        "onpolicy_ratio_dev": [0.0, 1e-7],
    }
    out = GRPOTrainer._summarize(fake, sums)
    assert out == {
        "train/loss": 2.0,
        "train/noise_weight_min": 0.1,
        "train/noise_weight_max": 4.0,
        "train/onpolicy_ratio_dev": 1e-7,
        "train/lr": 0.5,
    }
