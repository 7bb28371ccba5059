"""The benchmark suite runs end to end at smoke size and reports what docs/benchmarks.md is built from (the figures
themselves are not asserted: timings belong to benchmarks, not tests)."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from flowgrpo.benchmarks import gpu, report
from flowgrpo.benchmarks.common import loglog_exponent, markdown_table, parse
from flowgrpo.phases import PHASES, PhaseTimer, Span

# module -> the keys of each row of its results (besides "pass")
ROWS = {
    "rollout": ("samplers", {"kind", "case", "seconds", "ratio", "target", "images_per_s"}),
    "train_step": ("rows", {"case", "variant", "step_s", "bare_s", "ratio", "expected", "target"}),
    "window": ("rows", {"window", "expected", "seconds", "ratio"}),
    "epoch": ("rows", {"config", "rewards", "wall", "idle", "idle_fraction", *PHASES}),
    "memory": ("rows", {"phase", "setting", "setup_mib", "peak_mib", "delta_mib"}),
    "scaling": ("rows", {"phase", "variable", "values", "seconds", "exponent"}),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_each_benchmark_runs_at_smoke_size_and_writes_json(name, tmp_path, capsys):
    module = importlib.import_module(f"flowgrpo.benchmarks.{name}")
    out = tmp_path / "result.json"
    assert module.main([*module.SMOKE_ARGS, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    key, fields = ROWS[name]
    rows = result[key]
    assert rows and all(fields <= set(row) and "pass" in row for row in rows)
    assert result["benchmark"] == name.replace("_", "-") and "args" in result
    printed = capsys.readouterr().out
    assert "| " in printed and "---" in printed  # a markdown table
    if name == "rollout":  # the shared prefix is measured against the call arithmetic, and the rows counted
        prefix = result["shared_prefix"]
        assert [r["k"] for r in prefix][0] == 0 and all(r["arithmetic"] <= 1 for r in prefix)
        group = prefix[0]["G"]
        for r in prefix:  # forward rows per image: k / G + (T - k), exactly
            assert r["rows_per_image"] == pytest.approx(r["k"] / group + r["T"] - r["k"])


def test_all_writes_the_report_and_keeps_the_gpu_section(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text(f"old\n{gpu.BEGIN}\nGPU TABLE FROM THE DEVICE\n{gpu.END}\n")
    argv = ["--quick", "--only", "window,scaling", "--out", str(out), "--json", str(tmp_path / "a.json")]
    assert report.main(argv) == 0
    text = out.read_text()
    for part in (
        "# Benchmarks",
        "command: `python scripts/bench.py all --quick",
        "machine:",
        "torch",
        "diffusers",
        "## window",
        "## scaling",
        "| window w |",
        "GPU TABLE FROM THE DEVICE",
    ):
        assert part in text
    assert "old" not in text.splitlines()[0]
    saved = json.loads((tmp_path / "a.json").read_text())
    assert {"machine", "window", "scaling"} <= set(saved)
    assert report.main(["--only", "nonesuch", "--out", str(out)]) == 2


def test_gpu_section_is_replaced_or_appended(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("# Benchmarks\n")
    gpu.update_doc(doc, "first")
    gpu.update_doc(doc, "second")
    text = doc.read_text()
    assert text.count(gpu.BEGIN) == 1 and "second" in text and "first" not in text


def test_gpu_merge_renders_the_tables(tmp_path):
    row = {
        "kind": "sd3",
        "steps": 10,
        "batch": 8,
        "size": 512,
        "rows_per_image": 2,
        "forward_tflop": 2.44,
        "train_tflop": 5.23,
        "decode_tflop": 1.2,
        "rollout": {"images_per_s": 3.0, "ode/pipe": 1.0, "sde/ode": 1.01, "peak_gib": 20.0, "mfu": 0.4},
        "train": [{"setting": "no-checkpointing", "seconds": 0.2, "peak_gib": 50.0, "mfu": 0.5}],
    }
    parts = []
    compiled = {**row, "rollout": None, "train": [{**row["train"][0], "setting": "compile"}]}
    for i, results in enumerate([[row], [compiled]]):
        path = tmp_path / f"p{i}.json"
        path.write_text(
            json.dumps(
                {
                    "benchmark": "gpu",
                    "args": {"size": 512, "repeats": 3, "layers": None},
                    "device_name": "NVIDIA H200",
                    "peak_tflops": 989.0,
                    "results": results,
                }
            )
        )
        parts.append(str(path))
    args = parse("gpu", None, gpu.add_arguments, ["--merge", *parts])
    text = gpu.markdown(gpu.run(args))
    assert "NVIDIA H200" in text and "40.0%" in text and "| SD3.5-M | 8 | compile |" in text


def test_flops_are_counted_on_the_meta_device_as_on_the_real_module():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from flowgrpo.adapters import make_adapter
    from flowgrpo.tiny import build_tiny_pipeline

    adapter = make_adapter(build_tiny_pipeline("sd3", seed=0))
    embeds = adapter.encode_prompts(["a red cube"])
    latents = adapter.initial_noise(1, 32, 32, generator=torch.Generator().manual_seed(0))
    inputs = gpu.capture_inputs(adapter, embeds, latents)
    # The math attention path is counted op by op (the CPU's fused kernel has no FLOP formula; CUDA's have).
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        adapter.transformer(**inputs, return_dict=False)
    assert gpu.count_flops(adapter.transformer, inputs) == counter.get_total_flops() > 0
    assert gpu.count_flops(adapter.transformer, inputs, backward=True) > 2 * counter.get_total_flops()


def test_phase_timer_splits_epochs_into_phases_and_idle():
    timer = PhaseTimer()
    timer.spans.extend(
        [
            Span("epoch", 0, 0),
            Span("sampling", 0, 3),
            Span("reward_wait", 3, 4),
            Span("training", 4.5, 8),
            Span("checkpoint", 8, 9),
            Span("epoch", 10, 10),
            Span("sampling", 10, 12),
            Span("end", 13, 13),
        ]
    )
    first, second = timer.epochs()
    assert first["wall"] == 10 and first["sampling"] == 3 and first["training"] == 3.5
    assert first["idle"] == pytest.approx(10 - 3 - 1 - 3.5 - 1)
    assert second["wall"] == 3 and second["idle"] == 1 and second["training"] == 0
    with timer("eval"):
        pass
    assert timer.spans[-1].phase == "eval" and timer.spans[-1].end >= timer.spans[-1].start


def test_helpers():
    assert loglog_exponent([1, 2, 4], [3, 12, 48]) == pytest.approx(2.0)
    assert markdown_table(["a", "b"], [[1.23456, None]]).splitlines()[-1] == "| 1.23 | — |"
