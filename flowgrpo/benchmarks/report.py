"""Every benchmark at CPU sizes, one after another, into docs/benchmarks.md (tables, machine, command, date).

    python scripts/bench.py all [--out docs/benchmarks.md] [--json PATH] [--only rollout,window] [--quick]

About 10 minutes on two quiet cores (estimated from each part's timings on a shared machine: rollout 1 min,
train-step 1.5 (a cold model.compile included), window 0.5, epoch 2, memory 3 (one process per case), scaling 0.5,
rewards 1.5); docs/benchmarks.md records what each part took. ``--quick`` runs every
benchmark at its smoke-test size instead (a minute; the figures then mean nothing). The GPU section of an existing
output file (written by ``scripts/gpu_bench.sh``) is kept as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from flowgrpo.benchmarks.common import ROOT, machine, markdown_table, parse, write_json
from flowgrpo.benchmarks.gpu import BEGIN, END

# name -> (module, arguments of the `all` run: the modules' defaults are the CPU sizes)
PARTS: dict[str, tuple[str, list[str]]] = {
    "rollout": ("flowgrpo.benchmarks.rollout", ["--device", "cpu"]),
    "train-step": ("flowgrpo.benchmarks.train_step", []),
    "window": ("flowgrpo.benchmarks.window", []),
    "epoch": ("flowgrpo.benchmarks.epoch", []),
    "memory": ("flowgrpo.benchmarks.memory", ["--device", "cpu"]),
    "scaling": ("flowgrpo.benchmarks.scaling", []),
    "rewards": ("flowgrpo.benchmarks.rewards", ["--repeats", "2", "--batches", "4"]),
}
GPU_PLACEHOLDER = (
    "Not measured yet: `bash scripts/gpu_bench.sh` on a CUDA machine fills this section (real-size SD3.5-M and "
    "FLUX.1-dev, rollout images/s, seconds per trained step, peak memory, MFU)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="the markdown report")
    parser.add_argument("--only", default=None, help=f"a subset of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (fast, figures meaningless)")


def run_part(name: str, quick: bool) -> dict[str, Any]:
    module_name, argv = PARTS[name]
    module = importlib.import_module(module_name)
    if quick:
        argv = list(getattr(module, "SMOKE_ARGS", argv))
    start = time.perf_counter()
    if hasattr(module, "run"):  # a benchmark with results and a markdown table
        args = parse(name, module.__doc__, module.add_arguments, argv)
        result = module.run(args)
        text = module.markdown(result)
    else:  # the rewards benchmark prints its own tables
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            module.main(argv)
        result, text = {"output": buffer.getvalue()}, f"```\n{buffer.getvalue().rstrip()}\n```"
    seconds = time.perf_counter() - start
    print(text + f"\n\n({name}: {seconds:.0f} s)\n", flush=True)
    return {"result": result, "markdown": text, "seconds": seconds, "argv": argv}


def verdicts(result: dict[str, Any]) -> tuple[int, int]:
    """(passes, misses) of the figures with a target."""
    found = [
        row.get("pass") for rows in result.values() if isinstance(rows, list) for row in rows if isinstance(row, dict)
    ]
    return sum(1 for v in found if v is True), sum(1 for v in found if v is False)


def document(parts: dict[str, dict[str, Any]], info: dict[str, Any], command: str, gpu_section: str) -> str:
    total = sum(p["seconds"] for p in parts.values())
    summary = []
    for name, part in parts.items():
        passes, misses = verdicts(part["result"])
        summary.append([f"[{name}](#{name})", passes, misses, f"{part['seconds']:.0f}"])
    lines = [
        "# Benchmarks",
        "",
        "Written by `python scripts/bench.py all`; do not edit by hand (the GPU section is written by "
        "`bash scripts/gpu_bench.sh`). Every figure is a ratio of timings taken side by side in one run "
        "(interleaved repeats, medians), so it holds on a busy machine too; absolute seconds are this machine's.",
        "",
        f"- command: `{command}`",
        f"- date: {info['date']}",
        f"- machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable), torch threads "
        f"{info['torch_threads']}" + (f", GPU {info['gpu']}" if info["gpu"] else ""),
        f"- software: Python {info['python']}, torch {info['torch']}, diffusers {info['diffusers']}",
        f"- total time: {total / 60:.1f} min",
        "",
        markdown_table(["benchmark", "targets met", "missed", "seconds"], summary),
        "",
    ]
    for name, part in parts.items():
        command = " ".join(["python scripts/bench.py", name, *(shlex.quote(a) for a in part["argv"])])
        lines += [f"## {name}", "", f"`{command}`", "", part["markdown"], ""]
    lines += ["## GPU", "", BEGIN, gpu_section.strip(), END, ""]
    return "\n".join(lines)


def existing_gpu_section(path: Path) -> str:
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        if BEGIN in text and END in text:
            return text.split(BEGIN, 1)[1].split(END, 1)[0]
    return GPU_PLACEHOLDER


def main(argv: list[str]) -> int:
    args = parse("all", __doc__, add_arguments, argv)
    names = args.only.split(",") if args.only else list(PARTS)
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    info = machine()
    parts = {name: run_part(name, args.quick) for name in names}
    out = Path(args.out)
    command = "python scripts/bench.py all" + ("".join(f" {shlex.quote(a)}" for a in argv) if argv else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(document(parts, info, command, existing_gpu_section(out)), encoding="utf-8")
    print(f"wrote {out}")
    write_json(
        args.json,
        {
            "machine": info,
            "command": command,
            **{n: {"seconds": p["seconds"], **p["result"]} for n, p in parts.items()},
        },
    )
    return 0
