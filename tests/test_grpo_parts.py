"""Advantages, the clipped loss, configs and the epoch plan, against formulas written out by hand."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.advantages import AdvantageInputs, compute_advantages, group_advantages
from flowgrpo.config import AdvantageConfig, Config, ConfigError, load_config, parse_overrides, validate
from flowgrpo.data import DataError, PromptDataset, epoch_plan, rank_slice
from flowgrpo.objectives.clipped import grpo_loss


# ---------------------------------------------------------------- advantages
def test_group_advantages_match_the_formula():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0])
    groups = torch.tensor([7, 7, 7, 3, 3, 3])
    adv = group_advantages(rewards, groups, clip=100.0)
    expected = torch.empty(6)
    for g in (7, 3):
        m = groups == g
        expected[m] = (rewards[m] - rewards[m].mean()) / (rewards[m].std() + 1e-4)
    torch.testing.assert_close(adv, expected)
    glob = group_advantages(rewards, groups, std="global", clip=100.0)
    means = torch.tensor([2.0, 2, 2, 11, 11, 11])
    torch.testing.assert_close(glob, (rewards - means) / (rewards.std(correction=0) + 1e-4))  # population (np.std)


def test_group_advantages_interleaved_groups_clip_and_constant_group():
    rewards = torch.tensor([0.0, 5.0, 1.0, 5.0, 1000.0, 5.0, 2.0, 5.0])
    groups = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    adv = group_advantages(rewards, groups, clip=1.0)
    assert adv.abs().max() <= 1.0
    assert torch.equal(adv[groups == 1], torch.zeros(4))  # identical rewards: no signal
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))


def test_per_reward_advantages_are_weighted_sums():
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    a = torch.tensor([1.0, 2.0, 4.0, 0.0, 1.0, 0.5])
    b = torch.tensor([100.0, 300.0, 200.0, 5.0, 5.0, 6.0])
    scores = {"a": a, "b": b, "total": 1.0 * a + 0.5 * b}
    weights = {"a": 1.0, "b": 0.5}
    inputs, everyone = AdvantageInputs(scores, weights, groups, 0), torch.ones(6, dtype=torch.bool)
    per = compute_advantages(AdvantageConfig(estimator="per_reward", clip=100.0), inputs, everyone)
    expected = group_advantages(a, groups, clip=100.0) + 0.5 * group_advantages(b, groups, clip=100.0)
    torch.testing.assert_close(per, expected)
    torch.testing.assert_close(
        compute_advantages(AdvantageConfig(), inputs, everyone), group_advantages(scores["total"], groups)
    )


def test_groups_the_nan_policy_dropped_get_zero_and_leave_the_others_statistics():
    total = torch.tensor([1.0, 2.0, 4.0, 100.0, float("nan"), 7.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    keep = groups == 0
    out = compute_advantages(AdvantageConfig(clip=100.0), AdvantageInputs({"total": total}, {}, groups, 0), keep)
    torch.testing.assert_close(out[:3], group_advantages(total[:3], groups[:3], clip=100.0))
    assert torch.equal(out[3:], torch.zeros(3))


def test_renamed_advantage_keys_still_read_and_contradictions_are_refused():
    assert load_config(None, ["grpo.advantage.std=global"]).grpo.advantage.estimator == "global_std"
    assert load_config(None, ["grpo.advantage.per_reward=true"]).grpo.advantage.estimator == "per_reward"
    assert load_config(None, ["grpo.advantage.std=group"]).grpo.advantage.estimator == "group"
    with pytest.raises(ConfigError, match="contradicts the older keys"):
        load_config(None, ["grpo.advantage.std=global", "grpo.advantage.estimator=group"])
    with pytest.raises(ConfigError, match="estimator: per_reward"):
        load_config(None, ["grpo.advantage.std=global", "grpo.advantage.per_reward=true"])
    with pytest.raises(ConfigError, match="did you mean 'global_std'"):
        load_config(None, ["grpo.advantage.estimator=global_st"])


# ---------------------------------------------------------------- loss
def test_grpo_loss_matches_the_clipped_objective():
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    new = torch.tensor([-0.9, -1.1, -0.9, -1.0], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0])
    eps = 0.05
    loss, stats = grpo_loss(new, old, adv, clip_range=eps)
    r = torch.exp(new.detach() - old)
    expected = torch.maximum(-adv * r, -adv * r.clamp(1 - eps, 1 + eps)).mean()
    torch.testing.assert_close(loss.detach(), expected)
    torch.testing.assert_close(stats.clip_fraction, torch.tensor(0.75))
    loss.backward()
    # Pessimistic bound: A>0 with r>1+ε is clipped (no gradient); A>0 with r<1-ε and A<0 with r>1+ε are not.
    assert new.grad[0] == 0
    torch.testing.assert_close(new.grad[1], -adv[1] * r[1] / 4)
    torch.testing.assert_close(new.grad[2], -adv[2] * r[2] / 4)
    torch.testing.assert_close(new.grad[3], torch.tensor(-2.0 / 4))  # ratio 1: d(-A r)/dlogp = -A r / B


def test_grpo_loss_on_policy_and_kl_term():
    logp = torch.randn(5)
    adv = torch.randn(5)
    kl = torch.rand(5)
    loss, stats = grpo_loss(logp, logp.clone(), adv, clip_range=1e-4, kl=kl, beta=0.04)
    assert stats.ratio_mean == 1 and stats.ratio_min == 1 and stats.ratio_max == 1 and stats.clip_fraction == 0
    torch.testing.assert_close(loss, -adv.mean() + 0.04 * kl.mean())


# ---------------------------------------------------------------- config
def _write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_config_overrides_types_and_defaults(tmp_path):
    path = _write(tmp_path, "sampler: {num_steps: 12, window: {size: 4}}\ntrain: {lr: 1}\n")
    config = load_config(path, ["train.lr=2e-4", "sampler.window.strategy=random", "rewards={ocr: 1.0}"])
    assert config.sampler.num_steps == 12 and config.sampler.window.size == 4
    assert config.train.lr == 2e-4 and isinstance(config.train.lr, float)
    assert config.sampler.window.strategy == "random" and config.rewards == {"ocr": 1.0}
    assert config.grpo.clip_range == Config().grpo.clip_range
    assert parse_overrides(["a.b.c=[1, 2]"]) == {"a": {"b": {"c": [1, 2]}}}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.lrr=1"], r"unknown config key 'train.lrr'; did you mean 'train.lr'"),
        (["sampler.kind=ddim"], r"sampler.kind must be one of"),
        (["sampler.window.size=20", "sampler.num_steps=10"], r"window.size=20 .* at most 9"),
        (["grpo.group_size=5", "grpo.groups_per_epoch=3", "sampler.batch_size=4"], r"15 images per epoch"),
        (["train.lr=fast"], r"train.lr: expected a number"),
        (["grpo.group_size=1"], r"group_size must be >= 2"),
        (["oops"], r"key.sub=value"),
        (
            [
                "train.gradient_accumulation=4",
                "grpo.group_size=4",
                "grpo.groups_per_epoch=4",
                "sampler.batch_size=8",
                "train.batch_size=8",
            ],
            r"must divide the 2 micro-batches",
        ),
        (["checkpoint.keep_last=0"], r"checkpoint.keep_last must be >= 1"),
        (["run.log_every=0"], r"run.log_every must be >= 1"),
        (["sampler.kappa=0"], r"sampler.kappa must be > 0"),
        (["train.lr_schedule=cosine_decay"], r"train.lr_schedule.*cosine"),
        (["train.lr_warmup_steps=-1"], r"train.lr_warmup_steps must be >= 0"),
        (["train.lr_warmup_steps=2"], r"set train.lr_schedule: constant_with_warmup"),
        (["train.lr_schedule=cosine", "train.lr_schedule_steps=0"], r"train.lr_schedule_steps must be >= 1"),
        (["train.lr_schedule_steps=100"], r"does nothing with train.lr_schedule=constant"),
        (
            ["train.lr_schedule=constant_with_warmup", "train.lr_warmup_steps=2", "train.lr_schedule_steps=100"],
            r"does nothing with train.lr_schedule=constant_with_warmup",
        ),
    ],
)
def test_config_errors_name_key_and_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_an_lr_schedule_of_its_own_length_follows_diffusers_then_holds():
    """train.lr_schedule_steps: diffusers' schedule over that many optimizer steps whatever the run's length, then
    its last value (diffusers' cosine would climb back: at 1.5 lengths it reads 0.5)."""
    import math

    from flowgrpo.optim import make_lr_factor

    config = load_config(None, ["train.lr_schedule=cosine", "train.lr_warmup_steps=2", "train.lr_schedule_steps=10"])
    validate(config)
    factor = make_lr_factor(config, total_steps=100_000)  # a time budget's open epoch count

    def cosine(step):  # diffusers' cosine with warmup, by hand: 2 steps from 0, then half a cosine to 0 at step 10
        return step / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / 8))

    assert [factor(s) for s in range(11)] == pytest.approx([cosine(s) for s in range(11)], abs=1e-12)
    assert factor(10) == factor(15) == factor(1000) == pytest.approx(0, abs=1e-12)
    linear = load_config(None, ["train.lr_schedule=linear", "train.lr_schedule_steps=4"])
    assert [make_lr_factor(linear, 100)(s) for s in (0, 2, 4, 9)] == pytest.approx([1, 0.5, 0, 0])
    # Null: the run's steps, as before.
    run_long = load_config(None, ["train.lr_schedule=linear"])
    assert make_lr_factor(run_long, 8)(4) == pytest.approx(0.5)
    # The warmup must end inside the schedule: refused from the config alone, before any run.
    with pytest.raises(ConfigError, match="lower train.lr_warmup_steps or raise train.lr_schedule_steps"):
        load_config(None, ["train.lr_schedule=cosine", "train.lr_warmup_steps=10", "train.lr_schedule_steps=10"])


