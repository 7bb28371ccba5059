"""Rollout overhead against diffusers' own ``pipe()``, as ratios measured in one run.

    python scripts/bench.py rollout [--kind sd3|flux|both] [--steps 10] [--batch 4] [--size 64] [--repeats 5]

ODE rollout ÷ pipe() (target ≤ 1.05) and SDE rollout ÷ ODE rollout (target ≤ 1.10), same steps, batch,
latents and prompts; medians of interleaved repeats. Tiny random pipelines on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flowgrpo.adapters import make_adapter
from flowgrpo.config import SamplerConfig
from flowgrpo.rollout import rollout
from flowgrpo.tiny import build_tiny_pipeline

GUIDANCE = {"sd3": 4.5, "flux": 3.5}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_kind(kind: str, steps: int, batch: int, size: int, repeats: int) -> dict[str, float]:
    adapter = make_adapter(build_tiny_pipeline(kind, seed=0))
    prompts = [f"prompt number {i}" for i in range(batch)]
    latents = adapter.initial_noise(batch, size, size, generator=torch.Generator().manual_seed(0))
    gs = GUIDANCE[kind]
    ode = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=gs)
    sde = SamplerConfig(noise_level=0.7, num_steps=steps, guidance_scale=gs)
    window = range(0, steps - 1)

    def run_pipe():
        with torch.no_grad():
            adapter.pipe(prompt=prompts, latents=latents.clone(), num_inference_steps=steps, guidance_scale=gs,
                         height=size, width=size, output_type="pt")  # fmt: skip

    def run(sampler):
        # Prompt encoding is cached across epochs in training; pipe() re-encodes, so clear it for fairness.
        adapter.clear_prompt_cache()
        rollout(adapter, prompts, list(range(batch)), sampler, window, torch.Generator().manual_seed(1),
                height=size, width=size, initial_latents=latents)  # fmt: skip

    times: dict[str, list[float]] = {"pipe": [], "ode": [], "sde": []}
    run_pipe(), run(ode), run(sde)  # warm-up
    for _ in range(repeats):
        times["pipe"].append(_timed(run_pipe))
        times["ode"].append(_timed(lambda: run(ode)))
        times["sde"].append(_timed(lambda: run(sde)))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {**med, "ode/pipe": med["ode"] / med["pipe"], "sde/ode": med["sde"] / med["ode"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.py rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["sd3", "flux", "both"], default="both")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    kinds = ["sd3", "flux"] if args.kind == "both" else [args.kind]
    print(f"rollout benchmark: tiny pipelines on {'cuda' if torch.cuda.is_available() else 'cpu'}, "
          f"{args.steps} steps, batch {args.batch}, {args.size}x{args.size}, median of {args.repeats}")  # fmt: skip
    print(f"{'kind':<6}{'pipe s':>10}{'ode s':>10}{'sde s':>10}{'ode/pipe':>10}{'sde/ode':>10}")
    for kind in kinds:
        r = bench_kind(kind, args.steps, args.batch, args.size, args.repeats)
        print(f"{kind:<6}{r['pipe']:>10.4f}{r['ode']:>10.4f}{r['sde']:>10.4f}{r['ode/pipe']:>10.3f}{r['sde/ode']:>10.3f}")
    print("targets: ode/pipe <= 1.05, sde/ode <= 1.10")
    return 0
