"""CLIP-family rewards: ``clipscore`` and ``hpsv2`` (open_clip), ``pickscore`` and ``aesthetic`` (transformers).

Real weights are one config line (hub id / pretrained tag / local path), e.g.

    {name: clipscore, model: ViT-L-14, pretrained: openai}
    {name: hpsv2, checkpoint: /ckpt/HPS_v2.1_compressed.pt}          # default: hub xswu/HPSv2
    {name: pickscore}                                                # yuvalkirstain/PickScore_v1
    {name: aesthetic, weights: /ckpt/sac+logos+ava1-l14-linearMSE.pth}

``random_init: true`` builds the same architecture with seeded random weights and downloads
nothing (tests, benchmarks); ``model_config`` (open_clip ``CLIP`` kwargs) / ``config``
(transformers ``CLIPConfig`` kwargs) / ``vision_config`` swap in a tiny architecture.
Images are preprocessed as tensors, batched: shortest side resized (bicubic, antialiased)
to the model's input size, centre-cropped, normalised with the model's mean/std.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import ModelReward
from .registry import register_reward

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Random init that is reproducible and leaves the caller's global RNG state alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def clip_preprocess(images: Tensor, size: tuple[int, int], mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """``(B, 3, H, W)`` in [0, 1] -> normalised ``(B, 3, *size)``, as CLIP's resize + centre-crop."""
    x = images.float()
    h, w = size
    scale = max(h / x.shape[2], w / x.shape[3])
    new = (max(h, round(x.shape[2] * scale)), max(w, round(x.shape[3] * scale)))
    if new != tuple(x.shape[2:]):
        x = F.interpolate(x, size=new, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    top, left = (new[0] - h) // 2, (new[1] - w) // 2
    x = x[:, :, top : top + h, left : left + w]
    mean_t = torch.tensor(mean, device=x.device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=x.device).view(1, 3, 1, 1)
    return (x - mean_t) / std_t


def resolve_file(ref: str, filename: str | None, *, what: str, local_files_only: bool = False) -> str:
    """A local file, a file inside a local dir, or ``filename`` from hub repo ``ref`` (HF cache/offline aware)."""
    if os.path.isfile(ref):
        return ref
    if os.path.isdir(ref) and filename and os.path.isfile(os.path.join(ref, filename)):
        return os.path.join(ref, filename)
    if not filename:
        raise FileNotFoundError(f"{what}: {ref!r} is not a file")
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(ref, filename, local_files_only=local_files_only)
    except Exception as err:
        raise FileNotFoundError(
            f"{what}: {ref!r} is neither a local file nor a reachable hub repo with {filename!r} ({err}); "
            "pass a local path"
        ) from err


def load_state_dict(path: str) -> dict[str, Tensor]:
    """safetensors, or a torch pickle read with ``weights_only=True``; unwraps ``state_dict`` / DDP prefixes."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    return {k.removeprefix("module."): v for k, v in state.items()}


def _cosine(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cosine similarity, in float32 whatever the model dtype."""
    return (F.normalize(a.float(), dim=-1) * F.normalize(b.float(), dim=-1)).sum(-1)


class ClipImageReward(ModelReward):
    """A model reward fed CLIP-preprocessed pixels; subclasses set ``size`` (h, w), ``mean`` and ``std``."""

    size: tuple[int, int]
    mean: Sequence[float]
    std: Sequence[float]

    def _pixels(self, images: Tensor) -> Tensor:
        # Move first: resizing belongs on the reward's device, not the sampler's GPU. float32, then model dtype.
        pixels = clip_preprocess(images.to(self.device, non_blocking=True), self.size, self.mean, self.std)
        return pixels.to(self.dtype)


class OpenClipReward(ClipImageReward):
    """Cosine similarity of open_clip image and text embeddings (the base of ``clipscore`` and ``hpsv2``)."""

    default_model = "ViT-L-14"

    def __init__(
        self,
        *,
        model: str | None = None,
        model_config: dict[str, Any] | None = None,
        random_init: bool = False,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        batch_size: int | None = 32,
    ) -> None:
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        import open_clip

        arch = model or self.default_model
        with seeded(seed):
            net = self._build(open_clip, arch, model_config, random_init)
        if model_config is not None:
            context = model_config.get("text_cfg", {}).get("context_length", 77)
            self.tokenizer = open_clip.SimpleTokenizer(context_length=context)
        else:
            self.tokenizer = open_clip.get_tokenizer(arch)
        cfg = open_clip.get_model_preprocess_cfg(net)
        size = cfg.get("size", net.visual.image_size)
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.mean, self.std = cfg.get("mean", OPENAI_MEAN), cfg.get("std", OPENAI_STD)
        self.model = self._setup_model(net)

    def _build(self, open_clip: Any, arch: str, model_config: dict | None, random_init: bool) -> nn.Module:
        raise NotImplementedError

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        pixels = self._pixels(images)
        tokens = self.tokenizer(prompts).to(self.device)
        return _cosine(self.model.encode_image(pixels), self.model.encode_text(tokens))


@register_reward("clipscore")
class ClipScore(OpenClipReward):
    """CLIP image-text cosine similarity; any open_clip architecture (``model``) with ``pretrained`` = a tag
    (``openai``, ``laion2b_s32b_b82k``, ...) or a local checkpoint file."""

    def __init__(
        self,
        *,
        pretrained: str | None = "openai",
        model: str | None = None,
        model_config: dict[str, Any] | None = None,
        random_init: bool = False,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        batch_size: int | None = 32,
    ) -> None:
        self.pretrained = pretrained
        super().__init__(
            model=model, model_config=model_config, random_init=random_init, seed=seed,
            device=device, dtype=dtype, batch_size=batch_size,
        )

    def _build(self, open_clip: Any, arch: str, model_config: dict | None, random_init: bool) -> nn.Module:
        if random_init:  # architecture only: no CLIP weights, no tower weights
            if model_config is not None:
                return open_clip.CLIP(**model_config)
            return open_clip.create_model(arch, pretrained_text=False)
        if self.pretrained is None:
            raise ValueError("clipscore: no weights; set pretrained=<tag or local file> or random_init=True")
        if model_config is not None:
            net = open_clip.CLIP(**model_config)
            open_clip.load_checkpoint(net, self.pretrained)
            return net
        # open_clip only warns when a tag needs QuickGELU (all openai weights) and the arch lacks it;
        # without it the scores are silently off, so force it from the tag's config.
        tag_cfg = {} if os.path.isfile(self.pretrained) else open_clip.get_pretrained_cfg(arch, self.pretrained)
        return open_clip.create_model(
            arch, pretrained=self.pretrained, require_pretrained=True, force_quick_gelu=bool(tag_cfg.get("quick_gelu"))
        )


@register_reward("hpsv2")
class HPSv2(OpenClipReward):
    """HPS v2.1 (https://arxiv.org/abs/2306.09341): open_clip ViT-H-14 with the HPS checkpoint; score =
    cosine of image and prompt embeddings (the HPS repo's ``image_features @ text_features.T`` diagonal).
    ``checkpoint``: a local ``.pt`` file, or a hub repo holding ``filename``."""

    default_model = "ViT-H-14"

    def __init__(
        self,
        *,
        checkpoint: str = "xswu/HPSv2",
        filename: str = "HPS_v2.1_compressed.pt",
        local_files_only: bool = False,
        model: str | None = None,
        model_config: dict[str, Any] | None = None,
        random_init: bool = False,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        batch_size: int | None = 32,
    ) -> None:
        self.checkpoint = (checkpoint, filename, local_files_only)
        super().__init__(
            model=model, model_config=model_config, random_init=random_init, seed=seed,
            device=device, dtype=dtype, batch_size=batch_size,
        )

    def _build(self, open_clip: Any, arch: str, model_config: dict | None, random_init: bool) -> nn.Module:
        path = None
        if not random_init:  # find the checkpoint before building a 1B-parameter model
            ref, filename, local = self.checkpoint
            path = resolve_file(ref, filename, what="hpsv2 checkpoint", local_files_only=local)
        if model_config is not None:
            net = open_clip.CLIP(**model_config)
        else:
            net = open_clip.create_model(arch, pretrained_text=False)
        if path is not None:
            open_clip.load_checkpoint(net, path)
        return net


def _hf_image_cfg(processor: Any) -> tuple[tuple[int, int], Sequence[float], Sequence[float]]:
    crop = processor.crop_size
    get = crop.get if isinstance(crop, dict) else lambda k: getattr(crop, k, None)
    return (int(get("height")), int(get("width"))), processor.image_mean, processor.image_std


@register_reward("pickscore")
class PickScore(ClipImageReward):
    """PickScore (https://arxiv.org/abs/2305.01569): ``logit_scale.exp() * cos(image, prompt)`` of a CLIP model.

    ``random_init`` uses open_clip's bundled BPE tokenizer (same vocabulary as CLIP) and
    ``config`` (``CLIPConfig`` kwargs) or the hub config of ``model``.
    """

    def __init__(
        self,
        *,
        model: str = "yuvalkirstain/PickScore_v1",
        processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        config: dict[str, Any] | None = None,
        random_init: bool = False,
        seed: int = 0,
        local_files_only: bool = False,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        batch_size: int | None = 32,
    ) -> None:
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        from transformers import AutoProcessor, CLIPConfig, CLIPModel

        if random_init:
            import open_clip

            cfg = (
                CLIPConfig(**config) if config else CLIPConfig.from_pretrained(model, local_files_only=local_files_only)
            )
            with seeded(seed):
                net = CLIPModel(cfg)
            side = cfg.vision_config.image_size
            self.size, self.mean, self.std = (side, side), OPENAI_MEAN, OPENAI_STD
            bpe = open_clip.SimpleTokenizer(context_length=cfg.text_config.max_position_embeddings)
            self._tokenize = lambda prompts: (ids := bpe(prompts), (ids != 0).long())
        else:
            net = CLIPModel.from_pretrained(model, local_files_only=local_files_only)
            proc = AutoProcessor.from_pretrained(processor, local_files_only=local_files_only)
            self.size, self.mean, self.std = _hf_image_cfg(proc.image_processor)
            tok, length = proc.tokenizer, net.config.text_config.max_position_embeddings

            def tokenize(prompts: list[str]) -> tuple[Tensor, Tensor]:
                enc = tok(prompts, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
                return enc["input_ids"], enc["attention_mask"]

            self._tokenize = tokenize
        self.model = self._setup_model(net)

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        pixels = self._pixels(images)
        ids, mask = self._tokenize(prompts)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), pixel_values=pixels)
        return self.model.logit_scale.exp().float() * _cosine(out.image_embeds, out.text_embeds)


