"""Sample an offline store once: ``python scripts/sample_offline.py --config configs/<name>.yaml --out DIR [k=v]``.

The config's model (its LoRA switched off: the base model), sampler (the plain ODE), prompts (``data.train``),
rewards, ``grpo.group_size`` and ``sampler.offline.groups`` make ``sampler.offline.groups`` groups of images, scored
once, written to DIR as ``samples.safetensors`` and ``store.json`` (flowgrpo/offline.py says what they hold). Then
train on them without sampling again: ``scripts/train.py --config <the same> sampler.offline.path=DIR``. Prints the
one-time cost (seconds sampling and scoring; store.json keeps them) beside which the run's training time is read.
A bad config or an occupied DIR prints one paragraph and exits with code 2 before any work.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the YAML preset the store is for (configs/*_gdro.yaml)")
    parser.add_argument("--out", required=True, help="the store's directory (must not hold a store yet)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. sampler.offline.groups=512")
    args = parser.parse_args(argv)

    import torch

    from flowgrpo.config import load_config
    from flowgrpo.data import PromptDataset
    from flowgrpo.offline import INFO, build_store
    from flowgrpo.pipelines import build_adapter
    from rewards import RewardError, build_reward
    from rewards.base import accepts_source_images

    out = Path(args.out)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if (out / INFO).exists():
            raise ValueError(f"--out {out} already holds an offline store ({INFO}); choose another directory")
        # The store is what sampler.offline.path will name: validated as a store this run makes itself.
        overrides = [*args.overrides, "sampler.rollout=offline", "sampler.offline.path=null"]
        config = load_config(args.config, overrides)
        data = PromptDataset.from_file(config.data.train, "data.train")
        reward = build_reward(config.rewards, device=device, nan_policy="drop")
        reward.check_prompts(data.prompts)
        torch.manual_seed(config.run.seed)  # the LoRA initialisation (switched off while sampling)
        adapter = build_adapter(config.model, device)
    except (ValueError, OSError) as err:  # ConfigError, DataError, PipelineLoadError, reward specs
        print(textwrap.fill(f"error: {err}", width=100, break_long_words=False), file=sys.stderr)
        return 2

    def score(images, prompts, metadata, sources):
        extra = {"source_images": sources} if sources is not None and accepts_source_images(reward) else {}
        return reward(images, prompts, metadata, **extra)

    start = time.perf_counter()
    try:
        info = build_store(config, adapter, data, score, out, progress=True)
    except (RewardError, OSError) as err:
        print(textwrap.fill(f"error: {err}", width=100, break_long_words=False), file=sys.stderr)
        return 1
    assert info is not None
    given = "".join(f" {o}" for o in args.overrides)
    print(
        f"total {time.perf_counter() - start:.1f} s (model already loaded); train on it with: python scripts/train.py "
        f"--config {args.config}{given} sampler.offline.path={out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
