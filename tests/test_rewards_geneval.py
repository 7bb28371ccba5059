"""The ``geneval`` reward: GenEval's rules on synthetic detections (values worked out by hand from djghosh13/geneval
``evaluate_images.py`` and Flow-GRPO's ``reward_server/gen_eval.py``), the Mask2Former post-processing on hand-made
logits, the model path on tiny random Mask2Former / open_clip configs, and ``scripts/make_prompts.py geneval|ocr``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from script_helper import load_script

from flowgrpo.data import PromptDataset
from rewards import build_reward
from rewards.geneval import (
    CLASSES,
    TAGS,
    Detection,
    Verdict,
    box_iou,
    check_metadata,
    detector_input_size,
    instance_detections,
    judge,
    relative_position,
    select_objects,
)
from rewards.ocr import quoted_text

ROOT = Path(__file__).resolve().parents[1]
OPEN_CLIP_TINY = {
    "embed_dim": 32,
    "vision_cfg": {"layers": 2, "width": 32, "head_width": 16, "patch_size": 16, "image_size": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
MASK2FORMER_TINY = {
    "backbone_config": {
        "model_type": "swin",
        "embed_dim": 16,
        "depths": [1, 1, 1, 1],
        "num_heads": [1, 1, 1, 1],
        "out_features": ["stage1", "stage2", "stage3", "stage4"],
    },
    "feature_size": 32,
    "mask_feature_size": 32,
    "hidden_dim": 32,
    "encoder_feedforward_dim": 64,
    "encoder_layers": 1,
    "decoder_layers": 2,
    "num_attention_heads": 2,
    "dim_feedforward": 64,
    "num_queries": 10,
    "id2label": {i: name for i, name in enumerate(CLASSES)},
}


def det(x1: float, y1: float, x2: float, y2: float, score: float = 0.95) -> Detection:
    return Detection((x1, y1, x2, y2), score)


def painter(colors: dict[str, list[str]], calls: list | None = None):
    """A colour classifier that answers from a table (the i-th object of a class gets the i-th colour)."""

    def classify(name: str, objects: list[Detection]) -> list[str]:
        if calls is not None:
            calls.append((name, list(objects)))
        return colors[name][: len(objects)]

    return classify


NO_COLORS = painter({})


# ------------------------------------------------------------------------------------------------ rules, per tag


def test_single_object():
    meta = {"tag": "single_object", "include": [{"class": "bench", "count": 1}]}
    assert judge({"bench": [det(0, 0, 9, 9)]}, meta, NO_COLORS) == Verdict(1.0, True, True)
    assert judge({}, meta, NO_COLORS) == Verdict(0.0, False, False)
    # GenEval counts "at least"; Flow-GRPO's partial score wants exactly one: 1 - |1 - 2| / 1 = 0, and below 0 beyond
    assert judge({"bench": [det(0, 0, 9, 9), det(20, 0, 29, 9)]}, meta, NO_COLORS) == Verdict(0.0, False, True)
    assert judge({"bench": [det(0, 0, 9, 9)] * 3}, meta, NO_COLORS) == Verdict(-1.0, False, True)


def test_two_object():
    meta = {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "bicycle", "count": 1}]}
    dog, bike = det(0, 0, 9, 9), det(20, 0, 29, 9)
    assert judge({"dog": [dog], "bicycle": [bike]}, meta, NO_COLORS) == Verdict(1.0, True, True)
    assert judge({"dog": [dog]}, meta, NO_COLORS) == Verdict(0.5, False, False)  # credits [1, 0]
    assert judge({"dog": [dog], "bicycle": [bike, bike]}, meta, NO_COLORS) == Verdict(0.5, False, True)


def test_counting_uses_exact_counts_and_the_exclude_clause():
    meta = {"tag": "counting", "include": [{"class": "clock", "count": 3}], "exclude": [{"class": "clock", "count": 4}]}
    clocks = [det(20 * i, 0, 20 * i + 9, 9) for i in range(5)]
    assert judge({"clock": clocks[:3]}, meta, NO_COLORS) == Verdict(1.0, True, True)
    assert judge({"clock": clocks[:2]}, meta, NO_COLORS) == Verdict(pytest.approx(2 / 3), False, False)
    assert judge({"clock": clocks[:4]}, meta, NO_COLORS) == Verdict(pytest.approx(2 / 3), False, False)  # excluded
    assert judge({"clock": clocks}, meta, NO_COLORS) == Verdict(pytest.approx(1 / 3), False, False)


def test_colors_classify_the_most_confident_objects():
    meta = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "pink"}]}
    car, other = det(0, 0, 9, 9, 0.9), det(20, 0, 29, 9, 0.8)
    assert judge({"car": [car]}, meta, painter({"car": ["pink"]})) == Verdict(1.0, True, True)
    assert judge({"car": [car]}, meta, painter({"car": ["red"]})) == Verdict(0.5, False, False)  # [1, 0]
    assert judge({}, meta, NO_COLORS) == Verdict(0.0, False, False)  # [0, 0]
    calls = []
    # two cars: Flow-GRPO's count fails ([0, 0], no colour asked); GenEval checks the top car only
    assert judge({"car": [car, other]}, meta, painter({"car": ["pink", "red"]}, calls)) == Verdict(0.0, False, True)
    assert calls == [("car", [car])]


def test_position_margin_and_the_servers_scoring():
    meta = {
        "tag": "position",
        "include": [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
    }
    bear = det(0, 0, 100, 100)
    assert judge({"teddy bear": [bear], "dog": [det(200, 0, 300, 100)]}, meta, NO_COLORS) == Verdict(1.0, True, True)
    # wrong side: the server appends 0 and then 1 -> [1, 1, 0, 1]
    wrong = {"teddy bear": [det(200, 0, 300, 100)], "dog": [det(0, 0, 100, 100)]}
    assert judge(wrong, meta, NO_COLORS) == Verdict(0.75, False, False)
    # 15 px to the right, inside the margin 0.1 x (100 + 100): no relation at all
    assert relative_position((15, 0, 115, 100), bear.box) == set()
    assert judge({"teddy bear": [bear], "dog": [det(15, 0, 115, 100)]}, meta, NO_COLORS) == Verdict(0.75, False, False)
    # no target: credits [0 (bear count), 1 (dog count), 0 (no target)]
    assert judge({"dog": [det(200, 0, 300, 100)]}, meta, NO_COLORS) == Verdict(pytest.approx(1 / 3), False, False)
    # two dogs, the more confident one right of the bear: GenEval passes, Flow-GRPO's count fails ([1, 0, 0])
    dogs = [det(200, 0, 300, 100, 0.9), det(-300, 0, -200, 100, 0.5)]
    assert judge({"teddy bear": [bear], "dog": dogs}, meta, NO_COLORS) == Verdict(pytest.approx(1 / 3), False, True)


def test_relative_position_by_hand():
    b = (0, 0, 100, 100)
    # offset (150, 150), shrunk by 20 each: (130, 130) / |offset| 212.1 = 0.61 > 0.5 on both axes
    assert relative_position((150, 150, 250, 250), b) == {"right of", "below"}
    # offset (30, 200): shrunk (10, 180) / 202.2 = (0.05, 0.89)
    assert relative_position((30, 200, 130, 300), b) == {"below"}
    assert relative_position((0, -200, 100, -100), b) == {"above"}
    assert relative_position((-150, 0, -50, 100), b) == {"left of"}


def test_color_attr():
    meta = {
        "tag": "color_attr",
        "include": [
            {"class": "wine glass", "count": 1, "color": "purple"},
            {"class": "apple", "count": 1, "color": "black"},
        ],
    }
    objects = {"wine glass": [det(0, 0, 9, 9)], "apple": [det(20, 0, 29, 9)]}
    right = painter({"wine glass": ["purple"], "apple": ["black"]})
    assert judge(objects, meta, right) == Verdict(1.0, True, True)
    swapped = painter({"wine glass": ["purple"], "apple": ["red"]})
    assert judge(objects, meta, swapped) == Verdict(0.75, False, False)  # [1, 1, 1, 0]
    assert judge({"wine glass": objects["wine glass"]}, meta, right) == Verdict(0.5, False, False)  # [1, 1, 0, 0]


def test_select_objects_thresholds_cap_and_nms():
    dets = [det(0, 0, 9, 9, 0.3), det(0, 0, 9, 9, 0.95), det(5, 0, 14, 9, 0.31), det(50, 50, 59, 59, 0.5)]
    kept = select_objects({"cat": dets, "dog": [det(0, 0, 9, 9, 0.2)]}, threshold=0.3)
    assert kept == {"cat": [dets[1], dets[3], dets[2]]}  # > 0.3 strictly, most confident first, empty classes out
    assert select_objects({"cat": dets}, threshold=0.9) == {"cat": [dets[1]]}  # the counting threshold
    many = [det(i, 0, i + 9, 9, 0.5 + i / 100) for i in range(20)]
    assert len(select_objects({"cat": many}, threshold=0.3)["cat"]) == 16
    assert box_iou((0, 0, 9, 9), (5, 0, 14, 9)) == pytest.approx(50 / 150)  # GenEval's +1 pixel areas
    assert select_objects({"cat": dets}, threshold=0.3, max_overlap=0.3)["cat"] == [dets[1], dets[3]]


def test_check_metadata_names_the_problem():
    check_metadata(
        {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}]}
    )
    with pytest.raises(ValueError, match="needs a 'tag'"):
        check_metadata({"include": [{"class": "cat", "count": 1}]})
    with pytest.raises(ValueError, match=r"include\[0\] needs a 'class'"):
        check_metadata({"tag": "single_object", "include": [{"class": "unicorn", "count": 1}]})
    with pytest.raises(ValueError, match="colour must be one of"):
        check_metadata({"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "teal"}]})
    with pytest.raises(ValueError, match="earlier clause"):
        check_metadata({"tag": "position", "include": [{"class": "cat", "count": 1, "position": ["above", 0]}]})


# ------------------------------------------------------------------------------------------------ post-processing


def test_instance_detections_follow_mmdet():
    class_logits = torch.tensor([[5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]])  # query 1: "no object"
    masks = torch.full((2, 4, 4), -10.0)
    masks[0, 1:3, 0:3] = 10.0
    out = instance_detections(
        class_logits, masks, padded_size=(4, 4), resized_size=(4, 4), image_size=(4, 4), min_score=0.3
    )
    assert len(out) == 1
    label, found = out[0]
    p = math.exp(5) / (math.exp(5) + 3)
    assert label == 0 and found.box == (0.0, 1.0, 3.0, 3.0)  # mask2bbox: last column / row + 1
    assert found.score == pytest.approx(p * torch.sigmoid(torch.tensor(10.0)).item(), rel=1e-5)
    assert found.mask.shape == (4, 4) and int(found.mask.sum()) == 6
    # a mask that lies in the padding is cropped away: empty, score 0, zero box
    masks[0] = -10.0
    masks[0, 3] = 10.0
    out = instance_detections(class_logits, masks, padded_size=(4, 4), resized_size=(2, 4), image_size=(2, 4))
    assert out[0][1].score == 0.0 and out[0][1].box == (0.0, 0.0, 0.0, 0.0)


def test_detector_input_size_is_mmcv_rescale():
    assert detector_input_size(512, 512) == (800, 800)
    assert detector_input_size(768, 1024) == (800, 1067)
    assert detector_input_size(1000, 3000) == (444, 1333)


# ------------------------------------------------------------------------------------------------ model path


@pytest.fixture(scope="module")
def combined():
    reward = build_reward(
        {
            "geneval": {
                "random_init": True,
                "detector_config": MASK2FORMER_TINY,
                "clip_config": OPEN_CLIP_TINY,
                "detector_size": [48, 96],
            }
        }
    )
    model = reward.rewards["geneval"]
    with torch.no_grad():  # every query says "cat" (p ~ 0.996); random masks give scores ~0.5: > 0.3, < 0.9
        model.detector.class_predictor.weight.zero_()
        model.detector.class_predictor.bias.zero_()
        model.detector.class_predictor.bias[CLASSES.index("cat")] = 10.0
    model.max_objects = 1
    return reward


def test_model_path_end_to_end(combined):
    model = combined.rewards["geneval"]
    images = torch.rand(3, 3, 40, 56, generator=torch.Generator().manual_seed(0))
    metadata = [
        {"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "red"}]},
        {"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}]},
        {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]},
    ]
    out = combined(images, ["p"] * 3, metadata)
    per_tag = {f"geneval/{t}_{k}" for t in TAGS for k in ("strict_accuracy", "accuracy")}
    assert set(out) == {"geneval", "geneval/strict_accuracy", "geneval/accuracy", "total"} | per_tag
    assert all(v.shape == (3,) and v.dtype == torch.float32 for v in out.values())
    assert torch.isfinite(out["geneval"]).all()
    assert out["geneval/counting_strict_accuracy"][[0, 2]].isnan().all()
    assert out["geneval/counting_strict_accuracy"][1] == 0.0  # no cat passes the 0.9 counting threshold

    # the same numbers by hand from the reward's own parts: detections, colours, rules
    pixels = model._prepare(images)
    objects = model.detect(pixels, [m["tag"] for m in metadata])
    assert objects[1] == {} and len(objects[0]["cat"]) == 1
    cat = objects[0]["cat"][0]
    assert 0.3 < cat.score < 0.9 and cat.mask.shape == (40, 56)
    assert 0 <= cat.box[0] < cat.box[2] <= 56 and 0 <= cat.box[1] < cat.box[3] <= 40
    assert model.crops(pixels[0], [cat]).shape == (1, 3, 64, 64)
    (color,) = model.classify_colors(pixels, [(0, "cat", [cat])])[0]
    assert out["geneval"].tolist() == [1.0 if color == "red" else 0.5, 0.0, 0.5]  # 2 cats asked, none found: 1 - 2/2
    assert out["geneval/accuracy"].tolist() == [float(color == "red"), 0.0, 0.0]


def test_model_path_rejects_bad_metadata_and_label_sets(combined):
    with pytest.raises(Exception, match="make_prompts.py geneval"):
        combined(torch.rand(1, 3, 32, 32), ["a photo of a cat"], [{}])
    from rewards.geneval import GenEvalReward

    config = {**MASK2FORMER_TINY, "id2label": {0: "a", 1: "b"}}
    with pytest.raises(ValueError, match="detector has 2 classes"):
        GenEvalReward(random_init=True, detector_config=config, clip_config=OPEN_CLIP_TINY)


def test_jpeg_option_compresses_what_is_scored(combined):
    model = combined.rewards["geneval"]
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    try:
        model.jpeg_quality = 75
        compressed = model._prepare(image)
    finally:
        model.jpeg_quality = None
    plain = model._prepare(image)
    assert torch.equal(plain, (image * 255).round() / 255)
    assert compressed.shape == image.shape and 0 < (compressed - plain).abs().mean() < 0.25


# ------------------------------------------------------------------------------------------------ loading (issue 28)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Mask2Former saved as transformers saves it, and a tiny CLIP state dict as a safetensors file."""
    import open_clip
    from safetensors.torch import save_file
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation

    root = tmp_path_factory.mktemp("geneval")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        Mask2FormerForUniversalSegmentation(Mask2FormerConfig(**MASK2FORMER_TINY)).save_pretrained(root / "detector")
        save_file(open_clip.CLIP(**OPEN_CLIP_TINY).state_dict(), str(root / "clip.safetensors"))
    return root


