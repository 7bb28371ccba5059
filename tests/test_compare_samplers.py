"""scripts/compare_samplers.py under compare_methods' protocol, with training and evaluation faked: the runs it asks
for (a sampler's overrides, each seed, the budget), its cache, and the table's rows, calls and noise verdicts."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from script_helper import load_script

ROOT = Path(__file__).resolve().parent.parent
cs = load_script("compare_samplers", register=True)
cm = cs.cm

GAINS = {"flowgrpo": (0.05, 0.06, 0.07), "cps": (0.15, 0.16, 0.17)}  # colour+count above each seed's base


@pytest.fixture
def fake(monkeypatch):
    """compare_methods' training and evaluation replaced by files and numbers; returns the training calls."""
    trained = []

    def train(run, minutes, overrides, clock="cpu"):
        trained.append((run.name, run.seed, minutes, clock, [*run.overrides, *overrides]))
        folder = run.folder / "20260101-000000"
        (folder / "checkpoints" / "epoch-0002").mkdir(parents=True)
        epochs = 3 if run.name == "cps" else 2  # cps's two trained steps make faster epochs
        rows = [
            {"reward/total/mean": 0.5, "time/cpu": 50.0 * (e + 1), "global_step": 4 * (e + 1), "epoch": e}
            for e in range(epochs)
        ]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / "curves.png").write_bytes(b"")
        return 0

    def evaluate_run(folder, samples):
        name, seed = folder.parent.name.split("-")[1], int(folder.name.removeprefix("seed"))
        cc = 0.4 + 0.01 * seed + GAINS.get(name, (0.1,) * 3)[seed]
        return {cm.COLOR_COUNT: cc, cm.EXACT: 0.3, f"{cm.COLOR_COUNT}/pass@{samples}": 0.875}

    def evaluate_base(preset, seed, samples, overrides, work=None):
        return {cm.COLOR_COUNT: 0.4 + 0.01 * seed, cm.EXACT: 0.3, "images": 1536.0}

    monkeypatch.setattr(cm, "POOL", ThreadPoolExecutor)
    monkeypatch.setattr(cm, "_train", train)
    monkeypatch.setattr(cm, "_evaluate_run", evaluate_run)
    monkeypatch.setattr(cm, "_evaluate_base", evaluate_base)
    return trained


def test_samplers_train_at_equal_time_and_the_table_compares_them_with_flowgrpo(fake, tmp_path):
    argv = ["--samplers", "flowgrpo", "cps", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "s.md")]
    assert cs.main(argv) == 0
    assert sorted((n, s, m, c) for n, s, m, c, _ in fake) == [
        (n, s, 2.5, "cpu") for n in ("cps", "flowgrpo") for s in (0, 1, 2)
    ]
    assert all(o == cs.SAMPLERS[n][1] for n, _, _, _, o in fake)
    assert (tmp_path / "work" / "shapes-cps-2.5min-cpu" / "seed2").is_dir()
    page = (tmp_path / "s.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| ") and "±" in line}
    # gain, per seed, exact gain, pass@8, minutes, epochs, images (128 an epoch), steps, calls and trained steps
    assert (
        "| +6.0 ± 1.0 | +5.0 / +6.0 / +7.0 | +0.0 ± 0.0 | 87.5 | 1.7 | 2 | 256 | 8 | 14.0 | 4.0 |" in rows["flowgrpo"]
    )
    assert (
        "| +16.0 ± 1.0 | +15.0 / +16.0 / +17.0 | +0.0 ± 0.0 | 87.5 | 2.5 | 3 | 384 | 12 | 12.0 | 2.0 |" in rows["cps"]
    )
    assert "- cps: +10.0 ± 0.8 points: better" in page and "(1536 images)" in page
    assert "cc pass@8 %" in page and (tmp_path / "s_curves.png").read_bytes()[:4] == b"\x89PNG"

    fake.clear()  # a second call reuses the finished runs
    assert cs.main([*argv, "--seeds", "0", "1"]) == 0 and fake == []


def test_the_global_overrides_follow_the_samplers_and_a_failed_run_stops_it(fake, monkeypatch, tmp_path):
    def fail(run, minutes, overrides, clock="cpu"):
        fake.append([*run.overrides, *overrides])
        return 1

    monkeypatch.setattr(cm, "_train", fail)
    argv = ["--samplers", "dancegrpo", "--seeds", "0", "--work", str(tmp_path), "--out", str(tmp_path / "s.md")]
    assert cs.main([*argv, "--minutes", "1", "sampler.noise_level=0.5"]) == 1
    assert fake == [["sampler.diffusion=dance", "sampler.noise_level=0.3", "sampler.noise_level=0.5"]]
    assert not (tmp_path / "s.md").exists()


def test_overrides_the_base_evaluation_refuses_are_refused_before_any_run_trains(fake, tmp_path, capsys):
    # squared_error log-probs are CPS's only: cps' own overrides take them, the preset the base is evaluated under not.
    argv = ["--samplers", "cps", "--seeds", "0", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "s.md")]
    assert cs.main([*argv, "sampler.log_prob=squared_error"]) == 2
    assert "the shipped model is evaluated under shapes" in capsys.readouterr().err
    assert fake == [] and not list(tmp_path.iterdir())


def test_the_script_never_writes_docs_shapes_md(fake):
    with pytest.raises(SystemExit):
        cs.main(["--out", str(ROOT / "docs" / "shapes.md")])
    assert fake == []


def test_compare_methods_keeps_its_runs_and_table_on_the_shared_functions(fake, tmp_path):
    argv = ["--presets", "shapes", "shapes_nft@2", "--seeds", "0", "1", "--work", str(tmp_path), "grpo.kl.beta=0"]
    assert cm.main([*argv, "--out", str(tmp_path / "m.md")]) == 0
    assert sorted((n, s, m, o) for n, s, m, _, o in fake) == [("", s, 3.5, ["grpo.kl.beta=0"]) for s in (0, 0, 1, 1)]
    assert {p.name for p in tmp_path.iterdir()} >= {"shapes-3.5min-cpu", "shapes_nft-7min-cpu", "m.md"}
    page = (tmp_path / "m.md").read_text()
    assert "| `shapes` | ×1 | +10.0 ± 0.0 | +10.0 / +10.0 |" in page and "| `shapes_nft` | ×2 | +10.0 ± 0.0 |" in page
    assert "| preset | budget | colour+count gain | per seed |" in page and (tmp_path / "m_curves.png").is_file()