def test_batch_arithmetic_uses_the_world_size():
    config = load_config(
        None, ["grpo.group_size=4", "grpo.groups_per_epoch=4", "sampler.batch_size=4", "train.batch_size=8"]
    )
    validate(config, world_size=1)
    validate(config, world_size=2)
    with pytest.raises(ConfigError, match="processes = 4 × 3"):
        validate(config, world_size=3)
    with pytest.raises(ConfigError, match="train.batch_size=8 does not divide"):
        validate(config, world_size=4)


def test_every_preset_in_configs_is_valid():
    """Each preset loads, names prompt files that exist, and names registered rewards (no model is loaded)."""
    from pathlib import Path

    from rewards import resolve_reward

    root = Path(__file__).parent.parent
    presets = sorted(root.joinpath("configs").glob("*.yaml"))
    assert len(presets) >= 10
    for path in presets:
        config = load_config(path)
        assert path.read_text().startswith("# "), f"{path.name} should start with its launch line"
        for key in ("train", "test"):
            file = getattr(config.data, key)
            if file is not None:
                assert len(PromptDataset.from_file(root / file)) > 0, (path.name, file)
        spec = config.rewards
        names = list(spec) if isinstance(spec, dict) else [e["name"] for e in spec]
        for name in names:
            resolve_reward(name)


