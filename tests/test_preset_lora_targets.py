"""Every preset's LoRA targets reach its model: each name of ``model.lora.target_modules`` (or of the family's default
list) wraps at least one module of the family's tiny transformer, through the code the export's shape check runs
(:func:`flowgrpo.export.expected_lora_shapes`: the adapter's ``lora_model``, ``lora_exclude`` and peft's suffix
matching). peft refuses a list that matches nothing at all, but silently drops one name that matches nothing beside
others that do, so a preset could train less than its comments say (a FLUX.1 name on FLUX.2, say)."""

from __future__ import annotations

from pathlib import Path

import yaml

from flowgrpo.config import load_config
from flowgrpo.export import expected_lora_shapes
from flowgrpo.pipelines import tiny_sources

ROOT = Path(__file__).resolve().parent.parent
# The presets' hub models -> the tiny model of their family (the same transformer class and module names).
TINY_OF = {
    "stabilityai/stable-diffusion-3.5-medium": "tiny-sd3",
    "stabilityai/stable-diffusion-3.5-large": "tiny-sd3",
    "shapes-sd3": "tiny-sd3",
    "black-forest-labs/FLUX.1-dev": "tiny-flux",
    "black-forest-labs/FLUX.1-schnell": "tiny-flux",
    "black-forest-labs/FLUX.1-Kontext-dev": "tiny-flux-kontext",
    "black-forest-labs/FLUX.2-dev": "tiny-flux2",
    "black-forest-labs/FLUX.2-klein-base-4B": "tiny-flux2-klein",
    "Qwen/Qwen-Image": "tiny-qwenimage",
    "Qwen/Qwen-Image-Edit": "tiny-qwenimage-edit",
    "Qwen/Qwen-Image-Edit-2509": "tiny-qwenimage-edit-plus",
    "hunyuanvideo-community/HunyuanVideo": "tiny-hunyuanvideo",
    "Lightricks/LTX-2": "tiny-ltx2",
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": "tiny-wan",
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": "tiny-wan",
    "Tongyi-MAI/Z-Image-Turbo": "tiny-zimage",
}


def _matches(module: str, target: str) -> bool:
    """peft's rule for a list of target names: the module's full name, or its suffix after a dot."""
    return module == target or module.endswith(f".{target}")


def test_every_presets_lora_targets_each_wrap_a_module_of_its_model():
    groups: dict[tuple, list[str]] = {}  # the same tiny model and targets: checked once
    configs = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if "model" not in (yaml.safe_load(path.read_text()) or {}):
            continue  # not a run preset (accelerate's files live in a subfolder)
        config = load_config(path)
        m = config.model
        tiny = m.pretrained if m.pretrained in tiny_sources() else TINY_OF.get(m.pretrained)
        assert tiny is not None, f"{path.name}: add model.pretrained={m.pretrained!r}'s tiny model to TINY_OF"
        m.pretrained, m.kind = tiny, tiny_sources()[tiny]
        targets = m.lora.target_modules
        key = (tiny, targets if isinstance(targets, str) else tuple(targets), m.lora_experts)
        groups.setdefault(key, []).append(path.stem)
        configs[key] = config
    assert {"flux2_dev_pickscore", "flux2_klein_pickscore"} <= {name for names in groups.values() for name in names}
    unmatched = []
    for key, names in groups.items():
        config = configs[key]
        wrapped = {name.split(".lora_")[0] for name in expected_lora_shapes(config)}
        targets = config.model.lora.target_modules
        if targets == "default":
            from flowgrpo.adapters import family

            targets = family(config.model.kind).adapter.default_lora_targets
        unmatched += [(names, t) for t in targets if not any(_matches(module, t) for module in wrapped)]
    assert not unmatched, unmatched
