"""Noise-free evaluation on a prompt file: every configured reward, per-tag means, an image grid, a report.

The same routine runs every ``eval.every`` epochs during training and from ``scripts/evaluate.py`` (``--lora``: an
exported LoRA in plain diffusers, :mod:`flowgrpo.plain`).
Initial noise is fixed by the seed, so two evaluations differ only through the weights.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw
from torch import Tensor
from tqdm.auto import tqdm

from .adapters import PipelineAdapter
from .checks import height_width
from .config import EvalConfig, SamplerConfig, WindowConfig
from .data import PromptDataset
from .plain import PlainPipeline, check_plain_dataset
from .rollout import rollout


def ode_sampler(eval_config: EvalConfig) -> SamplerConfig:
    """The deterministic sampler evaluation uses: noise 0, every step an ODE step."""
    return SamplerConfig(
        noise_level=0.0,
        num_steps=eval_config.num_steps,
        guidance_scale=eval_config.guidance_scale,
        window=WindowConfig(size=0),
    )


@torch.no_grad()
def evaluate_shard(
    adapter: PipelineAdapter | PlainPipeline,
    dataset: PromptDataset,
    reward: Any,
    eval_config: EvalConfig,
    *,
    resolution: int | tuple[int, int],
    seed: int = 0,
    progress: bool = False,
    shard: tuple[int, int] = (0, 1),
    equal_batches: bool = False,
    image_prompts: int | None = None,
) -> tuple[list[int], Tensor, dict[str, Tensor]]:
    """ODE samples and scores of this shard's images (every ``world``-th from ``rank``): (prompt indices, images,
    scores). ``resolution``: the images' ``(height, width)`` (``model.size``), or one int for a square.
    ``eval.samples_per_prompt`` k: each prompt's k images are consecutive (its index repeats k times).
    ``adapter`` may be a :class:`~flowgrpo.plain.PlainPipeline`: an exported LoRA sampled by ``pipe(...)`` in plain
    diffusers from the same noise (text-to-image: prompts with source images are refused).

    Image j of prompt i starts from the (j+1)-th noise drawn from a generator seeded by ``(seed, i)`` (image 0: the
    first, as with k = 1), so an image does not depend on the batching, on k, or on how the images are split over
    processes. ``equal_batches``: every shard runs as many model batches as the largest one (padding with an
    unscored batch), for sharded models whose forwards are collectives. ``image_prompts`` n: only the images of
    prompts 0..n-1 are returned (the report's grid; GenEval's 2212 lines at 512 px would take 7 GB), the scores of all.
    """
    if isinstance(adapter, PlainPipeline):
        check_plain_dataset(dataset)  # text-to-image only: pipe(...) takes no source images
    count = len(dataset) if eval_config.max_prompts is None else min(len(dataset), eval_config.max_prompts)
    rank, world = shard
    per_prompt = eval_config.samples_per_prompt
    items = [(i, j) for i in range(count) for j in range(per_prompt)][rank::world]
    indices = [i for i, _ in items]
    sampler = ode_sampler(eval_config)
    size = height_width(resolution)
    images, scores = [], defaultdict(list)
    generator = torch.Generator()

    def noise(i: int, j: int) -> Tensor:
        generator.manual_seed(seed * 1_000_003 + i)
        for _ in range(j):
            adapter.initial_noise(1, *size, generator=generator)
        return adapter.initial_noise(1, *size, generator=generator)

    batches = [items[i : i + eval_config.batch_size] for i in range(0, len(items), eval_config.batch_size)]
    for batch_items in tqdm(batches, desc="evaluating", disable=not progress, leave=False):
        latents = torch.cat([noise(i, j) for i, j in batch_items])
        batch = [i for i, _ in batch_items]
        texts = [dataset.prompts[i] for i in batch]
        meta = [dict(dataset.metadata[i]) for i in batch]
        batch_images, sources = _sample(adapter, dataset, batch, latents, sampler, size, metadata=meta)
        for k, v in reward(batch_images, texts, meta, **sources).items():
            scores[k].append(v.float().cpu())
        kept = len(batch) if image_prompts is None else sum(i < image_prompts for i in batch)  # prompts ascend
        images.append(batch_images[:kept].cpu())
    largest = math.ceil(math.ceil(count * per_prompt / world) / eval_config.batch_size)
    for _ in range(len(batches), largest if equal_batches and count else 0):
        padding = adapter.initial_noise(1, *size, generator=generator.manual_seed(seed))
        _sample(adapter, dataset, [0], padding, sampler, size)
    empty = torch.zeros(0, 3, *size)
    return indices, torch.cat(images) if images else empty, {k: torch.cat(v) for k, v in scores.items()}


def _sample(
    adapter: PipelineAdapter | PlainPipeline,
    dataset: PromptDataset,
    batch: list[int],
    latents: Tensor,
    sampler: SamplerConfig,
    size: tuple[int, int],
    metadata: list[dict[str, Any]] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The images of prompts ``batch`` from ``latents`` at ``size`` = (height, width), and the reward's extra inputs
    (image editing: the sources): the ODE rollout, or ``pipe(...)`` for a :class:`PlainPipeline`."""
    texts = [dataset.prompts[i] for i in batch]
    height, width = size
    if isinstance(adapter, PlainPipeline):
        steps, scale = sampler.num_steps, sampler.guidance_scale
        images = adapter.images(texts, latents, height=height, width=width, num_steps=steps, guidance_scale=scale)
        return images, {}
    traj = rollout(
        adapter,
        texts,
        list(batch),
        sampler,
        range(0, 0),
        height=height,
        width=width,
        initial_latents=latents,
        metadata=metadata,
        sources=dataset.sources_of(batch),
    )
    return traj.images, {} if traj.source_images is None else {"source_images": traj.source_images}  # image editing


