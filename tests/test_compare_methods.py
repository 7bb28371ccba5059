"""scripts/compare_methods.py's arithmetic: gains against each seed's base, the noise verdict, the table's rows;
--processes' DDP launch (training faked), its folders and refusals."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from script_helper import load_script

ROOT = Path(__file__).resolve().parent.parent
cm = load_script("compare_methods", register=True)  # its dataclasses look their module up


def test_noise_verdict_is_twice_the_standard_error_of_the_difference():
    a, b = [10.0, 12.0, 14.0], [2.0, 3.0, 4.0]
    d, error, noise = cm.within_noise(a, b)
    assert d == pytest.approx(9.0)
    assert error == pytest.approx(math.sqrt(4.0 / 3 + 1.0 / 3))  # sample variances 4 and 1, three seeds each
    assert not noise
    assert cm.within_noise([1.0, 5.0, 9.0], [0.0, 2.0, 4.0])[2]  # 3 ± 2.6: within noise


@pytest.mark.parametrize("gains, reference", [([8.1], [8.5]), ([8.1], [8.5, 7.0, 9.0]), ([7.0, 9.0], [8.5])])
def test_one_seed_gets_no_verdict_and_no_spread(gains, reference, tmp_path):
    """A seed's sample std is undefined, not 0: a 0.4-point difference of two single runs is no "worse"."""
    verdict = cm.noise_verdict(gains, reference)
    assert "no noise estimate" in verdict and not verdict.endswith(("worse", "better", "within noise"))
    base = {0: {cm.COLOR_COUNT: 0.40, cm.EXACT: 0.30}}
    _, cells = cm.gain_cells(
        [_run("shapes", 0, 0.481, 0.32, 3, tmp_path)], base, argparse.Namespace(eval_samples=8, clock="cpu")
    )
    assert "(one seed)" in cells and "±" not in cells


def _run(preset, seed, cc, exact, steps, tmp_path):
    run = cm.Run(preset, 1.0, seed, tmp_path)
    run.summary = {cm.COLOR_COUNT: cc, cm.EXACT: exact, f"{cm.COLOR_COUNT}/pass@8": 0.9}
    run.rows = [
        {"reward/total/mean": 0.5, "time/cpu": 60.0 * (i + 1), "global_step": 4 * (i + 1)} for i in range(steps)
    ]
    run.images_per_epoch = 128
    return run


