"""Compare RL methods on the shapes task at equal time: 3 seeds each, every final model evaluated with 8 images per
held-out line; writes a markdown table and a reward-curve plot.

python scripts/compare_methods.py [--presets shapes shapes_awm shapes_nft] [--seeds 0 1 2] [--minutes 3.5]
    [--budgets 1 2] [--clock cpu] [--jobs 2] [--processes 1] [--also-last] [--work runs/compare_methods]
    [--out docs/methods.md] [key.sub=value ...]

Each preset (``configs/<preset>.yaml`` or a path) trains under ``run.max_minutes = minutes × budget`` on one thread
(``OMP_NUM_THREADS=1``), ``--jobs`` runs at a time. The budget's clock (``run.budget_clock``) is by default the
process's CPU time, which on one thread is the wall-clock of an idle core and which other work on the machine does
not spend (``--clock wall``: the wall-clock, fair only on an otherwise idle machine). Its run ends after the epoch
that spent the budget (the preset's ``run.epochs`` is lifted so that the budget, not the epoch count, ends it; a
preset whose lr schedule runs over ``run.epochs`` is therefore refused: ``train.lr_schedule_steps`` gives a schedule
a length of its own). The shipped model is evaluated under each seed's noise too, and a gain is the trained model's
accuracy minus the base model's under the same seed. Runs already finished under ``--work`` are reused (delete the
folder to redo them); one trained with other settings (the preset file's contents, an override, the budget: recorded
in its ``settings.json``) is refused before anything trains.

``--processes N`` (N > 1) launches each training as N processes of one thread under DDP (``accelerate launch
--multi_gpu``, which on a machine without GPUs runs torchrun and the trainer on the CPU with gloo), to measure a
method at "M minutes on this machine's N cores": ``--processes 2 --jobs 1 --clock wall``. It needs ``--clock wall``
(the CPU clock is per process) and is refused with ``--jobs > 1`` when processes × jobs exceed the machine's cores
(the runs would share cores, and a wall-clock budget would be unfair). ``train.batch_size`` is per process: the
presets are not changed, so pass e.g. ``train.batch_size=16`` to keep a 32-per-process preset's optimizer steps per
epoch at 2 processes (a warning says when they differ from the preset's at one process). Its runs are cached apart
(``<preset>-<minutes>min-wall-<N>proc``); rank 0 writes the run's metrics and checkpoints, which are evaluated as
a one-process run's.

The table reports, per preset and budget: colour+count and exact gain (mean ± sample std over seeds, and each
seed's), colour+count pass@8, minutes on the budget's clock, epochs, images sampled and optimizer steps. A
difference from the first preset is called within noise when it is smaller than twice its standard error,
sqrt(s₁²/n₁ + s₂²/n₂). A run that evaluates an EMA of its weights (``eval.use_ema``) is read through the EMA;
``--also-last`` also evaluates the same runs' last weights, a row of their own, and says the EMA's lead over them
paired by run (the mean of the run-by-run differences against twice its standard error).

A preset may carry its own overrides, ``preset+key=value+key=value`` (a variant: its own row, label and run folder,
e.g. ``shapes_fpo+grpo.fpo.weighting=elbo`` for an ablation), before the ones given to every run; ``@`` budgets
follow them (``shapes_fpo+grpo.fpo.functional=reinforce@1,2``).

scripts/compare_samplers.py runs the same protocol on samplers: its runs carry their own overrides and names
(``Run.overrides``, ``Run.name``) through :func:`measure`, :func:`gain_cells` and :func:`write_curves`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLOR_COUNT, EXACT = "shapes/accuracy/color_count", "shapes/accuracy/exact"
EPOCHS_CAP = 100_000  # the budget ends every run long before this


@dataclass
class Run:
    preset: str
    budget: float  # multiple of --minutes
    seed: int
    folder: Path
    summary: dict[str, float] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    images_per_epoch: int = 0
    overrides: list[str] = field(default_factory=list)  # this run's own, before the ones given to every run
    name: str = ""  # the label of its table row and curve; default the preset's stem
    processes: int = 1  # its training's DDP processes (--processes), one thread each
    last_summary: dict[str, float] | None = None  # --also-last: its last weights, where it evaluates an EMA

    @property
    def label(self) -> str:
        return self.name or _stem(self.preset)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--presets",
        nargs="+",
        default=["shapes", "shapes_awm", "shapes_nft"],
        help="configs/<name>.yaml or paths; name+key=value+... a variant with its own overrides; name@1,2 gives "
        "that preset its own budgets instead of --budgets",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=3.5, help="the budget unit: the main job's time")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="run.budget_clock of every run")
    parser.add_argument("--budgets", nargs="+", type=float, default=[1.0], help="multiples of --minutes")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="DDP processes of one thread per training run (accelerate launch); > 1 needs --clock wall and "
        "processes x jobs within the machine's cores. train.batch_size is per process and presets are not changed: "
        "pass e.g. train.batch_size=16 to keep a 32-per-process preset's optimizer steps with 2 processes",
    )
    parser.add_argument("--eval-samples", type=int, default=8, help="images per held-out line")
    parser.add_argument(
        "--also-last",
        action="store_true",
        help="also evaluate the last weights of each run that evaluates an EMA (eval.use_ema): a row of their own "
        "and the EMA's lead over them paired by run",
    )
    parser.add_argument("--work", default="runs/compare_methods")
    parser.add_argument("--out", default="docs/methods.md")
    parser.add_argument("overrides", nargs="*", help="key=value applied to every preset")
    args = parser.parse_args(argv)
    budgets_of = preset_budgets(args.presets, args.budgets)
    args.presets = list(budgets_of)
    args.budgets = sorted({b for bs in budgets_of.values() for b in bs})

    variants = {spec: split_variant(spec) for spec in args.presets}
    if any(v is None for v in variants.values()):
        bad = next(spec for spec, v in variants.items() if v is None)
        print(f"error: --presets {bad}: a variant is preset+key=value+key=value", file=sys.stderr)
        return 2
    configs = load_budgeted({spec: (p, [*own, *args.overrides]) for spec, (p, own) in variants.items()}, args)
    if configs is None or not base_loads(variants[args.presets[0]][0], args.overrides):
        return 2
    work = Path(args.work)
    procs = f"-{args.processes}proc" if args.processes > 1 else ""
    runs = [
        Run(
            variants[spec][0],
            b,
            s,
            work / f"{_variant_label(*variants[spec])}-{args.minutes * b:g}min-{args.clock}{procs}" / f"seed{s}",
            overrides=variants[spec][1],
            name=_variant_label(*variants[spec]) if variants[spec][1] else "",
            processes=args.processes,
        )
        for b in args.budgets
        for spec in args.presets
        if b in budgets_of[spec]
        for s in args.seeds
    ]
    by_label = {_variant_label(*variants[spec]): configs[spec] for spec in args.presets}
    return measure(runs, args, variants[args.presets[0]][0], lambda run: by_label[run.label], write_table)


def base_loads(preset: str, overrides: list[str]) -> bool:
    """Whether the config the shipped model is evaluated under (:func:`_evaluate_base`: the first preset with the
    overrides given to every run) loads; said on stderr, with the fix, when not: before any run trains, not after."""
    from flowgrpo.config import ConfigError, load_config

    try:
        load_config(_preset_path(preset), overrides)
    except (ConfigError, OSError) as err:
        print(
            f"error: the shipped model is evaluated under {_stem(preset)} with the overrides given to every run, "
            f"which it refuses: {err}. Give such an override to each variant instead (preset+key=value)",
            file=sys.stderr,
        )
        return False
    return True


def measure(runs: list[Run], args: argparse.Namespace, base_preset: str, config_of, write_page) -> int:
    """Trains and evaluates ``runs`` (:func:`train_and_evaluate`), then writes ``args.out``, the page
    ``write_page(runs, base, args, curves' file name)``, and the curves beside it (``<out>_curves.png``); 1 when a
    run failed. ``config_of(run)``: the run's config, for its images per epoch."""
    for run in runs:
        cfg = config_of(run).grpo
        run.images_per_epoch = cfg.group_size * cfg.groups_per_epoch
    base = train_and_evaluate(runs, args, base_preset)
    if base is None:
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = out.with_name(out.stem + "_curves.png")
    write_curves(runs, plot, args.minutes, CLOCKS[args.clock])
    out.write_text(write_page(runs, base, args, plot.name), encoding="utf-8")
    print(f"table: {out}\ncurves: {plot}")
    return 0


# ---------------------------------------------------------------------------- running
def split_variant(spec: str) -> tuple[str, list[str]] | None:
    """``preset+key=value+key=value`` -> (preset, [key=value, ...]); a plain preset has none; None when malformed."""
    preset, *own = spec.split("+")
    if not preset or any("=" not in item or item.startswith("=") for item in own):
        return None
    return preset, own


def _variant_label(preset: str, own: list[str]) -> str:
    """A run's row label and folder name: the preset's stem, then its own overrides (``shapes_fpo+key=value``)."""
    return "+".join([_stem(preset), *own])


def preset_budgets(items: list[str], budgets: list[float]) -> dict[str, list[float]]:
    """``{preset: its budgets}`` from ``--presets`` items: ``name`` takes ``budgets``, ``name@1,2`` its own."""
    out = {}
    for item in items:
        preset, _, own = item.partition("@")
        out[preset] = [float(b) for b in own.split(",")] if own else list(budgets)
    return out


CLOCKS = {"cpu": "time/cpu", "wall": "time/elapsed"}  # --clock -> the metric the budget is measured on
POOL = ProcessPoolExecutor  # runs the trainings and evaluations, --jobs at a time (tests substitute threads)


def load_budgeted(setups: dict, args: argparse.Namespace) -> dict | None:
    """``{key: config}`` for ``setups``' ``{key: (preset, overrides)}``; None, said on stderr, when a config does not
    load, its lr schedule runs over ``run.epochs`` (which a time budget leaves open; ``train.lr_schedule_steps``
    fixes its length) or ``args``' ``--jobs``,
    ``--eval-samples`` or ``--minutes`` is out of range, or ``--processes`` (default 1) does not fit
    (:func:`processes_problem`, or a config's batches at that many processes). With several processes, warns on
    stderr when a config's optimizer steps per epoch differ from its preset's at one process (``train.batch_size``
    is per process)."""
    from flowgrpo.config import (
        LENGTHLESS_LR_SCHEDULES,
        ConfigError,
        load_config,
        optimizer_steps_per_epoch,
        validate,
    )

    processes = getattr(args, "processes", 1)
    problem = processes_problem(processes, args.jobs, args.clock)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return None
    configs, steps = {}, {}
    try:
        for key, (preset, overrides) in setups.items():
            configs[key] = load_config(_preset_path(preset), overrides)
            train = configs[key].train
            if train.lr_schedule not in LENGTHLESS_LR_SCHEDULES and train.lr_schedule_steps is None:
                raise ConfigError(
                    f"{key}: train.lr_schedule={train.lr_schedule} runs over run.epochs, which a time budget leaves "
                    "open: set train.lr_schedule_steps (its length in optimizer steps) or train.lr_schedule=constant"
                )
            if processes > 1:
                validate(configs[key], processes)  # its batches at that many processes
                steps[key] = (
                    _steps_at_one_process(preset, overrides, args.overrides),
                    optimizer_steps_per_epoch(configs[key], processes),
                )
    except (ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    if args.jobs < 1 or args.eval_samples < 1 or args.minutes <= 0:
        print("error: --jobs and --eval-samples must be >= 1 and --minutes > 0", file=sys.stderr)
        return None
    for key, (one, many) in steps.items():
        if one is not None and one != many:
            batch = configs[key].train.batch_size
            hint = f": e.g. train.batch_size={batch * many // one} keeps them" if batch * many % one == 0 else ""
            print(
                f"warning: {key} takes {many} optimizer steps per epoch at {processes} processes, its preset {one} at "
                f"one process (train.batch_size is per process{hint})",
                file=sys.stderr,
            )
    if processes > (os.cpu_count() or 1):
        print(f"warning: --processes {processes} on {os.cpu_count()} cores: its processes share cores", file=sys.stderr)
    return configs


def _steps_at_one_process(preset: str, overrides: list[str], given: list[str]) -> int | None:
    """Optimizer steps per epoch of ``preset`` at one process, under ``overrides`` less the trailing ``given`` to every
    run (the command line's, e.g. a per-process ``train.batch_size``): a run's own overrides stay (a sampler's).
    None when that config does not load."""
    from flowgrpo.config import ConfigError, load_config, optimizer_steps_per_epoch

    cut = len(overrides) - len(given)
    own = overrides[:cut] if cut >= 0 and overrides[cut:] == list(given) else []
    try:
        return optimizer_steps_per_epoch(load_config(_preset_path(preset), own), 1)
    except ConfigError:
        return None


def processes_problem(processes: int, jobs: int, clock: str) -> str | None:
    """Why ``--processes`` cannot run with ``--jobs`` and ``--clock`` (None when it can)."""
    if processes < 1:
        return "--processes must be >= 1"
    if processes > 1 and clock == "cpu":
        return (
            f"--processes {processes} with --clock cpu: the CPU clock is per process, so a run's budget would not be "
            f"its {processes} processes' time; use --clock wall"
        )
    cores = os.cpu_count() or 1
    if processes > 1 and jobs > 1 and processes * jobs > cores:
        return (
            f"--processes {processes} × --jobs {jobs} = {processes * jobs} processes on {cores} cores: the runs would "
            "share cores, and a wall-clock budget would be unfair to them; use --jobs 1 (or fewer processes)"
        )
    return None


def train_and_evaluate(runs: list[Run], args: argparse.Namespace, base_preset: str) -> dict[int, dict] | None:
    """Trains the runs not finished yet (``args.jobs`` at a time, ``args.minutes`` × budget on ``args.clock``, with
    ``args.overrides``), evaluates the shipped model under ``base_preset`` for each of ``args.seeds`` (cached under
    ``args.work``) and every run's final model, ``args.eval_samples`` images per held-out line; fills each run's
    ``summary`` and ``rows`` (and with ``args.also_last`` its ``last_summary``: its last weights where it evaluates
    an EMA) and returns the base's summaries by seed, or None (said on stderr) when a run failed."""
    work = Path(args.work)
    todo = [r for r in runs if _final_checkpoint(r.folder) is None]
    finished = [r for r in runs if r not in todo]
    stale = [why for why in (_stale(r, args.minutes, args.overrides, args.clock) for r in finished) if why]
    if stale:
        shown = "; ".join(stale[:3]) + (f"; and {len(stale) - 3} more" if len(stale) > 3 else "")
        print(
            f"error: {len(stale)} finished run(s) under --work were trained with other settings than these: {shown}. "
            "Delete such a folder to train it again, or give another --work",
            file=sys.stderr,
        )
        return None
    print(f"{len(runs)} runs ({len(runs) - len(todo)} already done), {args.jobs} at a time")
    with POOL(args.jobs) as pool:
        failed = [
            r
            for r, rc in zip(
                todo,
                pool.map(
                    _train, todo, [args.minutes] * len(todo), [args.overrides] * len(todo), [args.clock] * len(todo)
                ),
                strict=True,
            )
            if rc != 0
        ]
        if failed:
            print(f"error: {len(failed)} runs failed, e.g. {failed[0].folder} (its train.log)", file=sys.stderr)
            return None
        n = len(args.seeds)
        evaluated = pool.map(
            _evaluate_base, [base_preset] * n, args.seeds, [args.eval_samples] * n, [args.overrides] * n, [work] * n
        )
        base = dict(zip(args.seeds, evaluated, strict=True))
        folders, samples = [r.folder for r in runs], [args.eval_samples] * len(runs)
        summaries = list(pool.map(_evaluate_run, folders, samples))
        also_last = getattr(args, "also_last", False)  # compare_samplers' arguments have no --also-last
        last = list(pool.map(_evaluate_run, folders, samples, [True] * len(runs))) if also_last else []
    for run, summary in zip(runs, summaries, strict=True):
        run.summary = summary
        run.rows = _metrics(run.folder)
    for run, summary in zip(runs, last or [None] * len(runs), strict=True):
        run.last_summary = summary
    return base


def _preset_path(preset: str) -> Path:
    path = Path(preset)
    return path if path.suffix in (".yaml", ".yml") else ROOT / "configs" / f"{preset}.yaml"


def _stem(preset: str) -> str:
    return Path(preset).stem


def _final_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint of the one run in ``folder``, if that run finished (its curves are written last)."""
    runs = [d for d in folder.glob("*/") if (d / "curves.png").is_file()] if folder.is_dir() else []
    if not runs:
        return None
    checkpoints = sorted((runs[-1] / "checkpoints").glob("epoch-*"))
    return checkpoints[-1] if checkpoints else None


SETTINGS_FILE = "settings.json"  # in a run's folder: what it was trained with, so that a reuse can be checked


def _settings(run: Run, minutes: float, overrides: list[str], clock: str) -> dict:
    """What decides a run's training besides the code: the preset file's contents, every override, the budget."""
    import hashlib

    return {
        "preset": run.preset,
        "preset_sha256": hashlib.sha256(_preset_path(run.preset).read_bytes()).hexdigest(),
        "overrides": [*run.overrides, *overrides],
        "seed": run.seed,
        "minutes": minutes * run.budget,
        "clock": clock,
        "processes": run.processes,
    }


def _stale(run: Run, minutes: float, overrides: list[str], clock: str) -> str | None:
    """Why the finished ``run`` cannot be reused for these settings (its recorded ones differ), or None. A folder
    trained before the settings were recorded is reused as it is."""
    file = run.folder / SETTINGS_FILE
    if not file.is_file():
        return None
    recorded, now = json.loads(file.read_text(encoding="utf-8")), _settings(run, minutes, overrides, clock)
    changed = [
        "the preset file's contents" if k == "preset_sha256" else f"{k} {recorded.get(k)!r}, now {now[k]!r}"
        for k in now
        if recorded.get(k) != now[k]
    ]
    return f"{run.folder} ({', '.join(changed)})" if changed else None


def _train(run: Run, minutes: float, overrides: list[str], clock: str = "cpu") -> int:
    if run.folder.exists():  # an unfinished attempt: start over
        import shutil

        shutil.rmtree(run.folder)
    run.folder.mkdir(parents=True)
    settings = json.dumps(_settings(run, minutes, overrides, clock), indent=1)
    (run.folder / SETTINGS_FILE).write_text(settings, encoding="utf-8")
    script = str(ROOT / "scripts" / "train.py")
    if run.processes > 1:  # DDP through accelerate: torchrun on a machine without GPUs, the trainer on gloo
        script_launch = [sys.executable, "-m", "accelerate.commands.launch", *launcher(run.processes), script]
    else:
        script_launch = [sys.executable, script]
    command = [
        *script_launch,
        "--config",
        str(_preset_path(run.preset)),
        *run.overrides,
        *overrides,
        f"run.seed={run.seed}",
        f"run.output_dir={run.folder}",
        f"run.max_minutes={minutes * run.budget}",
        f"run.budget_clock={clock}",
        f"run.epochs={EPOCHS_CAP}",
        "eval.every=0",
        "checkpoint.every=0",
        "run.progress=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(run.folder / "train.log", "w", encoding="utf-8") as log:
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode


def launcher(processes: int) -> list[str]:
    """``accelerate launch``'s flags for ``processes`` DDP processes on this machine (tests/test_distributed.py's):
    ``--cpu`` would start one process; port 0 lets accelerate pick a free one for each launch."""
    flags = f"--multi_gpu --num_processes {processes} --num_machines 1 --mixed_precision no --dynamo_backend no"
    return [*flags.split(), "--main_process_port", "0"]


def _evaluate(config, checkpoint: Path | None, samples: int, ema: bool | None = None) -> dict[str, float]:
    """``checkpoint``'s model (the shipped one for None) on the held-out lines, ``samples`` images each; its EMA
    weights where ``ema`` (by default ``config.eval.use_ema``, the weights the run's own evaluation would use)."""
    import diffusers
    import torch

    from flowgrpo.data import PromptDataset
    from flowgrpo.evaluation import evaluate
    from flowgrpo.export import adapter_from_checkpoint
    from flowgrpo.pipelines import build_adapter
    from rewards import build_reward

    torch.set_num_threads(1)
    diffusers.utils.logging.set_verbosity_error()  # the tiny VAE's class notes, once per evaluation
    config.eval.samples_per_prompt = samples
    dataset = PromptDataset.from_file(config.data.test, "data.test")
    reward = build_reward(config.rewards, device="cpu")
    if checkpoint is None:  # LoRA initialised to the identity: the shipped model itself
        adapter = build_adapter(config.model, "cpu")
    else:
        ema = config.eval.use_ema if ema is None else ema
        adapter = adapter_from_checkpoint(config, checkpoint, ema=ema, device="cpu")
    summary, _, prompts, _ = evaluate(
        adapter, dataset, reward, config.eval, resolution=config.model.size, seed=config.run.seed
    )
    return {**summary, "images": float(len(prompts))}  # one prompt per evaluated image


def _evaluate_base(
    preset: str, seed: int, samples: int, overrides: list[str], work: Path | None = None
) -> dict[str, float]:
    """The shipped model under ``preset``'s evaluation and ``seed``'s noise; cached under ``work/base/`` by preset,
    seed, samples and overrides."""
    import hashlib

    from flowgrpo.config import load_config

    config = load_config(_preset_path(preset), [*overrides, f"run.seed={seed}"])
    key = hashlib.sha256(json.dumps([config.model.pretrained, str(config.data.test), overrides]).encode()).hexdigest()
    cached = None if work is None else work / "base" / f"{_stem(preset)}-seed{seed}-eval{samples}-{key[:10]}.json"
    if cached is not None and cached.is_file():
        return json.loads(cached.read_text(encoding="utf-8"))
    summary = _evaluate(config, None, samples)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(summary), encoding="utf-8")
    return summary


def _evaluate_run(folder: Path, samples: int, last: bool = False) -> dict[str, float] | None:
    """The final checkpoint's summary, cached beside it (``eval<samples>.json``). ``last``: its last weights where
    the run evaluates an EMA (``eval<samples>-last.json``); None where it does not (they are what it evaluates)."""
    from flowgrpo.export import run_config

    checkpoint = _final_checkpoint(folder)
    cached = checkpoint / f"eval{samples}{'-last' if last else ''}.json"
    if cached.is_file():  # read before the config: a cached run's numbers stay readable whatever its config does now
        return json.loads(cached.read_text(encoding="utf-8"))
    config = run_config(checkpoint)  # run_config already clears run.resume
    if last and not config.eval.use_ema:
        return None
    summary = _evaluate(config, checkpoint, samples, ema=False if last else None)
    cached.write_text(json.dumps(summary), encoding="utf-8")
    return summary


def _metrics(folder: Path) -> list[dict]:
    (run,) = [d for d in folder.glob("*/") if (d / "metrics.jsonl").is_file()]
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [row for row in map(json.loads, lines) if "reward/total/mean" in row]


# ---------------------------------------------------------------------------- reporting
def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def within_noise(a: list[float], b: list[float]) -> tuple[float, float, bool]:
    """(difference of means, its standard error sqrt(s_a²/n_a + s_b²/n_b), whether |difference| < 2 × error)."""
    (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
    error = math.sqrt(sa**2 / len(a) + sb**2 / len(b))
    return ma - mb, error, verdict(ma - mb, error) == "within noise"


def verdict(difference: float, error: float) -> str:
    """The verdict on a difference with standard error ``error``: within noise when smaller than twice it, else
    better or worse; the one criterion of the unpaired and the paired comparisons."""
    return "within noise" if abs(difference) < 2 * error else ("better" if difference > 0 else "worse")


def write_table(
    runs: list[Run],
    base: dict[int, dict[str, float]],
    args: argparse.Namespace,
    plot: str,
    argv_shown: str | None = None,
) -> str:
    """The markdown page: the table (with a row of their last weights under each group of runs that has them), the
    EMA's paired lead over those, the noise verdicts against the first preset, the curves."""
    groups: dict[tuple[str, float], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.label, run.budget), []).append(run)
    base_cc = [100 * base[s][COLOR_COUNT] for s in args.seeds]
    command = " ".join(["python scripts/compare_methods.py", *sys.argv[1:]]) if argv_shown is None else argv_shown
    evaluated = int(base[args.seeds[0]].get("images", 0))
    clock_name = "CPU time" if args.clock == "cpu" else "wall-clock"
    processes = getattr(args, "processes", 1)
    where = "one thread" if processes == 1 else f"{processes} processes, one thread each (DDP)"
    lines = [
        "# Methods on the shapes task",
        "",
        f"Written by `{command}`: each preset trained on {where} ({args.jobs} runs at a time) for "
        f"{args.minutes:g} minutes × the budget ({clock_name}), then its final model evaluated with "
        f"{args.eval_samples} images per "
        f"held-out line ({evaluated} images). Gains are in points against the shipped "
        f"model under the same seed's noise (base colour+count: {', '.join(f'{v:.1f}' for v in base_cc)}). "
        "± is the sample standard deviation over seeds.",
        "",
        f"| preset | budget | {GAIN_HEADER.format(k=args.eval_samples)} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    gains: dict[tuple[str, float], list[float]] = {}
    paired: list[str] = []
    for (label, budget), group in groups.items():
        gains[label, budget], cells = gain_cells(group, base, args)
        lines.append(f"| `{label}` | ×{budget:g} {cells}")
        if all(r.last_summary for r in group):  # --also-last: the same runs' last weights, paired
            last = [replace(r, summary=r.last_summary) for r in group]
            last_gains, cells = gain_cells(last, base, args)
            lines.append(f"| `{label}`, its last weights | ×{budget:g} {cells}")
            paired.append(f"- `{label}` ×{budget:g}: {paired_verdict(gains[label, budget], last_gains)}")
    if paired:
        lines += ["", "The EMA weights against the same runs' last weights (paired by run):", "", *paired]
    lines += ["", "Against the first preset at the same budget (difference of mean colour+count gains):", ""]
    first = runs[0].label if runs else ""
    for (label, budget), cc in gains.items():
        if label == first or (first, budget) not in gains:
            continue
        lines.append(f"- `{label}` ×{budget:g}: {noise_verdict(cc, gains[first, budget])}")
    lines += [
        "",
        f"![training reward against minutes: seed mean, smoothed over 5 epochs, seed range shaded]({plot})",
        "",
    ]
    return "\n".join(lines)


GAIN_HEADER = "colour+count gain | per seed | exact gain | cc pass@{k} % | minutes | epochs | images | optimizer steps"


def gain_cells(group: list[Run], base: dict[int, dict[str, float]], args: argparse.Namespace) -> tuple[list, str]:
    """A group of seeds' colour+count gains (points, against each seed's base) and its table cells under
    :data:`GAIN_HEADER`, from ``| `` to the closing ``|``."""
    cc = [100 * (r.summary[COLOR_COUNT] - base[r.seed][COLOR_COUNT]) for r in group]
    exact = [100 * (r.summary[EXACT] - base[r.seed][EXACT]) for r in group]
    (m, s), (me, se) = mean_std(cc), mean_std(exact)
    pass8 = statistics.fmean(100 * r.summary.get(f"{COLOR_COUNT}/pass@{args.eval_samples}", math.nan) for r in group)
    minutes = statistics.fmean(r.rows[-1][CLOCKS[args.clock]] / 60 for r in group)
    epochs = statistics.fmean(len(r.rows) for r in group)
    images = statistics.fmean(len(r.rows) * r.images_per_epoch for r in group)
    steps = statistics.fmean(r.rows[-1]["global_step"] for r in group)
    spread = (lambda s: f" ± {s:.1f}") if len(group) > 1 else (lambda s: " (one seed)")  # noqa: E731
    return cc, (
        f"| {m:+.1f}{spread(s)} | {' / '.join(f'{g:+.1f}' for g in cc)} "
        f"| {me:+.1f}{spread(se)} | {pass8:.1f} | {minutes:.1f} | {epochs:.0f} | {images:.0f} | {steps:.0f} |"
    )


def paired_verdict(gains: list[float], reference: list[float]) -> str:
    """``"+d ± e points (+d1 / +d2 / ...): within noise"``: the mean of the run-by-run differences and its standard
    error (their sample std / sqrt(n)); within noise when smaller than twice it. No verdict from one run."""
    differences = [g - r for g, r in zip(gains, reference, strict=True)]
    d, spread = mean_std(differences)
    each = " / ".join(f"{x:+.1f}" for x in differences)
    if len(differences) < 2:
        return f"{d:+.1f} points: one seed, no noise estimate"
    error = spread / math.sqrt(len(differences))
    return f"{d:+.1f} ± {error:.1f} points ({each}): {verdict(d, error)}"


def noise_verdict(gains: list[float], reference: list[float]) -> str:
    """``"+d ± e points: within noise"`` (or better, worse): the difference of mean gains and its standard error.
    With one seed on either side there is no spread to measure the difference against: no verdict then."""
    d, error, _ = within_noise(gains, reference)
    if min(len(gains), len(reference)) < 2:
        return f"{d:+.1f} points: one seed, no noise estimate (a scout; one run's end point swings by several points)"
    return f"{d:+.1f} ± {error:.1f} points: {verdict(d, error)}"


def smoothed_curve(rows: list[dict], grid: list[float], window: int = 5, clock: str = "time/cpu") -> list[float]:
    """A run's training reward on ``grid`` (minutes): the epochs' mean reward averaged over the last ``window``
    epochs (an epoch's 16 prompts move it by ±0.1, more than a method does in minutes), then interpolated linearly
    at each grid point within the run's span (NaN outside it)."""
    import numpy as np

    x = np.array([row[clock] / 60 for row in rows])
    y = np.array([row["reward/total/mean"] for row in rows], dtype=float)
    trailing = np.array([y[max(0, i - window + 1) : i + 1].mean() for i in range(len(y))])
    inside = (np.asarray(grid) >= x[0]) & (np.asarray(grid) <= x[-1]) if len(x) else np.zeros(len(grid), bool)
    return np.where(inside, np.interp(grid, x, trailing) if len(x) else np.nan, np.nan).tolist()


def write_curves(runs: list[Run], path: Path, minutes: float, clock: str = "time/cpu") -> None:
    """Each preset's training reward against minutes on ``clock``, smoothed over 5 epochs: the mean over seeds as a
    line, the seeds' range shaded; dotted lines mark the budgets."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    longest: dict[tuple[str, str, int], Run] = {}
    for run in runs:  # the longest budget's run shows the shorter ones' span too
        key = (run.preset, run.name, run.seed)
        if key not in longest or run.budget > longest[key].budget:
            longest[key] = run
    end = max((row[clock] / 60 for run in longest.values() for row in run.rows), default=minutes)
    grid = np.linspace(0, end, 200)
    palette = plt.get_cmap("tab20").colors  # 20 distinct colours: more presets than tab10's ten
    for index, (preset, name) in enumerate(dict.fromkeys((run.preset, run.name) for run in runs)):
        group = [r for (p, n, _), r in longest.items() if (p, n) == (preset, name)]
        curves = np.array([smoothed_curve(r.rows, grid.tolist(), clock=clock) for r in group])
        if not len(curves):
            continue
        seen = ~np.isnan(curves).all(axis=0)
        mean = np.nanmean(np.where(seen, curves, 0.0), axis=0)
        (line,) = ax.plot(
            grid[seen], mean[seen], lw=1.8, color=palette[index % 20], label=f"{group[0].label} ({len(curves)} seeds)"
        )
        low, high = np.nanmin(curves[:, seen], axis=0), np.nanmax(curves[:, seen], axis=0)
        ax.fill_between(grid[seen], low, high, color=line.get_color(), alpha=0.15, lw=0)
    for budget in sorted({r.budget for r in runs}):
        ax.axvline(minutes * budget, color="grey", ls=":", lw=1)
    processes = max((run.processes for run in runs), default=1)
    where = "one thread" if processes == 1 else f"{processes} processes, one thread each"
    ax.set_xlabel(f"CPU minutes, {where}" if clock == "time/cpu" else f"wall-clock minutes, {where}")
    ax.set_ylabel("training reward, mean of the last 5 epochs")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