def _activations(model: torch.nn.Module) -> set[str]:
    import open_clip

    kinds = {open_clip.transformer.QuickGELU: "QuickGELU", torch.nn.GELU: "GELU"}
    return {name for m in model.modules() for kind, name in kinds.items() if type(m) is kind}


def test_colour_clip_from_a_state_dict_file_gets_quick_gelu(saved):
    """GenEval's colour CLIP is open_clip ViT-L-14 / openai, a QuickGELU model; a local file of those weights lost it
    (a state dict does not say which activation it was trained with)."""
    import open_clip

    (saved / "flowgrpo-tiny.json").write_text(json.dumps(OPEN_CLIP_TINY))
    open_clip.add_model_config(saved / "flowgrpo-tiny.json")  # an architecture by name, as ViT-L-14
    detector, clip = str(saved / "detector"), str(saved / "clip.safetensors")
    for spec in ({"clip_config": OPEN_CLIP_TINY}, {"clip_model": "flowgrpo-tiny"}):
        reward = build_reward([{"name": "geneval", "detector": detector, "clip_pretrained": clip, **spec}])
        model = reward.rewards["geneval"]
        assert _activations(model.clip.model) == {"QuickGELU"}, spec
        assert model.clip.preprocess.interpolation == "bicubic"  # GenEval's open_clip preprocessing, not Flow-GRPO's
        other = {"name": "geneval", "detector": detector, "clip_pretrained": clip, "clip_quick_gelu": False, **spec}
        assert _activations(build_reward([other]).rewards["geneval"].clip.model) == {"GELU"}, spec
    random = build_reward(
        {"geneval": {"random_init": True, "detector_config": MASK2FORMER_TINY, "clip_config": OPEN_CLIP_TINY}}
    )
    assert _activations(random.rewards["geneval"].clip.model) == {"QuickGELU"}  # the architecture GenEval runs


