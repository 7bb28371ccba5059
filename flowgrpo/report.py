"""End-of-run pictures from what a run wrote: training curves and a before/after grid of the evaluations.

    <run>/curves.png              reward, eval reward / accuracy, KL, clip fraction, loss, grad norm per epoch
    <run>/eval/before_after.png   the first and the last evaluation's images of the same test prompts and noise

``scripts/plot.py`` draws the curves of any run; the trainer writes both at the end of a run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from PIL import Image, ImageDraw

PANELS: list[tuple[str, Callable[[str], bool]]] = [
    ("reward (train samples)", lambda k: k.startswith("reward/") and k.endswith("/mean")),
    ("eval reward and accuracy", lambda k: k.startswith("eval/") and "/tag/" not in k),
    ("KL to reference", lambda k: k in ("train/kl", "train/approx_kl")),
    ("clip fraction", lambda k: k == "train/clip_fraction"),
    ("loss", lambda k: k in ("train/loss", "train/policy_loss")),
    ("grad norm", lambda k: k == "train/grad_norm"),
]


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_curves(run_dir: Path, out: Path | None = None) -> Path:
    """``curves.png`` of a run's ``metrics.jsonl`` (one panel per concern, one line per key)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
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
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.suptitle(Path(run_dir).name)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_before_after(run_dir: Path) -> Path | None:
    """``eval/before_after.png``: the first evaluation's grid beside the last one's (same prompts and noise)."""
    folder = Path(run_dir) / "eval"
    grids = sorted(p for p in folder.glob("epoch*.png") if re.fullmatch(r"epoch\d{5}\.png", p.name))
    if len(grids) < 2:
        return None
    first, last = Image.open(grids[0]).convert("RGB"), Image.open(grids[-1]).convert("RGB")
    gap, header = 12, 16
    canvas = Image.new("RGB", (first.width + gap + last.width, header + max(first.height, last.height)), "white")
    canvas.paste(first, (0, header))
    canvas.paste(last, (first.width + gap, header))
    draw = ImageDraw.Draw(canvas)
    draw.text((2, 2), f"before ({grids[0].stem})", fill="black")
    draw.text((first.width + gap + 2, 2), f"after ({grids[-1].stem})", fill="black")
    out = folder / "before_after.png"
    canvas.save(out)
    return out
