"""Benchmarks, reported as ratios measured in one run (never as timed test assertions).

    python scripts/bench.py rollout [options]
    python scripts/bench.py rewards [options]
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "rollout": "flowgrpo.benchmarks.rollout",
    "rewards": "flowgrpo.benchmarks.rewards",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python scripts/bench.py {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
