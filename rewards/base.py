"""The reward protocol, input checks and the batched base class every built-in reward uses.

A reward maps a batch of images (float ``(B, 3, H, W)`` in [0, 1]), their prompts and
per-sample metadata to ``dict[str, Tensor(B,)]`` of float32 scores on the CPU. The scores
go to the trainer's advantage computation, which runs on the CPU after gathering ranks,
so rewards never return device tensors.

Image editing adds an optional keyword, ``source_images`` (float ``(B, 3, h, w)`` in [0, 1]: the image each
sample edits). A reward receives it only if its call signature names a ``source_images`` parameter
(:func:`accepts_source_images`, checked once when it is combined); rewards without one keep working unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

Metadata = Sequence[Mapping[str, Any]]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@runtime_checkable
class Reward(Protocol):
    """Anything callable as ``reward(images, prompts, metadata) -> {name: Tensor(B,)}``; editing rewards also take
    ``source_images=`` (see the module docstring)."""

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Metadata | None = None
    ) -> dict[str, Tensor]: ...


class RewardError(RuntimeError):
    """A reward failed while scoring; names the reward (``reward``) and, when known, the batch."""

    def __init__(self, message: str, *, reward: str | None = None, batch: int | None = None) -> None:
        super().__init__(message)
        self.reward = reward
        self.batch = batch


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")


def check_inputs(
    images: Tensor, prompts: Sequence[str], metadata: Metadata | None, *, video: bool = False
) -> tuple[list[str], list[dict[str, Any]]]:
    """Reject malformed batches with a message that says what to fix; return prompts/metadata as lists.

    ``video``: clips ``(B, F, 3, H, W)`` are accepted too (see ``rewards.video``)."""
    is_clip = video and torch.is_tensor(images) and images.ndim == 5 and images.shape[2] == 3
    if not is_clip and (not torch.is_tensor(images) or images.ndim != 4 or images.shape[1] != 3):
        got = tuple(images.shape) if torch.is_tensor(images) else type(images).__name__
        if video:
            clips = "(or clips (B, F, 3, H, W))"
            raise ValueError(f"images must be a float tensor of shape (B, 3, H, W); got {got} {clips}")
        hint = ""
        if torch.is_tensor(images) and images.ndim == 5:  # clips given to an image reward
            hint = (
                " (a video batch (B, F, 3, H, W): score it through build_reward's combined reward, which scores "
                "image rewards frame by frame, or wrap the reward in rewards.FrameReward)"
            )
        raise ValueError(f"images must be a float tensor of shape (B, 3, H, W); got {got}{hint}")
    if not images.is_floating_point():
        raise ValueError(f"images must be floating point in [0, 1]; got {images.dtype} (divide uint8 by 255)")
    if images.numel() == 0:
        raise ValueError(f"images must be non-empty; got shape {tuple(images.shape)}")
    lo, hi = images.min().item(), images.max().item()  # NaN propagates through min/max
    if not (lo >= 0.0 and hi <= 1.0):
        raise ValueError(
            f"images must lie in [0, 1]; got min {lo:.4g}, max {hi:.4g} "
            "(decoded VAE output in [-1, 1] needs (x + 1) / 2 then clamp(0, 1))"
        )
    batch = images.shape[0]
    if isinstance(prompts, str) or len(prompts) != batch or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a list of {batch} strings, one per image")
    if metadata is None:
        return list(prompts), [{} for _ in range(batch)]
    if isinstance(metadata, Mapping) or len(metadata) != batch:
        raise ValueError(f"metadata must be None or a list of {batch} dicts, one per image")
    if not all(isinstance(m, Mapping) for m in metadata):
        raise ValueError("metadata entries must be dicts")
    return list(prompts), [dict(m) for m in metadata]


def check_source_images(source_images: Tensor, batch: int) -> None:
    """Reject malformed source images (one float ``(3, h, w)`` image in [0, 1] per sample; h, w may differ from the
    samples')."""
    if not torch.is_tensor(source_images) or source_images.ndim != 4 or source_images.shape[1] != 3:
        got = tuple(source_images.shape) if torch.is_tensor(source_images) else type(source_images).__name__
        raise ValueError(f"source_images must be a float tensor of shape (B, 3, h, w); got {got}")
    if source_images.shape[0] != batch:
        raise ValueError(f"source_images has {source_images.shape[0]} images for {batch} samples: give one per sample")
    if not source_images.is_floating_point():
        raise ValueError(f"source_images must be floating point in [0, 1]; got {source_images.dtype}")
    lo, hi = source_images.min().item(), source_images.max().item()
    if not (lo >= 0.0 and hi <= 1.0):
        raise ValueError(f"source_images must lie in [0, 1]; got min {lo:.4g}, max {hi:.4g}")


def accepts_source_images(reward: Any) -> bool:
    """Whether ``reward`` is called with ``source_images=``: its signature (``forward`` for a torch module) names a
    ``source_images`` parameter that can be passed by keyword. ``**kwargs`` alone does not count."""
    function = reward.forward if isinstance(reward, torch.nn.Module) else reward
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    parameter = parameters.get("source_images")
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def to_uint8_hwc(images: Tensor) -> np.ndarray:
    """``(B, 3, H, W)`` in [0, 1] -> uint8 ``(B, H, W, 3)``, rounding as DDPO and Flow-GRPO do."""
    return (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def as_score_dict(output: Any, default_key: str, batch: int) -> dict[str, Tensor]:
    """Coerce a reward's output (a dict, a tensor or a sequence) to ``{key: float32 CPU Tensor(B,)}``."""
    items = output.items() if isinstance(output, Mapping) else [(default_key, output)]
    scores: dict[str, Tensor] = {}
    for key, value in items:
        t = torch.as_tensor(value).detach().to("cpu", torch.float32).reshape(-1)
        if t.numel() != batch:
            raise ValueError(f"reward '{default_key}' returned {t.numel()} scores for key '{key}'; expected {batch}")
        scores[str(key)] = t
    if not scores:
        raise ValueError(f"reward '{default_key}' returned no scores")
    return scores


class BaseReward:
    """Validates inputs, splits the batch into ``batch_size`` chunks and runs ``score`` without grad.

    Subclasses implement ``score(images, prompts, metadata) -> Tensor(b,)`` (or a dict of them)
    on a chunk whose images are still in [0, 1]; ``name`` is set by ``register_reward``. An editing reward sets
    ``uses_source_images = True`` and implements ``score(images, prompts, metadata, source_images)``; it refuses a
    call without source images.
    """

    name: ClassVar[str] = "reward"
    uses_source_images: ClassVar[bool] = False

    def __init__(
        self,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        batch_size: int | None = None,
    ) -> None:
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"{self.name}: batch_size must be a positive integer or None; got {batch_size!r}")
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        self.batch_size = batch_size

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor | dict:
        raise NotImplementedError

    def __call__(
        self,
        images: Tensor,
        prompts: Sequence[str],
        metadata: Metadata | None = None,
        source_images: Tensor | None = None,
    ) -> dict[str, Tensor]:
        prompts, metadata = check_inputs(images, prompts, metadata)
        batch = images.shape[0]
        if self.uses_source_images:
            if source_images is None:
                raise ValueError(
                    f"reward '{self.name}' compares each image with the image it edits: call it with source_images= "
                    '(in training: an editing prompt file, whose rows name an "image")'
                )
            check_source_images(source_images, batch)
        step = self.batch_size or batch
        chunks: list[dict[str, Tensor]] = []
        with torch.no_grad():
            for s in range(0, batch, step):
                part = (images[s : s + step], prompts[s : s + step], metadata[s : s + step])
                if self.uses_source_images:
                    part += (source_images[s : s + step],)
                out = self.score(*part)
                chunks.append(as_score_dict(out, self.name, min(step, batch - s)))
        return {key: torch.cat([c[key] for c in chunks]) for key in chunks[0]}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, dtype={self.dtype}, batch_size={self.batch_size})"


class ModelReward(BaseReward):
    """A reward backed by a torch module: loaded once, eval mode, frozen, on its own device and dtype."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device, self.dtype).eval().requires_grad_(False)
