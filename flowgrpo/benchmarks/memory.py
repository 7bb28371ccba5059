"""Peak memory of a rollout and of a training step: host RSS and, on CUDA, ``torch.cuda.max_memory_allocated``.

    python scripts/bench.py memory [--size 128] [--batch 16] [--device cpu|cuda]

Each case runs in its own Python process, so one case's peak never hides another's. The process builds the adapter as
the trainer does (``build_adapter`` from a config: LoRA, dtype, gradient checkpointing, ``model.compile``), records
its resident set (``setup``), resets the peak (``/proc/self/clear_refs``; where that is not allowed the process's
lifetime peak is reported) and runs the phase twice: ``rollout`` (the SDE rollout of a batch, images decoded) or
``train`` (one trained timestep of a stored rollout: :func:`~flowgrpo.objectives.clipped.timestep_loss` and its
backward, CFG on). ``peak`` is the highest RSS since the reset, ``Δ`` = peak - setup (with compile, its compilation's
memory). Expected: gradient checkpointing lowers a training step's Δ, bf16 weights lower Δ against fp32.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from flowgrpo.benchmarks.common import ROOT, finish, markdown_table, parse, prompts, tiny_overrides, verdict

CASES = [  # (phase, model overrides)
    ("rollout", {}),
    ("rollout", {"model.dtype": "bf16"}),
    ("train", {}),
    ("train", {"model.gradient_checkpointing": True}),
    ("train", {"model.dtype": "bf16"}),
    ("train", {"model.dtype": "bf16", "model.gradient_checkpointing": True}),
    ("train", {"model.compile": True}),
]
SMOKE_ARGS = ["--size", "32", "--batch", "2", "--steps", "3", "--cases", "2"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["sd3", "flux"], default="sd3")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="enough rows that activations show beside the weights")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", default=None, help="indices into the case list (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the model.compile case")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one case, in this process (internal)


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _rss_mib() -> float:
    kib = _status_kib("VmRSS")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    return kib / 1024


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak RSS
        return True
    except OSError:
        return False


def _peak_mib() -> float:
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024


def measure(case: dict[str, Any]) -> dict[str, Any]:
    """Run one case in this process; its memory figures."""
    from flowgrpo.benchmarks.common import bench_config
    from flowgrpo.objectives.clipped import timestep_loss
    from flowgrpo.pipelines import build_adapter
    from flowgrpo.rollout import rollout

    a = case["args"]
    device = torch.device(a["device"])
    config = bench_config(tiny_overrides(a["kind"], a["size"], a["steps"], a["batch"], **case["model"]))
    adapter = build_adapter(config.model, device)
    texts = prompts(a["batch"])

    def sample(decode: bool):
        return rollout(
            adapter,
            texts,
            list(range(a["batch"])),
            config.sampler,
            range(0, a["steps"] - 1),
            torch.Generator().manual_seed(0),
            height=a["size"],
            width=a["size"],
            decode=decode,
        )

    if case["phase"] == "rollout":
        phase = lambda: sample(True)  # noqa: E731
    else:
        trajectory = sample(False)
        if config.model.compile:
            adapter.compile()
        adapter.transformer.train()
        advantages = torch.randn(a["batch"], generator=torch.Generator().manual_seed(1)).to(device)
        positions = torch.zeros(a["batch"], dtype=torch.long)

        def phase():
            loss, _ = timestep_loss(adapter, config, trajectory, positions, advantages)
            loss.backward()
            for p in adapter.trainable_parameters():
                p.grad = None

    gc.collect()
    setup = _rss_mib()
    reset = _reset_peak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        cuda_setup = torch.cuda.memory_allocated(device) / 2**20
    for _ in range(2):
        phase()
    result = {"setup_mib": setup, "peak_mib": _peak_mib(), "peak_since_setup": reset}
    result["delta_mib"] = result["peak_mib"] - setup
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        result.update({"cuda_setup_mib": cuda_setup, "cuda_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20})
    return result


def _label(model: dict[str, Any]) -> str:
    parts = [model.get("model.dtype", "fp32")]
    if model.get("model.gradient_checkpointing"):
        parts.append("grad. checkpointing")
    if model.get("model.compile"):
        parts.append("compile")
    return ", ".join(parts)


def run(args: argparse.Namespace) -> dict[str, Any]:
    indices = [int(i) for i in args.cases.split(",")] if args.cases else range(len(CASES))
    shared = {k: getattr(args, k) for k in ("kind", "size", "batch", "steps", "device")}
    rows = []
    for i in indices:
        phase, model = CASES[i]
        if args.no_compile and model.get("model.compile"):
            continue
        case = {"phase": phase, "model": model, "args": shared}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(
            [sys.executable, "-m", "flowgrpo.benchmarks.memory", "--child", json.dumps(case)],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"memory case {phase} {_label(model)} failed:\n{proc.stderr[-3000:]}")
        rows.append({"phase": phase, "setting": _label(model), **json.loads(proc.stdout.strip().splitlines()[-1])})
    by = {(r["phase"], r["setting"]): r for r in rows}
    for r in rows:  # the expectation each row is checked against, when its counterpart ran
        other = None
        if "grad. checkpointing" in r["setting"]:
            other, r["expected"] = r["setting"].replace(", grad. checkpointing", ""), "Δ below its counterpart's"
        elif r["setting"].startswith("bf16"):
            other, r["expected"] = r["setting"].replace("bf16", "fp32"), "Δ below fp32's"
        r["pass"] = r["delta_mib"] < by[(r["phase"], other)]["delta_mib"] if (r["phase"], other) in by else None
    return {"benchmark": "memory", "args": vars(args), "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    cuda = any("cuda_peak_mib" in r for r in result["rows"])
    head = (
        f"**Memory** — tiny {a['kind']} on {a['device']}, batch {a['batch']}, {a['size']}×{a['size']} px, "
        f"{a['steps']} steps, CFG; one process per case, MiB. Host RSS after setup, its peak over two runs of the "
        "phase, and the difference Δ" + (", and CUDA's max_memory_allocated" if cuda else "") + "."
    )
    headers = ["phase", "setting", "setup RSS", "peak RSS", "Δ", *(["CUDA peak"] if cuda else []), "expected", ""]
    table = markdown_table(
        headers,
        [
            [
                r["phase"],
                r["setting"],
                r["setup_mib"],
                r["peak_mib"],
                r["delta_mib"],
                *([r.get("cuda_peak_mib")] if cuda else []),
                r.get("expected", ""),
                verdict(r["pass"]),
            ]
            for r in result["rows"]
        ],
    )
    return head + "\n\n" + table


def main(argv: list[str]) -> int:
    args = parse("memory", __doc__, add_arguments, argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return 0
    return finish(run(args), markdown, args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
