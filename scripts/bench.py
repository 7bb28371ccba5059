"""Benchmarks, reported as ratios measured side by side in one run (never as timed test assertions).

    python scripts/bench.py <name> [options] [--json PATH]     # one benchmark: a markdown table and JSON
    python scripts/bench.py all                               # every benchmark at CPU sizes -> docs/benchmarks.md

names: rollout, rewards, train-step, window, epoch, memory, scaling, gpu (the real-size GPU figures of
scripts/gpu_bench.sh), tree (BranchGRPO's tree rollout against G chains), all. ``python scripts/bench.py <name>
--help`` says what each measures and how.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "rollout": "flowgrpo.benchmarks.rollout",
    "rewards": "flowgrpo.benchmarks.rewards",
    "train-step": "flowgrpo.benchmarks.train_step",
    "window": "flowgrpo.benchmarks.window",
    "epoch": "flowgrpo.benchmarks.epoch",
    "memory": "flowgrpo.benchmarks.memory",
    "scaling": "flowgrpo.benchmarks.scaling",
    "gpu": "flowgrpo.benchmarks.gpu",
    "tree": "flowgrpo.benchmarks.tree",
    "all": "flowgrpo.benchmarks.report",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python scripts/bench.py {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
