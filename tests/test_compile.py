"""``model.compile``: the transformer is compiled in place, the rollout, the loss's re-evaluation and the KL reference
all run through it, and the on-policy ratio stays exactly 1.

The trainer test compiles with a counting backend that runs the captured graphs eagerly (seconds): it checks the
wiring (every forward goes through torch.compile, in both grad modes) and the exact ratio. Whether inductor's
generated kernels keep the ratio exact is checked on the tiny pipeline by the opt-in test below: a cold inductor
compile of its four graphs takes minutes on two CPU cores (about 20 s with a warm cache in /tmp/torchinductor_*).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from flowgrpo.adapters import PipelineAdapter, make_adapter
from flowgrpo.config import ConfigError, SamplerConfig, load_config
from flowgrpo.rollout import evaluate_transitions, rollout
from flowgrpo.tiny import build_tiny_pipeline
from flowgrpo.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parent.parent


def test_compile_option_is_a_boolean():
    assert load_config(ROOT / "configs" / "tiny_sd3.yaml", ["model.compile=true"]).model.compile is True
    with pytest.raises(ConfigError, match="model.compile"):
        load_config(ROOT / "configs" / "tiny_sd3.yaml", ["model.compile=fast"])


def test_trainer_compiles_the_transformer_and_stays_exactly_on_policy(tmp_path, monkeypatch):
    grad_modes: list[bool] = []

    def counting_backend(graph_module, example_inputs):  # noqa: ARG001
        grad_modes.append(torch.is_grad_enabled())
        return graph_module.forward

    original = PipelineAdapter.compile
    monkeypatch.setattr(PipelineAdapter, "compile", lambda self, **kw: original(self, backend=counting_backend))
    config = load_config(
        ROOT / "configs" / "tiny_sd3.yaml",
        [
            f"run.output_dir={tmp_path}",
            "run.progress=false",
            "run.epochs=1",
            "eval.every=0",
            "grpo.kl.beta=0.04",
            "model.compile=true",
        ],
    )
    trainer = GRPOTrainer(config)
    model = trainer.adapter.transformer
    assert model._compiled_call_impl is not None  # compiled in place: same module, same parameter names
    assert all("_orig_mod" not in name for name, _ in model.named_parameters())
    trainer.fit()
    assert False in grad_modes and True in grad_modes  # rollout / reference (no grad) and re-evaluation (grad)
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train/onpolicy_ratio_dev"] == 0.0 and rows[-1]["train/kl"] >= 0


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FLOWGRPO_TEST_INDUCTOR"), reason="set FLOWGRPO_TEST_INDUCTOR=1 (minutes)")
def test_inductor_reevaluation_reproduces_the_rollout_log_probs_exactly():
    adapter = make_adapter(build_tiny_pipeline("sd3", seed=0))
    adapter.add_lora(rank=4, alpha=8)
    adapter.compile()  # inductor
    # same_initial_noise + a window starting at step 2: the shared prefix runs fewer rows (a second batch size)
    sampler = SamplerConfig(noise_level=0.7, num_steps=5, guidance_scale=4.5, same_initial_noise=True)
    trajectory = rollout(
        adapter,
        ["a red cube", "a red cube", "a blue ball", "a blue ball"],
        [0, 0, 1, 1],
        sampler,
        range(2, 4),
        torch.Generator().manual_seed(0),
        height=32,
        width=32,
    )
    adapter.transformer.train()  # the trainer's mode for the loss
    for position in range(2):
        new = evaluate_transitions(adapter, trajectory, position, sampler)
        assert torch.equal(new.log_prob, trajectory.log_probs[:, position])
        new.log_prob.mean().backward()
    with torch.no_grad(), adapter.adapter_disabled():  # the KL reference: one more graph, runs
        assert torch.isfinite(evaluate_transitions(adapter, trajectory, 0, sampler).mean).all()
