"""Rollout overhead against diffusers' own ``pipe()``, and one training step, as ratios measured in one run.

    python scripts/bench.py rollout                       # tiny pipelines on the CPU
    python scripts/bench.py rollout --real-size           # SD3.5-M / FLUX.1-dev-size random transformers (GPU)
    python scripts/bench.py rollout --real-size --layers 1 --size 256 --device cpu   # smoke run of that path

ODE rollout ÷ pipe() (target ≤ 1.05) and SDE rollout ÷ ODE rollout (target ≤ 1.10), same steps, batch,
latents and prompts; medians of interleaved repeats. Also one GRPO training step (re-score one trained
timestep of the batch with LoRA, forward + backward) and, on CUDA, the peak memory of each phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from flowgrpo.adapters import make_adapter
from flowgrpo.config import SamplerConfig
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline

GUIDANCE = {"sd3": 4.5, "flux": 3.5}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _peak_gib(device: torch.device, fn) -> float:
    if device.type != "cuda":
        fn()
        return float("nan")
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    return torch.cuda.max_memory_allocated(device) / 2**30


def bench_kind(kind: str, args: argparse.Namespace) -> dict[str, float]:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.real_size:
        from flowgrpo.benchmarks.models import build_random_pipeline

        pipe = build_random_pipeline(kind, num_layers=args.layers, dtype=dtype)
    else:
        pipe = build_tiny_pipeline(kind, seed=0, dtype=dtype)
    pipe.to(device)
    adapter = make_adapter(pipe)
    if args.attention != "sdpa":
        adapter.set_attention_backend(args.attention)
    prompts = [f"prompt number {i}" for i in range(args.batch)]
    size, steps, gs = args.size, args.steps, GUIDANCE[kind]
    latents = adapter.initial_noise(args.batch, size, size, generator=torch.Generator().manual_seed(0))
    ode = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=gs)
    sde = SamplerConfig(noise_level=0.7, num_steps=steps, guidance_scale=gs)
    window = range(0, steps - 1)

    def run_pipe():
        with torch.no_grad():
            pipe(prompt=prompts, latents=latents.clone(), num_inference_steps=steps, guidance_scale=gs,
                 height=size, width=size, output_type="pt")  # fmt: skip

    def run(sampler):
        adapter.clear_prompt_cache()  # pipe() encodes every call; training caches (an advantage not counted here)
        return rollout(adapter, prompts, list(range(args.batch)), sampler, window, torch.Generator().manual_seed(1),
                       height=size, width=size, initial_latents=latents)  # fmt: skip

    times: dict[str, list[float]] = {"pipe": [], "ode": [], "sde": []}
    run_pipe(), run(ode), run(sde)  # warm-up
    for _ in range(args.repeats):
        times["pipe"].append(_timed(run_pipe, device))
        times["ode"].append(_timed(lambda: run(ode), device))
        times["sde"].append(_timed(lambda: run(sde), device))
    result = {k: statistics.median(v) for k, v in times.items()}
    result["rollout_peak_gib"] = _peak_gib(device, lambda: run(sde))

    # One training step: LoRA r32, re-score one trained timestep of the batch, backward.
    trajectory = run(sde)
    adapter.add_lora(rank=32, alpha=64)
    if args.gradient_checkpointing:
        adapter.enable_gradient_checkpointing()

    def train_step():
        step = evaluate_transitions(adapter, trajectory, 0, sde)
        step.log_prob.mean().backward()
        for p in adapter.trainable_parameters():
            p.grad = None

    train_step()  # warm-up
    result["train_step"] = statistics.median(_timed(train_step, device) for _ in range(args.repeats))
    result["train_peak_gib"] = _peak_gib(device, train_step)
    result["ode/pipe"] = result["ode"] / result["pipe"]
    result["sde/ode"] = result["sde"] / result["ode"]
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.py rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["sd3", "flux", "both"], default="both")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=None, help="image size (default 64 tiny, 512 real-size)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--real-size", action="store_true", help="SD3.5-M / FLUX.1-dev-size random transformers")
    parser.add_argument("--layers", type=int, default=None, help="shrink the real-size transformer (smoke runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--attention", choices=["sdpa", "xformers"], default="sdpa")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    args.size = args.size or (512 if args.real_size else 64)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    kinds = ["sd3", "flux"] if args.kind == "both" else [args.kind]
    scale = "real-size random" if args.real_size else "tiny"
    print(f"rollout benchmark: {scale} pipelines on {args.device} ({args.dtype}, {args.attention}), {args.steps} "
          f"steps, batch {args.batch}, {args.size}x{args.size}, median of {args.repeats}")  # fmt: skip
    header = ["kind", "pipe s", "ode s", "sde s", "ode/pipe", "sde/ode", "train s", "roll GiB", "train GiB"]
    print("".join(f"{h:>10}" for h in header))
    results = {}
    for kind in kinds:
        r = results[kind] = bench_kind(kind, args)
        cells = [r["pipe"], r["ode"], r["sde"], r["ode/pipe"], r["sde/ode"], r["train_step"], r["rollout_peak_gib"],
                 r["train_peak_gib"]]  # fmt: skip
        print(f"{kind:>10}" + "".join(f"{c:>10.4f}" if c < 100 else f"{c:>10.1f}" for c in cells))
    print("targets: ode/pipe <= 1.05, sde/ode <= 1.10")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0
