"""A method lands as one module: an objective (with its own config section) and an advantage estimator registered
from this file alone train a tiny epoch; per-step advantages reach the clipped loss at each sample's position."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from flowgrpo.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, available_advantage_estimators
from flowgrpo.advantages import register_advantage_estimator as register_estimator
from flowgrpo.checkpoint import CONFIG_FILE, recipe_changes
from flowgrpo.config import ConfigError, load_config
from flowgrpo.objectives import OBJECTIVES, MicroBatch, Objective, available_objectives, register_objective
from flowgrpo.objectives.clipped import timestep_loss
from flowgrpo.rollouts import ROLLOUTS, register_rollout
from flowgrpo.rollouts.chain import Chain

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_sd3.yaml"
calls: dict[str, list] = {"estimator": [], "loss": []}


@dataclass
class ThrowawaySettings:
    sigma: float = 0.5  # the one noise level every term trains at


@register_objective("throwaway")
class Throwaway(Objective):
    """Advantage-weighted flow matching at one fixed σ: the smallest objective that trains."""

    config_class = ThrowawaySettings
    rollout = "ode"

    @classmethod
    def validate(cls, config):
        if not 0 < config.grpo.throwaway.sigma < 1:
            raise ConfigError(f"grpo.throwaway.sigma must lie in (0, 1), got {config.grpo.throwaway.sigma}")

    def loss(self, adapter, batch: MicroBatch):
        x0 = batch.trajectory.final_latents.float()
        noise = torch.randn(x0.shape, generator=batch.generator)
        sigma = torch.full((len(x0),), self.settings.sigma)
        v = adapter.velocity(
            (1 - self.settings.sigma) * x0 + self.settings.sigma * noise, sigma, batch.trajectory.embeds, 1.0
        ).float()
        error = (v - (noise - x0)).pow(2).flatten(1).mean(dim=1)
        loss = (batch.advantages * error).mean()
        calls["loss"].append(batch.advantages.clone())
        return loss, {"loss": loss.detach(), "weighted_error": error.mean().detach()}


@register_estimator("centred_rank")
def centred_rank(inputs: AdvantageInputs, settings) -> torch.Tensor:
    """Each sample's rank within its group, centred: robust to the reward's scale."""
    total, out = inputs.scores["total"], torch.zeros(len(inputs.group_ids))
    for g in inputs.group_ids.unique():
        rows = torch.nonzero(inputs.group_ids == g).flatten()
        ranks = total[rows].argsort().argsort().float()
        out[rows] = ranks - ranks.mean()
    calls["estimator"].append(out.clone())
    return out


@dataclass
class ExtrasSettings:
    columns: int = 2  # width of the "row" extra


@dataclass
class FromExtrasSettings:
    scale: float = 1.0


def _check_from_extras(config):
    if config.grpo.advantage.from_extras.scale <= 0:
        raise ConfigError("grpo.advantage.from_extras.scale must be > 0")


@register_rollout("chain_with_extras")
class ChainWithExtras(Chain):
    """The chain rollout, plus a per-sample extra: each image's reward scored at once through ``context.score``."""

    config_class = ExtrasSettings

    def collect(self, epoch):
        collected = super().collect(epoch)
        t = collected.trajectory
        scores = self.context.score(t.images, t.prompts, t.metadata, t.source_images)
        t.extras["scored_now"] = scores["total"]
        columns = self.context.config.sampler.chain_with_extras.columns
        t.extras["row"] = torch.arange(len(t), dtype=torch.float32)[:, None].repeat(1, columns)  # any shape
        return collected


@register_estimator("from_extras", config_class=FromExtrasSettings, validate=_check_from_extras)
def from_extras(inputs: AdvantageInputs, settings) -> torch.Tensor:
    calls["estimator"].append(dict(inputs.extras, total=inputs.scores["total"]))
    return settings.from_extras.scale * (inputs.extras["scored_now"] - inputs.extras["scored_now"].mean())


@pytest.fixture(autouse=True, scope="module")
def _unregister():
    yield
    OBJECTIVES.pop("throwaway")
    ADVANTAGE_ESTIMATORS.pop("centred_rank")
    ADVANTAGE_ESTIMATORS.pop("from_extras")
    ROLLOUTS.pop("chain_with_extras")


