"""Reward throughput on this machine, and how much async scoring hides behind sampling.

    python scripts/bench.py rewards [--batch-size 8] [--size 256] [--batches 6] [--rewards ocr,clipscore]

1. images/s of each reward on rendered text images (CPU unless --device). ``clipscore`` runs
   a full-size ViT-B-32 with random weights: the compute of the real model, nothing downloaded.
2. An epoch-like loop: a fake sampler takes about as long per batch as scoring does, batch i is
   scored in the background (``AsyncReward``) while batch i+1 is sampled. Reported:
   ``wall / (sampling + scoring)``: 1.0 is no overlap, 0.5 + 1/(2N) perfect overlap of N equal batches
   (``floor`` gives the perfect-overlap value for the times actually measured).
   ``sleep`` models a GPU sampler (the host thread waits); ``compute`` busies the CPU (worst case
   here, where sampler and reward share the same cores).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from rewards import AsyncReward, build_reward

WORDS = ["FLOW GRPO", "Open 24 Hours", "Hello World", "SALE", "Coffee", "Exit 12", "No Parking", "Welcome"]
SPECS: dict[str, dict[str, Any]] = {
    "ocr": {"name": "ocr"},
    "jpeg_compressibility": {"name": "jpeg_compressibility"},
    "jpeg_incompressibility": {"name": "jpeg_incompressibility"},
    "clipscore": {"name": "clipscore", "model": "ViT-B-32", "random_init": True},
}
SMOKE_ARGS = [
    "--rewards",
    "jpeg_compressibility",
    "--batch-size",
    "2",
    "--size",
    "64",
    "--batches",
    "2",
    "--repeats",
    "1",
    "--modes",
    "sleep",
]


def text_batch(batch: int, size: int) -> tuple[torch.Tensor, list[str]]:
    images, prompts = [], []
    font = ImageFont.load_default(size=max(12, size // 9))
    for i in range(batch):
        word = WORDS[i % len(WORDS)]
        img = Image.new("RGB", (size, size), "white")
        ImageDraw.Draw(img).text((size // 20, size // 2 - size // 16), word, fill="black", font=font)
        images.append(torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255)
        prompts.append(f'a street sign that says "{word}"')
    return torch.stack(images), prompts


def throughput(name: str, images: torch.Tensor, prompts: list[str], device: str, repeats: int) -> float:
    reward = build_reward([dict(SPECS[name])], device=device)
    reward(images[:1], prompts[:1])  # warm-up: lazy init, allocator, ONNX session
    start = time.perf_counter()
    for _ in range(repeats):
        reward(images, prompts)
    return repeats * images.shape[0] / (time.perf_counter() - start)


def fake_sampler(seconds: float, mode: str, images: torch.Tensor) -> torch.Tensor:
    if mode == "sleep":
        time.sleep(seconds)
    else:
        a = torch.randn(256, 256)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a = torch.tanh(a @ a)
    return images.clone()


def overlap(reward: Any, images: torch.Tensor, prompts: list[str], batches: int, mode: str, sample_s: float) -> dict:
    scoring: list[float] = []

    def timed(x: torch.Tensor, p: list[str], m: Any = None) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        out = reward(x, p, m)
        scoring.append(time.perf_counter() - start)
        return out

    sampling = 0.0
    with AsyncReward(timed, max_pending=2) as scorer:
        start = time.perf_counter()
        for _ in range(batches):
            t = time.perf_counter()
            batch = fake_sampler(sample_s, mode, images)
            sampling += time.perf_counter() - t
            scorer.submit(batch, prompts)
        results = scorer.results()
        wall = time.perf_counter() - start
    assert len(results) == batches
    total = sampling + sum(scoring)
    # Perfect overlap still pays the shorter phase once (first sample / last score): the floor to compare with.
    ideal = (max(sampling, sum(scoring)) + min(sampling, sum(scoring)) / batches) / total
    return {"sampling": sampling, "scoring": sum(scoring), "wall": wall, "ratio": wall / total, "ideal": ideal}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.py rewards", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=256, help="image side in pixels")
    parser.add_argument("--batches", type=int, default=6, help="batches in the overlap loop")
    parser.add_argument("--repeats", type=int, default=2, help="timed batches per reward")
    parser.add_argument("--rewards", default=",".join(SPECS), help=f"subset of {', '.join(SPECS)}")
    parser.add_argument("--modes", default="sleep,compute", help="fake sampler kinds: sleep, compute")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs a download

    images, prompts = text_batch(args.batch_size, args.size)
    print(
        f"rewards on {args.device}: batch {args.batch_size}, {args.size}x{args.size}, torch threads "
        f"{torch.get_num_threads()}, CPUs {os.cpu_count()}"
    )
    print(f"{'reward':<26}{'images/s':>10}{'ms/image':>10}")
    for name in args.rewards.split(","):
        rate = throughput(name, images, prompts, args.device, args.repeats)
        print(f"{name:<26}{rate:>10.1f}{1000 / rate:>10.1f}")

    reward = build_reward({"ocr": 1.0, "jpeg_compressibility": 0.01}, device=args.device)
    reward(images, prompts)  # warm-up, and the per-batch scoring time the fake sampler matches
    start = time.perf_counter()
    reward(images, prompts)
    sample_s = time.perf_counter() - start
    print(
        f"\noverlap: ocr + jpeg_compressibility, {args.batches} batches, sampler ≈ {sample_s:.2f} s/batch "
        f"(ideal ratio {0.5 + 0.5 / args.batches:.2f}, target ≤ 0.6)"
    )
    print(f"{'sampler':<10}{'sampling s':>12}{'scoring s':>12}{'wall s':>10}{'wall/(samp+score)':>20}{'floor':>8}")
    for mode in args.modes.split(","):
        r = overlap(reward, images, prompts, args.batches, mode, sample_s)
        print(
            f"{mode:<10}{r['sampling']:>12.2f}{r['scoring']:>12.2f}{r['wall']:>10.2f}{r['ratio']:>20.2f}"
            f"{r['ideal']:>8.2f}"
        )
    return 0
