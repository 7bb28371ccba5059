"""GenEval (https://arxiv.org/abs/2310.11513) as an in-process reward: detector + CLIP colour + GenEval's rules.

Metadata per sample is GenEval's (one line of its ``evaluation_metadata.jsonl``; ``scripts/make_prompts.py geneval``
writes such files)::

    {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                    {"class": "dog", "count": 1, "position": ["right of", 0]}]}
    {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}]}

``include`` clauses hold ``class`` (one of :data:`CLASSES`), ``count``, and optionally ``color`` (one of :data:`COLORS`)
or ``position`` = ``[relation, index of an earlier clause]``; ``exclude`` clauses say "fewer than ``count``".

The rules, from djghosh13/geneval ``evaluation/evaluate_images.py`` and yifan123/reward-server
``reward_server/gen_eval.py`` (Flow-GRPO's GenEval server):

- Detections of a class are kept when their score is **> 0.3** (**> 0.9** for the ``counting`` tag), at most 16 per
  class, highest score first; GenEval's NMS is off (``max_overlap`` 1.0) but available.
- Colour: each object is pasted on grey ``#999`` through its mask, cropped to its box, and classified by CLIP
  (open_clip ViT-L-14 / openai) zero-shot among 10 colours with the prompts "a photo of a {c} {class}",
  "a photo of a {c}-colored {class}", "a photo of a {c} object" (per-prompt unit embeddings, averaged, renormalised).
- Position of A relative to B from boxes: ``offset = centre_A - centre_B``, shrunk towards 0 per axis by
  ``0.1 x (size_A + size_B)``; A is "left of" B when the shrunk x offset is below ``-0.5 x |offset|`` (likewise
  right of / above / below, y down); no relation when both shrunk offsets are ~0.

Scores (keys as returned when called alone; through ``build_reward`` they become ``geneval``,
``geneval/strict_accuracy``, ...; the names of Flow-GRPO's logs and of ``remote`` with ``protocol: flowgrpo``):

    total      Flow-GRPO's training signal (the server's ``scores``): per include clause ``1 - |count - found|/count``
               over all kept detections, then colour ``1 - |count - n_right_colour|/count`` when the count is exact
               (0 when it is not), then position 1 if every pair holds; averaged. Kept as the server computes it:
               a count far above the asked one scores below 0 (3 benches for "a bench": -1), a failed position
               appends 0 **and** 1 (3 clauses of 1 and a failed relation score 0.75, not 2/3), exclude clauses are
               ignored.
    strict_accuracy        Flow-GRPO's ``strict_rewards``: 1 if every count is exact and every colour and relation
                           holds.
    accuracy               GenEval's own verdict (its benchmark number): counts are "at least", colours and relations
                           checked on the ``count`` most confident objects, and no exclude clause may be met.
    <tag>_strict_accuracy, <tag>_accuracy
                           (``per_tag``, for each of the six tags) the same, NaN for images of another tag, so the
                           training log's mean over finite values is the tag's accuracy. The keys are the same in
                           every batch (processes gather them by name).

How the scores may differ from GenEval's mmdet original, and why:

- **Detector weights and code.** GenEval uses mmdetection 2.x ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco``
  (OpenMMLab's training run, mmcv's CUDA deformable attention). The default here,
  ``facebook/mask2former-swin-small-coco-instance``, is the same architecture and recipe (Swin-S, COCO instance,
  LSJ, 50 epochs) trained by the Mask2Former authors (Detectron2) and run by transformers' PyTorch implementation.
  Different weights mean different score calibration: the 0.3 / 0.9 thresholds were chosen for mmdet's scores, so
  counts near the threshold (the ``counting`` tag above all) can differ. The size of the gap has not been measured
  here (it needs both models on the same images); compare the two on your own samples before quoting GenEval
  numbers from this reward, and expect agreement per tag, not per image.
- **Post-processing** is mmdet's (``MaskFormerFusionHead.instance_postprocess``): top 100 (query, class) pairs by
  softmax score, mask logits upsampled bilinearly to the padded input, cropped, upsampled to the image, binarised at
  0; score = class probability x mean sigmoid inside the mask; box = the mask's extent (x2 = last column + 1).
  The input is resized as mmdet's test pipeline does (short side 800, long side <= 1333, bilinear, ImageNet mean/std,
  padded to a multiple of 32), with torch's bilinear resize instead of OpenCV's.
- **Colour crops** are preprocessed by open_clip's resize + centre crop on tensors (bicubic, antialiased) rather than
  PIL on a ``uint8`` image, and CLIP runs in ``dtype`` (the reference runs it under fp16 autocast on CUDA).
- **QuickGELU.** GenEval's CLIP is open_clip ``ViT-L-14`` / ``openai``, which open_clip builds with QuickGELU. The tag
  ``openai`` gets it here too; so do a local ``clip_pretrained`` file and ``random_init``, which carry no tag to read
  it from: they are taken to be (the architecture of) OpenAI's weights. ``clip_quick_gelu: false`` keeps the
  architecture's GELU for a file of other weights (LAION, DataComp); ``true`` forces QuickGELU whatever the tag.
- **Flow-GRPO's server** receives JPEG-compressed images (PIL quality 75; ``jpeg_quality: 75`` reproduces that) and
  hands mmdet RGB arrays that mmdet's pipeline treats as BGR, so its detector sees red and blue swapped; we feed RGB,
  as GenEval's own evaluation does.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .base import ModelReward
from .clip_models import ClipScore, load_pretrained, seeded
from .registry import register_reward

# GenEval's object_names.txt: COCO's 80 thing classes in COCO order, with GenEval's wording for three of them.
CLASSES: tuple[str, ...] = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "computer mouse",
    "tv remote",
    "computer keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)
COLORS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COLOR_TEMPLATES: tuple[str, ...] = (
    "a photo of a {c} {cls}",
    "a photo of a {c}-colored {cls}",
    "a photo of a {c} object",
)

IMAGENET_MEAN = (123.675, 116.28, 103.53)  # mmdet's img_norm_cfg (0-255 scale), the Mask2Former configs' too
IMAGENET_STD = (58.395, 57.12, 57.375)


# ------------------------------------------------------------------------------------------------ rules


@dataclass(frozen=True)
class Detection:
    """One detected object: box ``(x1, y1, x2, y2)`` in pixels of the scored image, score, and its mask ``(H, W)``."""

    box: tuple[float, float, float, float]
    score: float
    mask: Tensor | None = field(default=None, compare=False, repr=False)


Objects = dict[str, list[Detection]]  # class -> kept detections, most confident first
ColorFn = Callable[[str, list[Detection]], list[str]]  # (class, objects) -> one colour name per object


@dataclass(frozen=True)
class Verdict:
    score: float  # Flow-GRPO's partial score
    strict: bool  # Flow-GRPO's strict_correct
    correct: bool  # GenEval's verdict


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """GenEval's ``compute_iou`` (pixel-inclusive areas: ``(x2 - x1 + 1) * (y2 - y1 + 1)``)."""

    def area(box: Sequence[float]) -> float:
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])])
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def select_objects(
    candidates: Mapping[str, Sequence[Detection]], *, threshold: float, max_objects: int = 16, max_overlap: float = 1.0
) -> Objects:
    """GenEval's per-class filter: score > ``threshold``, highest first, at most ``max_objects``, then greedy NMS
    dropping boxes with IoU >= ``max_overlap`` to a kept one (1.0: off, GenEval's default). Empty classes left out."""
    kept: Objects = {}
    for name, dets in candidates.items():
        scores = np.array([d.score for d in dets], dtype=np.float64)
        order = np.argsort(scores)[::-1]  # as GenEval: descending, ties in reverse index order
        order = order[scores[order] > threshold][:max_objects].tolist()
        chosen: list[Detection] = []
        while order:
            best = dets[order.pop(0)]
            chosen.append(best)
            if max_overlap < 1:
                order = [i for i in order if box_iou(best.box, dets[i].box) < max_overlap]
        if chosen:
            kept[name] = chosen
    return kept


