"""Registry, config specs, weighted combination, input checks, NaN policy and the JPEG rewards."""

import io
import logging
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

from rewards import (
    REWARDS,
    BaseReward,
    CombinedReward,
    NonFiniteRewardError,
    Reward,
    RewardError,
    apply_nan_policy,
    available_rewards,
    build_reward,
    register_reward,
)


def _images(batch=4, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, size, size, generator=g)


PROMPTS = ['a sign "one"', 'a sign "two"', 'a sign "three"', 'a sign "four"']


@pytest.fixture
def fake_rewards():
    """Two registered rewards with known outputs; removed from the registry afterwards."""

    @register_reward("_test_mean")
    class Mean(BaseReward):
        def score(self, images, prompts, metadata):
            return images.mean(dim=(1, 2, 3))

    @register_reward("_test_nan")
    class WithNaN(BaseReward):
        def __init__(self, *, bad=(1,), device="cpu"):
            super().__init__(device=device)
            self.bad = list(bad)

        def score(self, images, prompts, metadata):
            out = torch.arange(images.shape[0], dtype=torch.float32)
            out[self.bad] = float("nan")
            return out

    yield
    REWARDS.pop("_test_mean")
    REWARDS.pop("_test_nan")


def test_builtins_registered_and_protocol():
    assert {
        "ocr",
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "clipscore",
        "pickscore",
        "aesthetic",
        "hpsv2",
        "remote",
    } <= set(available_rewards())
    reward = build_reward({"jpeg_incompressibility": 1.0})
    assert isinstance(reward, Reward) and isinstance(reward, CombinedReward)


def test_jpeg_scores_match_pil_sizes_exactly():
    images = _images()
    images[0] = 0.5  # a flat image compresses far better than noise
    out = build_reward({"jpeg_incompressibility": 1.0, "jpeg_compressibility": 1.0})(images, PROMPTS)
    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    expected = []
    for p in pixels:
        buf = io.BytesIO()
        Image.fromarray(p).save(buf, format="JPEG", quality=95)
        expected.append(buf.tell() / 1000)
    expected = torch.tensor(expected, dtype=torch.float32)
    assert torch.equal(out["jpeg_incompressibility"], expected)
    assert torch.equal(out["jpeg_compressibility"], -expected)
    assert torch.equal(out["total"], torch.zeros(4))
    assert out["jpeg_incompressibility"][0] < out["jpeg_incompressibility"][1:].min()
    assert all(v.dtype == torch.float32 and v.shape == (4,) for v in out.values())


def test_weighting_and_per_reward_outputs_are_exact(fake_rewards):
    images = _images()
    reward = build_reward({"_test_mean": 0.5, "jpeg_incompressibility": -2.0})
    out = reward(images, PROMPTS)
    assert set(out) == {"_test_mean", "jpeg_incompressibility", "total"}
    assert reward.weights == {"_test_mean": 0.5, "jpeg_incompressibility": -2.0}
    mean = images.mean(dim=(1, 2, 3))
    assert torch.equal(out["_test_mean"], mean)
    expected = (0.5 * mean.double() - 2.0 * out["jpeg_incompressibility"].double()).float()
    assert torch.equal(out["total"], expected)


def test_spec_forms_agree(fake_rewards):
    images = _images()
    forms = [
        {"_test_mean": 2.0, "jpeg_compressibility": 1.0},
        {"_test_mean": {"weight": 2.0}, "jpeg_compressibility": {"quality": 95}},
        [{"name": "_test_mean", "weight": 2.0}, "jpeg_compressibility"],
    ]
    outs = [build_reward(f)(images, PROMPTS) for f in forms]
    for out in outs[1:]:
        assert out.keys() == outs[0].keys()
        for k in out:
            assert torch.equal(out[k], outs[0][k])


def test_same_reward_twice_needs_keys():
    with pytest.raises(ValueError, match="appears twice"):
        build_reward([{"name": "jpeg_compressibility"}, {"name": "jpeg_compressibility", "quality": 50}])
    reward = build_reward(
        [
            {"name": "jpeg_compressibility"},
            {"name": "jpeg_compressibility", "quality": 50, "key": "jpeg50", "weight": 0.0},
        ]
    )
    out = reward(_images(), PROMPTS)
    assert (out["jpeg50"] > out["jpeg_compressibility"]).all()  # quality 50 -> smaller files -> higher score
    assert torch.equal(out["total"], out["jpeg_compressibility"])  # weight 0: logged, not summed


