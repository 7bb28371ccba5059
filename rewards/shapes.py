"""The "shapes" task: a GenEval-style grammar of prompts about coloured shapes, and its rule-based verifier.

A miniature of Flow-GRPO's GenEval experiment that a CPU can train on: images show 1-3 filled circles,
squares or triangles in four saturated colours on white. Prompts come in GenEval's six kinds (``tag``):

    single_object   "a circle"                              one object, any colour
    colors          "a red circle"
    counting        "three blue squares"                    two or three objects of one colour and shape
    two_object      "a circle and a square"                 any colours
    color_attr      "a red square and a green circle"       colour bound to the right shape
    position        "a yellow circle left of a blue square" left of | right of | above | below

The verifier segments the image against the palette (nearest colour within ``max_color_distance``),
labels connected components, classifies each by where its centroid lies in its bounding box (an upright
triangle's 2/3 down) and how much of the box it fills (square ~1, circle ~pi/4), and checks counts, colours and the
relation of centroids. Scores:

    total                   partial credit in [0, 1] (the training signal): mean of per-object count credit
                            (and the relation), times 1 / (1 + extra objects); with ``count_weight`` w > 0,
                            (1 - w) x that + w x the mean count credit per named colour and in all (any shape)
    accuracy/exact          1 if every object, count, colour and the relation are right and nothing extra
    accuracy/color_count    1 if the number of objects of each named colour (and in all) is right,
                            ignoring shapes and position (the "colour+count" measure)

The image rendering and the dataset live in ``flowgrpo.shapes``; this module has no model code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import ndimage
from torch import Tensor

from .base import BaseReward
from .registry import register_reward

BACKGROUND: tuple[int, int, int] = (255, 255, 255)
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (40, 70, 220),
    "yellow": (235, 200, 30),
}
COLORS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
TAGS: tuple[str, ...] = ("single_object", "colors", "counting", "two_object", "color_attr", "position")
NUMBERS: dict[int, str] = {2: "two", 3: "three"}


class PromptGrammarError(ValueError):
    """A prompt outside the shapes task's grammar."""


@dataclass(frozen=True)
class ObjectSpec:
    """``count`` objects of ``shape``, all of ``color`` (``None``: any colour)."""

    count: int
    shape: str
    color: str | None = None


@dataclass(frozen=True)
class SceneSpec:
    """What a prompt asks for: its objects and, for ``position``, how the first relates to the second."""

    tag: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None

    @property
    def prompt(self) -> str:
        return prompt_of(self)


def _noun(obj: ObjectSpec) -> str:
    words = ([obj.color] if obj.color else []) + [obj.shape + ("s" if obj.count > 1 else "")]
    return (NUMBERS[obj.count] if obj.count > 1 else "a") + " " + " ".join(words)


def prompt_of(spec: SceneSpec) -> str:
    """The prompt text of a scene spec (the inverse of :func:`parse_prompt`)."""
    first = _noun(spec.objects[0])
    if spec.relation is not None:
        return f"{first} {spec.relation} {_noun(spec.objects[1])}"
    if len(spec.objects) == 2:
        return f"{first} and {_noun(spec.objects[1])}"
    return first


_COLOR = "|".join(COLORS)
_SHAPE = "|".join(SHAPES)
_OBJECT = rf"(a|two|three) (?:({_COLOR}) )?({_SHAPE})(s?)"
_RELATION = "|".join(RELATIONS)
_PROMPT = re.compile(rf"{_OBJECT}(?: (and|{_RELATION}) {_OBJECT})?")


def _object(article: str, color: str | None, shape: str, plural: str, prompt: str) -> ObjectSpec:
    count = {"a": 1, "two": 2, "three": 3}[article]
    if (count > 1) != (plural == "s"):
        raise PromptGrammarError(f"shapes: {prompt!r}: number and plural disagree ('{article} ... {shape}{plural}')")
    return ObjectSpec(count, shape, color)


