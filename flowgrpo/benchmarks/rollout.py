"""Rollout cost against diffusers' own ``pipe()``, per sampler, and shared-prefix rollouts against the arithmetic.

    python scripts/bench.py rollout                       # tiny pipelines on the CPU
    python scripts/bench.py rollout --real-size           # SD3.5-M / FLUX.1-dev-size random transformers (GPU)
    python scripts/bench.py rollout --real-size --layers 1 --size 256 --device cpu   # smoke run of that path

1. Samplers: our ODE rollout ÷ ``pipe()`` (target ≤ 1.05) and each SDE sampler's rollout ÷ our ODE rollout (target
   ≤ 1.10; Langevin with a re-evaluated score makes 2 network calls per window step, so its target is 1.10 × the
   call ratio (2T - 1) / T). Same steps, batch, initial latents and prompts, images decoded, every step in the window
   but the last. ``pipe()`` encodes its prompts on every call, so ours are re-encoded too (training caches them).
2. Shared prefix (``sampler.shared_prefix``, with ``same_initial_noise``): groups of G images, window of one step
   starting at k = 0, T/4, T/2, 3T/4; shared ÷ unshared time against the call arithmetic (k/G + T - k) / T
   (target: within 10%), prompts cached, no decoding (the transformer's work only). ``rows/image`` counts the
   forward rows each image costs, measured by a hook (T without sharing).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from flowgrpo.adapters import PipelineAdapter, make_adapter
from flowgrpo.benchmarks.common import finish, interleaved, markdown_table, parse, prompts, verdict
from flowgrpo.config import SamplerConfig
from flowgrpo.rollout import rollout
from flowgrpo.tiny import build_tiny_pipeline

GUIDANCE = {"sd3": 4.5, "flux": 3.5}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SDE_KINDS = {  # name -> sampler settings (noise level 0.7 throughout)
    "euler_maruyama": {"kind": "euler_maruyama"},
    "cps": {"kind": "cps"},
    "langevin_frozen": {"kind": "langevin", "score_eval": "frozen"},
    "langevin_reeval": {"kind": "langevin", "score_eval": "reeval"},
}
SMOKE_ARGS = [
    "--kind",
    "sd3",
    "--steps",
    "4",
    "--batch",
    "2",
    "--size",
    "32",
    "--repeats",
    "1",
    "--prefix-batch",
    "4",
    "--group",
    "2",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["sd3", "flux", "both"], default="both")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=None, help="image size (default 64 tiny, 512 real-size)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samplers", default=",".join(SDE_KINDS), help=f"subset of {', '.join(SDE_KINDS)}")
    parser.add_argument("--prefix-batch", type=int, default=8, help="shared prefix: images per rollout batch")
    parser.add_argument("--group", type=int, default=4, help="shared prefix: images per group (G)")
    parser.add_argument("--no-prefix", action="store_true", help="skip the shared-prefix part")
    parser.add_argument("--real-size", action="store_true", help="SD3.5-M / FLUX.1-dev-size random transformers")
    parser.add_argument("--layers", type=int, default=None, help="shrink the real-size transformer (smoke runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--attention", choices=["sdpa", "xformers"], default="sdpa")


def build(kind: str, args: argparse.Namespace) -> tuple[Any, PipelineAdapter]:
    """``(pipe, adapter)`` on the benchmark's device."""
    dtype = DTYPES[args.dtype]
    if args.real_size:
        from flowgrpo.benchmarks.models import build_random_pipeline

        pipe = build_random_pipeline(kind, num_layers=args.layers, dtype=dtype, device=args.device)
    else:
        pipe = build_tiny_pipeline(kind, seed=0, dtype=dtype).to(args.device)
    adapter = make_adapter(pipe)
    if args.attention != "sdpa":
        adapter.set_attention_backend(args.attention)
    return pipe, adapter


@contextlib.contextmanager
def forward_rows(adapter) -> Iterator[list[int]]:
    """The batch rows of every transformer forward while the context is open."""
    rows: list[int] = []

    def hook(module, args, kwargs):  # noqa: ARG001
        rows.append((kwargs.get("hidden_states") if "hidden_states" in kwargs else args[0]).shape[0])

    handle = adapter.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield rows
    finally:
        handle.remove()


def bench_samplers(kind: str, pipe, adapter, args: argparse.Namespace) -> list[dict[str, Any]]:
    size, steps, gs, batch = args.size, args.steps, GUIDANCE[kind], args.batch
    texts = prompts(batch)
    latents = adapter.initial_noise(batch, size, size, generator=torch.Generator().manual_seed(0))
    window = range(0, steps - 1)

    def run_pipe():
        with torch.no_grad():
            pipe(
                prompt=texts,
                latents=latents.clone(),
                num_inference_steps=steps,
                guidance_scale=gs,
                height=size,
                width=size,
                output_type="pt",
            )

    def ours(sampler: SamplerConfig):
        def run():
            adapter.clear_prompt_cache()  # pipe() encodes every call
            rollout(
                adapter,
                texts,
                list(range(batch)),
                sampler,
                window,
                torch.Generator().manual_seed(1),
                height=size,
                width=size,
                initial_latents=latents,
            )

        return run

    cases = {"pipe": run_pipe, "ode": ours(SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=gs))}
    for name in args.samplers.split(","):
        sampler = SamplerConfig(noise_level=0.7, num_steps=steps, guidance_scale=gs, **SDE_KINDS[name])
        cases[name] = ours(sampler)
    t = interleaved(cases, args.repeats, args.device)
    rows = [
        {
            "kind": kind,
            "case": "ode",
            "over": "pipe",
            "seconds": t["ode"],
            "ratio": t["ode"] / t["pipe"],
            "target": 1.05,
            "images_per_s": batch / t["ode"],
        }
    ]
    for name in args.samplers.split(","):
        calls = (2 * steps - 1) / steps if name == "langevin_reeval" else 1.0
        rows.append(
            {
                "kind": kind,
                "case": name,
                "over": "ode",
                "seconds": t[name],
                "ratio": t[name] / t["ode"],
                "target": round(1.10 * calls, 3),
                "images_per_s": batch / t[name],
            }
        )
    for row in rows:
        row["pass"] = row["ratio"] <= row["target"]
    rows.insert(
        0,
        {
            "kind": kind,
            "case": "pipe",
            "over": None,
            "seconds": t["pipe"],
            "ratio": None,
            "target": None,
            "images_per_s": batch / t["pipe"],
            "pass": None,
        },
    )
    return rows


