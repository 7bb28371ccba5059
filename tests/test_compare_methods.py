"""scripts/compare_methods.py's arithmetic: gains against each seed's base, the noise verdict, the table's rows."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("compare_methods", ROOT / "scripts" / "compare_methods.py")
cm = importlib.util.module_from_spec(spec)
sys.modules["compare_methods"] = cm  # dataclasses look their module up
spec.loader.exec_module(cm)


def test_noise_verdict_is_twice_the_standard_error_of_the_difference():
    a, b = [10.0, 12.0, 14.0], [2.0, 3.0, 4.0]
    d, error, noise = cm.within_noise(a, b)
    assert d == pytest.approx(9.0)
    assert error == pytest.approx(math.sqrt(4.0 / 3 + 1.0 / 3))  # sample variances 4 and 1, three seeds each
    assert not noise
    assert cm.within_noise([1.0, 5.0, 9.0], [0.0, 2.0, 4.0])[2]  # 3 ± 2.6: within noise


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
