"""The model-family registry (flowgrpo.adapters.registry): every supported pipeline class maps to its family, siblings
are refused by name, and a family registered from this file alone is a kind everywhere (tiny build, loading, adapter,
config) until it is unregistered."""

from __future__ import annotations

import inspect
from pathlib import Path

import diffusers
import pytest
from diffusers import FluxPipeline

from flowgrpo import adapters, pipelines
from flowgrpo.adapters import FluxAdapter, make_adapter
from flowgrpo.adapters.registry import (
    FamilySpec,
    available_families,
    family,
    family_of_pipeline,
    register_family,
    unregister_family,
)
from flowgrpo.checks import ConfigError
from flowgrpo.config import VIDEO_KINDS, load_config
from flowgrpo.pipelines import detect_kind, load_pipeline, pipeline_kind, tiny_sources
from flowgrpo.tiny import build_tiny_pipeline, flux_components

TINY_SD3 = Path(__file__).resolve().parent.parent / "configs" / "tiny_sd3.yaml"
SUPPORTED = {  # pipeline class -> family, written out here so that a lost or misrouted registration fails
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "FluxKontextPipeline": "flux-kontext",
    "Flux2Pipeline": "flux2",
    "Flux2KleinPipeline": "flux2-klein",
    "HunyuanVideoPipeline": "hunyuanvideo",
    "LTX2Pipeline": "ltx2",
    "QwenImagePipeline": "qwenimage",
    "QwenImageEditPipeline": "qwenimage-edit",
    "QwenImageEditPlusPipeline": "qwenimage-edit-plus",
    "WanPipeline": "wan",
    "WanImageToVideoPipeline": "wan-i2v",
    "ZImagePipeline": "zimage",
}
SIBLINGS = (  # same family namespace, other inputs (mask / control / source latents, first frames) or another model
    "FluxFillPipeline",
    "FluxControlPipeline",
    "FluxKontextInpaintPipeline",
    "FluxImg2ImgPipeline",
    "FluxInpaintPipeline",
    "Flux2KleinInpaintPipeline",
    "Flux2KleinKVPipeline",
    "HunyuanVideoImageToVideoPipeline",
    "HunyuanSkyreelsImageToVideoPipeline",
    "HunyuanVideoFramepackPipeline",
    "LTX2ImageToVideoPipeline",
    "LTX2ConditionPipeline",
    "QwenImageImg2ImgPipeline",
    "QwenImageInpaintPipeline",
    "WanVACEPipeline",
    "WanVideoToVideoPipeline",
    "StableDiffusion3Img2ImgPipeline",
    "StableDiffusion3InpaintPipeline",
)


def _sibling(name: str) -> object:
    """An instance of diffusers' class ``name``: built from the tiny FLUX components where its constructor takes them
    (FLUX's Fill / Control / Img2Img / Kontext-inpaint siblings), else an uninitialised instance (dispatch reads only
    the class)."""
    cls = getattr(diffusers, name, None)
    if cls is None:
        pytest.skip(f"diffusers {diffusers.__version__} has no {name}")
    components = build_tiny_pipeline("flux").components
    accepted = inspect.signature(cls.__init__).parameters
    try:
        return cls(**{key: value for key, value in components.items() if key in accepted})
    except (TypeError, ValueError, AttributeError):
        return cls.__new__(cls)