def bench_prefix(kind: str, adapter, args: argparse.Namespace) -> list[dict[str, Any]]:
    size, steps, batch, group = args.size, args.steps, args.prefix_batch, args.group
    if batch % group:
        raise ValueError(f"--prefix-batch {batch} must be a multiple of --group {group}")
    texts = [f"prompt number {i // group}" for i in range(batch)]
    group_ids = [i // group for i in range(batch)]
    starts = sorted({min(k, steps - 2) for k in (0, steps // 4, steps // 2, 3 * steps // 4)})  # window ends by T - 1
    samplers = {
        shared: SamplerConfig(
            noise_level=0.7,
            num_steps=steps,
            guidance_scale=GUIDANCE[kind],
            same_initial_noise=True,
            shared_prefix=shared,
        )
        for shared in (True, False)
    }
    adapter.encode_prompts(texts, with_negative=adapter.needs_negative(GUIDANCE[kind]))  # cached, as in training

    def run(k: int, shared: bool):
        return lambda: rollout(
            adapter,
            texts,
            group_ids,
            samplers[shared],
            range(k, k + 1),
            torch.Generator().manual_seed(1),
            height=size,
            width=size,
            decode=False,
        )

    cases = {f"{k}/{shared}": run(k, shared) for k in starts for shared in (True, False)}
    t = interleaved(cases, args.repeats, args.device)
    rows = []
    for k in starts:
        with forward_rows(adapter) as counted:
            run(k, True)()
        per_call = 2 if adapter.needs_negative(GUIDANCE[kind]) else 1
        arithmetic = (k / group + steps - k) / steps
        ratio = t[f"{k}/True"] / t[f"{k}/False"]
        rows.append(
            {
                "kind": kind,
                "k": k,
                "T": steps,
                "G": group,
                "rows_per_image": sum(counted) / per_call / batch,
                "arithmetic": arithmetic,
                "shared_s": t[f"{k}/True"],
                "unshared_s": t[f"{k}/False"],
                "ratio": ratio,
                "pass": abs(ratio / arithmetic - 1) <= 0.10,
            }
        )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.size = args.size or (512 if args.real_size else 64)
    args.dtype = args.dtype or ("bf16" if str(args.device).startswith("cuda") else "fp32")
    kinds = ["sd3", "flux"] if args.kind == "both" else [args.kind]
    samplers, prefix = [], []
    for kind in kinds:
        pipe, adapter = build(kind, args)
        samplers += bench_samplers(kind, pipe, adapter, args)
        if not args.no_prefix and kind == kinds[0]:
            prefix += bench_prefix(kind, adapter, args)
        del pipe, adapter
    return {"benchmark": "rollout", "args": vars(args), "samplers": samplers, "shared_prefix": prefix}


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    scale = "real-size random" if a["real_size"] else "tiny"
    rows = [
        [
            r["kind"],
            r["case"],
            r["over"] or "",
            r["seconds"],
            r["images_per_s"],
            r["ratio"],
            r["target"] and f"≤ {r['target']}",
            verdict(r["pass"]),
        ]
        for r in result["samplers"]
    ]
    out = [
        f"**Rollout** — {scale} pipelines on {a['device']} ({a['dtype']}), {a['steps']} steps, batch {a['batch']}, "
        f"{a['size']}×{a['size']} px, images decoded, median of {a['repeats']} interleaved repeats.",
        "",
        markdown_table(["model", "case", "÷", "s / batch", "images/s", "ratio", "target", ""], rows),
    ]
    if result["shared_prefix"]:
        r0 = result["shared_prefix"][0]
        out += [
            "",
            f"**Shared prefix** — {r0['kind']}, T = {r0['T']} steps, groups of G = {r0['G']} in batches of "
            f"{a['prefix_batch']}, SDE window = step k, no decoding: shared ÷ unshared time against the "
            "arithmetic (k/G + T − k) / T (target: within 10%).",
            "",
            markdown_table(
                ["k", "rows/image", "arithmetic", "shared s", "unshared s", "ratio", "ratio ÷ arith.", ""],
                [
                    [
                        r["k"],
                        r["rows_per_image"],
                        r["arithmetic"],
                        r["shared_s"],
                        r["unshared_s"],
                        r["ratio"],
                        r["ratio"] / r["arithmetic"],
                        verdict(r["pass"]),
                    ]
                    for r in result["shared_prefix"]
                ],
            ),
        ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    args = parse("rollout", __doc__, add_arguments, argv)
    return finish(run(args), markdown, args.json)