def relative_position(a: Sequence[float], b: Sequence[float], threshold: float = 0.1) -> set[str]:
    """Relations of box ``a`` to box ``b`` (GenEval's ``relative_position``; y grows downwards)."""
    boxes = np.array([a[:4], b[:4]], dtype=np.float64).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - threshold * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def _relation_holds(found: list[Detection], targets: list[Detection], relation: str, threshold: float) -> bool:
    return all(relation in relative_position(o.box, t.box, threshold) for o in found for t in targets)


def geneval_correct(
    objects: Objects, metadata: Mapping[str, Any], colors: ColorFn, position_threshold: float = 0.1
) -> bool:
    """GenEval's ``evaluate``: include clauses ANDed (at least ``count``; colour and position on the ``count`` most
    confident), exclude clauses ORed (``count`` or more of the class fails)."""
    correct = True
    groups: list[list[Detection] | None] = []
    for req in metadata["include"]:
        name, count = req["class"], req["count"]
        found = objects.get(name, [])[:count]
        matched = len(found) >= count
        if matched and "color" in req:
            matched = colors(name, found).count(req["color"]) >= count
        if matched and "position" in req:
            relation, target = req["position"]
            targets = groups[target]
            matched = targets is not None and _relation_holds(found, targets, relation, position_threshold)
        correct &= matched
        groups.append(found if matched else None)
    for req in metadata.get("exclude", []):
        if len(objects.get(req["class"], [])) >= req["count"]:
            correct = False
    return correct