def parse_prompt(prompt: str) -> SceneSpec:
    """The :class:`SceneSpec` of a prompt of the grammar; ``PromptGrammarError`` naming it otherwise."""
    match = _PROMPT.fullmatch(prompt.strip().lower())
    if match is None:
        raise PromptGrammarError(
            f"shapes: prompt {prompt!r} is outside the task's grammar (e.g. 'a red circle', 'three blue squares', "
            f"'a red square and a green circle', 'a yellow circle left of a blue square'; colours {', '.join(COLORS)}, "
            f"shapes {', '.join(SHAPES)})"
        )
    g = match.groups()
    first = _object(g[0], g[1], g[2], g[3], prompt)
    if g[4] is None:
        if first.count > 1:
            if first.color is None:
                raise PromptGrammarError(f"shapes: {prompt!r}: counting prompts name a colour ('two red circles')")
            return SceneSpec("counting", (first,))
        return SceneSpec("colors" if first.color else "single_object", (first,))
    second = _object(g[5], g[6], g[7], g[8], prompt)
    if first.count > 1 or second.count > 1:
        raise PromptGrammarError(f"shapes: {prompt!r}: two-object prompts name one of each ('a circle and a square')")
    if (first.color is None) != (second.color is None):
        raise PromptGrammarError(f"shapes: {prompt!r}: name a colour for both objects or for neither")
    if g[4] == "and":
        return SceneSpec("color_attr" if first.color else "two_object", (first, second))
    if first.color is None or first.color == second.color:
        raise PromptGrammarError(f"shapes: {prompt!r}: position prompts name two different colours")
    return SceneSpec("position", (first, second), relation=g[4])


# --------------------------------------------------------------------------- detection


@dataclass(frozen=True)
class Detection:
    """One connected region of a palette colour: its class, size and centroid (x right, y down, pixels)."""

    color: str
    shape: str
    area: int
    cx: float
    cy: float
    fill: float  # area / bounding-box area
    centroid_height: float  # centroid's height in its bounding box, from the top: 0.5 symmetric, 2/3 triangle


def classify_shape(fill: float, centroid_height: float) -> str:
    """An upright triangle's centroid lies 2/3 down its box (0.58-0.64 rendered and blurred); a square fills its
    box (>= 0.88 blurred), a circle pi/4 of it (0.68-0.76). Measured on renders blurred by sigma <= 1 pixel."""
    if centroid_height >= 0.56:
        return "triangle"
    return "square" if fill >= 0.85 else "circle"


def detect_objects(image: np.ndarray, *, max_color_distance: float = 0.35, min_area: int = 12) -> list[Detection]:
    """Objects in an ``(H, W, 3)`` image in [0, 1]: palette segmentation, then 4-connected components.

    A pixel takes the nearest of background and palette colours if it lies within ``max_color_distance``
    (Euclidean, RGB in [0, 1]) of it, else none; components smaller than ``min_area`` pixels are dropped
    (anti-aliased edges and speckle). ``min_area`` suits 32x32 images with ~10-pixel shapes.
    """
    references = np.array([BACKGROUND, *PALETTE.values()], dtype=np.float32) / 255.0
    distance = np.linalg.norm(image[:, :, None, :].astype(np.float32) - references[None, None], axis=-1)
    nearest = distance.argmin(axis=-1)
    nearest[distance.min(axis=-1) > max_color_distance] = 0
    found: list[Detection] = []
    for index, color in enumerate(COLORS, start=1):
        labels, count = ndimage.label(nearest == index)
        for region, box in enumerate(ndimage.find_objects(labels), start=1):
            mask = labels[box] == region
            area = int(mask.sum())
            if area < min_area:
                continue
            fill = area / mask.size
            ys, xs = np.nonzero(mask)
            height = (ys.mean() + 0.5) / mask.shape[0]
            found.append(
                Detection(
                    color,
                    classify_shape(fill, height),
                    area,
                    float(xs.mean() + box[1].start),
                    float(ys.mean() + box[0].start),
                    fill,
                    height,
                )
            )
    return found