def test_table_gains_are_against_the_same_seeds_base(tmp_path):
    base = {0: {cm.COLOR_COUNT: 0.40, cm.EXACT: 0.30, "images": 1536.0}, 1: {cm.COLOR_COUNT: 0.50, cm.EXACT: 0.35}}
    runs = [
        _run("shapes", 0, 0.45, 0.32, 3, tmp_path),
        _run("shapes", 1, 0.53, 0.36, 3, tmp_path),
        _run("shapes_nft", 0, 0.52, 0.40, 2, tmp_path),
        _run("shapes_nft", 1, 0.60, 0.45, 2, tmp_path),
    ]
    args = argparse.Namespace(
        presets=["shapes", "shapes_nft"], seeds=[0, 1], minutes=3.0, budgets=[1.0], jobs=2, eval_samples=8, clock="cpu"
    )
    page = cm.write_table(runs, base, args, "curves.png", argv_shown="cmd")
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| `")}
    assert "+4.0 ± 1.4 | +5.0 / +3.0 | +1.5 ± 0.7 | 90.0 | 3.0 | 3 | 384 | 12" in rows["`shapes`"]
    assert "+11.0 ± 1.4 | +12.0 / +10.0 | +10.0 ± 0.0 | 90.0 | 2.0 | 2 | 256 | 8" in rows["`shapes_nft`"]
    assert "`shapes_nft` ×1: +7.0 ± 1.4 points: better" in page and "(1536 images)" in page


def test_curves_are_trailing_means_interpolated_inside_each_runs_span(tmp_path):
    rows = [{"reward/total/mean": float(r), "time/cpu": 60.0 * i} for i, r in enumerate([0, 1, 2, 3])]
    curve = cm.smoothed_curve(rows, [0.0, 0.5, 1.0, 3.0, 4.0], window=2)  # trailing means 0, 0.5, 1.5, 2.5
    assert curve[:4] == pytest.approx([0.0, 0.25, 0.5, 2.5]) and math.isnan(curve[4])
    runs = [_run("shapes", 0, 0.45, 0.32, 3, tmp_path), _run("shapes", 1, 0.53, 0.36, 2, tmp_path)]
    cm.write_curves(runs, tmp_path / "curves.png", minutes=2.0)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_preset_may_name_its_own_budgets():
    assert cm.preset_budgets(["shapes@1,2", "shapes_nft", "x.yaml@2"], [1.0]) == {
        "shapes": [1.0, 2.0],
        "shapes_nft": [1.0],
        "x.yaml": [2.0],
    }


@pytest.fixture
def fake_training(monkeypatch):
    """The training subprocess and the evaluations faked (a run folder as rank 0 writes it); returns the commands and
    their environments."""
    launched = []

    def run(command, stdout=None, stderr=None, env=None, cwd=None):
        launched.append((command, env))
        output = Path(next(a for a in command if a.startswith("run.output_dir=")).partition("=")[2])
        folder = output / "20260101-000000"
        (folder / "checkpoints" / "epoch-00002").mkdir(parents=True)
        rows = [{"reward/total/mean": 0.5, "time/elapsed": 6.0 * (e + 1), "global_step": 4 * (e + 1)} for e in range(2)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / "curves.png").write_bytes(b"")
        return subprocess.CompletedProcess(command, 0)

    def evaluate(*_, **__):
        return {cm.COLOR_COUNT: 0.5, cm.EXACT: 0.4, f"{cm.COLOR_COUNT}/pass@1": 0.5, "images": 96.0}

    monkeypatch.setattr(cm, "POOL", ThreadPoolExecutor)
    monkeypatch.setattr(cm.subprocess, "run", run)
    monkeypatch.setattr(cm, "_evaluate_run", evaluate)
    monkeypatch.setattr(cm, "_evaluate_base", evaluate)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    return launched


def test_two_processes_launch_each_run_under_ddp_in_its_own_folder(fake_training, tmp_path, capsys):
    work = tmp_path / "work"
    argv = ["--presets", "shapes", "--seeds", "0", "--minutes", "0.5", "--processes", "2", "--jobs", "1"]
    argv += ["--clock", "wall", "--eval-samples", "1", "--work", str(work), "--out", str(tmp_path / "m.md")]
    assert cm.main([*argv, "train.batch_size=16"]) == 0
    ((command, env),) = fake_training
    train = str(ROOT / "scripts" / "train.py")
    launch = [sys.executable, "-m", "accelerate.commands.launch", *cm.launcher(2), train]
    assert command[: command.index(train) + 1] == launch  # tests/test_distributed.py's DDP flags, a free port
    assert " ".join(cm.launcher(2)) == (
        "--multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no --main_process_port 0"
    )
    assert "train.batch_size=16" in command and "run.budget_clock=wall" in command
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    assert (work / "shapes-0.5min-wall-2proc" / "seed0" / "train.log").is_file()
    assert "2 processes, one thread each" in (tmp_path / "m.md").read_text()
    assert "warning" not in capsys.readouterr().err  # 16 per process × 2: the preset's 4 optimizer steps of 32

    args = cm.argparse.Namespace(processes=2, jobs=1, clock="wall", eval_samples=1, minutes=1.0, overrides=[])
    assert cm.load_budgeted({"shapes": ("shapes", [])}, args) is not None
    assert "takes 2 optimizer steps per epoch at 2 processes, its preset 4" in capsys.readouterr().err
    # An lr schedule over run.epochs, which the budget leaves open, is refused; one with its own length is not.
    cosine = ["train.lr_schedule=cosine", "train.batch_size=16"]
    assert cm.load_budgeted({"shapes": ("shapes", cosine)}, args) is None
    assert "set train.lr_schedule_steps" in capsys.readouterr().err
    assert cm.load_budgeted({"shapes": ("shapes", [*cosine, "train.lr_schedule_steps=280"])}, args) is not None
    warmup = ["train.lr_schedule=constant_with_warmup", "train.lr_warmup_steps=4", "train.batch_size=16"]
    assert cm.load_budgeted({"shapes": ("shapes", warmup)}, args) is not None  # its length does not matter

    fake_training.clear()  # one process: the command as before, the folder without a process count
    assert cm.main([*argv[:6], "--jobs", "1", *argv[10:]]) == 0
    ((command, _),) = fake_training
    assert command[:2] == [sys.executable, train] and (work / "shapes-0.5min-wall" / "seed0").is_dir()
    assert "trained on one thread" in (tmp_path / "m.md").read_text()


def test_a_variant_carries_its_own_overrides_row_and_folder(fake_training, tmp_path, capsys):
    """``preset+key=value+...``: its overrides come before the ones given to every run, in its own folder and row;
    the plain preset beside it runs without them, and both are measured against one base evaluation."""
    assert cm.split_variant("shapes_fpo+grpo.fpo.weighting=elbo+train.lr=1e-3") == (
        "shapes_fpo",
        ["grpo.fpo.weighting=elbo", "train.lr=1e-3"],
    )
    assert cm.split_variant("shapes") == ("shapes", [])
    assert cm.split_variant("shapes+lr") is None and cm.split_variant("+a=1") is None
    work, out = tmp_path / "work", tmp_path / "m.md"
    variant = "shapes_fpo+grpo.fpo.weighting=elbo"
    argv = ["--presets", "shapes_fpo", f"{variant}@1,2", "--seeds", "0", "--minutes", "0.5", "--jobs", "1"]
    argv += ["--clock", "wall", "--eval-samples", "1", "--work", str(work), "--out", str(out), "train.lr=1e-4"]
    assert cm.main(argv) == 0
    assert len(fake_training) == 3  # the preset at ×1, the variant at ×1 and ×2
    own = [c for c, _ in fake_training if "grpo.fpo.weighting=elbo" in c]
    assert len(own) == 2 and all(c.index("grpo.fpo.weighting=elbo") < c.index("train.lr=1e-4") for c in own)
    assert all(Path(c[c.index("--config") + 1]).name == "shapes_fpo.yaml" for c, _ in fake_training)
    assert (work / f"{variant}-0.5min-wall" / "seed0" / "train.log").is_file()
    assert (work / f"{variant}-1min-wall" / "seed0" / "train.log").is_file()
    page = out.read_text()
    assert f"| `{variant}` | ×1 |" in page and f"| `{variant}` | ×2 |" in page and "| `shapes_fpo` | ×1 |" in page
    assert f"- `{variant}` ×1: " in page  # against the plain preset, the first
    assert cm.main(["--presets", "shapes+lr", "--work", str(work), "--out", str(out)]) == 2
    assert "a variant is preset+key=value" in capsys.readouterr().err


def test_a_finished_run_is_reused_only_under_the_settings_it_was_trained_with(fake_training, tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "m.md"
    argv = ["--presets", "shapes", "--seeds", "0", "--minutes", "0.5", "--jobs", "1", "--clock", "wall"]
    argv += ["--eval-samples", "1", "--work", str(work), "--out", str(out)]
    assert cm.main([*argv, "train.lr=1e-4"]) == 0 and len(fake_training) == 1
    folder = work / "shapes-0.5min-wall" / "seed0"
    assert json.loads((folder / cm.SETTINGS_FILE).read_text())["overrides"] == ["train.lr=1e-4"]
    assert cm.main([*argv, "train.lr=1e-4"]) == 0 and len(fake_training) == 1  # the same settings: reused
    assert cm.main([*argv, "train.lr=2e-4"]) == 1 and len(fake_training) == 1  # refused, nothing trained
    err = " ".join(capsys.readouterr().err.split())
    assert str(folder) in err and "another --work" in err
    assert "overrides ['train.lr=1e-4'], now ['train.lr=2e-4']" in err
    (folder / cm.SETTINGS_FILE).unlink()  # trained before settings were recorded: reused as it is
    assert cm.main([*argv, "train.lr=2e-4"]) == 0 and len(fake_training) == 1


def test_overrides_the_base_evaluation_refuses_are_refused_before_any_run_trains(fake_training, tmp_path, capsys):
    # 192 samples an epoch take batches of 24; the base evaluation loads the first preset (128) with them too.
    argv = ["--presets", "shapes_best+grpo.groups_per_epoch=24", "--seeds", "0", "--work", str(tmp_path / "w")]
    assert cm.main([*argv, "--out", str(tmp_path / "m.md"), "train.batch_size=24"]) == 2
    err = capsys.readouterr().err
    assert "the shipped model is evaluated under shapes_best" in err and "train.batch_size=24" in err
    assert "preset+key=value" in err and fake_training == [] and not list(tmp_path.iterdir())


def test_several_processes_are_refused_on_the_cpu_clock_and_on_shared_cores(
    fake_training, monkeypatch, tmp_path, capsys
):
    argv = ["--presets", "shapes", "--seeds", "0", "--processes", "2", "--work", str(tmp_path)]
    assert cm.main([*argv, "--jobs", "1"]) == 2  # --clock cpu, the default
    assert "the CPU clock is per process" in capsys.readouterr().err
    assert cm.main([*argv, "--jobs", "2", "--clock", "wall"]) == 2  # 4 processes on 2 cores
    assert "share cores, and a wall-clock budget would be unfair" in capsys.readouterr().err
    assert cm.main([*argv, "--jobs", "1", "--processes", "0", "--clock", "wall"]) == 2
    assert fake_training == [] and not list(tmp_path.iterdir())
    assert cm.processes_problem(2, 2, "wall") is not None and cm.processes_problem(1, 2, "cpu") is None
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert cm.processes_problem(2, 2, "wall") is None


@pytest.mark.parametrize("use_ema", [False, True])
def test_a_final_model_is_evaluated_with_the_weights_its_run_would_evaluate(monkeypatch, tmp_path, use_ema):
    # A run with eval.use_ema evaluates (and exports with --ema) its EMA weights; the table must read the same ones.
    import flowgrpo.evaluation
    import flowgrpo.export
    from flowgrpo.config import load_config

    loaded = {}

    def adapter_from_checkpoint(config, checkpoint, *, ema=False, **_):
        loaded.update(checkpoint=checkpoint, ema=ema)
        return object()

    monkeypatch.setattr(flowgrpo.export, "adapter_from_checkpoint", adapter_from_checkpoint)
    monkeypatch.setattr(flowgrpo.evaluation, "evaluate", lambda *_, **__: ({cm.COLOR_COUNT: 0.5}, None, ["p"], None))
    config = load_config(ROOT / "configs" / "shapes.yaml", ["train.ema=0.9", f"eval.use_ema={str(use_ema).lower()}"])
    assert cm._evaluate(config, tmp_path, 1) == {cm.COLOR_COUNT: 0.5, "images": 1.0}
    assert loaded == {"checkpoint": tmp_path, "ema": use_ema}


def test_paired_verdict_is_twice_the_standard_error_of_the_run_by_run_differences():
    # The EMA against its own runs' last weights (docs/methods.md's shapes_best rows): 3.3, 3.6, 0.2 apart.
    verdict = cm.paired_verdict([17.4, 17.1, 18.0], [14.1, 13.5, 17.8])
    differences = [3.3, 3.6, 0.2]
    error = statistics.stdev(differences) / math.sqrt(3)  # 1.09: the unpaired error would be 1.4
    assert verdict == f"+2.4 ± {error:.1f} points (+3.3 / +3.6 / +0.2): better"
    assert cm.paired_verdict([17.4, 17.1, 18.0], [14.1, 17.5, 17.8]).endswith("within noise")
    assert "no noise estimate" in cm.paired_verdict([8.0], [6.0])


def test_also_last_adds_the_last_weights_row_and_the_paired_lead(tmp_path):
    base = {0: {cm.COLOR_COUNT: 0.40, cm.EXACT: 0.30}, 1: {cm.COLOR_COUNT: 0.50, cm.EXACT: 0.35}}
    runs = [_run("shapes_best", 0, 0.58, 0.40, 3, tmp_path), _run("shapes_best", 1, 0.66, 0.45, 3, tmp_path)]
    runs += [_run("shapes", 0, 0.45, 0.32, 3, tmp_path), _run("shapes", 1, 0.53, 0.36, 3, tmp_path)]
    runs[0].last_summary = {cm.COLOR_COUNT: 0.55, cm.EXACT: 0.38}
    runs[1].last_summary = {cm.COLOR_COUNT: 0.64, cm.EXACT: 0.44}
    args = argparse.Namespace(seeds=[0, 1], minutes=1.0, jobs=1, clock="cpu", eval_samples=8)
    page = cm.write_table(runs, base, args, "c.png", argv_shown="x")
    last_row = next(line for line in page.splitlines() if line.startswith("| `shapes_best`, its last weights"))
    assert "| +14.5 ± 0.7 | +15.0 / +14.0 | +8.5 ± 0.7 |" in last_row  # against each seed's base, as the EMA row
    # Paired: differences 3 and 2, standard error 0.5; unpaired (± 1.4 and ± 0.7 over two seeds each) it would be 1.1
    assert "- `shapes_best` ×1: +2.5 ± 0.5 points (+3.0 / +2.0): better" in page
    assert "`shapes`, its last weights" not in page  # no EMA evaluated, no pair


def test_last_weights_are_evaluated_only_for_runs_that_evaluate_an_ema(monkeypatch, tmp_path):
    import flowgrpo.export
    from flowgrpo.config import load_config

    calls = []
    monkeypatch.setattr(cm, "_final_checkpoint", lambda folder: tmp_path)
    monkeypatch.setattr(cm, "_evaluate", lambda config, checkpoint, samples, ema=None: calls.append(ema) or {"a": 1})
    for use_ema in (False, True):
        config = load_config(
            ROOT / "configs" / "shapes.yaml", ["train.ema=0.9", f"eval.use_ema={str(use_ema).lower()}"]
        )
        monkeypatch.setattr(flowgrpo.export, "run_config", lambda *_, config=config: config)
        assert cm._evaluate_run(tmp_path, 8, last=True) == (None if not use_ema else {"a": 1})
    assert calls == [False] and json.loads((tmp_path / "eval8-last.json").read_text()) == {"a": 1}
    assert cm._evaluate_run(tmp_path, 8) == {"a": 1} and calls == [False, None]  # the EMA itself, its own file
    assert cm._evaluate_run(tmp_path, 8, last=True) == {"a": 1} and len(calls) == 2  # cached


def test_also_last_reads_each_runs_last_weights_into_its_own_row(fake_training, monkeypatch, tmp_path):
    def evaluate_run(folder, samples, last=False):  # seed 1's EMA 3 points above its last weights, seed 0's 5
        ema = 0.5 + 0.01 * ("seed1" in str(folder))
        cc = ema - (0.03 if "seed1" in str(folder) else 0.05) if last else ema
        return {cm.COLOR_COUNT: cc, cm.EXACT: 0.4, f"{cm.COLOR_COUNT}/pass@1": 0.5, "images": 96.0}

    monkeypatch.setattr(cm, "_evaluate_run", evaluate_run)
    out = tmp_path / "m.md"
    argv = ["--presets", "shapes_best", "--seeds", "0", "1", "--minutes", "0.5", "--jobs", "1", "--clock", "wall"]
    argv += ["--eval-samples", "1", "--work", str(tmp_path / "work"), "--out", str(out)]
    assert cm.main(argv) == 0 and "its last weights" not in out.read_text()  # only when asked
    assert cm.main([*argv, "--also-last"]) == 0
    page = out.read_text()
    assert "| `shapes_best`, its last weights | ×1 | -3.5 ± 2.1 | -5.0 / -2.0 |" in page  # the base: 0.5 each seed
    assert "- `shapes_best` ×1: +4.0 ± 1.0 points (+5.0 / +3.0): better" in page  # EMA rows +0.0 / +1.0
