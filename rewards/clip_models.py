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
``clipscore`` as Flow-GRPO's ``ClipScorer`` (shortest side resized bilinearly, centre crop; ``preprocessing:
open_clip`` follows the model's preprocess config: resize mode, interpolation, mean/std),
``hpsv2`` letterboxes like HPSv2's ``ResizeMaxSize``, ``pickscore`` / ``aesthetic`` follow the
transformers image processor of their reference.

Weights that cannot be loaded raise one-paragraph ``ValueError`` / ``OSError`` naming the option and the fix
(``load_pretrained``, ``unreadable_weights``): the scripts print those without a traceback.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import ModelReward
from .registry import register_reward

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".npz")
_T = TypeVar("_T")


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


def _reason(err: BaseException, limit: int = 200) -> str:
    """An exception's first line, whitespace collapsed and shortened: the cause inside a one-paragraph message."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    if text.startswith("Weights only load failed"):  # torch's advice to load untrusted pickles: not ours to give
        # the unpickler's own words follow "WeightsUnpickler error:", on that line or the next
        rest = str(err).partition("WeightsUnpickler error:")[2].strip().splitlines()
        text = "torch.load(weights_only=True) refused it" + (f": {rest[0].strip()}" if rest else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unreadable(err: BaseException) -> bool:
    """Whether ``err`` says a weights file is truncated, corrupt or no tensor file (not that it does not fit)."""
    from safetensors import SafetensorError

    if isinstance(err, (SafetensorError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile)):
        return True
    # torch.load on a cut zip archive; a legacy pickle with no tensor storages after its header
    return isinstance(err, RuntimeError) and any(
        s in str(err) for s in ("PytorchStreamReader", "central directory", "Invalid magic number", "invalid load key")
    )


def unreadable_weights(where: str, path: str, err: BaseException) -> ValueError:
    """The one-paragraph error for a weights file that cannot be read (``where``: "reward: key")."""
    return ValueError(
        f"{where}: cannot read {path} ({_reason(err)}); the file is truncated or corrupt (an interrupted download or "
        "copy) or is no weights file (safetensors, or a torch state dict that loads with weights_only=True): "
        "download or copy it again, or convert it to safetensors"
    )


def load_state_dict(path: str, *, what: str = "weights") -> dict[str, Tensor]:
    """safetensors, or a torch pickle read with ``weights_only=True``; unwraps ``state_dict`` / DDP prefixes.

    A truncated or corrupt file raises ``ValueError`` naming ``what`` (e.g. "aesthetic: weights") and ``path``."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        if _unreadable(err):
            raise unreadable_weights(what, path, err) from err
        raise
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    return {k.removeprefix("module."): v for k, v in state.items()}


