"""One trained timestep against a bare transformer forward + backward on the same batch: what the trainer adds.

    python scripts/bench.py train-step [--kind sd3] [--size 64] [--batch 4] [--repeats 5] [--no-compile]

``step``: the clipped objective's :func:`~flowgrpo.objectives.clipped.timestep_loss` on a rollout's micro-batch
(re-evaluation of the stored transition at one window position, the KL reference forward when β > 0, the clipped
loss) and its backward, with the adapter built by ``build_adapter`` from a trainer config, in train mode. ``bare``:
the same transformer (LoRA attached) called once on the same B latents, sigma and prompt embeddings, ``mean()`` of
the output, backward.

The targets come from the bare parts measured in the same run: without KL or CFG the step should cost the bare
forward + backward (target ≤ 1.15 ×); the KL reference adds a no-grad forward (expected 1 + fwd / (fwd + bwd));
CFG doubles the rows (expected: the bare forward + backward on 2B rows ÷ on B rows); each within 15% of its
expectation. The variant rows (gradient checkpointing, bf16 weights with fp32 LoRA, ``model.compile``) compare the
step with the bare forward + backward under the same setting (target ≤ 1.15) and with the fp32 eager step.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from flowgrpo.benchmarks.common import (
    bench_config,
    finish,
    interleaved,
    markdown_table,
    parse,
    prompts,
    tiny_overrides,
    verdict,
)
from flowgrpo.config import Config
from flowgrpo.objectives.clipped import timestep_loss
from flowgrpo.pipelines import build_adapter
from flowgrpo.rollout import Trajectory, rollout

VARIANTS = {  # name -> model overrides (on fp32 eager)
    "fp32": {},
    "gradient checkpointing": {"model.gradient_checkpointing": True},
    "bf16": {"model.dtype": "bf16"},
    "compile": {"model.compile": True},
}
SMOKE_ARGS = ["--size", "32", "--batch", "2", "--steps", "3", "--repeats", "1", "--variants", "fp32"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["sd3", "flux"], default="sd3")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch (train.batch_size)")
    parser.add_argument("--steps", type=int, default=6, help="sampler.num_steps of the rollout")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {', '.join(VARIANTS)}")
    parser.add_argument("--device", default="cpu")


class Setup:
    """An adapter built as the trainer builds it, and the rollouts whose stored transitions the step re-scores."""

    def __init__(self, args: argparse.Namespace, model: dict[str, Any]) -> None:
        self.args = args
        base = tiny_overrides(args.kind, args.size, args.steps, args.batch, **model)
        self.config = {beta: bench_config({**base, "grpo.kl.beta": beta}) for beta in (0.0, 0.04)}
        config = self.config[0.0]
        self.adapter = build_adapter(config.model, args.device)
        cfg_scales = [config.sampler.guidance_scale] + ([1.0] if self.adapter.uses_cfg else [])
        texts = prompts(args.batch)
        self.trajectories: dict[bool, Trajectory] = {}
        for gs in cfg_scales:
            sampler = replace(config.sampler, guidance_scale=gs)
            self.trajectories[gs > 1 and self.adapter.uses_cfg] = rollout(
                self.adapter,
                texts,
                list(range(args.batch)),
                sampler,
                range(0, args.steps - 1),
                torch.Generator().manual_seed(0),
                height=args.size,
                width=args.size,
                decode=False,
            )
        if config.model.compile:  # as the trainer does (after the rollouts here: their graphs are not timed)
            self.adapter.compile()
        self.adapter.transformer.train()
        self.advantages = torch.randn(args.batch, generator=torch.Generator().manual_seed(1)).to(args.device)
        self.positions = torch.zeros(args.batch, dtype=torch.long)

    def _clear(self) -> None:
        for p in self.adapter.trainable_parameters():
            p.grad = None

    def step(self, *, kl: bool, cfg: bool) -> Callable[[], None]:
        config: Config = self.config[0.04 if kl else 0.0]
        trajectory = self.trajectories[cfg]

        def run():
            loss, _ = timestep_loss(self.adapter, config, trajectory, self.positions, self.advantages)
            loss.backward()
            self._clear()

        return run

    def bare(self, *, rows: int = 1, backward: bool = True) -> Callable[[], None]:
        """The transformer alone on the trajectory's first stored latents (``rows`` copies of the batch)."""
        t = self.trajectories[False]
        x = torch.cat([t.latents[:, 0]] * rows)
        sigma = torch.cat([t.sigmas[:, 0]] * rows).to(x.device)
        embeds = t.embeds.select(list(range(len(t))) * rows)
        gs = 1.0 if self.adapter.uses_cfg else t.guidance_scale  # FLUX: the guidance embedding, no extra rows

        def run():
            with torch.set_grad_enabled(backward):
                out = self.adapter.velocity(x, sigma, embeds, gs)
                if backward:
                    out.float().mean().backward()
                    self._clear()

        return run


