"""What every benchmark shares: interleaved timing with medians, configs built like the trainer's, markdown tables
with a target and pass/miss, JSON output, and a description of the machine.

Every figure a benchmark reports is a ratio of timings taken side by side in one run: the cases are run in turn
(case A, case B, ..., then again), so a slow spell of a shared machine lands on every case alike, and each case's
time is the median of its repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from flowgrpo.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); the CPU runs eagerly."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Seconds ``fn`` takes, the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleaved(
    cases: dict[str, Callable[[], Any]], repeats: int, device: torch.device | str = "cpu", *, warmup: int = 1
) -> dict[str, float]:
    """Median seconds of each case over ``repeats`` rounds; every round runs every case once, in turn."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(timed(fn, device))
    return {name: statistics.median(values) for name, values in times.items()}


def bench_config(overrides: dict[str, Any]) -> Config:
    """A validated trainer config from ``key.sub: value`` pairs on the defaults (as ``scripts/train.py k=v``)."""
    return load_config(None, [f"{key}={json.dumps(value)}" for key, value in overrides.items()])


def tiny_overrides(kind: str, resolution: int, steps: int, batch: int, **more: Any) -> dict[str, Any]:
    """The tiny offline pipeline at a benchmark's size: LoRA r4, one rollout / training batch of ``batch`` images."""
    group = 4 if batch % 4 == 0 else batch
    return {
        "model.pretrained": f"tiny-{kind}",
        "model.resolution": resolution,
        "model.lora.rank": 4,
        "model.lora.alpha": 8,
        "sampler.num_steps": steps,
        "sampler.batch_size": batch,
        "sampler.guidance_scale": 4.5 if kind == "sd3" else 3.5,
        "grpo.group_size": group,
        "grpo.groups_per_epoch": batch // group,
        "train.batch_size": batch,
        "grpo.clip_range": 1e-2,
        "rewards": {"brightness": 1.0},
        "data.train": str(ROOT / "configs" / "prompts" / "tiny_train.txt"),
        **more,
    }


def prompts(n: int) -> list[str]:
    return [f"prompt number {i}" for i in range(n)]


@contextlib.contextmanager
def quiet_diffusers() -> Iterator[None]:
    """diffusers 0.42 warns about an empty list of fp32 modules on every ``ModelMixin.to(dtype)``: silence it."""
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(verbosity)


# ---------------------------------------------------------------------------- reporting
def fmt(value: Any) -> str:
    """Three significant digits for floats; text as is."""
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        if value == 0 or 0.01 <= abs(value) < 10_000:
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return f"{value:.2e}"
    return str(value)


def verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("pass" if ok else "**miss**")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def loglog_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x: cost ∝ x^slope."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / den if den else math.nan


def machine() -> dict[str, Any]:
    """CPU model, cores, threads, GPU and library versions: the header of docs/benchmarks.md."""
    import diffusers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": affinity,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    return info


def write_json(path: str | Path | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")


def parse(
    prog: str, doc: str | None, add: Callable[[argparse.ArgumentParser], None], argv: list[str]
) -> argparse.Namespace:
    """The benchmark's options plus ``--json PATH`` and ``--device``."""
    parser = argparse.ArgumentParser(
        prog=f"bench.py {prog}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add(parser)
    if not any(a.dest == "device" for a in parser._actions):
        parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--json", help="also write the results to this JSON file")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing a benchmark runs needs a download
    return parser.parse_args(argv)


def finish(result: dict[str, Any], markdown: Callable[[dict[str, Any]], str], path: str | None) -> int:
    print(markdown(result))
    write_json(path, result)
    return 0