def test_every_supported_pipeline_class_maps_to_its_family():
    assert set(available_families()) == set(SUPPORTED.values())
    assert sorted(name for kind in available_families() for name in family(kind).pipeline_names) == sorted(SUPPORTED)
    for class_name, kind in SUPPORTED.items():
        spec = family(kind)
        pipe = build_tiny_pipeline(kind)
        assert type(pipe).__name__ == class_name and spec.pipeline_class is getattr(diffusers, class_name)
        assert family_of_pipeline(pipe) is spec and pipeline_kind(pipe) == kind
        assert type(make_adapter(pipe)) is spec.adapter is adapters.ADAPTERS[kind]
        assert isinstance(pipe.transformer, spec.transformer_class)
        assert spec.edits == (kind in ("flux-kontext", "qwenimage-edit", "qwenimage-edit-plus", "wan-i2v"))
        assert spec.video == (kind in ("hunyuanvideo", "ltx2", "wan", "wan-i2v"))
    # The tables that used to be written out are derived from the registry.
    assert pipelines.KINDS == available_families() and tuple(VIDEO_KINDS) == ("hunyuanvideo", "ltx2", "wan", "wan-i2v")
    assert pipelines.KIND_BY_CLASS_NAME == SUPPORTED
    assert tiny_sources() == {
        "tiny-sd3": "sd3",
        "tiny-sd3-taesd": "sd3",
        "tiny-flux": "flux",
        "tiny-flux-taesd": "flux",
        "tiny-flux-kontext": "flux-kontext",
        "tiny-flux-kontext-taesd": "flux-kontext",
        "tiny-flux2": "flux2",
        "tiny-flux2-klein": "flux2-klein",
        "tiny-hunyuanvideo": "hunyuanvideo",
        "tiny-ltx2": "ltx2",
        "tiny-qwenimage": "qwenimage",
        "tiny-qwenimage-edit": "qwenimage-edit",
        "tiny-qwenimage-edit-plus": "qwenimage-edit-plus",
        "tiny-wan": "wan",
        "tiny-wan-i2v": "wan-i2v",
        "tiny-zimage": "zimage",
    }


@pytest.mark.parametrize("name", SIBLINGS)
def test_sibling_pipelines_are_refused_naming_the_supported_classes(name):
    pipe = _sibling(name)
    assert type(pipe).__name__ == name and family_of_pipeline(pipe) is None
    with pytest.raises(ValueError, match=f"{name} is not supported yet") as refused:
        make_adapter(pipe)
    message = str(refused.value)
    assert all(f"{cls} (model.kind={kind})" in message for cls, kind in SUPPORTED.items()), message
    with pytest.raises(ValueError, match="supported kinds"):
        pipeline_kind(pipe)


def test_a_subclass_of_a_supported_pipeline_is_refused_too():
    class PatchedFluxPipeline(FluxPipeline):  # e.g. a user's pipeline with its own __call__: the adapter is FLUX's
        pass

    pipe = PatchedFluxPipeline(**build_tiny_pipeline("flux").components)
    with pytest.raises(ValueError, match="PatchedFluxPipeline is not supported yet.*FluxPipeline"):
        make_adapter(pipe)


# ---------------------------------------------------------------- a family registered from this file alone
class ToyFluxPipeline(FluxPipeline):
    """A pipeline class of its own (the registry dispatches on exact classes, so FluxPipeline stays ``flux``)."""


class ToyFluxAdapter(FluxAdapter):
    family = "toy-flux"


class ToyVideoAdapter(FluxAdapter):
    family = "toy-video"


class ToyVideoPipeline(FluxPipeline):
    pass


@pytest.fixture
def toy_families():
    specs = [
        FamilySpec(
            name="toy-flux",
            pipelines=(ToyFluxPipeline,),
            transformer="FluxTransformer2DModel",
            adapter=ToyFluxAdapter,
            tiny=flux_components,
            tiny_vaes=("kl", "tiny"),
        ),
        FamilySpec(
            name="toy-video",
            pipelines=(ToyVideoPipeline,),
            transformer="FluxTransformer2DModel",
            adapter=ToyVideoAdapter,
            video=True,
        ),
    ]
    for spec in specs:
        register_family(spec)
    try:
        yield specs
    finally:
        for spec in specs:
            unregister_family(spec.name)