def relation_holds(a: Detection, b: Detection, relation: str, margin: float = 3.0) -> bool:
    """Centroid of ``a`` at least ``margin`` pixels to the left of / right of / above / below ``b``'s."""
    dx, dy = b.cx - a.cx, b.cy - a.cy
    return {"left of": dx > margin, "right of": -dx > margin, "above": dy > margin, "below": -dy > margin}[relation]


@dataclass(frozen=True)
class Verdict:
    partial: float
    exact: bool
    color_count: bool


def judge(spec: SceneSpec, found: list[Detection], count_weight: float = 0.0) -> Verdict:
    """Score detections against a scene spec (see the module docstring for the three measures).

    ``count_weight`` in [0, 1] mixes into the partial credit how well the counts alone are met (per named
    colour over any shape, and in all), so that a sample with the right number of blobs of each colour but
    misread shapes earns part of the credit (the colour+count measure, made dense).
    """
    matches = [
        [d for d in found if d.shape == o.shape and (o.color is None or d.color == o.color)] for o in spec.objects
    ]
    pairs = list(zip(matches, spec.objects, strict=True))
    credits = [_count_credit(len(m), o.count) for m, o in pairs]
    exact_counts = all(len(m) == o.count for m, o in pairs)
    relation_ok = True
    if spec.relation is not None:
        relation_ok = exact_counts and relation_holds(matches[0][0], matches[1][0], spec.relation)
        credits.append(float(relation_ok))
    wanted = sum(o.count for o in spec.objects)
    matched = len({id(d) for m in matches for d in m})
    extra = len(found) - matched
    partial = sum(credits) / len(credits) / (1 + extra)
    colored = [(sum(d.color == o.color for d in found), o.count) for o in spec.objects if o.color is not None]
    color_count = len(found) == wanted and all(n == count for n, count in colored)
    if count_weight:
        counts = [_count_credit(n, count) for n, count in colored]
        counts.append(_count_credit(len(found), wanted))
        partial = (1 - count_weight) * partial + count_weight * sum(counts) / len(counts)
    return Verdict(partial, exact_counts and relation_ok and extra == 0, color_count)


def _count_credit(found: int, wanted: int) -> float:
    """1 for the right count, falling linearly to 0 at ``found`` = 0 or 2 x ``wanted``."""
    return 1.0 - min(abs(found - wanted), wanted) / wanted


@register_reward("shapes")
class ShapesReward(BaseReward):
    """Rule-based verifier of the shapes task (module docstring): partial credit as ``total``, plus accuracies.

    ``check_prompts(prompts)`` raises :class:`PromptGrammarError` for a prompt outside the grammar; the
    trainer calls it on the prompt files at start-up, before any work.
    """

    def __init__(
        self, *, max_color_distance: float = 0.35, min_area: int = 12, count_weight: float = 0.0, **options: Any
    ) -> None:
        super().__init__(**options)
        if not 0.0 <= count_weight <= 1.0:
            raise ValueError(f"rewards.shapes: count_weight must lie in [0, 1]; got {count_weight!r}")
        self.max_color_distance = max_color_distance
        self.min_area = min_area
        self.count_weight = count_weight

    def check_prompts(self, prompts: list[str]) -> None:
        for prompt in prompts:
            parse_prompt(prompt)

    def verdicts(self, images: Tensor, prompts: list[str]) -> list[Verdict]:
        pixels = images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
        return [
            judge(
                parse_prompt(p),
                detect_objects(x, max_color_distance=self.max_color_distance, min_area=self.min_area),
                self.count_weight,
            )
            for x, p in zip(pixels, prompts, strict=True)
        ]

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> dict[str, list[float]]:
        verdicts = self.verdicts(images, prompts)
        return {
            "total": [v.partial for v in verdicts],
            "accuracy/exact": [float(v.exact) for v in verdicts],
            "accuracy/color_count": [float(v.color_count) for v in verdicts],
        }