def _config_error(excinfo: pytest.ExceptionInfo) -> str:
    """What the scripts print as one paragraph (they catch ValueError and OSError), not a traceback."""
    assert isinstance(excinfo.value, (ValueError, OSError)), type(excinfo.value)
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message and "Repo id must" not in message, message
    return message


def test_missing_detector_paths_say_the_path_does_not_exist(saved):
    for detector in ("/nonexistent/mask2former", "./models/mask2former", "~/no/such/dir"):
        with pytest.raises(FileNotFoundError) as excinfo:
            build_reward([{"name": "geneval", "detector": detector}])
        message = _config_error(excinfo)
        assert f"geneval: detector {detector!r} does not exist (relative paths start at" in message
        assert "config.json and model.safetensors" in message
    with pytest.raises(FileNotFoundError) as excinfo:  # random_init reads the detector's config
        build_reward([{"name": "geneval", "detector": "/nonexistent/m2f", "random_init": True}])
    assert "geneval: detector '/nonexistent/m2f' does not exist" in _config_error(excinfo)


def test_truncated_detector_weights_name_the_file(saved, tmp_path):
    import shutil

    shutil.copytree(saved / "detector", tmp_path / "detector")
    weights = tmp_path / "detector" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError) as excinfo:
        build_reward([{"name": "geneval", "detector": str(tmp_path / "detector")}])
    message = _config_error(excinfo)
    assert f"geneval: detector: cannot read {weights}" in message
    assert "truncated or corrupt" in message and "download or copy it again" in message


