"""Evaluate a checkpoint: noise-free sampling on the test prompts, every configured reward, a grid and a report.

python scripts/evaluate.py --checkpoint runs/<run>/checkpoints/epoch-00100 [--config cfg.yaml] [--ema]
    [--out DIR] [--overwrite] [key.sub=value ...]        # e.g. eval.num_steps=28 data.test=my_prompts.jsonl
python scripts/evaluate.py --lora my-lora --config cfg.yaml [--out DIR] [key.sub=value ...]
    # an exported LoRA (scripts/export.py) in plain diffusers: from_pretrained + load_lora_weights, sampled by
    # pipe(...) from the same noise (drawn from the config's run.seed), scored by the same rewards; report in
    # my-lora-eval (SD3-family text-to-image models). For an fp32 model (the shapes model) the summary is the
    # checkpoint's; with model.vae_fp32 on a bf16 model pipe(...) decodes in bf16, so scores may differ slightly
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="<run>/checkpoints/epoch-NNNNN")
    source.add_argument(
        "--lora",
        help="an exported LoRA directory, evaluated in plain diffusers (needs --config; noise from its run.seed); "
        "for an fp32 model the same summary as the checkpoint's evaluation",
    )
    parser.add_argument("--config", help="config YAML (default: the run's config.yaml)")
    parser.add_argument("--ema", action="store_true", help="evaluate the EMA weights")
    parser.add_argument(
        "--out", help="report directory (default: <checkpoint>/eval, <checkpoint>/eval_ema, or <lora>-eval)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier report at --out")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.lora and not args.config:
        parser.error("--lora needs --config: the model, test prompts, rewards and eval settings to evaluate it with")
    if args.lora and args.ema:
        parser.error("--ema chooses a checkpoint's weights: export them with scripts/export.py --ema, then pass --lora")

    from flowgrpo.config import load_config
    from flowgrpo.data import PromptDataset
    from flowgrpo.evaluation import evaluate, grid_prompts, write_report
    from flowgrpo.export import (
        adapter_from_checkpoint,
        atomic_dir,
        check_output_dir,
        ema_hint,
        protected_dirs,
        run_config,
    )
    from flowgrpo.plain import check_plain, dtype_note, load_plain
    from rewards import RewardError, build_reward

    checkpoint = Path(args.lora or args.checkpoint)  # --lora: the LoRA directory, kept as a checkpoint is
    name = "eval_ema" if args.ema else "eval"
    if args.out:
        out = Path(args.out)
    elif args.lora:  # resolved first: --lora . gives <its name>-eval beside it, not .-eval
        lora = checkpoint.expanduser().resolve()
        out = lora.with_name(lora.name + "-eval")
    else:
        out = checkpoint / name
    try:
        overrides = ["run.resume=null", *args.overrides]
        if args.config:  # training=False: the files only training reads (an offline store) need not exist
            config = load_config(args.config, overrides, training=False)
        else:
            config = run_config(checkpoint, overrides)
        if not config.data.test:
            raise ValueError("data.test is not set: pass data.test=<prompt file>")
        if not args.lora and (hint := ema_hint(config, args.ema)):  # an export holds the weights it was made from
            print(hint, file=sys.stderr)
        check_output_dir(
            out, overwrite=args.overwrite, kind="eval", protected=protected_dirs(config), keep=[checkpoint]
        )
        dataset = PromptDataset.from_file(config.data.test, "data.test")
        if args.lora:  # every refusal before the rewards and the model load
            check_plain(config, checkpoint, dataset)
            if note := dtype_note(config):
                print(note, file=sys.stderr)
        reward = build_reward(config.rewards, device=args.device)
        if args.lora:
            adapter = load_plain(config, checkpoint, device=args.device)
        else:
            adapter = adapter_from_checkpoint(config, checkpoint, ema=args.ema, device=args.device)
    except ValueError as err:  # a bad checkpoint, config, prompt file or --out: nothing was written
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        summary, images, prompts, scores = evaluate(
            adapter,
            dataset,
            reward,
            config.eval,
            resolution=config.model.size,
            seed=config.run.seed,
            progress=True,
            image_prompts=grid_prompts(config.eval.samples_per_prompt),
        )
        # Checked again: evaluation takes a while, and --out may have been filled meanwhile.
        check_output_dir(
            out, overwrite=args.overwrite, kind="eval", protected=protected_dirs(config), keep=[checkpoint]
        )
        with atomic_dir(out) as tmp:  # the whole report or none of it
            write_report(tmp, summary, images, prompts, scores, name=name)
    except (RewardError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    print(f"report: {out}")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
