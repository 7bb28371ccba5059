"""Model families by name: each ``flowgrpo/adapters/<family>.py`` declares one :class:`FamilySpec` at its bottom and
registers it; every table of families (``model.kind``'s choices, the video kinds, pipeline and transformer classes,
the tiny sources) is derived from here, so adding a family is one adapter module + its spec (+ its tiny builder).

    SPEC = register_family(FamilySpec(
        name="flux", pipelines=("FluxPipeline",), transformer="FluxTransformer2DModel", adapter=FluxAdapter,
        tiny="flowgrpo.tiny:flux_components", tiny_vaes=("kl", "tiny"),
    ))

A pipeline is matched by its exact class (:func:`family_of_pipeline`): a sibling of a supported pipeline (FLUX's
Fill / Control / Img2Img, Kontext's inpainting, Wan's video-to-video, ...) feeds its transformer inputs that the
family's adapter never builds (mask or control latents, a first frame), so it is refused rather than run wrongly.

A leaf: it imports neither ``flowgrpo.config`` (which imports it to validate ``model.kind``) nor diffusers' pipelines.
Classes named by a string are looked up in ``diffusers`` on first use, so importing the registry stays cheap.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..checks import ConfigError

if TYPE_CHECKING:
    from .base import PipelineAdapter

# (seed, vae) -> the components of a tiny random-weight pipeline of the family (flowgrpo.tiny.build_tiny_pipeline).
TinyBuilder = Callable[[int, str], dict[str, Any]]
TINY_VAES = ("kl", "tiny")  # kl: the family's own VAE type; tiny: a normalisation-free AutoencoderTiny ("-taesd")
_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


@dataclass(frozen=True)
class FamilySpec:
    """One model family: what ``model.kind`` names, which pipelines its adapter drives, how to build a tiny one.

    name:        the ``model.kind`` (lower case, digits and ``-``; not ``auto``); equal to ``adapter.family``
    pipelines:   the exact pipeline classes the adapter drives, a class or its name in ``diffusers``; the first is
                 what ``load_pipeline`` builds and what export saves LoRA weights with
    transformer: the transformer class (a checkpoint's LoRA shapes are checked against it, built from its config alone)
    adapter:     the :class:`~flowgrpo.adapters.base.PipelineAdapter` subclass
    tiny:        ``(seed, vae) -> components`` of a tiny random-weight pipeline, or ``"module:function"`` naming it
                 (imported on first use); None: no tiny build
    tiny_vaes:   the ``vae`` choices of the tiny build (``"tiny"`` also gives the source ``tiny-<name>-taesd``)
    video:       generates clips (``model.num_frames``) rather than images
    """

    name: str
    pipelines: tuple[str | type, ...]
    transformer: str | type
    adapter: type[PipelineAdapter]
    tiny: str | TinyBuilder | None = None
    tiny_vaes: tuple[str, ...] = ("kl",)
    video: bool = False

    def __post_init__(self) -> None:
        where = f"family {self.name!r}"
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name) or self.name == "auto":
            raise ValueError(f"{where}: a name is lower case letters, digits and '-' (not 'auto')")
        if isinstance(self.pipelines, str | type) or not self.pipelines:
            raise ValueError(f"{where}: pipelines must be a non-empty tuple of pipeline classes or their names")
        if getattr(self.adapter, "family", None) != self.name:
            said = getattr(self.adapter, "family", None)
            raise ValueError(f"{where}: its adapter {self.adapter!r} has family={said!r}, not the spec's name")
        if not self.tiny_vaes or not set(self.tiny_vaes) <= set(TINY_VAES):
            raise ValueError(f"{where}: tiny_vaes must be a non-empty subset of {TINY_VAES}, got {self.tiny_vaes}")
        if isinstance(self.tiny, str) and ":" not in self.tiny:
            raise ValueError(f"{where}: tiny={self.tiny!r} must name a function as 'package.module:function'")

    @property
    def edits(self) -> bool:
        """Takes a source image per prompt (image editing): the adapter's ``edits``."""
        return bool(self.adapter.edits)

    @property
    def pipeline_names(self) -> tuple[str, ...]:
        """Class names of :attr:`pipelines`, as ``model_index.json``'s ``_class_name`` writes them."""
        return tuple(_class_name(ref) for ref in self.pipelines)

    @property
    def pipeline_class(self) -> type:
        """The family's main pipeline class (the first of :attr:`pipelines`)."""
        return _resolve(self.pipelines[0])

    @property
    def transformer_class(self) -> type:
        return _resolve(self.transformer)

    @property
    def tiny_builder(self) -> TinyBuilder | None:
        if isinstance(self.tiny, str):
            module, _, function = self.tiny.partition(":")
            return getattr(importlib.import_module(module), function)
        return self.tiny

    @property
    def tiny_sources(self) -> tuple[str, ...]:
        """The names ``load_pipeline`` builds in code: ``tiny-<name>`` and, with a tiny VAE, ``tiny-<name>-taesd``."""
        if self.tiny is None:
            return ()
        return (f"tiny-{self.name}",) + ((f"tiny-{self.name}-taesd",) if "tiny" in self.tiny_vaes else ())

    def drives(self, pipe: Any) -> bool:
        """Whether ``pipe`` is exactly one of :attr:`pipelines` (a subclass or sibling is not)."""
        cls = type(pipe)
        return any(cls.__name__ == _class_name(ref) and cls is _resolve(ref, missing_ok=True) for ref in self.pipelines)


_FAMILIES: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add a family; returns ``spec`` (``SPEC = register_family(FamilySpec(...))``). A taken name or a pipeline class
    another family drives is refused, so that one class always maps to one adapter."""
    if not isinstance(spec, FamilySpec):
        raise TypeError(f"register_family takes a FamilySpec, got {type(spec).__name__}")
    known = _FAMILIES.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"family {spec.name!r} is already registered (by {known.adapter.__module__})")
    for other in _FAMILIES.values():
        shared = set(other.pipeline_names) & set(spec.pipeline_names)
        if other.name != spec.name and shared:
            raise ValueError(f"family {spec.name!r}: {', '.join(sorted(shared))} is already driven by {other.name!r}")
    _FAMILIES[spec.name] = spec
    return spec


def unregister_family(name: str) -> FamilySpec:
    """Remove a family (tests that register a throwaway one); returns its spec."""
    spec = family(name)
    del _FAMILIES[name]
    return spec


def family(name: str) -> FamilySpec:
    """The spec registered under ``name``; an unknown name is refused with the registered ones (and a near miss)."""
    if name not in _FAMILIES:
        close = difflib.get_close_matches(str(name), list(_FAMILIES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model family {name!r}: registered are {', '.join(available_families())}{hint}")
    return _FAMILIES[name]


def families() -> tuple[FamilySpec, ...]:
    """Every registered spec, by name."""
    return tuple(_FAMILIES[name] for name in sorted(_FAMILIES))


def available_families() -> tuple[str, ...]:
    """The registered family names (the values ``model.kind`` takes besides ``auto``), sorted."""
    return tuple(sorted(_FAMILIES))


class FamilyNames(Sequence[str]):
    """A read-only view of the registered family names (``video=True``: the video ones) that follows later
    registrations: a module-level constant such as ``config.VIDEO_KINDS`` stays current."""

    def __init__(self, *, video: bool | None = None) -> None:
        self._video = video

    def _names(self) -> tuple[str, ...]:
        return tuple(s.name for s in families() if self._video is None or s.video == self._video)

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __repr__(self) -> str:
        return repr(self._names())


# ``model.*`` keys that only some families' adapters take (as ``__init__`` keywords): ``build_adapter`` hands one on
# when it differs from its default, and a family whose adapter lacks it refuses it (:func:`family_option_error`).
FAMILY_OPTIONS = ("source_area", "true_cfg_scale", "guidance_scale_2", "lora_experts")


def adapter_options(adapter: type) -> frozenset[str]:
    """The keyword-only ``__init__`` options of an adapter class, its bases' included (a subclass such as
    FluxKontextAdapter hands ``**options`` on to its base)."""
    inits = [vars(cls)["__init__"] for cls in adapter.__mro__ if "__init__" in vars(cls)]
    params = [p for init in inits for p in inspect.signature(init).parameters.values()]
    return frozenset(p.name for p in params if p.kind is p.KEYWORD_ONLY)


def families_with_option(option: str) -> tuple[str, ...]:
    """The registered families whose adapter takes ``option`` (:func:`adapter_options`)."""
    return tuple(spec.name for spec in families() if option in adapter_options(spec.adapter))


def family_option_error(option: str, value: Any, family: str) -> ConfigError:
    """``model.<option>`` set for a family whose adapter does not take it."""
    takers = ", ".join(families_with_option(option))
    where = f"an option of {takers} only, but the model is {family}" if takers else f"not an option of {family}"
    return ConfigError(f"model.{option}={value} is {where}: remove model.{option}")


def family_of_pipeline(pipe: Any) -> FamilySpec | None:
    """The family whose adapter drives exactly ``type(pipe)``; None for anything else (subclasses and siblings too)."""
    return next((spec for spec in families() if spec.drives(pipe)), None)


def family_of_class_name(class_name: str | None) -> FamilySpec | None:
    """The family driving the pipeline class of that name (``model_index.json``'s ``_class_name``), if any."""
    return next((spec for spec in families() if class_name in spec.pipeline_names), None)


def supported_pipelines() -> str:
    """``"StableDiffusion3Pipeline (model.kind=sd3), FluxPipeline (model.kind=flux), ..."``, for messages."""
    return ", ".join(f"{name} (model.kind={spec.name})" for spec in families() for name in spec.pipeline_names)


def unsupported_pipeline_message(pipe: Any) -> str:
    """Why ``pipe`` gets no adapter, naming every pipeline class that does."""
    name = type(pipe).__name__
    return (
        f"{name} is not supported yet (no adapter drives it): the adapters drive exactly {supported_pipelines()}. "
        "A sibling pipeline (inpainting, fill, control, img2img, video-to-video, ...) feeds its transformer "
        "inputs the family's adapter never builds; supporting one is a new family: an adapter module "
        "flowgrpo/adapters/<family>.py that registers its FamilySpec"
    )


def _class_name(ref: str | type) -> str:
    return ref if isinstance(ref, str) else ref.__name__


@functools.cache
def _resolve(ref: str | type, missing_ok: bool = False) -> Any:
    """A class given as itself or by its name in ``diffusers`` (imported here: diffusers loads lazily)."""
    if not isinstance(ref, str):
        return ref
    import diffusers

    try:
        return getattr(diffusers, ref)
    except (AttributeError, ImportError, RuntimeError):
        if missing_ok:
            return None
        version = getattr(diffusers, "__version__", "?")
        raise ImportError(f"diffusers {version} has no {ref}; upgrade diffusers to use this model family") from None


__all__ = [
    "FAMILY_OPTIONS",
    "FamilyNames",
    "FamilySpec",
    "TinyBuilder",
    "adapter_options",
    "available_families",
    "families",
    "family",
    "family_of_class_name",
    "family_option_error",
    "family_of_pipeline",
    "families_with_option",
    "register_family",
    "supported_pipelines",
    "unregister_family",
    "unsupported_pipeline_message",
]
