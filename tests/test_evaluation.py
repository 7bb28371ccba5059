"""Noise-free evaluation: per-tag means from jsonl metadata, sharding, determinism, and the report files."""

from __future__ import annotations

import json

import pytest
import torch

from flowgrpo.adapters import make_adapter
from flowgrpo.config import EvalConfig
from flowgrpo.data import PromptDataset
from flowgrpo.evaluation import evaluate, evaluate_shard, merge_shards, shard_order, summarize, write_report
from flowgrpo.tiny import build_tiny_pipeline
from rewards import build_reward


def _tagged(tmp_path, count):
    """A prompt file of ``count`` tagged prompts (odd: counting, even: colors), read back, and a tiny SD3."""
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": f"object {i}", "tag": "counting" if i % 2 else "colors"} for i in range(count)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    return rows, PromptDataset.from_file(prompts), make_adapter(build_tiny_pipeline("sd3", seed=0, vae="tiny"))


def test_per_tag_means_shards_and_report(tmp_path):
    rows, dataset, adapter = _tagged(tmp_path, 5)
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


def test_samples_per_prompt_adds_images_from_their_own_noise_and_pass_at_k(tmp_path):
    _, dataset, adapter = _tagged(tmp_path, 3)
    reward = build_reward({"brightness": 1.0})
    one = EvalConfig(num_steps=3, guidance_scale=4.5, batch_size=2)
    three = EvalConfig(num_steps=3, guidance_scale=4.5, batch_size=2, samples_per_prompt=3)
    _, images, _, _ = evaluate(adapter, dataset, reward, one, resolution=32, seed=1)
    summary, many, names, scores = evaluate(adapter, dataset, reward, three, resolution=32, seed=1)
    assert names == [p for p in dataset.prompts for _ in range(3)] and many.shape == (9, 3, 32, 32)
    # Image 0 of each prompt is the one-image evaluation's (same noise); images 1 and 2 are others.
    torch.testing.assert_close(many[0::3], images, rtol=0, atol=1e-6)
    assert (many[1::3] - many[0::3]).abs().amax() > 0.05 and (many[2::3] - many[1::3]).abs().amax() > 0.05
    assert summary["brightness"] == scores["brightness"].mean().item()
    # Sharded over 2 processes by image, not by prompt: the same images.
    _, odd, odd_names, _ = evaluate(adapter, dataset, reward, three, resolution=32, seed=1, shard=(1, 2))
    assert odd_names == names[1::2]
    torch.testing.assert_close(odd, many[1::2], rtol=0, atol=1e-6)
    # image_prompts: images of the first prompts only (the report's grid), scores of all.
    _, first, _, all_scores = evaluate(adapter, dataset, reward, three, resolution=32, seed=1, image_prompts=2)
    torch.testing.assert_close(first, many[:6], rtol=0, atol=1e-6)
    torch.testing.assert_close(all_scores["brightness"], scores["brightness"], rtol=0, atol=1e-6)
    _, odd_first, _, _ = evaluate(adapter, dataset, reward, three, resolution=32, seed=1, shard=(1, 2), image_prompts=2)
    torch.testing.assert_close(odd_first, many[1:6:2], rtol=0, atol=1e-6)  # images 1, 3, 5; 7 is prompt 2's
    # pass@k of an accuracy: the share of prompts with any of their k images right, overall and per tag.
    right = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0])  # prompts 0 and 2 have one right
    passed = summarize(dataset, [0, 0, 0, 1, 1, 1, 2, 2, 2], {"v/accuracy/exact": right, "v": right})
    assert passed["v/accuracy/exact"] == right.mean().item()
    assert passed["v/accuracy/exact/pass@3"] == torch.tensor(2 / 3).item() and "v/pass@3" not in passed  # (float32)
    assert passed["v/accuracy/exact/pass@3/tag/colors"] == 1.0  # prompts 0 and 2
    assert passed["v/accuracy/exact/pass@3/tag/counting"] == 0.0
    assert not any("pass@" in k for k in summarize(dataset, [0, 1, 2], {"v/accuracy/exact": right[:3]}))
    # GenEval's names; a per-tag accuracy is NaN on other tags' images: skipped, as the means skip it.
    nan = float("nan")
    tagged = torch.tensor([nan, nan, nan, 1.0, 0.0, nan, nan, nan, nan])  # only prompt 1 (counting) has it
    passed = summarize(dataset, [0, 0, 0, 1, 1, 1, 2, 2, 2], {"geneval/accuracy": right, "g/counting_accuracy": tagged})
    assert passed["geneval/accuracy/pass@3"] == torch.tensor(2 / 3).item()
    assert passed["g/counting_accuracy/pass@3"] == 1.0 and passed["g/counting_accuracy/pass@3/tag/counting"] == 1.0
    assert passed["g/counting_accuracy/pass@3/tag/colors"] != passed["g/counting_accuracy/pass@3/tag/colors"]  # NaN


def test_shards_merge_back_into_the_unsharded_order(tmp_path):
    """What the trainer does with its processes' evaluations: 10 images over 3 shards (4, 3, 3), merged, are the
    single-process evaluation's, in its order (a prompt's k images together); with image_prompts, the first
    prompts' images only."""
    _, dataset, adapter = _tagged(tmp_path, 5)
    reward = build_reward({"brightness": 1.0})
    config = EvalConfig(num_steps=2, guidance_scale=4.5, batch_size=4, samples_per_prompt=2)
    _, images, names, scores = evaluate(adapter, dataset, reward, config, resolution=32, seed=1)
    parts = [evaluate_shard(adapter, dataset, reward, config, resolution=32, seed=1, shard=(r, 3)) for r in range(3)]
    assert [len(indices) for indices, _, _ in parts] == [4, 3, 3]
    indices, merged, merged_scores = merge_shards(parts)
    assert [dataset.prompts[i] for i in indices] == names
    # Other batches than the unsharded run's: equal up to float rounding, as in the tests above.
    torch.testing.assert_close(merged, images, rtol=0, atol=1e-6)
    torch.testing.assert_close(merged_scores["total"], scores["total"], rtol=0, atol=1e-6)
    # The report grid's images only (prompts 0 and 1: images 0-3 of the list, held 2, 1, 1 by the shards).
    parts = [
        evaluate_shard(adapter, dataset, reward, config, resolution=32, seed=1, shard=(r, 3), image_prompts=2)
        for r in range(3)
    ]
    assert [len(shard_images) for _, shard_images, _ in parts] == [2, 1, 1]
    indices, first, first_scores = merge_shards(parts, image_prompts=2)
    assert [dataset.prompts[i] for i in indices] == names
    torch.testing.assert_close(first, images[:4], rtol=0, atol=1e-6)
    torch.testing.assert_close(first_scores["total"], scores["total"], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="round-robin"):
        shard_order([3, 3, 4])  # rank 2 cannot hold more than rank 0