def test_a_rollouts_extras_reach_the_advantage_estimator(tmp_path):
    """Trajectory.extras are joined over rollout batches, gathered and handed to the estimator row for row; a
    rollout may score its images at once through RolloutContext.score (the same reward as the final scores)."""
    from flowgrpo.trainer import GRPOTrainer

    config = _config(
        tmp_path,
        "sampler.rollout=chain_with_extras",
        "sampler.chain_with_extras.columns=3",
        "grpo.advantage.estimator=from_extras",
    )
    calls["estimator"].clear()
    GRPOTrainer(config).fit()
    (seen,) = calls["estimator"]
    n = config.grpo.group_size * config.grpo.groups_per_epoch
    assert seen["row"].shape == (n, 3)
    torch.testing.assert_close(seen["scored_now"], seen["total"], rtol=0, atol=0)


def _config(tmp_path, *overrides):
    return load_config(
        TINY,
        [
            f"run.output_dir={tmp_path}",
            "run.progress=false",
            "run.epochs=1",
            "eval.every=0",
            "sampler.noise_level=0",
            "grpo.objective=throwaway",
            "grpo.advantage.estimator=centred_rank",
            *overrides,
        ],
    )


def test_an_objective_and_an_estimator_from_this_file_train_one_epoch(tmp_path):
    from flowgrpo.trainer import GRPOTrainer

    assert "throwaway" in available_objectives() and "centred_rank" in available_advantage_estimators()
    config = _config(tmp_path, "grpo.throwaway.sigma=0.25")
    assert config.grpo.throwaway.sigma == 0.25 and config.to_dict()["grpo"]["throwaway"] == {"sigma": 0.25}
    calls["estimator"].clear()
    calls["loss"].clear()
    trainer = GRPOTrainer(config)
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "train/loss" in r)
    assert "train/weighted_error" in row and "train/ratio_mean" not in row  # the objective's own metrics
    assert row["global_step"] > 0
    assert any(not torch.equal(p.detach(), b) for p, b in zip(trainer.params, before, strict=True))
    (advantages,) = calls["estimator"]  # one call per epoch, over every sample
    assert len(advantages) == config.grpo.group_size * config.grpo.groups_per_epoch
    trained = torch.cat(calls["loss"])
    assert sorted(trained.tolist()) == sorted(advantages.tolist())  # every sample trained once, with its advantage


def test_an_objectives_own_section_is_validated_and_unknown_keys_named(tmp_path):
    with pytest.raises(ConfigError, match=r"grpo\.throwaway\.sigma must lie in \(0, 1\)"):
        _config(tmp_path, "grpo.throwaway.sigma=1.5")
    with pytest.raises(ConfigError, match=r"unknown config key 'grpo\.throwaway\.sigm'; did you mean"):
        _config(tmp_path, "grpo.throwaway.sigm=0.3")
    # its settings under another objective do nothing: refused
    with pytest.raises(ConfigError, match=r"grpo\.throwaway\.sigma=0\.3 is a setting of grpo\.objective=throwaway"):
        load_config(TINY, ["grpo.throwaway.sigma=0.3"])


def test_a_saved_config_names_only_the_active_objectives_section(tmp_path):
    """A run saved while a plugin objective is registered (but not used) loads where the plugin is not: the
    inactive sections sit at their defaults and are left out; an older run that wrote every section reports no
    change on resume."""
    config = load_config(TINY, [f"run.output_dir={tmp_path}"])
    saved = config.to_dict()
    assert "throwaway" not in saved["grpo"] and "nft" not in saved["grpo"]
    OBJECTIVES.pop("throwaway")
    try:
        path = tmp_path / "saved.yaml"
        path.write_text(config.to_yaml())
        assert load_config(path).to_dict() == saved
    finally:
        register_objective("throwaway")(Throwaway)
    older = config.with_every_section(saved)  # every section, at defaults
    assert "throwaway" in older["grpo"] and "nft" in older["grpo"]
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(older))
    assert recipe_changes(tmp_path, config) == []
    older["grpo"]["nft"]["beta"] = 0.5  # a real difference in an inactive section is still reported
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(older))
    assert recipe_changes(tmp_path, config) == ["grpo.nft.beta: 0.5 -> None"]


