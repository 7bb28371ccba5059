"""Draw a run's curves (reward per reward, eval reward, KL, clip fraction, approx KL, loss) to <run>/curves.png.

    python scripts/plot.py runs/<run> [--out curves.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = [
    ("reward (train samples)", lambda k: k.startswith("reward/") and k.endswith("/mean")),
    ("eval reward", lambda k: k.startswith("eval/") and "/tag/" not in k),
    ("KL to reference", lambda k: k in ("train/kl", "train/approx_kl")),
    ("clip fraction", lambda k: k == "train/clip_fraction"),
    ("loss", lambda k: k in ("train/loss", "train/policy_loss")),
    ("grad norm", lambda k: k == "train/grad_norm"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run directory (holds metrics.jsonl)")
    parser.add_argument("--out", help="PNG path (default: <run>/curves.png)")
    args = parser.parse_args(argv)
    metrics = Path(args.run) / "metrics.jsonl"
    if not metrics.is_file():
        print(f"error: {metrics} not found: pass a run directory", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for ax, (title, wanted) in zip(axes.flat, PANELS, strict=True):
        keys = sorted({k for r in rows for k in r if wanted(k)})
        for key in keys:
            points = [(r["epoch"], r[key]) for r in rows if key in r and "epoch" in r]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="." if len(points) < 40 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        if keys:
            ax.legend(fontsize=7)
    out = Path(args.out) if args.out else Path(args.run) / "curves.png"
    fig.suptitle(Path(args.run).name)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