def test_bad_clip_pretrained_names_the_key(saved, tmp_path):
    (tmp_path / "garbage.safetensors").write_bytes(b"not a checkpoint at all\n" * 20)
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all\n" * 20)
    detector = str(saved / "detector")
    cases = {
        "/nonexistent/clip.safetensors": "geneval: clip_pretrained '/nonexistent/clip.safetensors' does not exist",
        str(tmp_path / "garbage.safetensors"): f"geneval: clip_pretrained: cannot read {tmp_path}/garbage.safetensors",
        str(tmp_path / "garbage.pt"): f"geneval: clip_pretrained: cannot read {tmp_path}/garbage.pt",
    }
    for clip, expected in cases.items():
        spec = {"name": "geneval", "detector": detector, "clip_config": OPEN_CLIP_TINY, "clip_pretrained": clip}
        with pytest.raises((ValueError, OSError)) as excinfo:
            build_reward([spec])
        assert expected in _config_error(excinfo), clip
    with pytest.raises(FileNotFoundError) as excinfo:
        build_reward([{"name": "geneval", "detector": detector, "clip_model": "ViT-B-32", "clip_pretrained": "opnai"}])
    message = _config_error(excinfo)
    assert "geneval: clip_pretrained 'opnai' is neither a file" in message
    assert "nor a pretrained tag of clip_model 'ViT-B-32' (its tags: openai," in message