GRID_IMAGES = 64  # an evaluation report's grid: the first prompts' images, all k of each (eval.json has every score)


def grid_prompts(samples_per_prompt: int) -> int:
    """How many prompts, from the first, a report's grid shows with ``samples_per_prompt`` images each: as many as
    fit in ``GRID_IMAGES``, at least one."""
    return max(1, GRID_IMAGES // samples_per_prompt)


def shard_order(lengths: list[int]) -> list[tuple[int, int]]:
    """``(rank, j)`` of every image in the unsharded evaluation's order, given each rank's image count:
    :func:`evaluate_shard` deals image n of the full list to rank ``n % world`` as that rank's j-th, j = ``n // world``.
    """
    world, total = len(lengths), sum(lengths)
    if any(length != len(range(rank, total, world)) for rank, length in enumerate(lengths)):
        raise ValueError(f"shard sizes {lengths} are not a round-robin deal of {total} images over {world} processes")
    return [(n % world, n // world) for n in range(total)]


def merge_shards(
    parts: list[tuple[list[int], Tensor, dict[str, Tensor]]], image_prompts: int | None = None
) -> tuple[list[int], Tensor, dict[str, Tensor]]:
    """The processes' :func:`evaluate_shard` results, in rank order, as one evaluation's: the prompt index and
    scores of every image in the unsharded order, and the images the shards kept (``image_prompts``: theirs)."""
    order = shard_order([len(indices) for indices, _, _ in parts])
    indices = [parts[r][0][j] for r, j in order]
    scores = {k: torch.stack([parts[r][2][k][j] for r, j in order]) for k in parts[0][2]}
    # A shard keeps the images of the first prompts: the first of its list, so j indexes them too.
    kept = [parts[r][1][j] for r, j in order if image_prompts is None or parts[r][0][j] < image_prompts]
    return indices, torch.stack(kept) if kept else torch.zeros(0), scores


def summarize(dataset: PromptDataset, indices: list[int], scores: dict[str, Tensor]) -> dict[str, float]:
    """``{reward: mean}`` plus ``"{reward}/tag/{tag}"`` means when the prompts' metadata carry a ``tag``.

    A trained score (``total``, each reward's own key) that is NaN makes its mean NaN: a failed reward shows. A
    logged sub-score (``reward/sub``, e.g. GenEval's per-tag accuracies) is NaN where it does not apply to an
    image, so its mean is over the images it applies to."""

    def mean(key: str, values: Tensor) -> float:
        return (values.nanmean() if "/" in key else values.mean()).item()

    summary = {k: mean(k, v) for k, v in scores.items()}
    for tag, mask in _tag_masks(dataset, indices).items():
        for k, v in scores.items():
            summary[f"{k}/tag/{tag}"] = mean(k, v[mask])
    summary.update(pass_at_k(dataset, indices, scores))
    return summary


def _tag_masks(dataset: PromptDataset, indices: list[int]) -> dict[str, Tensor]:
    """``{tag: boolean mask over indices}`` for the tags the prompts' metadata carry, sorted by tag."""
    tags = [dataset.metadata[i].get("tag") for i in indices]
    return {tag: torch.tensor([t == tag for t in tags]) for tag in sorted({t for t in tags if t is not None})}


def pass_at_k(dataset: PromptDataset, indices: list[int], scores: dict[str, Tensor]) -> dict[str, float]:
    """With k > 1 images of every prompt (``eval.samples_per_prompt``): for each accuracy (a sub-score whose name
    has "accuracy" in it, 0 or 1 per image: ``shapes/accuracy/exact``, ``geneval/accuracy``, ...) the share of prompts
    with at least one of their k images right, as ``{key}/pass@k`` and per tag ``{key}/pass@k/tag/{tag}``: how much
    better the model can do than its mean, the headroom a reward-driven fine-tune can sharpen into. NaN (a score
    that does not apply to an image, e.g. GenEval's per-tag accuracies) is skipped as in :func:`summarize`; a prompt
    whose images all lack it does not count. Nothing for k = 1 (it equals the mean)."""
    prompts = sorted(set(indices))
    position = {i: n for n, i in enumerate(prompts)}
    rows = torch.tensor([position[i] for i in indices], dtype=torch.long)
    counts = torch.bincount(rows)
    k = int(counts[0]) if len(counts) else 0
    if k < 2 or bool((counts != k).any()):
        return {}
    masks = _tag_masks(dataset, prompts)
    out = {}
    for key, values in scores.items():
        if "/" not in key or "accuracy" not in key:
            continue
        filled = values.float().nan_to_num(nan=-math.inf)
        right = torch.zeros(len(prompts)).scatter_reduce(0, rows, filled, "amax", include_self=False)
        right[right == -math.inf] = math.nan
        out[f"{key}/pass@{k}"] = right.nanmean().item()
        for tag, mask in masks.items():
            out[f"{key}/pass@{k}/tag/{tag}"] = right[mask].nanmean().item()
    return out


def evaluate(
    adapter: PipelineAdapter | PlainPipeline,
    dataset: PromptDataset,
    reward: Any,
    eval_config: EvalConfig,
    **options: Any,
) -> tuple[dict[str, float], Tensor, list[str], dict[str, Tensor]]:
    """:func:`evaluate_shard` then :func:`summarize`: (summary, images, prompts, scores); same options."""
    indices, images, scores = evaluate_shard(adapter, dataset, reward, eval_config, **options)
    return summarize(dataset, indices, scores), images, [dataset.prompts[i] for i in indices], scores


FILMSTRIP_FRAMES = 8  # frames of each clip a grid cell shows, evenly spaced (first and last included)
GIF_FPS = 8  # frame rate of the animated previews (Flow-GRPO's Wan previews: fps 8)


def filmstrips(videos: Tensor, max_frames: int = FILMSTRIP_FRAMES) -> Tensor:
    """Clips ``[N, F, 3, H, W]`` -> ``[N, 3, H, k·W]``: ``k = min(F, max_frames)`` evenly spaced frames side by side."""
    n, f, c, h, w = videos.shape
    index = torch.linspace(0, f - 1, min(f, max_frames)).round().long()
    return videos[:, index].permute(0, 2, 3, 1, 4).reshape(n, c, h, len(index) * w)


def image_grid(
    images: Tensor, captions: list[str], columns: int | None = None, caption_height: int = 14
) -> Image.Image:
    """A PIL grid of ``[N, 3, H, W]`` images in [0, 1], each with a one-line caption underneath. Clips
    ``[N, F, 3, H, W]`` (video models) become a frame grid: each cell a filmstrip of up to ``FILMSTRIP_FRAMES``
    frames (:func:`filmstrips`)."""
    scale = max(1, 96 // images.shape[-1])  # small images (32 px) are enlarged, so that captions fit under them
    if scale > 1:
        flat = torch.nn.functional.interpolate(images.float().flatten(0, -4), scale_factor=scale, mode="nearest")
        images = flat.reshape(*images.shape[:-2], *flat.shape[-2:])
    if images.ndim == 5:
        images = filmstrips(images)
    n, _, h, w = images.shape
    columns = columns or max(1, math.ceil(math.sqrt(n)))
    rows = math.ceil(n / columns)
    grid = Image.new("RGB", (columns * w, rows * (h + caption_height)), "white")
    draw = ImageDraw.Draw(grid)
    pixels = (images.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).numpy()
    for i in range(n):
        x, y = (i % columns) * w, (i // columns) * (h + caption_height)
        grid.paste(Image.fromarray(pixels[i]), (x, y))
        draw.text((x + 1, y + h + 1), captions[i][: max(4, w // 6)], fill="black")
    return grid


def write_gif(
    videos: Tensor, captions: list[str], path: Path, *, columns: int | None = None, fps: int = GIF_FPS
) -> Path:
    """An animated GIF (PIL) of clips ``[N, F, 3, H, W]`` in [0, 1] laid out as :func:`image_grid`: its frame ``f`` is
    the captioned grid of every clip's frame ``f``; it loops forever at ``fps`` frames per second."""
    frames = [image_grid(videos[:, f], captions, columns) for f in range(videos.shape[1])]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)
    return Path(path)


def write_report(
    folder: Path,
    summary: dict[str, float],
    images: Tensor,
    prompts: list[str],
    scores: dict[str, Tensor],
    *,
    name: str = "eval",
) -> None:
    """``{name}.json`` (means and per-image scores) and ``{name}.png`` (a grid of ``images``, which may be
    the first few of ``prompts`` only) in ``folder``. Clips ``[N, F, 3, H, W]`` (video models): the PNG is a frame
    grid (filmstrips) and ``{name}.gif`` an animated preview of the same clips."""
    folder.mkdir(parents=True, exist_ok=True)
    per_image = [{"prompt": p, **{k: float(v[i]) for k, v in scores.items()}} for i, p in enumerate(prompts)]
    (folder / f"{name}.json").write_text(json.dumps({"summary": summary, "images": per_image}, indent=2))
    total = scores.get("total")
    captions = [f"{float(total[i]):.3g} {p}" if total is not None else p for i, p in enumerate(prompts)]
    if len(images):
        image_grid(images, captions[: len(images)]).save(folder / f"{name}.png")
    if len(images) and images.ndim == 5:
        write_gif(images, captions[: len(images)], folder / f"{name}.gif")