# ---------------------------------------------------------------- data
def test_prompt_files(tmp_path):
    txt = _write(tmp_path, "a cat\n\n  a dog  \n", "p.txt")
    assert PromptDataset.from_file(txt).prompts == ["a cat", "a dog"]
    jsonl = _write(
        tmp_path, '{"prompt": "two cats", "tag": "counting"}\n{"prompt": "a sign", "text": "hi"}\n', "p.jsonl"
    )
    data = PromptDataset.from_file(jsonl)
    assert data.prompts == ["two cats", "a sign"] and data.metadata == [{"tag": "counting"}, {"text": "hi"}]
    with pytest.raises(DataError, match="does not exist"):
        PromptDataset.from_file(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="no prompts"):
        PromptDataset.from_file(_write(tmp_path, "\n \n", "empty.txt"))
    with pytest.raises(DataError, match=":2 needs"):
        PromptDataset.from_file(_write(tmp_path, '{"prompt": "x"}\n{"text": 1}\n', "bad.jsonl"))


def test_epoch_plan_groups_are_complete_deterministic_and_span_ranks():
    plan = epoch_plan(10, group_size=4, groups_per_epoch=6, seed=3, epoch=2)
    assert plan == epoch_plan(10, group_size=4, groups_per_epoch=6, seed=3, epoch=2)
    assert plan != epoch_plan(10, group_size=4, groups_per_epoch=6, seed=3, epoch=3)
    ids = [s.group_id for s in plan]
    assert sorted(set(ids)) == list(range(12, 18)) and all(ids.count(g) == 4 for g in set(ids))
    for g in set(ids):  # every copy of a group is the same prompt
        assert len({s.prompt_index for s in plan if s.group_id == g}) == 1
    assert len({s.prompt_index for s in plan}) == 6  # without replacement when the file is big enough
    shards = [rank_slice(plan, r, 2) for r in range(2)]
    assert shards[0] + shards[1] == plan
    assert {s.group_id for s in shards[0]} & {s.group_id for s in shards[1]}  # some group spans both ranks


def test_accelerate_configs_load():
    from pathlib import Path

    from accelerate.commands.config.config_args import load_config_from_file

    folder = Path(__file__).parent.parent / "configs" / "accelerate"
    kinds = {p.stem: load_config_from_file(str(p)).distributed_type.value for p in folder.glob("*.yaml")}
    assert kinds == {
        "single_gpu": "NO",
        "multi_gpu": "MULTI_GPU",
        "multi_node": "MULTI_GPU",
        "deepspeed_zero2": "DEEPSPEED",
        "fsdp": "FSDP",
    }