# ------------------------------------------------------------------------------------------------ make_prompts


@pytest.fixture(scope="module")
def make_prompts():
    return load_script("make_prompts")


def test_geneval_suite_is_genevals_benchmark(make_prompts):
    suite = make_prompts.geneval_suite()
    counts = {t: sum(s["tag"] == t for s in suite) for t in TAGS}
    assert counts == {
        "single_object": 80,
        "two_object": 99,
        "counting": 80,
        "colors": 94,
        "position": 100,
        "color_attr": 100,
    }
    assert [s["prompt"] for s in suite[:3]] == ["a photo of a bench", "a photo of a cow", "a photo of a bicycle"]
    first = {t: next(s for s in suite if s["tag"] == t) for t in TAGS}
    assert first["counting"] == {
        "tag": "counting",
        "include": [{"class": "clock", "count": 2}],
        "exclude": [{"class": "clock", "count": 3}],
        "prompt": "a photo of two clocks",
    }
    assert first["position"]["prompt"] == "a photo of a dog right of a teddy bear"
    assert first["position"]["include"] == [
        {"class": "teddy bear", "count": 1},
        {"class": "dog", "count": 1, "position": ["right of", 0]},
    ]


def test_make_prompts_geneval_files(make_prompts, tmp_path):
    for folder in ("a", "b"):
        assert make_prompts.main(["geneval", "--out", str(tmp_path / folder), "--train-per-tag", "40"]) == 0
    for name in ("geneval_train.jsonl", "geneval_test.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()  # deterministic
    train = PromptDataset.from_file(tmp_path / "a" / "geneval_train.jsonl")
    test = PromptDataset.from_file(tmp_path / "a" / "geneval_test.jsonl")
    assert len(test) == 4 * 553 and len(train) == 5 * 40
    assert {m["tag"] for m in test.metadata} == set(TAGS)
    # GenEval's suite holds all 80 single objects, so none is left to train on; every other tag is there
    assert {m["tag"] for m in train.metadata} == set(TAGS) - {"single_object"}
    for meta in train.metadata + test.metadata:
        check_metadata(meta)
    held = {make_prompts.objects_key(m) for m in test.metadata}
    assert not any(make_prompts.objects_key(m) in held for m in train.metadata)
    assert not set(train.prompts) & set(test.prompts)
    assert [m["tag"] for m in test.metadata[:6]] == list(TAGS)  # the first lines (image grids) show every tag


def test_committed_prompt_files_are_the_scripts_output(make_prompts, tmp_path):
    make_prompts.main(["geneval", "--out", str(tmp_path)])
    make_prompts.main(["ocr", "--out", str(tmp_path)])
    for name in ("geneval_train.jsonl", "geneval_test.jsonl", "ocr_train.txt", "ocr_test.txt"):
        assert (tmp_path / name).read_bytes() == (ROOT / "configs" / "prompts" / name).read_bytes(), name


def test_make_prompts_ocr_files(make_prompts, tmp_path):
    for folder in ("a", "b"):
        args = ["ocr", "--out", str(tmp_path / folder), "--train-size", "300", "--test-size", "50"]
        assert make_prompts.main(args) == 0
    for name in ("ocr_train.txt", "ocr_test.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    train = PromptDataset.from_file(tmp_path / "a" / "ocr_train.txt").prompts
    test = PromptDataset.from_file(tmp_path / "a" / "ocr_test.txt").prompts
    assert len(set(train)) == 300 and len(set(test)) == 50

    def texts(prompts):  # compared as the OCR reward compares them
        return {"".join(quoted_text(p).split()).lower() for p in prompts}

    assert len(texts(test)) == 50 and not texts(train) & texts(test)
    with pytest.raises(SystemExit):
        make_prompts.main(["ocr", "--out", str(tmp_path / "c"), "--test-size", "100000"])
