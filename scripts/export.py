"""Export a training checkpoint to plain diffusers.

    python scripts/export.py --checkpoint runs/<run>/checkpoints/epoch-00100 --out my-lora      # LoRA directory
    python scripts/export.py --checkpoint ... --out my-pipeline --merge                        # fused pipeline
    # then:  pipe = StableDiffusion3Pipeline.from_pretrained(base); pipe.load_lora_weights("my-lora")
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="<run>/checkpoints/epoch-NNNNN")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--merge", action="store_true", help="write a full pipeline with the LoRA fused in")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights instead of the last ones")
    parser.add_argument("--config", help="config YAML (default: the run's config.yaml)")
    args = parser.parse_args(argv)

    from flowgrpo.config import load_config
    from flowgrpo.export import export_checkpoint

    try:
        config = load_config(args.config, ["run.resume=null"]) if args.config else None
        out = export_checkpoint(args.checkpoint, args.out, merge=args.merge, ema=args.ema, config=config)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {'merged pipeline' if args.merge else 'LoRA'} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
