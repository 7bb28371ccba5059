"""CLIP-family rewards: ``clipscore`` and ``hpsv2`` (open_clip), ``pickscore`` and ``aesthetic`` (transformers).

Real weights are one config line (hub id / pretrained tag / local path), e.g.

    {name: clipscore, model: ViT-L-14, pretrained: openai}
    {name: hpsv2, checkpoint: /ckpt/HPS_v2.1_compressed.pt}          # default: hub xswu/HPSv2
    {name: pickscore}                                                # yuvalkirstain/PickScore_v1
    {name: aesthetic}                                                # hub trl-lib/ddpo-aesthetic-predictor

``random_init: true`` builds the same architecture with seeded random weights and downloads
nothing (tests, benchmarks); ``model_config`` (open_clip ``CLIP`` kwargs) / ``config``
(transformers ``CLIPConfig`` kwargs) / ``vision_config`` swap in a tiny architecture.
Images are preprocessed as tensors, batched, the way each reward's reference does it (``ImagePreprocess``):
open_clip rewards follow the model's preprocess config (resize mode, interpolation, mean/std),
``hpsv2`` letterboxes like HPSv2's ``ResizeMaxSize``, ``pickscore`` / ``aesthetic`` follow the
transformers image processor of their reference.
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import ModelReward
from .registry import register_reward

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".npz")


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Random init that is reproducible and leaves the caller's global RNG state alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# transformers' ``resample`` (PIL's codes) -> the interpolation names open_clip and torchvision use.
PIL_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}
RESIZE_MODES = ("shortest", "longest", "squash")


@dataclass(frozen=True)
class ImagePreprocess:
    """A reference's image pipeline on batched ``(B, 3, H, W)`` tensors in [0, 1] -> normalised ``(B, 3, *size)``.

    ``resize_mode`` takes open_clip's names. ``shortest``: the shortest side to ``resize_to`` (default: the input
    size), the long side truncated as torchvision's ``Resize(int)`` and transformers' ``shortest_edge`` do, then a
    centre crop. ``longest``: the longest side to the input size, black padding to a square (HPSv2's
    ``ResizeMaxSize``; open_clip's ``ResizeKeepRatio(longest=1)`` + ``CenterCropOrPad``). ``squash``: both sides to
    the input size (open_clip's SigLIP and DFN configs). Resampling is antialiased, as PIL's is; the crop sits at
    ``round((H - h) / 2)`` (torchvision, open_clip) or, with ``floor_crop``, ``(H - h) // 2`` (transformers).
    """

    size: tuple[int, int]  # model input (h, w)
    mean: tuple[float, ...] = OPENAI_MEAN
    std: tuple[float, ...] = OPENAI_STD
    resize_mode: str = "shortest"
    interpolation: str = "bicubic"
    resize_to: int | None = None
    floor_crop: bool = False

    def __post_init__(self) -> None:
        if self.resize_mode not in RESIZE_MODES:
            raise ValueError(f"resize_mode must be one of {RESIZE_MODES}; got {self.resize_mode!r}")
        if self.interpolation not in ("nearest", "bilinear", "bicubic"):
            raise ValueError(f"interpolation must be nearest, bilinear or bicubic; got {self.interpolation!r}")

    @classmethod
    def from_open_clip(cls, cfg: dict[str, Any], **override: Any) -> ImagePreprocess:
        """From ``open_clip.get_model_preprocess_cfg(model)`` (``size``, ``mean``, ``std``, ``resize_mode``, ...)."""
        cfg = {**cfg, **override}
        size = cfg["size"]
        interpolation = cfg.get("interpolation") or "bicubic"
        return cls(
            size=(size, size) if isinstance(size, int) else tuple(size),
            mean=tuple(cfg.get("mean") or OPENAI_MEAN),
            std=tuple(cfg.get("std") or OPENAI_STD),
            resize_mode=cfg.get("resize_mode") or "shortest",
            interpolation="bicubic" if interpolation == "random" else interpolation,  # as open_clip at inference
        )

    @classmethod
    def from_hf(cls, processor: Any) -> ImagePreprocess:
        """From a transformers ``CLIPImageProcessor``: ``size.shortest_edge``, then ``crop_size``."""

        def get(obj: Any, key: str) -> Any:
            return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)

        shortest = get(processor.size, "shortest_edge")
        if shortest is None or not processor.do_center_crop:
            raise ValueError(f"expected a CLIP image processor (shortest_edge resize + centre crop); got {processor}")
        crop = processor.crop_size
        return cls(
            size=(int(get(crop, "height")), int(get(crop, "width"))),
            mean=tuple(processor.image_mean),
            std=tuple(processor.image_std),
            interpolation=PIL_RESAMPLE[int(processor.resample)],
            resize_to=int(shortest),
            floor_crop=True,
        )

    def __call__(self, images: Tensor) -> Tensor:
        from torchvision.transforms.v2 import InterpolationMode
        from torchvision.transforms.v2 import functional as TF

        x = images.float()
        (h, w), (H, W) = self.size, x.shape[-2:]
        if self.resize_mode == "squash":
            new = (h, w)
        elif self.resize_mode == "shortest" and (self.resize_to or h == w):
            side = self.resize_to or h
            new = (side, int(side * W / H)) if H <= W else (int(side * H / W), side)
        else:  # longest, or shortest to a non-square size: open_clip's ResizeKeepRatio
            ratio = max(H / h, W / w) if self.resize_mode == "longest" else min(H / h, W / w)
            new = (round(H / ratio), round(W / ratio))
        if new != (H, W):
            mode = InterpolationMode(self.interpolation)
            x = TF.resize(x, list(new), interpolation=mode, antialias=True).clamp(0, 1)  # PIL clamps to 0..255
        H, W = new
        if H < h or W < w:  # letterbox: black (0) padding before normalising, split as open_clip / HPSv2 split it
            ph, pw = max(h - H, 0), max(w - W, 0)
            x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
            H, W = x.shape[-2:]
        top, left = ((H - h) // 2, (W - w) // 2) if self.floor_crop else (round((H - h) / 2), round((W - w) / 2))
        x = x[..., top : top + h, left : left + w]
        return TF.normalize(x, list(self.mean), list(self.std))


def clip_preprocess(
    images: Tensor, size: tuple[int, int], mean: Sequence[float], std: Sequence[float], **options: Any
) -> Tensor:
    """``(B, 3, H, W)`` in [0, 1] -> normalised ``(B, 3, *size)``; ``options``: ``ImagePreprocess``'s
    (default: CLIP's shortest-side resize + centre crop)."""
    return ImagePreprocess(tuple(size), tuple(mean), tuple(std), **options)(images)


def resolve_file(ref: str, filename: str | None, *, what: str, local_files_only: bool = False) -> str:
    """A local file, a file inside a local dir, or ``filename`` from hub repo ``ref`` (HF cache/offline aware)."""
    ref = os.path.expanduser(ref)
    if os.path.isfile(ref):
        return ref
    if not filename:
        raise FileNotFoundError(f"{what}: {ref!r} is not a file")
    if os.path.isdir(ref):
        if os.path.isfile(os.path.join(ref, filename)):
            return os.path.join(ref, filename)
        raise FileNotFoundError(f"{what}: directory {ref!r} has no {filename!r}; name the file (or set filename)")
    if os.path.splitext(ref)[1] in WEIGHT_SUFFIXES:  # a file name, never a hub repo id
        raise FileNotFoundError(
            f"{what}: no such file {ref!r} (relative paths start at {os.getcwd()}); for the hub file leave this "
            f"unset or give the repo id, and the file's name as filename (default {filename!r})"
        )
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


def is_torchscript(path: str) -> bool:
    """A TorchScript archive (OpenAI's CLIP release format): a zip with ``constants.pkl``, as torch tells them apart."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.rsplit("/", 1)[-1] == "constants.pkl" for name in archive.namelist())


def _architecture(open_clip: Any, arch: str, model_config: dict | None) -> nn.Module:
    """An open_clip model with random weights: ``model_config`` (``CLIP`` kwargs) or the named architecture."""
    if model_config is not None:
        return open_clip.CLIP(**model_config)
    # No tower weights either: open_clip 2.x names the flag pretrained_hf, 3.x still takes it (pretrained_text: 3.0+).
    return open_clip.create_model(arch, pretrained_hf=False)


def _cosine(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cosine similarity, in float32 whatever the model dtype."""
    return (F.normalize(a.float(), dim=-1) * F.normalize(b.float(), dim=-1)).sum(-1)


class ClipImageReward(ModelReward):
    """A model reward fed preprocessed pixels; subclasses set ``preprocess`` to their reference's pipeline."""

    preprocess: ImagePreprocess

    def _pixels(self, images: Tensor) -> Tensor:
        # Move first: resizing belongs on the reward's device, not the sampler's GPU. float32, then model dtype.
        return self.preprocess(images.to(self.device, non_blocking=True)).to(self.dtype)


class OpenClipReward(ClipImageReward):
    """Cosine similarity of open_clip image and text embeddings (the base of ``clipscore`` and ``hpsv2``)."""

    default_model = "ViT-L-14"
    preprocess_override: dict[str, Any] = {}  # what the reference does whatever the model's preprocess config says

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
        cfg = {"size": net.visual.image_size, **open_clip.get_model_preprocess_cfg(net)}
        self.preprocess = ImagePreprocess.from_open_clip(cfg, **self.preprocess_override)
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
            model=model,
            model_config=model_config,
            random_init=random_init,
            seed=seed,
            device=device,
            dtype=dtype,
            batch_size=batch_size,
        )

    def _build(self, open_clip: Any, arch: str, model_config: dict | None, random_init: bool) -> nn.Module:
        if random_init:  # architecture only: no CLIP weights, no tower weights
            return _architecture(open_clip, arch, model_config)
        if self.pretrained is None:
            raise ValueError("clipscore: no weights; set pretrained=<tag or local file> or random_init=True")
        path = os.path.expanduser(self.pretrained)
        if os.path.isfile(path) and is_torchscript(path):
            # OpenAI's own release (a TorchScript archive, as ``clip.load`` caches it): QuickGELU, architecture read
            # from the weights. open_clip's file loader would build ``arch`` with GELU (open_clip < 3 on torch < 2.6)
            # or fail on ``weights_only``.
            return open_clip.load_openai_model(path, precision="fp32", device="cpu")
        if model_config is not None:
            net = open_clip.CLIP(**model_config)
            open_clip.load_checkpoint(net, path)
            return net
        # open_clip only warns when a tag needs QuickGELU (all openai weights) and the arch lacks it;
        # without it the scores are silently off, so force it from the tag's config (open_clip 3; 2.x loads
        # "openai" with QuickGELU itself and its tag configs lack the flag). A state-dict file does not say:
        # name the ``-quickgelu`` architecture for OpenAI / DFN / MetaCLIP weights saved that way.
        tag_cfg = {} if os.path.isfile(path) else open_clip.get_pretrained_cfg(arch, path)
        quick_gelu = bool(tag_cfg.get("quick_gelu")) or path.lower() == "openai"
        return open_clip.create_model(arch, pretrained=path, require_pretrained=True, force_quick_gelu=quick_gelu)


@register_reward("hpsv2")
class HPSv2(OpenClipReward):
    """HPS v2.1 (https://arxiv.org/abs/2306.09341): open_clip ViT-H-14 with the HPS checkpoint; score =
    cosine of image and prompt embeddings (the HPS repo's ``image_features @ text_features.T`` diagonal).
    ``checkpoint``: a local ``.pt`` file, or a hub repo holding ``filename``."""

    default_model = "ViT-H-14"
    # HPSv2's ``preprocess_val``: ``image_transform(..., resize_longest_max=True)`` = ResizeMaxSize, black letterbox.
    preprocess_override = {"resize_mode": "longest", "interpolation": "bicubic"}

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
            model=model,
            model_config=model_config,
            random_init=random_init,
            seed=seed,
            device=device,
            dtype=dtype,
            batch_size=batch_size,
        )

    def _build(self, open_clip: Any, arch: str, model_config: dict | None, random_init: bool) -> nn.Module:
        path = None
        if not random_init:  # find the checkpoint before building a 1B-parameter model
            ref, filename, local = self.checkpoint
            path = resolve_file(ref, filename, what="hpsv2 checkpoint", local_files_only=local)
        net = _architecture(open_clip, arch, model_config)
        if path is not None:
            open_clip.load_checkpoint(net, path)
        return net


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
            self.preprocess = ImagePreprocess((side, side), floor_crop=True)  # the CLIP processor's defaults
            bpe = open_clip.SimpleTokenizer(context_length=cfg.text_config.max_position_embeddings)
            self._tokenize = lambda prompts: (ids := bpe(prompts), (ids != 0).long())
        else:
            net = CLIPModel.from_pretrained(model, local_files_only=local_files_only)
            proc = AutoProcessor.from_pretrained(processor, local_files_only=local_files_only)
            self.preprocess = ImagePreprocess.from_hf(proc.image_processor)
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
            nn.Linear(in_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
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


def _vision_config(clip_model: str, local_files_only: bool) -> Any:
    """The vision tower's config with the CLIP's projection size: a ``CLIPConfig`` keeps it at the top level, and
    some LAION repos leave ``vision_config.projection_dim`` at its 512 default (a size mismatch when loading)."""
    from transformers import AutoConfig, CLIPVisionConfig

    cfg = AutoConfig.from_pretrained(clip_model, local_files_only=local_files_only)
    if isinstance(cfg, CLIPVisionConfig):  # a saved vision tower
        return cfg
    vision = cfg.vision_config
    vision.projection_dim = cfg.projection_dim
    return vision


@register_reward("aesthetic")
class Aesthetic(ClipImageReward):
    """LAION aesthetic score (~1..10) of L2-normalised CLIP ViT-L/14 image embeddings (DDPO's ``aesthetic_score``).

    ``weights``: the MLP's ``.pth``/``.safetensors`` file, a dir holding ``filename``, or a hub repo holding it. The
    default is TRL's hub copy of LAION's ``sac+logos+ava1-l14-linearMSE.pth`` (renamed ``aesthetic-model.pth``), the
    file DDPO and Flow-GRPO ship; ``.pth`` pickles are read with ``weights_only=True``.
    """

    def __init__(
        self,
        *,
        weights: str = "trl-lib/ddpo-aesthetic-predictor",
        filename: str = "aesthetic-model.pth",
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
            if vision_config:
                cfg = CLIPVisionConfig(**vision_config)
            else:
                cfg = _vision_config(clip_model, local_files_only)
            with seeded(seed):
                vision, head = CLIPVisionModelWithProjection(cfg), AestheticMLP(cfg.projection_dim)
            self.preprocess = ImagePreprocess((cfg.image_size, cfg.image_size), floor_crop=True)
        else:
            # find the MLP file before loading a 300M-parameter tower
            path = resolve_file(weights, filename, what="aesthetic weights", local_files_only=local_files_only)
            cfg = _vision_config(clip_model, local_files_only)
            vision = CLIPVisionModelWithProjection.from_pretrained(
                clip_model, config=cfg, local_files_only=local_files_only
            )
            proc = CLIPImageProcessor.from_pretrained(clip_model, local_files_only=local_files_only)
            self.preprocess = ImagePreprocess.from_hf(proc)
            head = AestheticMLP(cfg.projection_dim)
            head.load_state_dict(load_state_dict(path))
        self.model = self._setup_model(_AestheticNet(vision, head))

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        return self.model(self._pixels(images))