def test_custom_module_class_loads_from_config(tmp_path, monkeypatch):
    (tmp_path / "my_custom_rewards.py").write_text(
        textwrap.dedent("""
        class Brightness:
            def __init__(self, scale=1.0, device="cpu"):
                self.scale, self.device = scale, device

            def __call__(self, images, prompts, metadata=None):
                return {"brightness": self.scale * images.mean(dim=(1, 2, 3))}
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    images = _images()
    reward = build_reward({"my_custom_rewards:Brightness": {"weight": 2.0, "scale": 3.0}})
    out = reward(images, PROMPTS)
    assert torch.equal(out["Brightness"], 3.0 * images.mean(dim=(1, 2, 3)))
    assert torch.equal(out["total"], (2.0 * out["Brightness"].double()).float())
    assert reward.rewards["Brightness"].device == "cpu"  # build_reward's device is passed on
    with pytest.raises(ValueError, match="unknown option.*colour.*accepted: scale, device"):
        build_reward({"my_custom_rewards:Brightness": {"colour": 1}})
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        build_reward({"my_custom_rewards:Missing": 1.0})
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"):
        build_reward({"no_such_pkg.mod:Cls": 1.0})


def test_things_that_are_not_rewards_or_lack_options_are_config_errors(tmp_path, monkeypatch):
    # Each of these raised a TypeError (a traceback from train.py) or built a module that crashed when scored.
    (tmp_path / "my_threshold_reward.py").write_text(
        textwrap.dedent("""
        class Threshold:
            def __init__(self, threshold, device="cpu"):
                self.threshold = threshold

            def __call__(self, images, prompts, metadata=None):
                return images.mean(dim=(1, 2, 3)) > self.threshold
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"'my_threshold_reward:Threshold' needs option\(s\) threshold"):
        build_reward({"my_threshold_reward:Threshold": 1.0})
    built = build_reward({"my_threshold_reward:Threshold": {"threshold": 0.5}})
    assert built(_images(), PROMPTS)["total"].shape == (4,)
    with pytest.raises(ValueError, match=r"reward 'remote' needs option\(s\) url"):
        build_reward({"remote": 1.0})
    with pytest.raises(ValueError, match=r"reward 'json:dumps' needs option\(s\) obj"):
        build_reward({"json:dumps": 1.0})
    for spec in (
        {"torch.nn:Linear": 1.0},
        {"torch.nn:Linear": {"in_features": 3, "out_features": 1}},
        {"json:JSONDecoder": 1.0},
    ):
        with pytest.raises(ValueError, match=r"is not a reward: a reward is called as reward\(images, prompts"):
            build_reward(spec)


def test_config_errors_name_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"unknown reward 'ocrr'; registered: aesthetic, brightness, clip.*mean 'ocr'"):
        build_reward({"ocrr": 1.0})
    with pytest.raises(ValueError, match=r"jpeg_compressibility': unknown option\(s\) qualty; accepted: .*quality"):
        build_reward([{"name": "jpeg_compressibility", "qualty": 90}])
    with pytest.raises(ValueError, match="weight must be a finite number"):
        build_reward({"jpeg_compressibility": "high"})
    with pytest.raises(ValueError, match="weight must be a finite number"):
        build_reward({"jpeg_compressibility": float("nan")})
    with pytest.raises(ValueError, match="key 'total' is reserved"):
        build_reward([{"name": "jpeg_compressibility", "key": "total"}])
    with pytest.raises(ValueError, match="rewards is empty"):
        build_reward({})
    with pytest.raises(ValueError, match="nan_policy must be one of error, drop"):
        build_reward({"jpeg_compressibility": 1.0}, nan_policy="ignore")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("ocr")(type("Other", (BaseReward,), {}))


@pytest.mark.parametrize(
    "images, match",
    [
        (torch.rand(2, 3, 8, 8) * 2 - 1, r"\[0, 1\].*\(x \+ 1\) / 2"),
        (torch.rand(2, 8, 8, 3), r"shape \(B, 3, H, W\); got \(2, 8, 8, 3\)"),
        (torch.rand(3, 8, 8), r"got \(3, 8, 8\)"),
        (torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8), "floating point.*divide uint8 by 255"),
        (torch.full((2, 3, 8, 8), float("nan")), r"\[0, 1\]"),
    ],
)
def test_bad_images_are_rejected(images, match):
    reward = build_reward({"jpeg_compressibility": 1.0})
    with pytest.raises(ValueError, match=match):
        reward(images, ["a", "b"][: images.shape[0]] if images.ndim == 4 else ["a"])


