"""Write prompt files for a task: ``python scripts/make_prompts.py shapes [--out configs/prompts]``.

shapes: ``shapes_train.jsonl`` (every train-split prompt of ``flowgrpo.shapes``, balanced so that each of the
six tags fills the same number of lines) and ``shapes_test.jsonl`` (held-out prompts, the same number per
tag; a tag with fewer held-out prompts than lines repeats them, and evaluation gives every line its own
noise). The tags take turns line by line, so the first lines (the ones image grids show) cover every tag.
Each line: ``{"prompt": ..., "tag": ...}``. Deterministic: the same files every time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=["shapes"])
    parser.add_argument("--out", type=Path, default=Path("configs/prompts"), help="folder for the files")
    parser.add_argument("--train-per-tag", type=int, default=64)
    parser.add_argument("--test-per-tag", type=int, default=32)
    args = parser.parse_args(argv)
    if args.train_per_tag < 1 or args.test_per_tag < 1:
        parser.error("--train-per-tag and --test-per-tag must be >= 1")

    from flowgrpo.shapes import balanced_prompts, round_robin, split, write_prompt_file

    train, test = split()
    args.out.mkdir(parents=True, exist_ok=True)
    write_prompt_file(args.out / "shapes_train.jsonl", round_robin(balanced_prompts(train, args.train_per_tag, seed=0)))
    write_prompt_file(args.out / "shapes_test.jsonl", round_robin(balanced_prompts(test, args.test_per_tag, seed=1)))
    print(f"wrote {args.out}/shapes_train.jsonl ({6 * args.train_per_tag} lines from {len(train)} prompts) and "
          f"shapes_test.jsonl ({6 * args.test_per_tag} lines from {len(test)} held-out prompts)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