def flowgrpo_score(
    objects: Objects, metadata: Mapping[str, Any], colors: ColorFn, position_threshold: float = 0.1
) -> tuple[float, bool]:
    """Flow-GRPO's ``evaluate_reward``: (partial score, strict). Exact counts over all kept detections; the score
    keeps the server's quirks (negative count credit, 0 and 1 both appended for a failed relation)."""
    strict = True
    rewards: list[float] = []
    groups: list[list[Detection] | None] = []
    for req in metadata["include"]:
        name, count = req["class"], req["count"]
        found = objects.get(name, [])
        matched = True
        rewards.append(1 - abs(count - len(found)) / count)
        if len(found) != count:
            strict = matched = False
            if "color" in req or "position" in req:
                rewards.append(0.0)
        else:
            if "color" in req:
                right = colors(name, found).count(req["color"])
                rewards.append(1 - abs(count - right) / count)
                if right != count:
                    strict = matched = False
            if "position" in req and matched:
                relation, target = req["position"]
                if groups[target] is None:
                    strict = matched = False
                    rewards.append(0.0)
                else:
                    if not _relation_holds(found, groups[target], relation, position_threshold):
                        strict = matched = False
                        rewards.append(0.0)
                    rewards.append(1.0)  # the server appends it after the loop, failed or not
        groups.append(found if matched else None)
    return (sum(rewards) / len(rewards) if rewards else 0.0), strict


def judge(objects: Objects, metadata: Mapping[str, Any], colors: ColorFn, position_threshold: float = 0.1) -> Verdict:
    """All three measures of one image's kept detections against its metadata."""
    score, strict = flowgrpo_score(objects, metadata, colors, position_threshold)
    return Verdict(score, strict, geneval_correct(objects, metadata, colors, position_threshold))


def check_metadata(metadata: Mapping[str, Any], classes: Sequence[str] = CLASSES) -> None:
    """Raise ``ValueError`` saying what is wrong with one sample's GenEval metadata."""
    where = f"geneval metadata {dict(metadata)!r}"
    if not isinstance(metadata.get("tag"), str):
        raise ValueError(f"{where}: needs a 'tag' ({', '.join(TAGS)}); write prompt files with make_prompts.py geneval")
    include = metadata.get("include")
    if not isinstance(include, list) or not include:
        raise ValueError(f"{where}: needs a non-empty 'include' list of {{class, count[, color | position]}}")
    clauses = [("include", i, r) for i, r in enumerate(include)]
    clauses += [("exclude", i, r) for i, r in enumerate(metadata.get("exclude", []))]
    for kind, i, req in clauses:
        if not isinstance(req, Mapping) or req.get("class") not in classes:
            raise ValueError(f"{where}: {kind}[{i}] needs a 'class' the detector knows (e.g. {classes[0]!r})")
        count = req.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{where}: {kind}[{i}] needs an integer 'count' >= 1")
        if "color" in req and req["color"] not in COLORS:
            raise ValueError(f"{where}: {kind}[{i}] colour must be one of {', '.join(COLORS)}")
        if "position" in req:
            pos = req["position"]
            ok = isinstance(pos, (list, tuple)) and len(pos) == 2 and pos[0] in RELATIONS
            if not ok or isinstance(pos[1], bool) or not isinstance(pos[1], int) or not 0 <= pos[1] < i:
                raise ValueError(f"{where}: {kind}[{i}] position must be [relation, index of an earlier clause]")


# ------------------------------------------------------------------------------------------------ detector


def detector_input_size(height: int, width: int, short: int = 800, long: int = 1333) -> tuple[int, int]:
    """mmcv's ``imrescale`` with ``keep_ratio``: scale so the image fits ``short`` x ``long``, rounded half up."""
    scale = min(long / max(height, width), short / min(height, width))
    return int(height * scale + 0.5), int(width * scale + 0.5)


