"""Noise-free evaluation: per-tag means from jsonl metadata, sharding, determinism, and the report files."""

from __future__ import annotations

import json

import torch

from flowgrpo.adapters import make_adapter
from flowgrpo.config import EvalConfig
from flowgrpo.data import PromptDataset
from flowgrpo.evaluation import evaluate, summarize, write_report
from flowgrpo.tiny import build_tiny_pipeline
from rewards import build_reward


def test_per_tag_means_shards_and_report(tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": f"object {i}", "tag": "counting" if i % 2 else "colors"} for i in range(5)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    dataset = PromptDataset.from_file(prompts)
    adapter = make_adapter(build_tiny_pipeline("sd3", seed=0, vae="tiny"))
    reward = build_reward({"brightness": 2.0})
    config = EvalConfig(num_steps=3, guidance_scale=4.5, batch_size=2)
    summary, images, names, scores = evaluate(adapter, dataset, reward, config, resolution=32, seed=1)
    assert names == dataset.prompts and images.shape == (5, 3, 32, 32)
    tags = torch.tensor([r["tag"] == "counting" for r in rows])
    assert summary["brightness/tag/counting"] == scores["brightness"][tags].mean().item()
    assert summary["total/tag/colors"] == scores["total"][~tags].mean().item()
    torch.testing.assert_close(torch.tensor(summary["total"]), 2 * scores["brightness"].mean())
    # Fixed noise per prompt: batching and sharding do not change an image.
    config_one = EvalConfig(num_steps=3, guidance_scale=4.5, batch_size=1)
    _, odd_images, odd_names, _ = evaluate(adapter, dataset, reward, config_one, resolution=32, seed=1, shard=(1, 2))
    assert odd_names == dataset.prompts[1::2]
    torch.testing.assert_close(odd_images, images[1::2], rtol=0, atol=1e-6)
    write_report(tmp_path / "report", summary, images, names, scores)
    report = json.loads((tmp_path / "report" / "eval.json").read_text())
    assert report["summary"] == summary and len(report["images"]) == 5
    assert (tmp_path / "report" / "eval.png").stat().st_size > 0


def test_summary_sub_scores_skip_images_they_do_not_apply_to_and_trained_scores_show_nan():
    dataset = PromptDataset(["a", "b", "c", "d"], [{"tag": "counting"}, {"tag": "colors"}, {"tag": "counting"}, {}])
    nan = float("nan")
    scores = {
        "total": torch.tensor([0.5, 1.0, nan, 0.0]),  # a failed reward on image 2
        "geneval": torch.tensor([0.5, 1.0, 0.25, 0.0]),
        "geneval/counting_accuracy": torch.tensor([1.0, nan, 0.0, nan]),  # GenEval's per-tag sub-scores
    }
    summary = summarize(dataset, [0, 1, 2, 3], scores)
    assert summary["geneval/counting_accuracy"] == 0.5  # over the two counting images, not NaN
    assert summary["geneval"] == 0.4375 and summary["geneval/tag/colors"] == 1.0
    assert summary["total"] != summary["total"] and summary["total/tag/colors"] == 1.0  # NaN shows where it is
    assert summary["geneval/counting_accuracy/tag/colors"] != summary["geneval/counting_accuracy/tag/colors"]