def run(args: argparse.Namespace) -> dict[str, Any]:
    variants = args.variants.split(",")
    setups = {name: Setup(args, VARIANTS[name]) for name in variants}
    cases = {}
    for name, s in setups.items():
        cases[f"{name}/bare"] = s.bare()
        cases[f"{name}/step"] = s.step(kl=False, cfg=False)
    base = setups.get("fp32")
    if base is not None:
        cases.update({"bare_fwd": base.bare(backward=False), "step_kl": base.step(kl=True, cfg=False)})
        if base.adapter.uses_cfg:
            cases["bare2"], cases["bare2_fwd"] = base.bare(rows=2), base.bare(rows=2, backward=False)
            cases["step_cfg"], cases["step_cfg_kl"] = base.step(kl=False, cfg=True), base.step(kl=True, cfg=True)
    t = interleaved(cases, args.repeats, args.device)
    rows = []
    if base is not None:
        fb, f = t["fp32/bare"], t["bare_fwd"]
        expected = {"step": 1.0, "step_kl": 1 + f / fb}
        if "step_cfg" in t:
            expected.update({"step_cfg": t["bare2"] / fb, "step_cfg_kl": (t["bare2"] + t["bare2_fwd"]) / fb})
        names = {"step": "fp32/step"}
        labels = {"step": "no KL, no CFG", "step_kl": "KL", "step_cfg": "CFG", "step_cfg_kl": "CFG + KL"}
        for case, exp in expected.items():
            seconds = t[names.get(case, case)]
            ratio = seconds / fb
            rows.append(
                {
                    "case": labels[case],
                    "variant": "fp32",
                    "step_s": seconds,
                    "bare_s": fb,
                    "ratio": ratio,
                    "expected": exp,
                    "target": 1.15 * exp,
                    "pass": ratio <= 1.15 * exp,
                    "vs_fp32_step": seconds / t["fp32/step"],
                }
            )
    for name in variants:
        if name == "fp32":
            continue
        seconds, bare = t[f"{name}/step"], t[f"{name}/bare"]
        rows.append(
            {
                "case": "no KL, no CFG",
                "variant": name,
                "step_s": seconds,
                "bare_s": bare,
                "ratio": seconds / bare,
                "expected": 1.0,
                "target": 1.15,
                "pass": seconds / bare <= 1.15,
                "vs_fp32_step": seconds / t["fp32/step"] if "fp32/step" in t else None,
            }
        )
    return {"benchmark": "train-step", "args": vars(args), "rows": rows, "seconds": t}


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    head = (
        f"**Train step** — tiny {a['kind']} on {a['device']}, micro-batch {a['batch']}, {a['size']}×{a['size']} "
        "px, LoRA r4, one trained timestep (re-evaluation + loss + backward) ÷ a bare transformer forward + "
        f"backward on the same batch under the same setting; median of {a['repeats']} interleaved repeats. "
        "Expected: from "
        "the bare parts of this run (KL: + a no-grad forward; CFG: the bare pass on 2B rows); target ≤ 1.15 × "
        "expected."
    )
    table = markdown_table(
        ["case", "setting", "step s", "bare s", "ratio", "expected", "target", "", "÷ fp32 step"],
        [
            [
                r["case"],
                r["variant"],
                r["step_s"],
                r["bare_s"],
                r["ratio"],
                r["expected"],
                f"≤ {r['target']:.3g}",
                verdict(r["pass"]),
                r["vs_fp32_step"],
            ]
            for r in result["rows"]
        ],
    )
    return head + "\n\n" + table


def main(argv: list[str]) -> int:
    args = parse("train-step", __doc__, add_arguments, argv)
    return finish(run(args), markdown, args.json)
