"""Export a training checkpoint to plain diffusers.

python scripts/export.py --checkpoint runs/<run>/checkpoints/epoch-00100 --out my-lora      # LoRA directory
python scripts/export.py --checkpoint ... --out my-pipeline --merge                        # fused pipeline
python scripts/export.py ... --overwrite      # replace an earlier export (never the base model's directory)
# then:  pipe = StableDiffusion3Pipeline.from_pretrained(base); pipe.load_lora_weights("my-lora")
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="<run>/checkpoints/epoch-NNNNN")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--merge", action="store_true", help="write a full pipeline with the LoRA fused in")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights instead of the last ones")
    parser.add_argument("--config", help="config YAML (default: the run's config.yaml)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
    args = parser.parse_args(argv)

    from flowgrpo.config import load_config
    from flowgrpo.export import ema_hint, export_checkpoint, run_config

    try:
        config = load_config(args.config, ["run.resume=null"], training=False) if args.config else None
        hint = ema_hint(config or run_config(Path(args.checkpoint)), args.ema)
        if hint:
            print(hint, file=sys.stderr)
        out = export_checkpoint(
            args.checkpoint, args.out, merge=args.merge, ema=args.ema, config=config, overwrite=args.overwrite
        )
    except ValueError as err:  # a bad checkpoint, config or --out: nothing was written
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # disk full, permissions: the partial output was removed
        print(f"error: writing {args.out} failed: {err}", file=sys.stderr)
        return 1
    print(f"exported {'merged pipeline' if args.merge else 'LoRA'} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