def test_per_step_advantages_reach_the_clipped_loss_at_each_samples_position():
    """[B, W] advantages equal to A in every column give the [B] loss; a column changed at a position not trained
    changes nothing, at the trained one it changes the loss."""
    from flowgrpo.pipelines import build_adapter
    from flowgrpo.rollout import rollout

    config = load_config(TINY, ["model.resolution=32", "grpo.clip_range=0.2"])
    adapter = build_adapter(config.model)
    trajectory = rollout(
        adapter,
        ["a red cube", "a red cube", "a blue ball", "a blue ball"],
        [0, 0, 1, 1],
        config.sampler,
        range(0, 2),
        torch.Generator().manual_seed(0),
        height=32,
        width=32,
    )
    trajectory.log_probs = trajectory.log_probs + 0.1  # stored log-probs off the current policy: ratios ≠ 1
    positions = torch.tensor([0, 1, 0, 1])
    advantages = torch.tensor([1.0, -2.0, 0.5, 3.0])
    per_step = advantages[:, None].repeat(1, trajectory.num_trained_steps)
    loss, _ = timestep_loss(adapter, config, trajectory, positions, advantages)
    same, _ = timestep_loss(adapter, config, trajectory, positions, per_step)
    torch.testing.assert_close(same, loss, rtol=0, atol=0)
    untouched = per_step.clone()
    untouched[0, 1] = 100.0  # sample 0 trains position 0
    torch.testing.assert_close(
        timestep_loss(adapter, config, trajectory, positions, untouched)[0], loss, rtol=0, atol=0
    )
    moved = per_step.clone()
    moved[0, 0] = 100.0
    assert not torch.equal(timestep_loss(adapter, config, trajectory, positions, moved)[0], loss)


def test_rollouts_and_estimators_have_their_own_sections_like_objectives(tmp_path):
    """sampler.<rollout> and grpo.advantage.<estimator>: typed, validated, refused when another one is chosen, and
    saved only while chosen."""
    chosen = _config(tmp_path, "sampler.rollout=chain_with_extras", "grpo.advantage.estimator=from_extras")
    saved = chosen.to_dict()
    assert saved["sampler"]["chain_with_extras"] == {"columns": 2}
    assert saved["grpo"]["advantage"]["from_extras"] == {"scale": 1.0}
    plain = _config(tmp_path).to_dict()
    assert "chain_with_extras" not in plain["sampler"] and "from_extras" not in plain["grpo"]["advantage"]
    with pytest.raises(
        ConfigError,
        match=r"sampler\.chain_with_extras\.columns=4 is a setting of "
        r"sampler\.rollout=chain_with_extras, but sampler\.rollout=chain; remove it, or set",
    ):
        _config(tmp_path, "sampler.chain_with_extras.columns=4")
    with pytest.raises(
        ConfigError,
        match=r"grpo\.advantage\.from_extras\.scale=2\.0 is a setting of "
        r"grpo\.advantage\.estimator=from_extras",
    ):
        _config(tmp_path, "grpo.advantage.from_extras.scale=2")
    with pytest.raises(ConfigError, match=r"grpo\.advantage\.from_extras\.scale must be > 0"):
        _config(tmp_path, "grpo.advantage.estimator=from_extras", "grpo.advantage.from_extras.scale=-1")
    with pytest.raises(ConfigError, match=r"sampler\.chain_with_extras\.columns: expected an integer"):
        _config(tmp_path, "sampler.rollout=chain_with_extras", "sampler.chain_with_extras.columns=wide")


def test_a_rollout_strategys_validate_gets_the_process_count_and_the_older_hook_still_works():
    """``RolloutStrategy.validate(cls, config, world_size=1)`` is called with the validated process count; a
    strategy written for the hook's older form, ``validate(cls, config)``, is still called (without the count)."""
    from flowgrpo.config import validate

    seen: list[tuple] = []

    @register_rollout("counting_hook")
    class CountingHook(Chain):
        @classmethod
        def validate(cls, config, world_size=1):
            seen.append(("new", world_size))

    @register_rollout("older_hook")
    class OlderHook(Chain):
        @classmethod
        def validate(cls, config):
            seen.append(("old",))

    @register_rollout("keyword_hook")
    class KeywordHook(Chain):
        @classmethod
        def validate(cls, config, *, world_size=1):
            seen.append(("keyword", world_size))

    @register_rollout("kwargs_hook")
    class KwargsHook(Chain):
        @classmethod
        def validate(cls, config, **kwargs):
            seen.append(("kwargs", kwargs.get("world_size")))

    try:
        config = load_config(TINY, ["run.progress=false"])
        for strategy in (CountingHook, OlderHook):
            config.sampler.rollout = strategy.name
            validate(config, world_size=2)
            validate(config, world_size=2, training=False)  # evaluate, export: no rollout, nothing checked
            strategy.validate(config)  # callers with one argument, as before
        assert seen == [("new", 2), ("new", 1), ("old",), ("old",)]
        seen.clear()
        for strategy in (KeywordHook, KwargsHook):  # the count by name: keyword-only, or among **kwargs
            config.sampler.rollout = strategy.name
            validate(config, world_size=2)
        assert seen == [("keyword", 2), ("kwargs", 2)]
    finally:
        for name in ("counting_hook", "older_hook", "keyword_hook", "kwargs_hook"):
            ROLLOUTS.pop(name)