def mask_boxes(masks: Tensor) -> Tensor:
    """mmdet's ``mask2bbox``: ``(N, H, W)`` bool -> ``(N, 4)`` ``x1, y1, x2 + 1, y2 + 1``; zeros for empty masks."""
    boxes = torch.zeros(masks.shape[0], 4, device=masks.device)
    cols, rows = masks.any(dim=1), masks.any(dim=2)
    for i in range(masks.shape[0]):
        x, y = torch.nonzero(cols[i]).flatten(), torch.nonzero(rows[i]).flatten()
        if len(x) and len(y):
            boxes[i] = torch.stack([x[0], y[0], x[-1] + 1, y[-1] + 1]).float()
    return boxes


def instance_detections(
    class_logits: Tensor,
    mask_logits: Tensor,
    *,
    padded_size: tuple[int, int],
    resized_size: tuple[int, int],
    image_size: tuple[int, int],
    min_score: float = 0.0,
    max_per_image: int = 100,
) -> list[tuple[int, Detection]]:
    """mmdet's Mask2Former instance post-processing for one image: ``(label, Detection)`` pairs.

    ``class_logits`` ``(Q, C + 1)`` (last = no object), ``mask_logits`` ``(Q, h, w)`` at 1/4 of ``padded_size``.
    Pairs whose class probability is <= ``min_score`` are skipped before their masks are upsampled: their final score
    (class probability x mask score <= 1) could not pass a ``> min_score`` threshold anyway.
    """
    probs = class_logits.float().softmax(-1)[:, :-1]
    num_classes = probs.shape[1]
    top_scores, top = probs.flatten().topk(min(max_per_image, probs.numel()), sorted=False)
    keep = top_scores > min_score
    top_scores, top = top_scores[keep], top[keep]
    if not len(top):
        return []
    labels, queries = top % num_classes, top // num_classes
    masks = F.interpolate(mask_logits[queries][None].float(), size=padded_size, mode="bilinear", align_corners=False)
    masks = masks[:, :, : resized_size[0], : resized_size[1]]
    masks = F.interpolate(masks, size=image_size, mode="bilinear", align_corners=False)[0]
    binary = masks > 0
    mask_scores = (masks.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
    scores = (top_scores * mask_scores).tolist()
    boxes = mask_boxes(binary).tolist()
    return [
        (int(label), Detection(tuple(box), score, mask))
        for label, box, score, mask in zip(labels.tolist(), boxes, scores, binary, strict=True)
    ]


def _jpeg(images: Tensor, quality: int) -> Tensor:
    """Round-trip ``(B, 3, H, W)`` in [0, 1] through PIL JPEG at ``quality`` (Flow-GRPO's client compresses so)."""
    from PIL import Image

    out = []
    for image in (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy():
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
        out.append(torch.from_numpy(np.array(Image.open(buffer).convert("RGB"))))
    return torch.stack(out).permute(0, 3, 1, 2).to(images.device).float() / 255


class _ColorClip(ClipScore):
    """``clipscore``'s loader under geneval's option names (what its error messages call them)."""

    name = "geneval"
    option_names = {
        "pretrained": "clip_pretrained",
        "model": "clip_model",
        "model_config": "clip_config",
        "quick_gelu": "clip_quick_gelu",
    }


DETECTOR_EXPECTS = "a directory holding a Mask2Former model's config.json and model.safetensors (save_pretrained's)"


@register_reward("geneval")
class GenEvalReward(ModelReward):
    """GenEval's rules on Mask2Former (transformers) detections and open_clip colours (module docstring).

    ``detector``: hub id or local dir of a ``Mask2FormerForUniversalSegmentation`` COCO-instance model whose labels
    are COCO's 80 classes in COCO order (``class_names`` to use another label set). ``clip_model`` /
    ``clip_pretrained``: open_clip architecture and tag or local file; ``clip_quick_gelu``: null gives QuickGELU to
    the ``openai`` tag, a local file and ``random_init`` (GenEval's CLIP is OpenAI's; module docstring), false keeps
    the architecture's activation, true forces QuickGELU. ``random_init`` builds both with seeded random
    weights (``detector_config``: ``Mask2FormerConfig`` kwargs; ``clip_config``: open_clip ``CLIP`` kwargs) and
    downloads nothing. ``detector_size``: (short, long) input side limits. ``jpeg_quality``: score JPEG-compressed
    copies, as Flow-GRPO's server does (75); null: the pixels as given. ``per_tag``: the per-tag keys.
    """

    def __init__(
        self,
        *,
        detector: str = "facebook/mask2former-swin-small-coco-instance",
        clip_model: str = "ViT-L-14",
        clip_pretrained: str = "openai",
        detector_config: dict[str, Any] | None = None,
        clip_config: dict[str, Any] | None = None,
        clip_quick_gelu: bool | None = None,
        random_init: bool = False,
        seed: int = 0,
        local_files_only: bool = False,
        class_names: Sequence[str] | None = None,
        threshold: float = 0.3,
        counting_threshold: float = 0.9,
        max_objects: int = 16,
        max_overlap: float = 1.0,
        position_threshold: float = 0.1,
        max_per_image: int = 100,
        detector_size: Sequence[int] = (800, 1333),
        background: Sequence[int] = (153, 153, 153),
        jpeg_quality: int | None = None,
        per_tag: bool = True,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        batch_size: int | None = 8,
    ) -> None:
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        if len(detector_size) != 2 or min(detector_size) < 32:
            raise ValueError(f"geneval: detector_size must be (short, long) sides >= 32; got {detector_size!r}")
        if jpeg_quality is not None and not 1 <= jpeg_quality <= 95:
            raise ValueError(f"geneval: jpeg_quality must lie in 1..95 or be null; got {jpeg_quality!r}")
        from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation

        self.class_names = tuple(class_names) if class_names is not None else CLASSES
        where = "geneval: detector"
        if random_init:
            if detector_config is not None:
                cfg = Mask2FormerConfig(**detector_config)
            else:
                cfg = load_pretrained(
                    lambda ref: Mask2FormerConfig.from_pretrained(ref, local_files_only=local_files_only),
                    detector,
                    where=where,
                    expects=DETECTOR_EXPECTS,
                )
            with seeded(seed):
                net = Mask2FormerForUniversalSegmentation(cfg)
        else:
            net = load_pretrained(
                lambda ref: Mask2FormerForUniversalSegmentation.from_pretrained(ref, local_files_only=local_files_only),
                detector,
                where=where,
                expects=DETECTOR_EXPECTS,
            )
        if net.config.num_labels != len(self.class_names):
            raise ValueError(
                f"geneval: the detector has {net.config.num_labels} classes but class_names has "
                f"{len(self.class_names)}; use a COCO-instance model (80 classes) or class_names in its label order"
            )
        self.detector = self._setup_model(net)
        # The colour classifier: open_clip through clipscore's loader, open_clip's preprocessing (GenEval's), and
        # QuickGELU wherever no tag says otherwise (module docstring).
        quick_gelu = clip_quick_gelu
        if quick_gelu is None and (random_init or os.path.isfile(os.path.expanduser(clip_pretrained or ""))):
            quick_gelu = True
        self.clip = _ColorClip(
            pretrained=clip_pretrained,
            model=clip_model,
            model_config=clip_config,
            quick_gelu=quick_gelu,
            preprocessing="open_clip",
            random_init=random_init,
            seed=seed,
            device=device,
            dtype=dtype,
        )
        self.thresholds = (float(threshold), float(counting_threshold))
        self.max_objects, self.max_overlap = int(max_objects), float(max_overlap)
        self.position_threshold, self.max_per_image = float(position_threshold), int(max_per_image)
        self.detector_size = (int(min(detector_size)), int(max(detector_size)))
        self.background = torch.tensor([float(c) / 255 for c in background], device=self.device).view(3, 1, 1)
        self.jpeg_quality = jpeg_quality
        self.per_tag = bool(per_tag)
        self._color_text: dict[str, Tensor] = {}

    # ---------------------------------------------------------------- detection

    def _threshold(self, tag: str) -> float:
        return self.thresholds[1] if tag == "counting" else self.thresholds[0]

    def _prepare(self, images: Tensor) -> Tensor:
        """The pixels GenEval sees: quantised to 8 bits (it reads PNGs), JPEG-compressed if asked."""
        images = images.to(self.device).float()
        if self.jpeg_quality is not None:
            return _jpeg(images, self.jpeg_quality)
        return (images * 255).round() / 255

    def detect(self, images: Tensor, tags: Sequence[str]) -> list[Objects]:
        """Kept detections per image (``images`` as :meth:`_prepare` returns them; thresholds by each tag)."""
        height, width = images.shape[2:]
        resized = detector_input_size(height, width, *self.detector_size)
        x = images.float() * 255
        if resized != (height, width):
            x = F.interpolate(x, size=resized, mode="bilinear", align_corners=False)
        mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
        x = (x - mean) / std
        padded = (math.ceil(resized[0] / 32) * 32, math.ceil(resized[1] / 32) * 32)
        x = F.pad(x, (0, padded[1] - resized[1], 0, padded[0] - resized[0]))
        out = self.detector(pixel_values=x.to(self.dtype))
        results = []
        for cls_logits, mask_logits, tag in zip(out.class_queries_logits, out.masks_queries_logits, tags, strict=True):
            threshold = self._threshold(tag)
            pairs = instance_detections(
                cls_logits,
                mask_logits,
                padded_size=padded,
                resized_size=resized,
                image_size=(height, width),
                min_score=threshold,
                max_per_image=self.max_per_image,
            )
            candidates: dict[str, list[Detection]] = {}
            for label, det in pairs:
                candidates.setdefault(self.class_names[label], []).append(det)
            results.append(
                select_objects(
                    candidates, threshold=threshold, max_objects=self.max_objects, max_overlap=self.max_overlap
                )
            )
        return results

    # ---------------------------------------------------------------- colour

    def _color_classifier(self, name: str) -> Tensor:
        """``(D, 10)`` zero-shot weights for ``name`` (clip_benchmark's ``zero_shot_classifier``)."""
        if name not in self._color_text:
            weights = []
            for color in COLORS:
                texts = [t.format(c=color, cls=name) for t in COLOR_TEMPLATES]
                emb = self.clip.model.encode_text(self.clip.tokenizer(texts).to(self.device))
                emb = F.normalize(emb.float(), dim=-1).mean(0)
                weights.append(emb / emb.norm())
            self._color_text[name] = torch.stack(weights, dim=1)
        return self._color_text[name]

    def crops(self, image: Tensor, objects: Sequence[Detection]) -> Tensor:
        """CLIP inputs ``(n, 3, S, S)``: each object through its mask on grey, cropped to its box (GenEval's
        ``ImageCrops``)."""
        pixels = []
        for det in objects:
            x = image if det.mask is None else torch.where(det.mask.to(image.device), image, self.background)
            x1, y1, x2, y2 = (int(round(v)) for v in det.box)
            pixels.append(self.clip._pixels(x[None, :, y1:y2, x1:x2]))
        return torch.cat(pixels)

    def classify_colors(self, images: Tensor, requests: Sequence[tuple[int, str, list[Detection]]]) -> list[list[str]]:
        """The colour of every object of every ``(image index, class, objects)`` request, batched through CLIP."""
        if not requests:
            return []
        pixels = torch.cat([self.crops(images[i], dets) for i, _, dets in requests])
        feats = F.normalize(self.clip.model.encode_image(pixels).float(), dim=-1)
        out, start = [], 0
        for _, name, dets in requests:
            logits = feats[start : start + len(dets)] @ self._color_classifier(name)
            out.append([COLORS[k] for k in logits.argmax(1).tolist()])
            start += len(dets)
        return out

    # ---------------------------------------------------------------- scoring

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> dict[str, list[float]]:
        for meta in metadata:
            check_metadata(meta, self.class_names)
        pixels = self._prepare(images)
        objects = self.detect(pixels, [m["tag"] for m in metadata])
        # Every colour either rule can ask for: the `count` most confident objects of a class that has at least
        # `count` (GenEval looks at those; Flow-GRPO only when exactly `count`, the same objects).
        requests = {
            (i, req["class"], req["count"]): objects[i][req["class"]][: req["count"]]
            for i, meta in enumerate(metadata)
            for req in meta["include"]
            if "color" in req and len(objects[i].get(req["class"], [])) >= req["count"]
        }
        colors = self.classify_colors(pixels, [(i, name, dets) for (i, name, _), dets in requests.items()])
        found = dict(zip(requests, colors, strict=True))
        verdicts = [
            judge(objs, meta, lambda name, dets, i=i: found[(i, name, len(dets))], self.position_threshold)
            for i, (objs, meta) in enumerate(zip(objects, metadata, strict=True))
        ]
        scores = {
            "total": [v.score for v in verdicts],
            "strict_accuracy": [float(v.strict) for v in verdicts],
            "accuracy": [float(v.correct) for v in verdicts],
        }
        if self.per_tag:
            tags = [m["tag"] for m in metadata]
            for tag in TAGS:
                for key in ("strict_accuracy", "accuracy"):
                    scores[f"{tag}_{key}"] = [
                        v if t == tag else math.nan for v, t in zip(scores[key], tags, strict=True)
                    ]
        return scores
