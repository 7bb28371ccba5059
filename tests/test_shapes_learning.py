"""GRPO makes the shipped shapes model better on held-out prompts: a short run, held-out reward before and after."""

from __future__ import annotations

import json
from pathlib import Path

from flowgrpo.config import load_config
from flowgrpo.shapes import balanced_prompts, round_robin, split, write_prompt_file
from flowgrpo.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parent.parent


def test_a_short_grpo_run_on_the_shipped_model_raises_the_held_out_reward(tmp_path):
    # The single-object and colour prompts: the tags the main job improves first (its per-tag curves), so a
    # few epochs show it. Train and test prompts come from the two sides of the split.
    train, test = split()
    tags = ("single_object", "colors")
    write_prompt_file(
        tmp_path / "train.jsonl", round_robin(balanced_prompts([s for s in train if s.tag in tags], 8, 0))
    )
    write_prompt_file(tmp_path / "test.jsonl", round_robin(balanced_prompts([s for s in test if s.tag in tags], 16, 1)))
    epochs = 6
    config = load_config(ROOT / "configs" / "shapes.yaml", [
        f"run.output_dir={tmp_path}", "run.progress=false", f"run.epochs={epochs}", f"eval.every={epochs}",
        f"data.train={tmp_path / 'train.jsonl'}", f"data.test={tmp_path / 'test.jsonl'}", "grpo.groups_per_epoch=8",
    ])  # fmt: skip
    trainer = GRPOTrainer(config)
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    before, after = (r for r in rows if "eval/shapes" in r)
    # 32 held-out images with fixed noise, evaluated with the ODE: the change is the weights' alone.
    assert after["eval/shapes"] > before["eval/shapes"] + 0.1, (before["eval/shapes"], after["eval/shapes"])
    assert (trainer.run_dir / "eval" / "before_after.png").is_file() and (trainer.run_dir / "curves.png").is_file()