class AestheticMLP(nn.Module):
    """LAION improved-aesthetic-predictor head (https://github.com/christophschuhmann/improved-aesthetic-predictor);
    parameter names match its ``sac+logos+ava1-l14-linearMSE.pth``."""

    def __init__(self, in_dim: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_dim, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16), nn.Linear(16, 1),
        )

    def forward(self, embeds: Tensor) -> Tensor:
        return self.layers(embeds)


class _AestheticNet(nn.Module):
    def __init__(self, vision: nn.Module, head: AestheticMLP) -> None:
        super().__init__()
        self.vision, self.head = vision, head

    def forward(self, pixels: Tensor) -> Tensor:
        embeds = self.vision(pixel_values=pixels).image_embeds
        return self.head(F.normalize(embeds, dim=-1)).squeeze(-1)  # the MLP was trained on unit embeddings


@register_reward("aesthetic")
class Aesthetic(ClipImageReward):
    """LAION aesthetic score (~1..10) of L2-normalised CLIP ViT-L/14 image embeddings (DDPO's ``aesthetic_score``).

    ``weights``: the MLP's ``.pth``/``.safetensors`` file, a dir holding ``filename``, or a hub repo id.
    """

    def __init__(
        self,
        *,
        weights: str | None = None,
        filename: str = "sac+logos+ava1-l14-linearMSE.pth",
        clip_model: str = "openai/clip-vit-large-patch14",
        vision_config: dict[str, Any] | None = None,
        random_init: bool = False,
        seed: int = 0,
        local_files_only: bool = False,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        batch_size: int | None = 32,
    ) -> None:
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

        if random_init:
            cfg = (
                CLIPVisionConfig(**vision_config)
                if vision_config
                else CLIPVisionConfig.from_pretrained(clip_model, local_files_only=local_files_only)
            )
            with seeded(seed):
                vision, head = CLIPVisionModelWithProjection(cfg), AestheticMLP(cfg.projection_dim)
            self.size, self.mean, self.std = (cfg.image_size, cfg.image_size), OPENAI_MEAN, OPENAI_STD
        else:
            if weights is None:
                raise ValueError("aesthetic: set weights=<sac+logos+ava1-l14-linearMSE.pth path> or random_init=True")
            vision = CLIPVisionModelWithProjection.from_pretrained(clip_model, local_files_only=local_files_only)
            proc = CLIPImageProcessor.from_pretrained(clip_model, local_files_only=local_files_only)
            self.size, self.mean, self.std = _hf_image_cfg(proc)
            head = AestheticMLP(vision.config.projection_dim)
            path = resolve_file(weights, filename, what="aesthetic weights", local_files_only=local_files_only)
            head.load_state_dict(load_state_dict(path))
        self.model = self._setup_model(_AestheticNet(vision, head))

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        return self.model(self._pixels(images))
