"""``small_prompt_set_warning``: a real model left on a preset's 4–12-prompt sample file is warned, loudly and once;
the shipped shapes model and the tiny test pipelines are not."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flowgrpo.data import SMALL_PROMPT_SET, PromptDataset, small_prompt_set_warning

ROOT = Path(__file__).resolve().parent.parent
SD35M = "stabilityai/stable-diffusion-3.5-medium"


def test_a_real_model_on_a_small_prompt_file_is_warned_in_one_paragraph():
    message = small_prompt_set_warning(12, SD35M, "configs/prompts/pickscore_train.txt", groups_per_epoch=48)
    assert message is not None and "\n" not in message
    assert message.startswith("data.train: configs/prompts/pickscore_train.txt holds only 12 prompt(s)")
    assert f"model.pretrained={SD35M} is a real model" in message
    assert "each epoch draws its 48 groups from these 12 prompts (with replacement)" in message
    assert "point data.train at the recipe's own prompt set (docs/recipes.md says where each comes from" in message
    more = small_prompt_set_warning(500, "/models/flux-dev", "p.txt", key="data.x", groups_per_epoch=48)
    assert "data.x: p.txt holds only 500" in more and "(with replacement)" not in more
    assert "every epoch draws its groups from these 3 prompts" in small_prompt_set_warning(3, SD35M, "p.txt")


@pytest.mark.parametrize(
    "num_prompts, pretrained, threshold, warned",
    [
        (SMALL_PROMPT_SET - 1, SD35M, SMALL_PROMPT_SET, True),
        (SMALL_PROMPT_SET, SD35M, SMALL_PROMPT_SET, False),
        (10_000, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", SMALL_PROMPT_SET, False),
        (12, SD35M, 10, False),
        (12, "shapes-sd3", SMALL_PROMPT_SET, False),  # the shipped shapes model: its prompts are the task
        (8, "tiny-sd3", SMALL_PROMPT_SET, False),
        (4, "tiny-flux-kontext-taesd", SMALL_PROMPT_SET, False),
        (4, "tiny-qwenimage-edit", SMALL_PROMPT_SET, False),
        (8, "tiny-wan", SMALL_PROMPT_SET, False),
        (8, "tiny-not-a-family", SMALL_PROMPT_SET, True),  # only the names load_pipeline builds in code
    ],
)
def test_who_is_warned(num_prompts, pretrained, threshold, warned):
    message = small_prompt_set_warning(num_prompts, pretrained, "p.txt", threshold=threshold)
    assert (message is not None) == warned


def test_the_shipped_presets_are_warned_exactly_where_their_prompt_file_is_a_sample():
    warned = {}
    for preset in sorted((ROOT / "configs").glob("*.yaml")):
        config = yaml.safe_load(preset.read_text())
        train = ROOT / config["data"]["train"]
        data = PromptDataset.from_file(train)
        message = small_prompt_set_warning(len(data), config["model"]["pretrained"], config["data"]["train"])
        warned[preset.stem] = message is not None
    assert not any(warned[name] for name in warned if name.startswith(("tiny_", "shapes")))
    assert not warned["sd35m_geneval"] and not warned["sd35m_ocr"] and not warned["wan21_t2v_ocr"]  # generated sets
    assert warned["sd35m_pickscore"] and warned["flux_dev_pickscore"] and warned["qwenimage_edit_counting"]
    assert warned["flux_kontext_counting"] and warned["flux_dancegrpo"]
