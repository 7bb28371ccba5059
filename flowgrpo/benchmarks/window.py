"""Training cost of MixGRPO's sliding windows against full Flow-GRPO training, and the trained-steps arithmetic.

    python scripts/bench.py window [--steps 25] [--windows 1,2,4,8] [--size 64] [--batch 4]

A tiny trainer (``GRPOTrainer`` from a config: LoRA, AdamW, one micro-batch per optimizer step) trains with its own
`train_on` the stored transitions of one rollout batch per window: a window of w steps starting at step 0 of a
T-step schedule (MixGRPO: w = 4 of T = 25), and Flow-GRPO's full window (every step but the last, T - 1 steps).
Training cost ratio = `train_on` time of the window ÷ of the full window; expected w / (T - 1), the trained
timesteps (target: within 10%). What does not shrink with the window (the optimizer step, gradient clipping, one
per micro-batch) is the difference.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from typing import Any

import torch

from flowgrpo.benchmarks.common import bench_config, finish, interleaved, markdown_table, parse, prompts, tiny_overrides
from flowgrpo.benchmarks.common import verdict as _verdict
from flowgrpo.rollout import rollout
from flowgrpo.trainer import GRPOTrainer

SMOKE_ARGS = ["--steps", "5", "--windows", "1,2", "--size", "32", "--batch", "4", "--repeats", "1"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["sd3", "flux"], default="sd3")
    parser.add_argument("--steps", type=int, default=25, help="T, the schedule's steps (MixGRPO: 25)")
    parser.add_argument("--windows", default="1,2,4,8", help="window sizes w")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="images per rollout batch = training micro-batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="bench-window-")
    try:
        overrides = tiny_overrides(
            args.kind,
            args.size,
            args.steps,
            args.batch,
            **{"run.output_dir": out, "run.progress": False, "eval.every": 0, "checkpoint.every": 0},
        )
        trainer = GRPOTrainer(bench_config(overrides))
        cfg = trainer.config
        full = args.steps - 1
        sizes = [int(w) for w in args.windows.split(",")]
        texts = prompts(args.batch)
        advantages = torch.randn(args.batch, generator=torch.Generator().manual_seed(1))
        cases = {}
        for w in [full, *sizes]:
            trajectory = rollout(
                trainer.adapter,
                texts,
                list(range(args.batch)),
                cfg.sampler,
                range(0, w),
                torch.Generator().manual_seed(0),
                height=args.size,
                width=args.size,
                decode=False,
            )
            cases[w] = lambda trajectory=trajectory: trainer.train_on(trajectory, advantages, 0)
        t = interleaved(cases, args.repeats, args.device)
        if trainer.run_lock is not None:
            trainer.run_lock.release()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    rows = []
    for w in [full, *sizes]:
        expected, ratio = w / full, t[w] / t[full]
        rows.append(
            {
                "window": w,
                "trained_steps": w,
                "expected": expected,
                "seconds": t[w],
                "ratio": ratio,
                "pass": abs(ratio / expected - 1) <= 0.10 if w != full else None,
            }
        )
    return {"benchmark": "window", "args": vars(args), "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    full = a["steps"] - 1
    head = (
        f"**Window** — tiny {a['kind']} trainer on {a['device']}, T = {a['steps']} steps, micro-batch "
        f"{a['batch']}, {a['size']}×{a['size']} px: `train_on` time of a w-step window ÷ Flow-GRPO's full window "
        f"({full} steps), "
        f"against w / {full} (target: within 10%); median of {a['repeats']} interleaved repeats."
    )
    table = markdown_table(
        ["window w", "trained steps ÷ full", "train s", "cost ÷ full", "cost ÷ expected", ""],
        [
            [
                "full" if r["window"] == full else r["window"],
                r["expected"],
                r["seconds"],
                r["ratio"],
                r["ratio"] / r["expected"],
                _verdict(r["pass"]),
            ]
            for r in result["rows"]
        ],
    )
    return head + "\n\n" + table


def main(argv: list[str]) -> int:
    args = parse("window", __doc__, add_arguments, argv)
    return finish(run(args), markdown, args.json)
