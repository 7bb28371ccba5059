"""What the rollout strategies' tests share (tests/test_tempflow.py, test_egrpo.py, test_branchgrpo.py,
test_dense_rewards.py, test_flash.py, test_shared_prefix.py): the tiny SD3 pipeline, its settings and its own
images, a count of the transformer's forwards, a one-process RolloutContext, the strategy's own refusal of
objectives that store nothing, and one training epoch through the trainer."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgrpo.adapters import make_adapter
from flowgrpo.config import ConfigError, SamplerConfig, load_config
from flowgrpo.tiny import build_tiny_pipeline

# Re-scoring a stored transition runs the transformer on another batch than the rollout did. Where the CPU's matmul
# kernels are not batch-invariant (seen on an Intel Xeon; an AMD EPYC gives bit-equal results) the two differ in the
# last float32 bit: log-probs agree to a few ulps and the on-policy ratio deviates from 1 by about 6e-8, not by 0.
ON_POLICY_RATIO_TOL = 1e-6


def rescored_equal(again: torch.Tensor, stored: torch.Tensor) -> bool:
    """A re-scored log-prob equals the stored one to a few float32 ulps (see ``ON_POLICY_RATIO_TOL``)."""
    return torch.allclose(again, stored, rtol=1e-6, atol=1e-7)


TINY = "configs/tiny_sd3.yaml"
SIZE, STEPS, CFG_SCALE = 32, 6, 4.5
# The fields a rollout stores per image, compared bit for bit between two ways of sampling the same transitions.
STORED = ("latents", "next_latents", "log_probs", "stds", "sigmas", "sigmas_next", "step_indices", "final_latents")


def adapter():
    """The tiny random SD3 pipeline (seed 0; CFG: two rows per image in a forward)."""
    return make_adapter(build_tiny_pipeline("sd3", seed=0))


def sampler(**kwargs: Any) -> SamplerConfig:
    """An SDE sampler of ``STEPS`` steps at guidance ``CFG_SCALE``, noise level 0.7, one initial noise per group;
    ``kwargs`` replace any of it."""
    base = {"noise_level": 0.7, "num_steps": STEPS, "guidance_scale": CFG_SCALE, "same_initial_noise": True}
    return SamplerConfig(**{**base, **kwargs})


def pipe_images(adapter, prompts: list[str], latents: torch.Tensor) -> torch.Tensor:
    """What the diffusers pipeline itself draws from ``latents`` (``STEPS`` steps at ``CFG_SCALE``, ``SIZE``²)."""
    kwargs = {"num_inference_steps": STEPS, "guidance_scale": CFG_SCALE, "height": SIZE, "width": SIZE}
    return adapter.pipe(prompt=prompts, latents=latents.clone(), output_type="pt", **kwargs).images


@contextlib.contextmanager
def forward_rows(adapter) -> Iterator[list[int]]:
    """The rows of every transformer forward (CFG doubles an image's rows), one entry per forward."""
    rows: list[int] = []
    handle = adapter.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: rows.append(kwargs.get("hidden_states", args[0] if args else None).shape[0]),
        with_kwargs=True,
    )
    try:
        yield rows
    finally:
        handle.remove()


def rollout_context(
    config,
    adapter,
    *,
    rank: int = 0,
    processes: int = 1,
    seed: int = 0,
    submit: Callable[..., None] | None = None,
    score: Callable[..., dict[str, torch.Tensor]] | None = None,
):
    """A RolloutContext for process ``rank`` of ``processes``: the config's training prompts and objective, rollout
    noise from a generator seeded ``seed``, never asked to stop; ``submit(images, prompts, metadata, sources)`` (by
    default: nothing) gets each sampled batch, ``score`` is the reward a strategy may call at once (dense)."""
    from flowgrpo.data import PromptDataset
    from flowgrpo.objectives import get_objective
    from flowgrpo.rollouts import RolloutContext

    return RolloutContext(
        config,
        adapter,
        PromptDataset.from_file(config.data.train),
        get_objective(config.grpo.objective)(config),
        torch.Generator().manual_seed(seed),
        rank,
        processes,
        submit=submit if submit is not None else lambda *args: None,
        should_stop=lambda: False,
        score=score,
    )


def check_refuses_awm(strategy, overrides: list[str], match: str = "grpo.objective=awm trains the final samples"):
    """``strategy.validate`` itself refuses an objective that stores no transitions: ``awm``, set in code on the config
    of ``overrides`` (past awm's own checks: noise level, same initial noise)."""
    config = load_config(TINY, overrides)
    config.grpo.objective = "awm"
    with pytest.raises(ConfigError, match=match):
        strategy.validate(config)


def one_epoch(tmp_path: Path, *overrides: str) -> list[str]:
    """``overrides`` for a one-epoch run in ``tmp_path``: no evaluation, no progress bars."""
    return [*overrides, f"run.output_dir={tmp_path}", "run.epochs=1", "eval.every=0", "run.progress=false"]


def train(config) -> tuple[Any, dict[str, Any]]:
    """Fit ``config``'s run through the trainer; the trainer and its first training row of metrics.jsonl. Checks
    that the weights moved."""
    from flowgrpo.trainer import GRPOTrainer

    trainer = GRPOTrainer(config)
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    assert any(not torch.equal(p.detach(), b) for p, b in zip(trainer.params, before, strict=True))
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, next(r for r in rows if "train/loss" in r)


def record_epoch_weights(trainer, after: Callable[[], list[torch.Tensor]]) -> dict[str, list[list[torch.Tensor]]]:
    """Wrap ``trainer``'s rollout and training to record, per epoch, the trainable weights the rollout ran with
    (``sampled``), those training started from and ended with (``trained_from``, ``trained_to``), and ``after()``
    once the epoch trained (``after``: e.g. the objective's old weights)."""
    weights = lambda: [p.detach().clone() for p in trainer.params]  # noqa: E731
    record: dict[str, list[list[torch.Tensor]]] = {"sampled": [], "trained_from": [], "trained_to": [], "after": []}
    collect, train_on = trainer.rollouts.collect, trainer.train_on

    def recording_collect(epoch):
        record["sampled"].append(weights())
        return collect(epoch)

    def recording_train_on(*args):
        record["trained_from"].append(weights())
        stats = train_on(*args)
        record["trained_to"].append(weights())
        record["after"].append([t.clone() for t in after()])
        return stats

    trainer.rollouts.collect, trainer.train_on = recording_collect, recording_train_on
    return record