def _valid_repo_id(ref: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(ref)
    except HFValidationError:
        return False
    return True


def looks_like_path(ref: str) -> bool:
    """Whether ``ref`` can only be a local path: starts with ``/``, ``.`` or ``~``, or is no valid hub repo id
    (``name`` or ``namespace/name``; ``models/m2f`` could be either and is not a path here)."""
    return ref.startswith(("/", ".", "~", os.sep)) or not _valid_repo_id(ref)


def load_pretrained(load: Callable[[str], _T], ref: str, *, where: str, expects: str) -> _T:
    """``load(ref)`` (a transformers ``from_pretrained``) with its failures as one-paragraph errors.

    ``where`` names the option ("geneval: detector"), ``expects`` what a local path must hold. A path that does not
    exist raises ``FileNotFoundError`` before huggingface_hub can call it a malformed repo id; a truncated or corrupt
    weights file ``ValueError`` naming the file; a repo that cannot be loaded ``OSError`` with transformers' reason.
    """
    path = os.path.expanduser(ref)
    local = os.path.exists(path)
    if not local and looks_like_path(ref):
        raise FileNotFoundError(
            f"{where} {ref!r} does not exist (relative paths start at {os.getcwd()}); give {expects}, or a hub repo id"
        )
    try:
        return load(path if local else ref)
    except Exception as err:
        if _unreadable(err):
            raise unreadable_weights(where, _weights_file(path if local else ref, local), err) from err
        if not isinstance(err, OSError):
            raise
        if local:
            raise OSError(f"{where} {ref!r} cannot be loaded ({_reason(err)}); give {expects}") from err
        raise OSError(
            f"{where} {ref!r} is no local path (relative paths start at {os.getcwd()}) and cannot be loaded as a "
            f"hub repo ({_reason(err)}); give {expects}, or a hub repo id (downloaded once into the HF cache)"
        ) from err


def _weights_file(ref: str, local: bool) -> str:
    """The weights file ``from_pretrained`` read for a dir or a cached hub repo, or a description of it."""
    if local and os.path.isdir(ref):
        files = sorted(f for f in os.listdir(ref) if f.endswith((".safetensors", ".bin")))
        if len(files) == 1:
            return os.path.join(ref, files[0])
        return f"the weights ({', '.join(files) or 'none'}) in {ref}"
    if not local:
        from huggingface_hub import try_to_load_from_cache

        for name in ("model.safetensors", "pytorch_model.bin"):
            cached = try_to_load_from_cache(ref, name)
            if isinstance(cached, str):
                return f"{cached} (hub {ref}: delete it, or `hf download {ref} --force-download`)"
        return f"the weights of hub repo {ref}"
    return ref


def is_torchscript(path: str) -> bool:
    """A TorchScript archive (OpenAI's CLIP release format): a zip with ``constants.pkl``, as torch tells them apart."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.rsplit("/", 1)[-1] == "constants.pkl" for name in archive.namelist())


def _architecture(open_clip: Any, arch: str, model_config: dict | None, quick_gelu: bool | None = None) -> nn.Module:
    """An open_clip model with random weights: ``model_config`` (``CLIP`` kwargs) or the named architecture;
    ``quick_gelu`` True forces QuickGELU, False / None keep what the config or the architecture says."""
    if model_config is not None:
        return open_clip.CLIP(**{**model_config, **({"quick_gelu": True} if quick_gelu else {})})
    # No tower weights either: open_clip 2.x names the flag pretrained_hf, 3.x still takes it (pretrained_text: 3.0+).
    if quick_gelu:
        return open_clip.create_model(arch, pretrained_hf=False, force_quick_gelu=True)
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


# Flow-GRPO's ClipScorer (flow_grpo/clip_scorer.py): torchvision ``T.Resize(shortest_edge)`` on tensors, whose default
# interpolation is bilinear (antialiased), then ``T.CenterCrop`` and the processor's mean/std. The HF processor's own
# ``resample`` (bicubic for openai/clip-vit-large-patch14) is not passed on.
FLOWGRPO_PREPROCESS = {"resize_mode": "shortest", "interpolation": "bilinear"}
PREPROCESSINGS = ("flowgrpo", "open_clip")


@register_reward("clipscore")
class ClipScore(OpenClipReward):
    """CLIP image-text cosine similarity; any open_clip architecture (``model``) with ``pretrained`` = a tag
    (``openai``, ``laion2b_s32b_b82k``, ...) or a local checkpoint file.

    ``preprocessing``: ``flowgrpo`` (default) resizes as Flow-GRPO's ``ClipScorer``: the shortest side bilinearly
    (antialiased) to the input size, centre crop, the model's mean/std. That deviates from OpenAI's and open_clip's
    CLIP preprocessing (bicubic) and from the model's preprocess config (squash for SigLIP / DFN); ``open_clip``
    follows that config instead.

    ``quick_gelu``: ``true`` builds the architecture with QuickGELU, ``false`` / ``null`` keep the architecture's own
    activation, except that ``null`` with a pretrained tag follows the tag (every ``openai`` tag is QuickGELU; open_clip
    only warns on a mismatch). A state-dict file does not say which activation it was trained with: OpenAI, DFN and
    MetaCLIP weights need ``quick_gelu: true`` (or the ``-quickgelu`` architecture). OpenAI's own TorchScript release
    files (``ViT-L-14.pt``) always load with QuickGELU.
    """

    # The option names in messages; a reward that builds its CLIP from its own options renames them (geneval).
    option_names: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        *,
        pretrained: str | None = "openai",
        model: str | None = None,
        model_config: dict[str, Any] | None = None,
        quick_gelu: bool | None = None,
        preprocessing: str = "flowgrpo",
        random_init: bool = False,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        batch_size: int | None = 32,
    ) -> None:
        if preprocessing not in PREPROCESSINGS:
            raise ValueError(
                f"{self._where('preprocessing')} must be one of {', '.join(PREPROCESSINGS)}; got {preprocessing!r}"
            )
        if quick_gelu is not None and not isinstance(quick_gelu, bool):
            raise ValueError(f"{self._where('quick_gelu')} must be true, false or null; got {quick_gelu!r}")
        self.pretrained, self.quick_gelu = pretrained, quick_gelu
        self.preprocess_override = FLOWGRPO_PREPROCESS if preprocessing == "flowgrpo" else {}
        super().__init__(
            model=model,
            model_config=model_config,
            random_init=random_init,
            seed=seed,
            device=device,
            dtype=dtype,
            batch_size=batch_size,
        )

    def _where(self, option: str) -> str:
        return f"{self.name}: {self.option_names.get(option, option)}"

    def _option(self, option: str) -> str:
        return self.option_names.get(option, option)

    def _build(self, open_clip: Any, arch: str, model_config: dict | None, random_init: bool) -> nn.Module:
        if random_init:  # architecture only: no CLIP weights, no tower weights
            return _architecture(open_clip, arch, model_config, self.quick_gelu)
        key = self._where("pretrained")
        if self.pretrained is None:
            raise ValueError(f"{key} is null: no weights; give a pretrained tag or a local file, or random_init: true")
        path = os.path.expanduser(self.pretrained)
        is_file = os.path.isfile(path)
        tag_cfg = {} if is_file or model_config is not None else open_clip.get_pretrained_cfg(arch, path)
        if not is_file and not tag_cfg:
            raise self._missing(open_clip, arch, model_config)
        try:
            if is_file and is_torchscript(path):
                # OpenAI's own release (a TorchScript archive, as ``clip.load`` caches it): QuickGELU, architecture
                # read from the weights. open_clip's file loader would build ``arch`` with GELU (open_clip < 3 on
                # torch < 2.6) or fail on ``weights_only``.
                return open_clip.load_openai_model(path, precision="fp32", device="cpu")
            if model_config is not None:
                net = _architecture(open_clip, arch, model_config, self.quick_gelu)
                open_clip.load_checkpoint(net, path)
                return net
            # open_clip only warns when a tag needs QuickGELU (all openai weights) and the arch lacks it; without it
            # the scores are silently off, so force it from the tag's config (open_clip 3; 2.x loads "openai" with
            # QuickGELU itself and its tag configs lack the flag). A state-dict file does not say: quick_gelu.
            quick_gelu = self.quick_gelu
            if quick_gelu is None:
                quick_gelu = bool(tag_cfg.get("quick_gelu")) or path.lower() == "openai"
            return open_clip.create_model(arch, pretrained=path, require_pretrained=True, force_quick_gelu=quick_gelu)
        except (FileNotFoundError, ValueError):
            raise
        except Exception as err:
            if is_file and _unreadable(err):
                raise unreadable_weights(key, path, err) from err
            # load_state_dict's key / size mismatches; open_clip's asserts and lookups while converting the layout
            mismatch = isinstance(err, (AssertionError, KeyError)) or "state_dict" in str(err)
            if is_file and mismatch:
                what = self._option("model_config") if model_config is not None else f"{self._option('model')} {arch!r}"
                raise ValueError(
                    f"{key} {path!r} does not fit the architecture of {what} ({_reason(err)}); name the "
                    "architecture the checkpoint was saved from"
                ) from err
            if not is_file and isinstance(err, (RuntimeError, OSError)):  # open_clip's download of a tag
                raise OSError(
                    f"{key} {self.pretrained!r}: the {arch} weights of this tag are neither in the cache nor "
                    f"downloadable ({_reason(err)}); connect once so open_clip caches them, or give a local "
                    "checkpoint file"
                ) from err
            raise

    def _missing(self, open_clip: Any, arch: str, model_config: dict | None) -> Exception:
        """What to say when ``pretrained`` is neither a file nor a tag open_clip knows for ``arch``."""
        key, ref = self._where("pretrained"), str(self.pretrained)
        path = os.path.expanduser(ref)
        where = f"relative paths start at {os.getcwd()}"
        if os.path.isdir(path):
            return FileNotFoundError(f"{key} {ref!r} is a directory; name the checkpoint file in it")
        if model_config is not None or looks_like_path(ref) or os.path.splitext(ref)[1] in WEIGHT_SUFFIXES:
            tags = "" if model_config is not None else f" or a pretrained tag of {arch} (e.g. 'openai')"
            return FileNotFoundError(
                f"{key} {ref!r} does not exist ({where}); give the path of a checkpoint file (.safetensors, or a "
                f"torch state dict){tags}"
            )
        tags = open_clip.list_pretrained_tags_by_model(arch)
        known = f"its tags: {', '.join(tags[:8])}{', ...' if len(tags) > 8 else ''}" if tags else "no tags known"
        return FileNotFoundError(
            f"{key} {ref!r} is neither a file ({where}) nor a pretrained tag of {self._option('model')} {arch!r} "
            f"({known}); give one of those or a checkpoint file"
        )


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
            try:
                open_clip.load_checkpoint(net, path)
            except Exception as err:
                if _unreadable(err):
                    raise unreadable_weights("hpsv2: checkpoint", path, err) from err
                raise
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

        where, expects = "pickscore: model", "a directory holding a CLIP model's config.json and weights"
        if random_init:
            import open_clip

            if config:
                cfg = CLIPConfig(**config)
            else:
                cfg = load_pretrained(
                    lambda ref: CLIPConfig.from_pretrained(ref, local_files_only=local_files_only),
                    model,
                    where=where,
                    expects=expects,
                )
            with seeded(seed):
                net = CLIPModel(cfg)
            side = cfg.vision_config.image_size
            self.preprocess = ImagePreprocess((side, side), floor_crop=True)  # the CLIP processor's defaults
            bpe = open_clip.SimpleTokenizer(context_length=cfg.text_config.max_position_embeddings)
            self._tokenize = lambda prompts: (ids := bpe(prompts), (ids != 0).long())
        else:
            net = load_pretrained(
                lambda ref: CLIPModel.from_pretrained(ref, local_files_only=local_files_only),
                model,
                where=where,
                expects=expects,
            )
            proc = load_pretrained(
                lambda ref: AutoProcessor.from_pretrained(ref, local_files_only=local_files_only),
                processor,
                where="pickscore: processor",
                expects="a directory holding a CLIP processor (tokenizer files and preprocessor_config.json)",
            )
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


AESTHETIC_CLIP = ("aesthetic: clip_model", "a directory holding a CLIP model's config.json and weights")


def _vision_config(clip_model: str, local_files_only: bool) -> Any:
    """The vision tower's config with the CLIP's projection size: a ``CLIPConfig`` keeps it at the top level, and
    some LAION repos leave ``vision_config.projection_dim`` at its 512 default (a size mismatch when loading)."""
    from transformers import AutoConfig, CLIPVisionConfig

    where, expects = AESTHETIC_CLIP
    cfg = load_pretrained(
        lambda ref: AutoConfig.from_pretrained(ref, local_files_only=local_files_only),
        clip_model,
        where=where,
        expects=expects,
    )
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
            where, expects = AESTHETIC_CLIP
            vision = load_pretrained(
                lambda ref: CLIPVisionModelWithProjection.from_pretrained(
                    ref, config=cfg, local_files_only=local_files_only
                ),
                clip_model,
                where=where,
                expects=expects,
            )
            proc = load_pretrained(
                lambda ref: CLIPImageProcessor.from_pretrained(ref, local_files_only=local_files_only),
                clip_model,
                where=where,
                expects=expects,
            )
            self.preprocess = ImagePreprocess.from_hf(proc)
            head = AestheticMLP(cfg.projection_dim)
            head.load_state_dict(load_state_dict(path, what="aesthetic: weights"))
        self.model = self._setup_model(_AestheticNet(vision, head))

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        return self.model(self._pixels(images))
