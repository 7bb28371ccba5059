"""The shapes task: grammar, held-out split, renders, the verifier reward, and the model's autoencoder / tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.ndimage import gaussian_filter

from flowgrpo.shapes import PlacedObject, all_specs, render, render_prompt, sample_scene, split
from flowgrpo.shapes_model import SHAPES_MODEL_DIR, pixels_to_latents, render_scenes, shapes_tokenizer
from rewards import build_reward
from rewards.shapes import TAGS, PromptGrammarError, ShapesReward, detect_objects, judge, parse_prompt


def _blur(image: np.ndarray, sigma: float) -> np.ndarray:
    return image if sigma == 0 else np.stack([gaussian_filter(image[..., c], sigma) for c in range(3)], -1)


def test_every_prompt_parses_back_to_its_spec_and_the_tags_have_the_documented_sizes():
    specs = all_specs()
    assert [parse_prompt(s.prompt) for s in specs] == specs
    sizes = {tag: sum(s.tag == tag for s in specs) for tag in TAGS}
    assert sizes == {
        "single_object": 3,
        "colors": 12,
        "counting": 24,
        "two_object": 6,
        "color_attr": 72,
        "position": 432,
    }
    assert len({s.prompt for s in specs}) == len(specs)


@pytest.mark.parametrize(
    "prompt",
    [
        "a purple circle",
        "a red circles",
        "two circles",
        "three red circle",
        "a red circle and a square",
        "a red circle left of a red square",
        "draw a red circle",
        "",
    ],
)
def test_prompts_outside_the_grammar_are_refused_by_name(prompt):
    with pytest.raises(PromptGrammarError, match="shapes: "):
        parse_prompt(prompt)


def test_the_split_holds_out_whole_prompts_of_every_tag():
    train, test = split()
    assert not {s.prompt for s in train} & {s.prompt for s in test}
    assert len(train) + len(test) == len(all_specs())
    for tag in TAGS:
        assert any(s.tag == tag for s in train) and any(s.tag == tag for s in test), tag
    assert 0.2 < len(test) / len(all_specs()) < 0.35
    assert split() == (train, test)  # a hash, not a random draw


def test_renders_are_deterministic_in_the_seed_and_anti_aliased():
    a = render_prompt("a red square and a green circle", np.random.default_rng(3))
    b = render_prompt("a red square and a green circle", np.random.default_rng(3))
    assert np.array_equal(a, b) and a.shape == (32, 32, 3)
    levels = np.unique(a.reshape(-1, 3), axis=0)
    assert len(levels) > 3  # edge pixels mix the colour with white


@pytest.mark.parametrize("sigma", [0.0, 0.5, 0.7])
def test_the_verifier_accepts_rendered_ground_truth_sharp_and_blurred(sigma):
    rng = np.random.default_rng(0)
    specs = all_specs()
    verdicts = []
    for _ in range(300):
        spec = specs[int(rng.integers(len(specs)))]
        verdicts.append(judge(spec, detect_objects(_blur(render(sample_scene(spec, rng)), sigma))))
    assert np.mean([v.exact for v in verdicts]) == 1.0
    assert np.mean([v.color_count for v in verdicts]) == 1.0
    assert np.mean([v.partial for v in verdicts]) == 1.0


def test_the_verifier_rejects_noise_and_wrong_renders():
    rng = np.random.default_rng(1)
    specs = all_specs()
    noise = [judge(specs[i], detect_objects(rng.random((32, 32, 3)).astype(np.float32))) for i in range(0, 549, 5)]
    assert max(v.partial for v in noise) < 0.2 and not any(v.exact for v in noise)
    # wrong colour: every object repainted with another palette colour
    spec = parse_prompt("a red square and a green circle")
    objects = sample_scene(spec, rng)
    swapped = [PlacedObject(o.shape, {"red": "blue", "green": "yellow"}[o.color], o.x, o.y) for o in objects]
    verdict = judge(spec, detect_objects(render(swapped)))
    assert not verdict.exact and not verdict.color_count and verdict.partial == 0.0
    # colours swapped between the shapes: colour+count holds, binding does not
    bound = [PlacedObject(o.shape, {"red": "green", "green": "red"}[o.color], o.x, o.y) for o in objects]
    verdict = judge(spec, detect_objects(render(bound)))
    assert not verdict.exact and verdict.color_count
    # wrong count: one of three objects missing
    spec = parse_prompt("three blue circles")
    verdict = judge(spec, detect_objects(render(sample_scene(spec, rng)[:2])))
    assert not verdict.exact and not verdict.color_count and verdict.partial == pytest.approx(2 / 3)
    # wrong relation: the same render judged against the opposite relation
    spec = parse_prompt("a yellow circle left of a blue square")
    image = render(sample_scene(spec, rng))
    assert judge(spec, detect_objects(image)).exact
    assert not judge(parse_prompt("a yellow circle right of a blue square"), detect_objects(image)).exact


def test_count_weight_mixes_colour_and_count_credit_into_the_partial_score():
    rng = np.random.default_rng(4)
    spec = parse_prompt("a red square and a green circle")
    objects = sample_scene(spec, rng)
    bound = [PlacedObject(o.shape, {"red": "green", "green": "red"}[o.color], o.x, o.y) for o in objects]
    found = detect_objects(render(bound))
    # shapes bound to the wrong colours: no strict credit, but each colour's count and the total are right
    assert judge(spec, found).partial == 0.0
    assert judge(spec, found, count_weight=0.5).partial == pytest.approx(0.5)
    assert judge(spec, found, count_weight=1.0).partial == pytest.approx(1.0)
    # one of three blue circles missing: strict 2/3; counts: blue 2 of 3 (2/3) and total 2 of 3 (2/3)
    spec = parse_prompt("three blue circles")
    found = detect_objects(render(sample_scene(spec, rng)[:2]))
    assert judge(spec, found, count_weight=0.5).partial == pytest.approx(2 / 3)
    # an extra yellow blob beside "a red circle": strict 1 / (1 + 1); counts: red 1 of 1 (1), total 2 of 1 (0)
    spec = parse_prompt("a red circle")
    found = detect_objects(render([PlacedObject("circle", "red", 20, 20), PlacedObject("square", "yellow", 0, 0)]))
    assert len(found) == 2
    assert judge(spec, found, count_weight=0.5).partial == pytest.approx(0.5 * 0.5 + 0.5 * 0.5)
    with pytest.raises(ValueError, match="count_weight"):
        ShapesReward(count_weight=1.5)


def test_shapes_reward_through_the_registry_reports_partial_credit_and_accuracies():
    reward = build_reward({"shapes": 1.0})
    rng = np.random.default_rng(2)
    prompts = ["a red circle", "two green triangles", "a circle and a square", "a blue square above a red circle"]
    images = torch.from_numpy(np.stack([render_prompt(p, rng) for p in prompts])).permute(0, 3, 1, 2)
    images[-1] = 1.0  # a blank image fails
    scores = reward(images, prompts)
    assert set(scores) == {"shapes", "shapes/accuracy/exact", "shapes/accuracy/color_count", "total"}
    assert scores["shapes/accuracy/exact"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert scores["total"].tolist() == [1.0, 1.0, 1.0, 0.0]
    with pytest.raises(PromptGrammarError, match="'a photo of a cat'"):
        ShapesReward().check_prompts(["a red circle", "a photo of a cat"])


def test_the_shipped_autoencoder_keeps_what_the_verifier_reads_and_the_tokenizer_keeps_words_whole():
    from diffusers import AutoencoderTiny

    vae = AutoencoderTiny.from_pretrained(SHAPES_MODEL_DIR / "vae")
    rng = np.random.default_rng(3)
    specs = [s for s in split()[1] for _ in range(2)]  # held-out prompts: the autoencoder never saw these scenes
    prompts = [s.prompt for s in specs]
    images = render_scenes(specs, rng)
    with torch.no_grad():
        latents = pixels_to_latents(vae, images)  # what the transformer sees: normalised by the shipped factors
        decoded = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample
    assert latents.shape == (len(specs), 4, 8, 8)
    assert abs(latents.mean().item()) < 0.1 and abs(latents.std().item() - 1) < 0.1
    reconstructed = ((decoded + 1) / 2).clamp(0, 1)
    assert (reconstructed - images).abs().mean() < 0.02
    assert ShapesReward()(reconstructed, prompts)["accuracy/exact"].mean() >= 0.99
    tokenizer = shapes_tokenizer()
    words = sorted({w for s in all_specs() for w in s.prompt.split()})
    for word in words:
        assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, word
    longest = max((s.prompt for s in all_specs()), key=lambda p: len(tokenizer(p).input_ids))
    assert len(tokenizer(longest).input_ids) <= tokenizer.model_max_length


def test_the_tokenizer_vocabulary_is_the_same_in_every_process():
    # Pretraining reproduces its weights only if every process numbers the words alike (tokenizers' BPE
    # trainer, used before, broke ties in hash order, which differed between processes).
    import os
    import subprocess
    import sys

    from flowgrpo.shapes_model import _word_bpe

    code = "from flowgrpo.shapes_model import _word_bpe; print(repr(_word_bpe()))"
    # Side by side: each process spends its time importing torch and diffusers.
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1"},
        )
        for seed in (1, 2, 3)
    ]
    results = [p.communicate(timeout=600) for p in processes]
    assert all(p.returncode == 0 for p in processes), [err for _, err in results]
    assert {out.strip() for out, _ in results} == {repr(_word_bpe())}


def test_a_prompt_outside_the_grammar_stops_training_before_any_work(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import train

    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "a red circle", "tag": "colors"}\n{"prompt": "a photo of a cat", "tag": "colors"}\n')
    code = train.main(["--config", "configs/shapes.yaml", f"data.train={bad}", f"run.output_dir={tmp_path / 'runs'}"])
    assert code == 2
    assert "'a photo of a cat' is outside the task's grammar" in capsys.readouterr().err.replace("\n", " ")
    assert not (tmp_path / "runs").exists()
