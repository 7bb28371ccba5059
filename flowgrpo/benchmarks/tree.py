"""BranchGRPO's tree rollout against G independent chains, measured beside the arithmetic.

    python scripts/bench.py tree                                   # tiny SD3 pipeline on the CPU, the paper's tree
    python scripts/bench.py tree --real-size --device cuda         # an SD3.5-M-size random transformer

One group of G = K^|S| images, T steps, splits S (default: the paper's 20 steps split at 0, 3, 6, 9 in two: 16
leaves). Both sample every step but the last with the SDE and store it:

- ``chains``: :func:`flowgrpo.rollout.rollout` on G images, window ``0..T-2``: ``G·T`` forward rows;
- ``tree``: :func:`flowgrpo.rollouts.tree.tree_rollout`: one row per node and step, ``sum_{d<T} n(d)`` rows
  (203 of 320 for the paper's tree).

``rows/image`` counts the rows each image costs (a hook on the transformer, CFG's doubling removed); the time ratio
tree ÷ chains is compared with the row arithmetic (target: within 10%; prompts cached, no decoding, so the
transformer's work dominates). ``train terms`` is the other saving: W stored slots per image (each edge once) against
the T - 1 a chain stores and trains.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from flowgrpo.benchmarks.common import finish, interleaved, markdown_table, parse, verdict
from flowgrpo.benchmarks.rollout import DTYPES, GUIDANCE, build, forward_rows
from flowgrpo.config import SamplerConfig
from flowgrpo.rollout import rollout
from flowgrpo.rollouts.tree import TreeShape, slots_per_leaf, tree_rollout

SMOKE_ARGS = ["--steps", "6", "--splits", "0,2", "--size", "32", "--repeats", "1"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["sd3", "flux"], default="sd3")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--splits", default="0,3,6,9", help="split steps, comma-separated (the paper: 0,3,6,9)")
    parser.add_argument("--factor", type=int, default=2, help="children per split (the paper: 2)")
    parser.add_argument("--size", type=int, default=None, help="image size (default 64 tiny, 512 real-size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--real-size", action="store_true", help="SD3.5-M / FLUX.1-dev-size random transformers")
    parser.add_argument("--layers", type=int, default=None, help="shrink the real-size transformer (smoke runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--attention", choices=["sdpa", "xformers"], default="sdpa")


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.size = args.size or (512 if args.real_size else 64)
    args.dtype = args.dtype or ("bf16" if str(args.device).startswith("cuda") else "fp32")
    _, adapter = build(args.kind, args)
    shape = TreeShape(args.steps, tuple(int(s) for s in args.splits.split(",")), args.factor)
    g, steps, gs = shape.leaves, args.steps, GUIDANCE[args.kind]
    sampler = SamplerConfig(noise_level=0.7, num_steps=steps, guidance_scale=gs, same_initial_noise=True)
    texts, groups, leaves = ["a prompt"] * g, [0] * g, list(range(g))
    adapter.encode_prompts(texts, with_negative=adapter.needs_negative(gs))  # cached, as in training
    sde = list(range(steps - 1))
    cases = {
        "chains": lambda: rollout(
            adapter, texts, groups, sampler, range(0, steps - 1), torch.Generator().manual_seed(1),
            height=args.size, width=args.size, decode=False,
        ),
        "tree": lambda: tree_rollout(
            adapter, texts, groups, leaves, sampler, shape, sde=sde, stored=sde,
            height=args.size, width=args.size, decode=False,
        ),
    }  # fmt: skip
    t = interleaved(cases, args.repeats, args.device)
    per_call = 2 if adapter.needs_negative(gs) else 1
    rows = []
    arithmetic = {"chains": 1.0, "tree": shape.forward_rows() / (g * steps)}
    slots = {"chains": steps - 1, "tree": slots_per_leaf(shape, sde)}
    for name, fn in cases.items():
        with forward_rows(adapter) as counted:
            fn()
        ratio = t[name] / t["chains"]
        rows.append(
            {
                "case": name,
                "G": g,
                "T": steps,
                "splits": list(shape.splits),
                "forwards": len(counted),
                "rows_per_image": sum(counted) / per_call / g,
                "arithmetic": arithmetic[name],
                "seconds": t[name],
                "ratio": ratio,
                "train_terms_per_image": slots[name],
                "pass": abs(ratio / arithmetic[name] - 1) <= 0.10,
            }
        )
    return {"benchmark": "tree", "args": vars(args), "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    a, r0 = result["args"], result["rows"][0]
    scale = "real-size random" if a["real_size"] else "tiny"
    return "\n".join(
        [
            f"**Tree rollout** — {scale} {a['kind']} on {a['device']} ({a['dtype']}), one group of G = {r0['G']}, "
            f"T = {r0['T']} steps, splits {r0['splits']} × {a['factor']}, {a['size']}×{a['size']} px, no decoding: "
            "tree ÷ G independent chains against the row arithmetic Σ n(d) / (G·T) (target: within 10%).",
            "",
            markdown_table(
                [
                    "case",
                    "forwards",
                    "rows/image",
                    "arithmetic",
                    "s",
                    "ratio",
                    "ratio ÷ arith.",
                    "train terms/image",
                    "",
                ],
                [
                    [
                        r["case"],
                        r["forwards"],
                        r["rows_per_image"],
                        r["arithmetic"],
                        r["seconds"],
                        r["ratio"],
                        r["ratio"] / r["arithmetic"],
                        r["train_terms_per_image"],
                        verdict(r["pass"]),
                    ]
                    for r in result["rows"]
                ],
            ),
        ]
    )


def main(argv: list[str]) -> int:
    args = parse("tree", __doc__, add_arguments, argv)
    return finish(run(args), markdown, args.json)
