"""Draw a run's curves (reward per reward, eval reward and accuracy, KL, clip fraction, loss, grad norm) to
<run>/curves.png, and the first-versus-last evaluation grid to <run>/eval/before_after.png.

    python scripts/plot.py runs/<run> [--out curves.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run directory (holds metrics.jsonl)")
    parser.add_argument("--out", help="PNG path (default: <run>/curves.png)")
    args = parser.parse_args(argv)
    metrics = Path(args.run) / "metrics.jsonl"
    if not metrics.is_file():
        print(f"error: {metrics} not found: pass a run directory", file=sys.stderr)
        return 2

    from flowgrpo.report import write_before_after, write_curves

    print(f"wrote {write_curves(Path(args.run), Path(args.out) if args.out else None)}")
    grid = write_before_after(Path(args.run))
    if grid is not None:
        print(f"wrote {grid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
