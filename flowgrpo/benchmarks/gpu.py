"""Real-size figures for a GPU: rollout images/s, seconds per trained step, peak memory and model FLOP utilisation.

    python scripts/bench.py gpu --doc docs/benchmarks.md            # on a CUDA machine (scripts/gpu_bench.sh)
    python scripts/bench.py gpu --device cpu --layers 1 --size 256  # smoke run of the same code path on a CPU

Random-weight transformers and VAEs with SD3.5-Medium's and FLUX.1-dev's architecture (flowgrpo.benchmarks.models;
text encoders tiny), bf16 weights, fp32 LoRA r32 on the default targets, SDPA. SD3.5-M: 10 steps, CFG 4.5 (2 rows per
image); FLUX.1-dev: 6 steps, guidance embedding 3.5. Rollout: our Flow-GRPO SDE rollout (every step but the last in
the window, images decoded), timed against our ODE rollout and ``pipe()`` (interleaved repeats, medians). Train step:
one trained timestep of the rollout's batch with the clipped objective's
:func:`~flowgrpo.objectives.clipped.timestep_loss` (KL off) and its backward. Peak memory:
``torch.cuda.max_memory_allocated`` during each phase.

FLOPs per image are counted, not estimated: the transformer (and the VAE decoder) are built from their configs on
PyTorch's meta device and run once under ``torch.utils.flop_counter.FlopCounterMode``, which adds up the FLOPs of
every matmul, convolution and attention call (2 per multiply-add) for the token counts of this size: image tokens
(512 px: 1024) plus text tokens (SD3: 77 CLIP + 256 T5; FLUX: 512 T5). The backward is counted the same way with
frozen weights (LoRA's share is < 1%), so a train step counts forward + input-gradient backward FLOPs.
Rollout FLOPs per image = steps × forward × rows per image + VAE decode; train step = (forward + backward) × rows.
MFU = FLOPs done per second ÷ the device's dense bf16 peak (H100 / H200: 989 TFLOP/s; ``--peak-tflops``).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
from pathlib import Path
from typing import Any

import torch

from flowgrpo.benchmarks.common import finish, interleaved, markdown_table, parse, prompts, quiet_diffusers, timed
from flowgrpo.config import SamplerConfig
from flowgrpo.rollout import rollout

SETTINGS = {  # kind -> steps, guidance, default training settings
    "sd3": {"steps": 10, "guidance": 4.5, "train": "no-checkpointing,checkpointing"},
    "flux": {"steps": 6, "guidance": 3.5, "train": "checkpointing"},  # 12 B: batch 8's activations need checkpointing
}
TRAIN_SETTINGS = ("no-checkpointing", "checkpointing", "compile")  # compile: model.compile, no checkpointing
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}  # dense bf16
BEGIN, END = "<!-- gpu:begin -->", "<!-- gpu:end -->"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", default="sd3,flux", help="sd3, flux or both (comma-separated)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="override the steps (default: SD3 10, FLUX 6)")
    parser.add_argument("--layers", type=int, default=None, help="shrink the transformers (smoke runs)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--train",
        default=None,
        help=f"train-step settings, a subset of {', '.join(TRAIN_SETTINGS)} "
        "(default: SD3 without and with checkpointing, FLUX with)",
    )
    parser.add_argument("--no-rollout", action="store_true", help="train-step rows only")
    parser.add_argument("--merge", nargs="+", help="measure nothing: join these JSON results (and write --doc)")
    parser.add_argument("--attention", choices=["sdpa", "xformers"], default="sdpa")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by GPU name)")
    parser.add_argument("--doc", help="markdown file whose GPU section (between the gpu markers) is replaced")


def count_flops(module: torch.nn.Module, inputs: dict[str, torch.Tensor], backward: bool = False) -> float:
    """FLOPs of one call of a module of this config (built on the meta device, so nothing is computed)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"), quiet_diffusers():
        dtype = next(module.parameters()).dtype
        twin = type(module).from_config(module.config).to(dtype).requires_grad_(False)
        meta = {k: v.to("meta") for k, v in inputs.items()}
        if backward:
            meta["hidden_states"].requires_grad_(True)
        with FlopCounterMode(display=False) as counter:
            out = twin(**meta, return_dict=False)[0]
            if backward:
                out.float().mean().backward()
    return float(counter.get_total_flops())