def test_a_family_registered_from_a_test_file_is_a_kind_everywhere(toy_families):
    assert {"toy-flux", "toy-video"} <= set(available_families()) and adapters.ADAPTERS["toy-flux"] is ToyFluxAdapter
    assert "toy-video" in VIDEO_KINDS and "toy-flux" not in VIDEO_KINDS  # config's constant follows the registry
    assert tiny_sources()["tiny-toy-flux-taesd"] == "toy-flux" and "tiny-toy-video" not in tiny_sources()
    pipe = build_tiny_pipeline("toy-flux", vae="tiny")
    assert type(pipe) is ToyFluxPipeline and type(make_adapter(pipe)) is ToyFluxAdapter
    assert type(make_adapter(build_tiny_pipeline("flux"))) is FluxAdapter  # the parent class keeps its own family
    assert detect_kind("tiny-toy-flux") == "toy-flux" and pipeline_kind(load_pipeline("tiny-toy-flux")) == "toy-flux"
    with pytest.raises(ValueError, match="unknown tiny pipeline kind 'toy-video'"):
        build_tiny_pipeline("toy-video")
    with pytest.raises(ValueError, match="model.num_frames is for video pipelines \\(.*ToyVideoPipeline"):
        make_adapter(pipe, num_frames=5)

    # Config validation reads the registry: the toy kinds are accepted, num_frames only for the video one.
    config = load_config(TINY_SD3, ["model.kind=toy-flux", "model.pretrained=tiny-toy-flux"])
    assert config.model.kind == "toy-flux"
    load_config(TINY_SD3, ["model.kind=toy-video", "model.num_frames=5"])
    with pytest.raises(ConfigError, match="is for video models \\(.*toy-video"):
        load_config(TINY_SD3, ["model.kind=toy-flux", "model.num_frames=5"])


def test_an_unregistered_family_is_refused_everywhere(toy_families):
    pipe = build_tiny_pipeline("toy-flux")
    for spec in toy_families:
        unregister_family(spec.name)
    try:
        assert "toy-flux" not in available_families() and "toy-video" not in VIDEO_KINDS
        with pytest.raises(ValueError, match="ToyFluxPipeline is not supported yet"):
            make_adapter(pipe)
        with pytest.raises(ValueError, match="unknown tiny pipeline kind 'toy-flux'"):
            build_tiny_pipeline("toy-flux")
        with pytest.raises(ConfigError, match=r"model.kind must be one of auto, flux, .*got 'toy-flux'"):
            load_config(TINY_SD3, ["model.kind=toy-flux"])
    finally:
        for spec in toy_families:
            register_family(spec)  # the fixture unregisters them


def test_registration_is_refused_early_for_a_bad_spec(toy_families):
    flux = family("flux")
    with pytest.raises(ValueError, match="'flux' is already registered"):
        register_family(FamilySpec(name="flux", pipelines=(ToyFluxPipeline,), transformer="X", adapter=FluxAdapter))
    with pytest.raises(ValueError, match="FluxPipeline is already driven by 'flux'"):
        register_family(
            FamilySpec(
                name="toy-flux-2",
                pipelines=("FluxPipeline",),
                transformer="X",
                adapter=type("A", (FluxAdapter,), {"family": "toy-flux-2"}),
            )
        )
    with pytest.raises(ValueError, match="has family='flux', not the spec's name"):
        FamilySpec(name="toy-3", pipelines=("ToyPipeline",), transformer="X", adapter=FluxAdapter)
    with pytest.raises(ValueError, match="lower case"):
        FamilySpec(name="auto", pipelines=("ToyPipeline",), transformer="X", adapter=FluxAdapter)
    with pytest.raises(ValueError, match="tiny_vaes"):
        FamilySpec(name="flux", pipelines=("ToyPipeline",), transformer="X", adapter=FluxAdapter, tiny_vaes=("vq",))
    with pytest.raises(ValueError, match="unknown model family 'flx'.*did you mean 'flux'"):
        family("flx")
    assert register_family(flux) is flux and family("flux") is flux  # re-registering the same spec is a no-op
