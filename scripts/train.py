"""Train: ``accelerate launch scripts/train.py --config configs/<name>.yaml [key.sub=value ...]`` (or ``python``).

Configuration problems (unknown keys, bad values, missing prompt files, models that cannot be loaded)
print one paragraph and exit with code 2, before any training work.
"""

from __future__ import annotations

import argparse
import sys
import textwrap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GRPO fine-tuning of flow-matching image models.")
    parser.add_argument("--config", help="YAML preset (configs/*.yaml); fields not given take their defaults")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.lr=1e-4 run.epochs=3")
    args = parser.parse_args(argv)

    from flowgrpo.checkpoint import CheckpointError
    from flowgrpo.config import load_config
    from flowgrpo.data import DataError
    from flowgrpo.parallel import end_process
    from flowgrpo.trainer import GRPOTrainer, TrainingError
    from rewards import RewardError

    try:
        config = load_config(args.config, args.overrides)
        trainer = GRPOTrainer(config)
    except (ValueError, OSError) as err:  # ConfigError, DataError, PipelineLoadError, reward specs; unusable paths
        print(textwrap.fill(f"error: {err}", width=100, break_long_words=False), file=sys.stderr)
        return 2
    trainer.accelerator.print(f"run directory: {trainer.run_dir}")
    code = 0
    try:
        trainer.fit()
        trainer.accelerator.print(f"done: {trainer.run_dir}")
    # messages written for people: no traceback (DataError: a source image broken after the run started)
    except (TrainingError, RewardError, CheckpointError, DataError) as err:
        print(textwrap.fill(f"error: {err}", width=100, break_long_words=False), file=sys.stderr)
        code = 1
    end_process(trainer.accelerator, code)  # several processes: exit here, before gloo's threads meet teardown
    return code


if __name__ == "__main__":
    sys.exit(main())