def vae_decode_flops(vae: torch.nn.Module, latent_shape: tuple[int, ...]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"), quiet_diffusers():
        dtype = next(vae.parameters()).dtype
        twin = type(vae).from_config(vae.config).to(dtype)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            twin.decode(torch.zeros(1, *latent_shape, dtype=dtype), return_dict=False)
    return float(counter.get_total_flops())


def capture_inputs(adapter, embeds, latents) -> dict[str, torch.Tensor]:
    """The keyword arguments of one transformer call for one image (batch row 0), captured by a hook."""
    captured: dict[str, torch.Tensor] = {}

    def hook(module, args, kwargs):  # noqa: ARG001
        captured.update(
            {
                k: v[:1] if k not in ("img_ids", "txt_ids") else v
                for k, v in kwargs.items()
                if isinstance(v, torch.Tensor)
            }
        )

    handle = adapter.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            adapter.velocity(latents[:1], 0.5, embeds.select([0]), 1.0)
    finally:
        handle.remove()
    return captured


def peak_gib(device: torch.device, fn) -> float | None:
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def bench_kind(kind: str, args: argparse.Namespace, peak: float | None) -> dict[str, Any]:
    from flowgrpo.adapters import make_adapter
    from flowgrpo.benchmarks.models import build_random_pipeline
    from flowgrpo.config import Config
    from flowgrpo.objectives.clipped import timestep_loss

    device = torch.device(args.device)
    s = SETTINGS[kind]
    steps, gs, batch, size = args.steps or s["steps"], s["guidance"], args.batch, args.size
    pipe = build_random_pipeline(kind, num_layers=args.layers, dtype=torch.bfloat16, device=device)
    pipe.set_progress_bar_config(disable=True)
    adapter = make_adapter(pipe)
    adapter.set_attention_backend(args.attention)
    adapter.add_lora(rank=32, alpha=64)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    texts = prompts(batch)
    latents = adapter.initial_noise(batch, size, size, generator=torch.Generator().manual_seed(0))
    rows_per_image = 2 if adapter.needs_negative(gs) else 1

    # FLOPs per image, counted on the meta device for this config and size.
    embeds = adapter.encode_prompts(texts, with_negative=rows_per_image == 2)
    inputs = capture_inputs(adapter, embeds, latents)
    forward = count_flops(unwrap_base(adapter.transformer), inputs)
    backward = count_flops(unwrap_base(adapter.transformer), inputs, backward=True)
    decode = vae_decode_flops(pipe.vae, tuple(adapter._latents_to_vae(latents[:1], size, size).shape[1:]))
    rollout_flops = steps * forward * rows_per_image + decode
    train_flops = backward * rows_per_image

    ode = SamplerConfig(noise_level=0.0, num_steps=steps, guidance_scale=gs)
    sde = SamplerConfig(noise_level=0.7, num_steps=steps, guidance_scale=gs)
    window = range(0, steps - 1)

    def run_pipe():
        with torch.no_grad():
            pipe(
                prompt=texts,
                latents=latents.clone(),
                num_inference_steps=steps,
                guidance_scale=gs,
                height=size,
                width=size,
                output_type="pt",
            )

    def ours(sampler):
        def run():
            adapter.clear_prompt_cache()  # pipe() encodes every call
            return rollout(
                adapter,
                texts,
                list(range(batch)),
                sampler,
                window,
                torch.Generator().manual_seed(1),
                height=size,
                width=size,
                initial_latents=latents,
            )

        return run

    result: dict[str, Any] = {
        "kind": kind,
        "attention": args.attention,
        "steps": steps,
        "batch": batch,
        "size": size,
        "rows_per_image": rows_per_image,
        "forward_tflop": forward / 1e12,
        "train_tflop": backward / 1e12,
        "decode_tflop": decode / 1e12,
        "rollout": None,
        "train": [],
    }
    if not args.no_rollout:
        t = interleaved({"pipe": run_pipe, "ode": ours(ode), "sde": ours(sde)}, args.repeats, device)
        result["rollout"] = {
            "pipe_s": t["pipe"],
            "ode_s": t["ode"],
            "sde_s": t["sde"],
            "ode/pipe": t["ode"] / t["pipe"],
            "sde/ode": t["sde"] / t["ode"],
            "images_per_s": batch / t["sde"],
            "mfu": rollout_flops * batch / t["sde"] / (peak * 1e12) if peak else None,
        }
    holder: dict[str, Any] = {}
    rollout_peak = peak_gib(device, lambda: holder.update(trajectory=ours(sde)()))
    if result["rollout"] is not None:
        result["rollout"]["peak_gib"] = rollout_peak
    trajectory = holder["trajectory"]
    trajectory.images = None

    config = Config()
    config.sampler = sde
    positions = torch.zeros(batch, dtype=torch.long)
    advantages = torch.randn(batch, generator=torch.Generator().manual_seed(2)).to(device)

    def train_step():
        loss, _ = timestep_loss(adapter, config, trajectory, positions, advantages)
        loss.backward()
        for p in adapter.trainable_parameters():
            p.grad = None

    settings = (args.train or s["train"]).split(",")
    unknown = set(settings) - set(TRAIN_SETTINGS)
    if unknown:
        raise ValueError(f"--train: unknown setting(s) {sorted(unknown)}; choose from {', '.join(TRAIN_SETTINGS)}")
    adapter.transformer.train()
    model = unwrap_base(adapter.transformer)
    for name in sorted(settings, key=TRAIN_SETTINGS.index):  # compile last: it stays compiled
        if name == "checkpointing":
            model.enable_gradient_checkpointing()
        else:
            model.disable_gradient_checkpointing()
        if name == "compile":
            adapter.compile()
        row: dict[str, Any] = {"setting": name}
        try:
            train_step()  # warm-up (and compilation)
            seconds = sorted(timed(train_step, device) for _ in range(args.repeats))[args.repeats // 2]
            row.update(
                {
                    "seconds": seconds,
                    "peak_gib": peak_gib(device, train_step),
                    "mfu": train_flops * batch / seconds / (peak * 1e12) if peak else None,
                }
            )
        except torch.cuda.OutOfMemoryError:
            row.update({"seconds": None, "peak_gib": None, "mfu": None, "error": "out of memory"})
            torch.cuda.empty_cache()
        result["train"].append(row)
    return result


def unwrap_base(model: torch.nn.Module) -> torch.nn.Module:
    from flowgrpo.adapters import unwrap

    return unwrap(model)


def device_peak(args: argparse.Namespace) -> tuple[str, float | None]:
    if not str(args.device).startswith("cuda"):
        return "cpu", args.peak_tflops
    name = torch.cuda.get_device_name(torch.device(args.device))
    found = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return name, args.peak_tflops or found


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.merge:
        parts = [json.loads(Path(path).read_text()) for path in args.merge]
        return {**parts[0], "results": [r for part in parts for r in part["results"]]}
    name, peak = device_peak(args)
    kinds = [k.strip() for k in args.kind.replace("both", "sd3,flux").split(",") if k.strip()]
    results = []
    for kind in kinds:
        results.append(bench_kind(kind, args, peak))
        gc.collect()  # the previous model's memory, before the next one is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"benchmark": "gpu", "args": vars(args), "device_name": name, "peak_tflops": peak, "results": results}


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    layers = f", {a['layers']} layer(s) only (smoke run)" if a["layers"] else ""
    peak = f"{result['peak_tflops']:g} TFLOP/s dense bf16" if result["peak_tflops"] else "no peak given"
    models = {"sd3": "SD3.5-M", "flux": "FLUX.1-dev"}

    def names(r: dict[str, Any]) -> str:
        return models[r["kind"]] + (f" ({r['attention']})" if r.get("attention", "sdpa") != "sdpa" else "")

    gib = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
    pct = lambda v: "—" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    rollout_rows = [
        [
            names(r),
            r["batch"],
            r["steps"],
            r["rows_per_image"],
            r["forward_tflop"],
            r["rollout"]["images_per_s"],
            r["rollout"]["ode/pipe"],
            r["rollout"]["sde/ode"],
            gib(r["rollout"]["peak_gib"]),
            pct(r["rollout"]["mfu"]),
        ]
        for r in result["results"]
        if r["rollout"]
    ]
    train_rows = [
        [
            names(r),
            r["batch"],
            t["setting"],
            r["train_tflop"] * r["rows_per_image"],
            t.get("error") or t["seconds"],
            gib(t["peak_gib"]),
            pct(t["mfu"]),
        ]
        for r in result["results"]
        for t in r["train"]
    ]
    return "\n".join(
        [
            f"**GPU** — {result['device_name']} ({peak}), random-weight real-size models{layers}, bf16 weights, "
            f"LoRA r32, {a['size']}×{a['size']} px; median of {a['repeats']} repeats. FLOPs counted on the meta device "
            "(scripts/bench.py gpu --help says how).",
            "",
            markdown_table(
                [
                    "model",
                    "batch",
                    "steps",
                    "rows/image",
                    "fwd TFLOP/row",
                    "rollout images/s",
                    "ODE ÷ pipe",
                    "SDE ÷ ODE",
                    "rollout peak GiB",
                    "rollout MFU",
                ],
                rollout_rows,
            ),
            "",
            markdown_table(
                ["model", "micro-batch", "setting", "fwd+bwd TFLOP/image", "s / trained step", "peak GiB", "MFU"],
                train_rows,
            ),
        ]
    )


def update_doc(path: str | Path, section: str) -> None:
    """Replace the GPU section of ``path`` (between the gpu markers), or append one."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    block = f"{BEGIN}\n{section.strip()}\n{END}"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n## GPU\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def main(argv: list[str]) -> int:
    args = parse("gpu", __doc__, add_arguments, argv)
    result = run(args)
    if args.doc:
        update_doc(args.doc, f"Written by `python scripts/bench.py gpu` (scripts/gpu_bench.sh).\n\n{markdown(result)}")
    return finish(result, markdown, args.json)
