"""SDE rollouts for the objectives on the final samples (``sampler.noise_level > 0`` with awm, nft, fpo, dgpo, dpo,
sft, gdro): the design-space study's rollout-sampler axis. The window's steps sample with the SDE exactly as a
per-step objective's rollout does (same noise, same final latents; also with a shared prefix and a multistep tail)
and nothing of them is kept; noise 0, or an objective that does not opt in, stays the ODE; the refusals that only an
ODE rollout needs are lifted, SDE rollouts off a plain chain are refused; and a run trains."""

from __future__ import annotations

import pytest
import rollout_helper as helper
import torch

from flowgrpo.config import ConfigError, load_config
from flowgrpo.rollouts import get_rollout

FORWARD = ["awm", "nft", "fpo", "dgpo", "dpo", "sft", "gdro"]
# A shared prefix (run.seed 0 places epoch 0's random window of 3 at steps 2-4); a multistep solver after the window
# that starts from the window's history: the settings an SDE rollout may use, sampled as the per-step rollout does.
SHARED_PREFIX = ["sampler.same_initial_noise=true", "sampler.window.size=3", "sampler.window.strategy=random"]
SHARED_PREFIX += ["sampler.window.max_start=2"]
CARRIED_TAIL = ["sampler.window.size=3", "sampler.post_window.solver=dpmpp_2m"]
CARRIED_TAIL += ["sampler.post_window.carry_history=true"]


def _config(objective: str, *overrides: str):
    return load_config(helper.TINY, ["run.progress=false", f"grpo.objective={objective}", *overrides])


def _collect(config, seed: int = 3):
    context = helper.rollout_context(config, helper.adapter(), seed=seed)
    return get_rollout(config.sampler.rollout)(context).collect(0)


@pytest.mark.parametrize("overrides", [[], SHARED_PREFIX, CARRIED_TAIL], ids=["every_step", "prefix", "tail"])
def test_sde_rollout_of_final_sample_objective_samples_as_per_step_rollout_and_keeps_no_transitions(overrides):
    config = _config("nft", "sampler.noise_level=0.7", *overrides)
    sde = _collect(config)
    per_step = _collect(_config("clipped", "sampler.noise_level=0.7", *overrides))  # the same window, kept
    ode = _collect(_config("nft", "sampler.noise_level=0"))
    size = config.sampler.window.size or config.sampler.num_steps - 1  # 0: every step but the last
    assert per_step.trajectory.num_trained_steps == size and per_step.metrics == sde.metrics
    assert sde.trajectory.num_trained_steps == 0 and sde.trajectory.latents.shape[1] == 0
    assert sde.trajectory.log_probs.shape == (len(sde.trajectory), 0)
    assert sde.metrics["window/size"] == size and ode.metrics["window/size"] == 0
    assert sde.metrics["window/start"] == (2 if overrides == SHARED_PREFIX else 0)
    # Keeping the transitions or not changes nothing sampled: the same noise gives the same images.
    torch.testing.assert_close(sde.trajectory.final_latents, per_step.trajectory.final_latents, rtol=0, atol=0)
    assert not torch.allclose(sde.trajectory.final_latents, ode.trajectory.final_latents, atol=1e-3)


def test_an_objective_on_final_samples_that_takes_no_sde_rollouts_samples_the_ode_whatever_the_noise_level():
    config = _config("nft", "sampler.noise_level=0.7")
    context = helper.rollout_context(config, helper.adapter(), seed=3)
    context.objective.sde_final_samples = False  # a plugin objective that does not opt in
    plain = get_rollout("chain")(context).collect(0)
    ode = _collect(_config("nft", "sampler.noise_level=0"))
    assert plain.metrics["window/size"] == 0
    torch.testing.assert_close(plain.trajectory.final_latents, ode.trajectory.final_latents, rtol=0, atol=0)


@pytest.mark.parametrize("objective", FORWARD)
def test_sde_rollouts_are_refused_off_a_plain_chain(objective):
    """The offline store samples with the ODE (and takes awm, dgpo, dpo, sft, gdro at noise 0): refused there."""
    extra = ["train.inner_epochs=2"] if objective == "fpo" else []  # fpo: two optimizer steps an epoch
    _config(objective, "sampler.noise_level=0.7", *extra)  # a chain: accepted
    with pytest.raises(ConfigError, match=r"sampler\.noise_level=0\.7 .* sampler\.rollout: chain"):
        _config(objective, "sampler.noise_level=0.7", "sampler.rollout=offline", *extra)


@pytest.mark.parametrize(
    "override",
    ["sampler.same_initial_noise=true", "sampler.last_step=sde", "sampler.post_window.solver=dpmpp_2m"],
)
def test_stochastic_rollout_settings_are_refused_only_under_the_ode(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _config("nft", "sampler.noise_level=0", override)
    extra = ["sampler.window.size=3"] if "post_window" in override else []  # a tail after the window to solve
    _config("nft", "sampler.noise_level=0.7", override, *extra)


def test_fpo_trains_on_sde_rollouts(tmp_path):
    config = _config("fpo", "sampler.noise_level=0.7", *helper.one_epoch(tmp_path))
    trainer, row = helper.train(config)
    steps = config.sampler.num_steps
    assert row["window/size"] == steps - 1 and torch.isfinite(torch.tensor(row["train/loss"]))
    assert row["global_step"] == 2  # the tiny config's 2 micro-batches: the ratio acts from the second step
