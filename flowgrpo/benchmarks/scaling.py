"""How rollout and train-step cost grow with batch, steps and resolution: cost ∝ x^e, e fitted on a log-log scale.

    python scripts/bench.py scaling [--batches 1,2,4,8] [--steps 2,4,8,16] [--sizes 32,64,128]

One adapter built as the trainer builds it (tiny SD3, LoRA r4, CFG). ``rollout``: the SDE rollout of a batch (every
step but the last in the window; prompts cached, no decoding: the network and the sampler maths). ``train step``: one
trained timestep of a stored rollout (:func:`~flowgrpo.objectives.clipped.timestep_loss` + backward). Each sweep
varies one of batch / steps / resolution around the base point (batch 4, 6 steps, 64 px); the points of a sweep are
timed in turn (interleaved repeats, medians) and e is the least-squares slope of log time on log x. Expected: steps e
≈ 1 (each step one forward; target 0.9 - 1.1); batch e ≤ 1 (rows share the per-call overhead; 1 once compute-bound;
target ≤ 1.1); resolution: tokens grow as px², linear layers as tokens, attention as tokens², so 2 ≤ e ≤ 4 once
compute-bound, less while per-call overhead dominates (target ≤ 4.2). A train step does not depend on the number of
steps (one timestep), so it has no steps sweep.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from flowgrpo.benchmarks.common import (
    bench_config,
    finish,
    interleaved,
    loglog_exponent,
    markdown_table,
    parse,
    prompts,
    tiny_overrides,
    verdict,
)
from flowgrpo.objectives.clipped import timestep_loss
from flowgrpo.pipelines import build_adapter
from flowgrpo.rollout import rollout

BASE = {"batch": 4, "steps": 6, "size": 64}
TARGETS = {"batch": (None, 1.1), "steps": (0.9, 1.1), "size": (None, 4.2)}
SMOKE_ARGS = ["--batches", "1,2", "--steps", "2,3", "--sizes", "32,48", "--repeats", "1", "--base-size", "32"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["sd3", "flux"], default="sd3")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--steps", default="2,4,8,16")
    parser.add_argument("--sizes", default="32,64,128", help="image sizes in pixels")
    parser.add_argument("--base-size", type=int, default=BASE["size"], help="resolution of the batch / steps sweeps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = {**BASE, "size": args.base_size}
    config = bench_config(tiny_overrides(args.kind, base["size"], base["steps"], base["batch"]))
    adapter = build_adapter(config.model, args.device)
    advantages = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(args.device)

    def sample(batch: int, steps: int, size: int):
        sampler = replace(config.sampler, num_steps=steps)
        texts = prompts(batch)
        return lambda: rollout(
            adapter,
            texts,
            list(range(batch)),
            sampler,
            range(0, steps - 1),
            torch.Generator().manual_seed(0),
            height=size,
            width=size,
            decode=False,
        )

    def train_step(batch: int, size: int) -> Callable[[], None]:
        adapter.transformer.eval()
        trajectory = sample(batch, base["steps"], size)()
        positions = torch.zeros(batch, dtype=torch.long)

        def step():
            adapter.transformer.train()
            loss, _ = timestep_loss(adapter, config, trajectory, positions, advantages[:batch])
            loss.backward()
            for p in adapter.trainable_parameters():
                p.grad = None
            adapter.transformer.eval()

        return step

    sweeps = {
        "batch": [int(x) for x in args.batches.split(",")],
        "steps": [int(x) for x in args.steps.split(",")],
        "size": [int(x) for x in args.sizes.split(",")],
    }
    rows = []
    for phase in ("rollout", "train step"):
        for var, values in sweeps.items():
            if phase == "train step" and var == "steps":
                continue
            cases = {}
            for x in values:
                point = {**base, var: x}
                cases[x] = (
                    sample(point["batch"], point["steps"], point["size"])
                    if phase == "rollout"
                    else train_step(point["batch"], point["size"])
                )
            t = interleaved(cases, args.repeats, args.device)
            exponent = loglog_exponent(values, [t[x] for x in values])
            low, high = TARGETS[var]
            rows.append(
                {
                    "phase": phase,
                    "variable": var,
                    "values": values,
                    "seconds": [t[x] for x in values],
                    "exponent": exponent,
                    "low": low,
                    "high": high,
                    "pass": (low is None or exponent >= low) and exponent <= high,
                }
            )
    return {"benchmark": "scaling", "args": vars(args), "base": base, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    a, b = result["args"], result["base"]
    head = (
        f"**Scaling** — tiny {a['kind']} on {a['device']} (CFG, no decoding); each sweep varies one variable "
        f"around batch {b['batch']}, {b['steps']} steps, {b['size']} px; cost ∝ x^e, e = least-squares log-log "
        f"slope; median of {a['repeats']} interleaved repeats."
    )
    names = {"batch": "batch", "steps": "steps", "size": "resolution (px)"}

    def target(r: dict[str, Any]) -> str:
        return f"{r['low']} – {r['high']}" if r["low"] is not None else f"≤ {r['high']}"

    table = markdown_table(
        ["phase", "variable", "points", "seconds", "exponent e", "target", ""],
        [
            [
                r["phase"],
                names[r["variable"]],
                ", ".join(map(str, r["values"])),
                ", ".join(f"{s:.3g}" for s in r["seconds"]),
                r["exponent"],
                target(r),
                verdict(r["pass"]),
            ]
            for r in result["rows"]
        ],
    )
    return head + "\n\n" + table


def main(argv: list[str]) -> int:
    args = parse("scaling", __doc__, add_arguments, argv)
    return finish(run(args), markdown, args.json)