def test_bad_prompts_and_metadata_are_rejected():
    reward = build_reward({"jpeg_compressibility": 1.0})
    with pytest.raises(ValueError, match="list of 2 strings"):
        reward(torch.rand(2, 3, 8, 8), ["only one"])
    with pytest.raises(ValueError, match="None or a list of 2 dicts"):
        reward(torch.rand(2, 3, 8, 8), ["a", "b"], [{}])


def test_batch_size_option_chunks_without_changing_scores(fake_rewards):
    images = _images(batch=5)
    full = build_reward({"_test_mean": 1.0})(images, PROMPTS + ["x"])
    chunked = build_reward([{"name": "_test_mean", "batch_size": 2}])(images, PROMPTS + ["x"])
    assert torch.equal(full["_test_mean"], chunked["_test_mean"])
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        build_reward([{"name": "_test_mean", "batch_size": 0}])


def test_nan_policy_error_names_the_reward(fake_rewards):
    reward = build_reward({"_test_mean": 1.0, "_test_nan": 1.0})
    with pytest.raises(NonFiniteRewardError, match=r"reward '_test_nan' returned non-finite scores at indices \[1\]"):
        reward(_images(), PROMPTS)


def test_nan_policy_drop_drops_whole_groups_and_logs(fake_rewards, caplog):
    reward = build_reward([{"name": "_test_nan", "bad": [1, 4]}, "_test_mean"], nan_policy="drop")
    images = _images(batch=6)
    out = reward(images, PROMPTS + ["e", "f"])
    assert torch.isnan(out["total"][[1, 4]]).all() and torch.isfinite(out["_test_mean"]).all()
    groups = [0, 0, 1, 1, 2, 2]
    with caplog.at_level(logging.WARNING, logger="rewards"):
        keep, dropped = apply_nan_policy(out, groups, policy="drop")
    assert dropped == 2
    assert keep.tolist() == [False, False, True, True, False, False]
    assert "dropped 2 of 3 groups (4 samples)" in caplog.text and "_test_nan=2" in caplog.text
    keep, dropped = apply_nan_policy({"_test_mean": out["_test_mean"]}, groups, policy="error")
    assert keep.all() and dropped == 0
    with pytest.raises(NonFiniteRewardError, match="_test_nan"):
        apply_nan_policy(out, groups, policy="error")


def test_failing_reward_is_named(fake_rewards):
    reward = build_reward({"_test_mean": 1.0, "ocr": 1.0})
    with pytest.raises(RewardError, match="reward 'ocr' failed: ValueError: ocr reward: prompt has no quoted text"):
        reward(_images(batch=1), ["no quotes here"])


def test_rewards_do_not_build_graphs(fake_rewards):
    images = _images().requires_grad_(True)
    out = build_reward({"_test_mean": 1.0})(images, PROMPTS)
    assert not out["total"].requires_grad and out["total"].device.type == "cpu"


def test_custom_reward_outputs_are_coerced(tmp_path, monkeypatch):
    (tmp_path / "my_tensor_reward.py").write_text(
        "import torch\n"
        "def make(device='cpu'):\n"
        "    return lambda images, prompts, metadata=None: images.mean(dim=(1, 2, 3)).double()\n"
        "def bad(device='cpu'):\n"
        "    return lambda images, prompts, metadata=None: torch.zeros(3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    images = _images()
    out = build_reward({"my_tensor_reward:make": 1.0})(images, PROMPTS)
    assert out["make"].dtype == torch.float32 and torch.allclose(out["make"], images.mean(dim=(1, 2, 3)))
    with pytest.raises(RewardError, match="returned 3 scores.*expected 4"):
        build_reward({"my_tensor_reward:bad": 1.0})(images, PROMPTS)
    assert np.isfinite(out["total"].numpy()).all()


def test_brightness_is_the_mean_pixel_value():
    images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    out = build_reward({"brightness": 2.0})(images, ["a", "b", "c"])
    torch.testing.assert_close(out["brightness"], images.mean(dim=(1, 2, 3)))
    torch.testing.assert_close(out["total"], 2 * out["brightness"])
