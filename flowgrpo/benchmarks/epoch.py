"""Where an epoch's time goes: sampling, reward wait, advantages, training, checkpoint and idle, with rewards scored
in the background (the trainer's ``AsyncReward``) and inline.

    python scripts/bench.py epoch [--configs configs/tiny_sd3.yaml,configs/shapes.yaml] [--epochs 3]

The real trainer (``GRPOTrainer.fit`` on the config, evaluation off, a checkpoint every epoch) records its phases
with its own phase timer (:class:`flowgrpo.phases.PhaseTimer`: host clock only, no device syncs added); idle is
the epoch's wall time that no phase covers (logging, metric summaries, signal agreement). The first epoch (warm-up:
lazy initialisation, allocator growth) is left out; the others' medians are reported. Inline scoring is the same
``AsyncReward`` waiting for each batch's scores as soon as it is submitted, so scoring no longer overlaps the next
batch's sampling; the time it waits is moved from sampling to the reward wait. Target: idle ≤ 10% of an epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from typing import Any
from unittest import mock

from flowgrpo import trainer as trainer_module
from flowgrpo.benchmarks.common import ROOT, finish, markdown_table, parse, verdict
from flowgrpo.config import load_config
from flowgrpo.phases import PHASES
from rewards import AsyncReward

CONFIGS = "configs/tiny_sd3.yaml,configs/shapes.yaml"
SMOKE_ARGS = [
    "--configs",
    "configs/tiny_sd3.yaml",
    "--epochs",
    "2",
    "--set",
    "grpo.groups_per_epoch=2",
    "sampler.num_steps=3",
    "sampler.batch_size=4",
    "train.batch_size=4",
]
SHOWN = ("sampling", "reward_wait", "advantages", "training", "checkpoint", "idle")


class InlineScoring(AsyncReward):
    """The trainer's scorer, waiting for each batch's scores at submission (no overlap with sampling)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waited = 0.0

    def submit(self, *args: Any, **kwargs: Any) -> int:
        index = super().submit(*args, **kwargs)
        start = time.perf_counter()
        self._futures[-1][1].exception()  # waits; a failure is raised by results(), as with background scoring
        self.waited += time.perf_counter() - start
        return index


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default=CONFIGS, help="comma-separated trainer configs")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (the first is left out)")
    parser.add_argument("--repeats", type=int, default=1, help="background/inline run pairs, interleaved")
    parser.add_argument("--set", nargs="*", default=[], help="key=value overrides for every config")
    parser.add_argument("--device", default="cpu")


def one_run(path: str, args: argparse.Namespace, inline: bool) -> list[dict[str, float]]:
    out = tempfile.mkdtemp(prefix="bench-epoch-")
    scorers: list[InlineScoring] = []

    def make_scorer(reward: Any, **kwargs: Any) -> AsyncReward:
        scorers.append(InlineScoring(reward, **kwargs))
        return scorers[-1]

    overrides = [
        f"run.output_dir={out}",
        f"run.epochs={args.epochs}",
        "run.progress=false",
        "eval.every=0",
        "checkpoint.every=1",
        "run.image_grid_every=0",
        *args.set,
    ]
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)  # the configs name their prompt files relative to the repository
        config = load_config(ROOT / path, overrides)
        patch = mock.patch.object(trainer_module, "AsyncReward", make_scorer) if inline else contextlib.nullcontext()
        with patch:
            trainer = trainer_module.GRPOTrainer(config)
            trainer.fit()
        epochs = trainer.phases.epochs()
    finally:
        os.chdir(cwd)
        shutil.rmtree(out, ignore_errors=True)
    for row, scorer in zip(epochs, scorers, strict=False):  # inline scoring happened inside the sampling phase
        row["sampling"] -= scorer.waited
        row["reward_wait"] += scorer.waited
    return epochs[1:] if len(epochs) > 1 else epochs


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for path in args.configs.split(","):
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for inline in (False, True):
                runs[inline] += one_run(path, args, inline)
        for inline, epochs in runs.items():
            row: dict[str, Any] = {"config": path, "rewards": "inline" if inline else "background"}
            for key in (*PHASES, "wall", "idle"):
                row[key] = statistics.median(e[key] for e in epochs)
            row["idle_fraction"] = row["idle"] / row["wall"]
            row["pass"] = row["idle_fraction"] <= 0.10
            rows.append(row)
    return {"benchmark": "epoch", "args": vars(args), "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    head = (
        f"**Epoch** — `GRPOTrainer.fit` on {a['device']}, {a['epochs']} epochs per run (the first left out), a "
        "checkpoint every epoch, evaluation off; share of the epoch's wall time per phase, rewards scored in the "
        "background (the trainer's default) or inline. Target: idle ≤ 10%."
    )
    table = markdown_table(
        ["config", "rewards", "epoch s", *SHOWN, ""],
        [
            [
                r["config"].removeprefix("configs/"),
                r["rewards"],
                r["wall"],
                *(f"{100 * r[k] / r['wall']:.1f}%" for k in SHOWN),
                verdict(r["pass"]),
            ]
            for r in result["rows"]
        ],
    )
    return head + "\n\n" + table


def main(argv: list[str]) -> int:
    args = parse("epoch", __doc__, add_arguments, argv)
    return finish(run(args), markdown, args.json)
