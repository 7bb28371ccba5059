"""The shapes dataset: every prompt of the grammar, a held-out split, and seeded anti-aliased renders.

The grammar and the verifier are in ``rewards.shapes``. Here:

- :func:`all_specs` enumerates the 549 prompts (3 single-object, 12 colour, 24 counting, 6 two-object,
  72 colour-attribution, 432 position prompts); :func:`split` holds out about a quarter of each tag's
  *combinations* (a prompt is test or train, never both), fixed by a hash, so neither pretraining nor RL
  ever sees a test prompt.
- :func:`render` draws a scene at 32x32: each object fills a 12x12 box whose corner lies on a 4-pixel
  grid (the transformer's patch size, so a shape spans exactly 3x3 patches), inset by one pixel, drawn
  at 4x resolution and box-filtered down (anti-aliased edges, as a model draws them).
- :func:`sample_scene` lays out a spec at random (non-overlapping boxes; the position relation holds
  with at least 8 pixels to spare), deterministic in its ``numpy`` generator.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from rewards.shapes import COLORS, PALETTE, RELATIONS, SHAPES, TAGS, ObjectSpec, SceneSpec, parse_prompt

RESOLUTION = 32
BOX = 12  # object box side, pixels
GRID = 4  # box corners lie on this grid (the transformer's patch size)
SUPERSAMPLE = 4
TEST_FRACTION = 0.25


def all_specs() -> list[SceneSpec]:
    """Every prompt of the grammar, in a fixed order."""
    colored = [(s, c) for c in COLORS for s in SHAPES]
    specs = [SceneSpec("single_object", (ObjectSpec(1, s),)) for s in SHAPES]
    specs += [SceneSpec("colors", (ObjectSpec(1, s, c),)) for s, c in colored]
    specs += [SceneSpec("counting", (ObjectSpec(n, s, c),)) for n in (2, 3) for s, c in colored]
    pairs = itertools.permutations(SHAPES, 2)
    specs += [SceneSpec("two_object", (ObjectSpec(1, a), ObjectSpec(1, b))) for a, b in pairs]
    specs += [
        SceneSpec("color_attr", (ObjectSpec(1, s1, c1), ObjectSpec(1, s2, c2)))
        for (s1, c1), (s2, c2) in itertools.permutations(colored, 2)
        if s1 != s2 and c1 != c2
    ]
    specs += [
        SceneSpec("position", (ObjectSpec(1, s1, c1), ObjectSpec(1, s2, c2)), r)
        for r in RELATIONS
        for (s1, c1), (s2, c2) in itertools.permutations(colored, 2)
        if c1 != c2
    ]
    return specs


def is_test_prompt(prompt: str) -> bool:
    """Held out (never trained on) if the prompt's hash falls in the first quarter; ``split`` guarantees one per tag."""
    digest = int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < TEST_FRACTION


def split() -> tuple[list[SceneSpec], list[SceneSpec]]:
    """(train, test) specs: disjoint prompts, every tag on both sides."""
    specs = all_specs()
    train, test = [s for s in specs if not is_test_prompt(s.prompt)], [s for s in specs if is_test_prompt(s.prompt)]
    for tag in TAGS:  # a tag too small for the hash to pick a test prompt gives up its last one
        if not any(s.tag == tag for s in test):
            moved = [s for s in train if s.tag == tag][-1]
            train.remove(moved)
            test.append(moved)
    return train, test


@dataclass(frozen=True)
class PlacedObject:
    shape: str
    color: str
    x: int  # box corner, pixels
    y: int


def _boxes_overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return abs(a[0] - b[0]) < BOX and abs(a[1] - b[1]) < BOX


def _relation_ok(a: tuple[int, int], b: tuple[int, int], relation: str, spare: int = 8) -> bool:
    dx, dy = b[0] - a[0], b[1] - a[1]
    return {"left of": dx >= spare, "right of": -dx >= spare, "above": dy >= spare, "below": -dy >= spare}[relation]


def sample_scene(spec: SceneSpec, rng: np.random.Generator) -> list[PlacedObject]:
    """A random layout of ``spec``: colourless objects get a random palette colour each."""
    wanted = [(o.shape, o.color) for o in spec.objects for _ in range(o.count)]
    corners = np.arange(0, RESOLUTION - BOX + 1, GRID)
    while True:  # rejection sampling: at most three boxes in a 6x6 grid of corners, accepted within a few tries
        boxes = [(int(rng.choice(corners)), int(rng.choice(corners))) for _ in wanted]
        if any(_boxes_overlap(a, b) for a, b in itertools.combinations(boxes, 2)):
            continue
        if spec.relation is not None and not _relation_ok(boxes[0], boxes[1], spec.relation):
            continue
        colors = [c if c is not None else COLORS[int(rng.integers(len(COLORS)))] for _, c in wanted]
        if spec.tag == "two_object" and colors[0] == colors[1]:
            continue  # keep "any colour" distinct objects apart for the verifier's connected components
        return [PlacedObject(s, c, x, y) for (s, _), c, (x, y) in zip(wanted, colors, boxes, strict=True)]


def render(objects: list[PlacedObject], resolution: int = RESOLUTION) -> np.ndarray:
    """``(H, W, 3)`` float32 in [0, 1]: the objects on white, anti-aliased by 4x supersampling."""
    k = SUPERSAMPLE
    canvas = Image.new("RGB", (resolution * k, resolution * k), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for o in objects:
        x0, y0, x1, y1 = (o.x + 1) * k, (o.y + 1) * k, (o.x + BOX - 1) * k - 1, (o.y + BOX - 1) * k - 1
        fill = PALETTE[o.color]
        if o.shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif o.shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    small = canvas.resize((resolution, resolution), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.float32) / 255.0


def render_prompt(prompt: str, rng: np.random.Generator) -> np.ndarray:
    """A ground-truth image of a prompt of the grammar."""
    return render(sample_scene(parse_prompt(prompt), rng))


def balanced_prompts(specs: list[SceneSpec], per_tag: int, seed: int) -> list[SceneSpec]:
    """``per_tag`` specs of each tag present (cycling through its shuffled specs when it has fewer), in tag order."""
    rng = np.random.default_rng(seed)
    out: list[SceneSpec] = []
    for tag in TAGS:
        pool = [s for s in specs if s.tag == tag]
        if not pool:
            continue
        order = rng.permutation(len(pool))
        out += [pool[order[i % len(pool)]] for i in range(per_tag)]
    return out


def round_robin(specs: list[SceneSpec]) -> list[SceneSpec]:
    """Interleave the tags (one of each in turn), so that the first lines of a file, which image grids show,
    cover every tag."""
    by_tag = [[s for s in specs if s.tag == tag] for tag in TAGS]
    return [s for row in itertools.zip_longest(*by_tag) for s in row if s is not None]


def write_prompt_file(path: str | Path, specs: list[SceneSpec]) -> None:
    """A ``.jsonl`` prompt file (``{"prompt", "tag"}`` per line) for ``data.train`` / ``data.test``."""
    lines = [json.dumps({"prompt": s.prompt, "tag": s.tag}) for s in specs]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
