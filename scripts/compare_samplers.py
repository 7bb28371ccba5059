"""Compare samplers on the shapes task at equal time, with scripts/compare_methods.py's protocol: 3 seeds each, every
final model evaluated with 8 images per held-out line; writes docs/samplers_comparison.md (a table) and its curves.

    python scripts/compare_samplers.py [--samplers flowgrpo cps ...] [--seeds 0 1 2] [--minutes 2.5] [--clock cpu]
        [--jobs 2] [--eval-samples 8] [--config configs/shapes.yaml] [--work runs/compare_samplers]
        [--out docs/samplers_comparison.md] [key.sub=value ...]

Each run is ``scripts/train.py --config configs/shapes.yaml`` with a sampler's overrides (``SAMPLERS``, then the
key=value given to every run), trained and evaluated by compare_methods' functions: ``run.max_minutes = --minutes``
on ``run.budget_clock = --clock`` (CPU time by default, one thread a run, ``--jobs`` at a time), the final model
evaluated with ``--eval-samples`` images per held-out line and the shipped model under each seed's noise, a gain being
the difference under the same seed. Runs and evaluations are cached under ``--work``
(``<config>-<sampler>-<minutes>min-<clock>/seed<s>``, the base model under ``base/``): an interrupted comparison
continues where it stopped (delete the folder to redo it).

The table reports, per sampler: colour+count gain (mean ± sample std over seeds, and each seed's), exact gain,
colour+count pass@k, minutes on the clock, epochs, images sampled, optimizer steps, and network calls and trained
steps per image per epoch (``calls_per_image``, averaged over the epochs each run trained); a difference from the
flowgrpo row (the first sampler when flowgrpo is not run) is within noise when it is smaller than twice its standard
error. The curves (``<out>_curves.png``) are the training reward against minutes, as compare_methods'.

``--epochs N`` runs the older protocol instead (docs/shapes.md §8's table: N epochs, ``--eval-every``, one image per
held-out line, runs under ``--runs``, the mean ± half the range over seeds). ``--out`` may not be docs/shapes.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import compare_methods as cm  # noqa: E402

from flowgrpo.report import read_metrics  # noqa: E402

# name -> (what it is, overrides of configs/shapes.yaml). Values follow the presets in configs/ (noise levels,
# window sizes), scaled to the shapes task's 10 steps and short runs.
SAMPLERS: dict[str, tuple[str, list[str]]] = {
    "flowgrpo": ("Euler-Maruyama, g = 0.7 sqrt(t/(1-t)) (Flow-GRPO)", []),
    "dancegrpo": ("Euler-Maruyama, g = 0.3 (DanceGRPO)", ["sampler.diffusion=dance", "sampler.noise_level=0.3"]),
    "cps": (
        "coefficients-preserving, a = 0.8, random window of 2 in steps 0-4 (Flow-GRPO-Fast)",
        [
            "sampler.kind=cps",
            "sampler.noise_level=0.8",
            "sampler.window.size=2",
            "sampler.window.strategy=random",
            "sampler.window.max_start=4",
        ],
    ),
    "langevin_frozen": (
        "Langevin-corrected, frozen score (LC-GRPO, 1 call per step)",
        ["sampler.kind=langevin", "sampler.score_eval=frozen"],
    ),
    "langevin_reeval": (
        "Langevin-corrected, re-evaluated score (2 calls per SDE step)",
        ["sampler.kind=langevin", "sampler.score_eval=reeval"],
    ),
    "mixgrpo": (
        "SDE window of 4 moving every 2 epochs, ODE elsewhere (MixGRPO)",
        [
            "sampler.window.size=4",
            "sampler.window.strategy=progressive",
            "sampler.window.shift_interval=2",
            "sampler.window.roll_back=true",
        ],
    ),
    "mixgrpo_flash": (
        "MixGRPO + DPM-Solver++(2M) on 40% of the tail (MixGRPO-Flash)",
        [
            "sampler.window.size=4",
            "sampler.window.strategy=progressive",
            "sampler.window.shift_interval=2",
            "sampler.window.roll_back=true",
            "sampler.post_window.solver=dpmpp_2m",
            "sampler.post_window.ratio=0.4",
        ],
    ),
}


def calls_per_image(config) -> tuple[float, float]:
    """(network calls, trained steps) per image per epoch, averaged over the window's positions.

    A call is one transformer forward of one image (CFG's batched pair counts once). Rollout: every step one
    call, a re-evaluated Langevin step two, the steps after the window as many calls as the compressed tail has
    steps when ``post_window.solver`` is dpmpp_2m (the rollout's own schedules: ``compress_schedule``'s
    ``max(int(tail * ratio), 1)``, or ``mixgrpo_tail_schedule``'s with ``sampler.time_shift``). Training: each
    trained (window) step one call, two when re-evaluated.
    """
    import torch

    from flowgrpo.rollouts import make_window
    from samplers import compress_schedule, mixgrpo_tail_schedule, static_shift_schedule

    sampler = config.sampler
    window = make_window(config)
    per_sde = 2 if sampler.kind == "langevin" and sampler.score_eval == "reeval" else 1
    totals, trained = [], []
    for iteration in range(config.run.epochs):
        steps = window.steps(iteration)
        after = steps.stop if len(steps) else 0  # first step after the window (as flowgrpo.rollout)
        tail = sampler.num_steps - after
        tail_calls = tail
        if sampler.post_window.solver == "dpmpp_2m" and tail > 0:  # the schedule rollout() builds
            ratio, shift = sampler.post_window.ratio, sampler.time_shift
            if shift is None:
                schedule = compress_schedule(torch.linspace(1, 0, sampler.num_steps + 1), after, ratio)
            else:
                full, _ = static_shift_schedule(sampler.num_steps, shift)
                schedule = mixgrpo_tail_schedule(full, after, ratio, shift)
            tail_calls = len(schedule) - 1 - after
        rollout = after + tail_calls + (per_sde - 1) * len(steps)
        totals.append(rollout + per_sde * len(steps))
        trained.append(len(steps))
    return statistics.mean(totals), statistics.mean(trained)


# ---------------------------------------------------------------------------- equal time (compare_methods' protocol)
def compare(args: argparse.Namespace) -> int:
    """Trains and evaluates every (sampler, seed) under compare_methods' protocol and writes the table and curves."""
    preset = str(args.config)
    configs = cm.load_budgeted({n: (preset, [*SAMPLERS[n][1], *args.overrides]) for n in args.samplers}, args)
    if configs is None or not cm.base_loads(preset, args.overrides):  # the base: no sampler overrides
        return 2
    runs = [
        cm.Run(
            preset,
            1.0,
            seed,
            Path(args.work) / f"{cm._stem(preset)}-{name}-{args.minutes:g}min-{args.clock}" / f"seed{seed}",
            overrides=SAMPLERS[name][1],
            name=name,
        )
        for name in args.samplers
        for seed in args.seeds
    ]
    return cm.measure(runs, args, preset, lambda run: configs[run.name], write_table)


def trained_calls(run: cm.Run, overrides: list[str]) -> tuple[float, float]:
    """``calls_per_image`` of ``run``'s config over the epochs it trained."""
    from flowgrpo.config import load_config

    config = load_config(
        cm._preset_path(run.preset), [*run.overrides, *overrides, f"run.seed={run.seed}", f"run.epochs={len(run.rows)}"]
    )
    return calls_per_image(config)


def write_table(
    runs: list[cm.Run], base: dict[int, dict[str, float]], args: argparse.Namespace, plot: str, argv_shown=None
) -> str:
    """The markdown page: a row per sampler, the noise verdicts against flowgrpo's row, the samplers, the curves."""
    groups: dict[str, list[cm.Run]] = {}
    for run in runs:
        groups.setdefault(run.name, []).append(run)
    command = " ".join(["python scripts/compare_samplers.py", *sys.argv[1:]]) if argv_shown is None else argv_shown
    evaluated = int(base[args.seeds[0]].get("images", 0))
    bases = {
        k: ", ".join(f"{100 * base[s][m]:.1f}" for s in args.seeds)
        for k, m in (("cc", cm.COLOR_COUNT), ("ex", cm.EXACT))
    }
    lines = [
        "# Samplers on the shapes task",
        "",
        f"Written by `{command}`: `{Path(args.config).name}` with each sampler's overrides, seeds "
        f"{', '.join(map(str, args.seeds))}, each run trained on one thread ({args.jobs} at a time) for "
        f"{args.minutes:g} minutes ({'CPU time' if args.clock == 'cpu' else 'wall-clock'}), then its final model "
        f"evaluated with {args.eval_samples} images per held-out line ({evaluated} images). Gains are in points "
        f"against the shipped model under the same seed's noise (base colour+count: {bases['cc']}; exact: "
        f"{bases['ex']}); ± is the sample standard deviation over seeds. Calls and trained steps are per image per "
        "epoch, averaged over the epochs each run trained.",
        "",
        f"| sampler | {cm.GAIN_HEADER.format(k=args.eval_samples)} | calls / image | trained steps / image |",
        "|" + "---|" * 11,
    ]
    gains: dict[str, list[float]] = {}
    for name, group in groups.items():
        gains[name], cells = cm.gain_cells(group, base, args)
        calls, trained = (
            statistics.fmean(v) for v in zip(*(trained_calls(r, args.overrides) for r in group), strict=True)
        )
        lines.append(f"| {name} {cells} {calls:.1f} | {trained:.1f} |")
    reference = "flowgrpo" if "flowgrpo" in gains else next(iter(gains))
    lines += [
        "",
        f"Against {reference} (difference of mean colour+count gains; within noise: under twice its error):",
        "",
    ]
    lines += [f"- {n}: {cm.noise_verdict(cc, gains[reference])}" for n, cc in gains.items() if n != reference]
    lines += [
        "",
        f"The samplers (overrides of `{Path(args.config).name}`):",
        "",
        *(f"- **{n}**: {SAMPLERS[n][0]}; overrides `{' '.join(SAMPLERS[n][1]) or '(none)'}`" for n in groups),
        "",
        f"![training reward against minutes: seed mean, smoothed over 5 epochs, seed range shaded]({plot})",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- fixed epochs (the older protocol)
def run_one(name: str, seed: int, args: argparse.Namespace) -> Path:
    """The run directory of (sampler, seed): an existing finished run, or a new one trained now."""
    out = args.runs / f"{name}-s{seed}"
    done = [d for d in sorted(out.glob("*")) if _last_epoch(d) == args.epochs - 1]
    if done:
        return done[-1]
    command = [
        sys.executable,
        str(ROOT / "scripts" / "train.py"),
        "--config",
        str(args.config),
        f"run.name={name}",
        f"run.output_dir={out}",
        f"run.seed={seed}",
        f"run.epochs={args.epochs}",
        f"eval.every={args.eval_every}",
        "run.progress=false",
        *SAMPLERS[name][1],
        *args.overrides,
    ]
    print(f"[{name} seed {seed}] {' '.join(command[2:])}", flush=True)
    subprocess.run(command, check=True, cwd=ROOT)
    done = [d for d in sorted(out.glob("*")) if _last_epoch(d) == args.epochs - 1]
    if not done:
        raise RuntimeError(f"{name} seed {seed}: no finished run in {out}")
    return done[-1]


def _last_epoch(run_dir: Path) -> int | None:
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    epochs = [row.get("epoch") for row in read_metrics(run_dir)]
    return max((e for e in epochs if e is not None), default=None)


def curve(run_dir: Path) -> list[tuple[float, dict[str, float]]]:
    """(cumulative training seconds, eval metrics) at each evaluation of a run."""
    seconds, points = 0.0, []
    for row in read_metrics(run_dir):
        seconds += sum(row.get(k, 0.0) for k in ("time/sampling", "time/reward_wait", "time/training"))
        evals = {k.removeprefix("eval/"): v for k, v in row.items() if k.startswith("eval/")}
        if evals:
            points.append((seconds, evals))
    return points


def mean_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * statistics.mean(values):.1f} ± {100 * (max(values) - min(values)) / 2:.1f}"


def write_report(results: dict[str, list[Path]], args: argparse.Namespace) -> None:
    from flowgrpo.config import load_config
    from rewards.shapes import TAGS

    key = "shapes/accuracy/{}"
    columns = ["exact", "color_count"] + [f"exact/tag/{t}" for t in TAGS]
    header = ["sampler", "exact", "colour+count", *TAGS, "wall s", "calls / image", "trained steps / image"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    first_run = next(iter(results.values()))[0]
    base = curve(first_run)[0][1]
    images = len(json.loads(sorted((first_run / "eval").glob("epoch*.json"))[0].read_text())["images"])
    per_tag = images // len(TAGS)
    overall_se, tag_se = 100 * (0.3 * 0.7 / images) ** 0.5, 100 * (0.5 * 0.5 / per_tag) ** 0.5
    lines.append(
        "| base model (before RL) | " + " | ".join(f"{100 * base[key.format(c)]:.1f}" for c in columns) + " | | | |"
    )
    for name, runs in results.items():
        finals = [curve(r)[-1] for r in runs]
        config = load_config(str(args.config), [*SAMPLERS[name][1], f"run.epochs={args.epochs}", *args.overrides])
        calls, trained = calls_per_image(config)
        cells = [mean_spread([f[1][key.format(c)] for f in finals]) for c in columns]
        wall = statistics.mean(f[0] for f in finals)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {wall:.0f} | {calls:.1f} | {trained:.1f} |")
    plot = args.out.with_suffix(".png")
    _plot(results, plot)
    seeds = ", ".join(str(s) for s in args.seeds)
    text = [
        "# Samplers on the shapes task",
        "",
        f"Written by `python scripts/compare_samplers.py {' '.join(sys.argv[1:])}`: `{args.config.name}` with each "
        f"sampler's overrides, {args.epochs} epochs, seeds {seeds}. Held-out accuracy in % (ODE sampling of the "
        "test prompts, mean ± half the range over seeds); wall time is sampling + reward + training, evaluation "
        "excluded.",
        "",
        *lines,
        "",
        f"Reading it: each accuracy comes from {images} held-out images ({per_tag} per tag), so one standard error "
        f"is about {overall_se:.0f} points at 30% overall and {tag_se:.0f} points per tag; differences smaller than "
        "twice that are noise, and with one seed the spread between seeds is not measured. Calls and trained steps "
        "are per image per epoch, averaged over the window's positions.",
        "",
        *(f"- **{n}**: {SAMPLERS[n][0]}; overrides `{' '.join(SAMPLERS[n][1]) or '(none)'}`" for n in results),
        "",
        f"![held-out accuracy against wall-clock]({plot.name})",
        "",
    ]
    args.out.write_text("\n".join(text))
    print(f"wrote {args.out} and {plot}")


def _plot(results: dict[str, list[Path]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for ax, measure in zip(axes, ("exact", "color_count"), strict=True):
        for i, (name, runs) in enumerate(results.items()):
            for j, run in enumerate(runs):
                points = curve(run)
                accuracy = [100 * p[1][f"shapes/accuracy/{measure}"] for p in points]
                label = name if j == 0 else None
                ax.plot(
                    [p[0] for p in points], accuracy, color=f"C{i}", alpha=0.5 + 0.4 * (j == 0), marker=".", label=label
                )
        ax.set_xlabel("training wall time, s (2 CPU cores)")
        ax.set_ylabel(f"held-out accuracy, {measure} (%)")
        ax.legend(fontsize=8)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=list(SAMPLERS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "shapes.yaml")
    parser.add_argument("--minutes", type=float, default=2.5, help="every run's budget")
    parser.add_argument("--clock", choices=sorted(cm.CLOCKS), default="cpu", help="run.budget_clock of every run")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--eval-samples", type=int, default=8, help="images per held-out line")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "compare_samplers")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "samplers_comparison.md")
    parser.add_argument("--epochs", type=int, default=None, help="the older protocol: this many epochs a run")
    parser.add_argument("--eval-every", type=int, default=None, help="--epochs only; default: the config's eval.every")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "compare", help="--epochs only: its runs")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args(argv)
    if args.out.resolve() == (ROOT / "docs" / "shapes.md").resolve():
        parser.error("--out may not be docs/shapes.md: write the table elsewhere and copy it into §8")
    if args.epochs is None:
        return compare(args)

    from flowgrpo.config import load_config

    config = load_config(str(args.config), args.overrides)
    args.eval_every = args.eval_every or config.eval.every
    if args.eval_every < 1 or args.epochs % args.eval_every:
        parser.error("--eval-every must be >= 1 and divide --epochs: the table reads the last epoch's evaluation")
    results = {name: [run_one(name, seed, args) for seed in args.seeds] for name in args.samplers}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_report(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
