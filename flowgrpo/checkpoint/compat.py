"""Whether a checkpoint's adapter weights belong to the model a config describes: one implementation for resume
(the trainer), loading (:func:`flowgrpo.checkpoint.lora.load_lora_state`) and export.

Two questions, asked before any model weight is loaded:

- **Do they fit?** Every saved LoRA weight is a LoRA weight of the model, of the same shape, and the other way
  round (:func:`lora_mismatch`; diffusers' ``load_lora_weights`` would load whatever names happen to match).
- **Do they mean the same?** The same base model, LoRA rank, alpha and target modules (``WEIGHT_KEYS``) as the
  checkpoint was trained on (:func:`check_model_matches`): a rank-16 adapter of another fine-tune fits, and means
  something else. The record is the checkpoint's ``trained_on`` (state.json); for checkpoints of earlier releases,
  its adapter_config.json and the run's config.yaml.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .layout import ADAPTER_CONFIG_FILE, ADAPTER_FILE, CONFIG_FILE, EMA_FILE, STATE_FILE
from .safe_io import CheckpointError, read_json, reading

if TYPE_CHECKING:
    from ..config import Config

Shapes = dict[str, tuple[int, ...]]  # saved (peft) name -> shape

# Config keys whose change alters what the adapter weights mean: a resume or an export with another value is refused.
WEIGHT_KEYS = ("model.pretrained", "model.lora.rank", "model.lora.alpha", "model.lora.target_modules")
# Keys a resume may change without comment (extending a run, console output, where resume points, where new runs go).
BOOKKEEPING_KEYS = {"run.resume", "run.epochs", "run.progress", "run.log_every", "run.output_dir"}


# ---------------------------------------------------------------------------- do the weights fit the model
def lora_mismatch(expected: Shapes, saved: Shapes) -> list[str]:
    """Why ``saved`` LoRA weights are not exactly the model's ``expected`` ones: weights missing, unexpected or
    of another shape, each with a count and an example; empty when they fit."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    reshaped = sorted(k for k in set(expected) & set(saved) if expected[k] != saved[k])
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} of the model's {len(expected)} LoRA weights are not in the checkpoint (e.g. {missing[0]})"
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} of the checkpoint's {len(saved)} are not in the model (e.g. {unexpected[0]})"
        )
    if reshaped:
        key = reshaped[0]
        problems.append(
            f"{len(reshaped)} differ in shape (e.g. {key}: {saved[key]} saved, {expected[key]} in the model)"
        )
    return problems


def saved_lora_shapes(checkpoint: Path, *, ema: bool = False) -> Shapes:
    """Names and shapes of a checkpoint's adapter (or EMA) weights, read from the file header only."""
    from safetensors import safe_open

    file = Path(checkpoint) / (EMA_FILE if ema else ADAPTER_FILE)
    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as err:  # safetensors raises its own error types for damaged headers
        raise CheckpointError(f"{file} is not a readable safetensors file ({err}); the checkpoint is damaged") from None


def model_lora_shapes(model: Any) -> Shapes:
    """Names (as checkpoints save them) and shapes of a model's LoRA weights."""
    from peft import get_peft_model_state_dict

    return {key: tuple(value.shape) for key, value in get_peft_model_state_dict(model).items()}


def check_lora_fits(checkpoint: Path, config: Config, expected: Shapes, saved: Shapes) -> None:
    """Refuse a checkpoint whose LoRA weights (``saved``) are not exactly the model's (``expected``): another model
    family or size, or other ``model.lora`` settings. The message names the config keys that decide them."""
    problems = lora_mismatch(expected, saved)
    if not problems:
        return
    m = config.model
    raise CheckpointError(
        f"checkpoint {checkpoint} was not trained on model.pretrained={m.pretrained!r} with model.lora rank "
        f"{m.lora.rank}, target_modules {m.lora.target_modules!r}: {'; '.join(problems)}. Use the config the "
        "checkpoint was trained with (leave out --config to read <run>/config.yaml), or set model.pretrained and "
        "model.lora to the model it was trained on"
    )


def check_checkpoint_fits(checkpoint: Path, config: Config, expected: Shapes, *, ema: bool = False) -> None:
    """Both questions for a model not yet loaded: the checkpoint's adapter (``ema``: EMA) weights have exactly the
    ``expected`` names and shapes (:func:`check_lora_fits`), and were trained on the model ``config`` describes
    (:func:`check_model_matches`: same shapes, other meaning — another fine-tune, alpha, targets)."""
    check_lora_fits(checkpoint, config, expected, saved_lora_shapes(checkpoint, ema=ema))
    check_model_matches(checkpoint, config)


# ---------------------------------------------------------------------------- do the weights mean the same
def check_model_matches(checkpoint: Path, config: Config) -> None:
    """Raise :class:`CheckpointError` when ``config`` describes another model than the one ``checkpoint`` was
    trained on: another ``model.pretrained``, LoRA rank, alpha or target modules (the weights would mean something
    else, or not fit). The message names each key with the checkpoint's and the config's value, and the fix.

    The record is the checkpoint's ``trained_on`` (state.json); for checkpoints of earlier releases, its
    adapter_config.json and the run's config.yaml. Nothing to compare: no error."""
    recorded = trained_on(checkpoint)
    given = _model_keys(config, recorded.get("model.kind"))
    wrong = [(k, recorded[k], given[k]) for k in WEIGHT_KEYS if k in recorded and not _same(k, recorded[k], given[k])]
    if wrong:
        listed = "; ".join(f"{k}: checkpoint {old!r}, config {new!r}" for k, old, new in wrong)
        fix = " ".join(f"{k}={_override(old)}" for k, old, _ in wrong)
        raise CheckpointError(
            f"{checkpoint} was trained on another model than this config describes ({listed}). These settings "
            f"decide what the adapter weights mean: use the config the checkpoint was trained with (its "
            f"{CONFIG_FILE}), or pass {fix}; to train with new ones, start a new run"
        )


def trained_on(checkpoint: Path) -> dict[str, Any]:
    """What a checkpoint's weights were trained on: ``WEIGHT_KEYS`` (and ``model.kind``, the family) to values."""
    checkpoint = Path(checkpoint)
    state = read_json(checkpoint / STATE_FILE) if (checkpoint / STATE_FILE).is_file() else {}
    if isinstance(state, dict) and isinstance(state.get("trained_on"), dict):
        return dict(state["trained_on"])
    record: dict[str, Any] = {}
    model = (recorded_config(checkpoint) or {}).get("model") or {}
    if "pretrained" in model:
        record["model.pretrained"] = model["pretrained"]
    if model.get("kind") not in (None, "auto"):
        record["model.kind"] = model["kind"]
    adapter = checkpoint / ADAPTER_CONFIG_FILE
    lora = read_json(adapter) if adapter.is_file() else {}
    if isinstance(lora, dict):
        for key, name in (("model.lora.rank", "r"), ("model.lora.alpha", "lora_alpha")):
            if name in lora:
                record[key] = lora[name]
        if lora.get("target_modules"):
            record["model.lora.target_modules"] = sorted(lora["target_modules"])
    return record


def recorded_config(checkpoint: Path) -> dict[str, Any] | None:
    """The resolved config a checkpoint was trained with, as a dict: its own config.yaml, or for checkpoints of
    earlier releases the run's; None when neither exists."""
    checkpoint = Path(checkpoint)
    for path in (checkpoint / CONFIG_FILE, checkpoint.parent.parent / CONFIG_FILE):
        if path.is_file():
            with reading(path):
                data = yaml.safe_load(path.read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else None
    return None


def recipe_changes(checkpoint: Path, config: Config) -> list[str]:
    """``key: old -> new`` for each setting that differs from the checkpoint's config, besides the bookkeeping
    ones (run.epochs, run.resume, ...): what a resume warns about."""
    old = recorded_config(checkpoint)
    if old is None:
        return []
    before, now = _flat(old), _flat(config.to_dict())
    defaults = _flat(config.with_every_section(type(config)().to_dict()))
    # A key on one side only, at its default on the other, changes nothing: grpo.objective on an older run, or an
    # inactive plugin's section (older runs wrote every objective's section).
    one_sided = (set(now) ^ set(before)) & set(defaults)
    at_default = {k for k in one_sided if now.get(k, before.get(k)) == defaults[k]}
    keys = sorted((set(before) | set(now)) - BOOKKEEPING_KEYS - at_default)
    return [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in keys if before.get(k) != now.get(k)]


def _model_keys(config: Config, family: str | None) -> dict[str, Any]:
    """``WEIGHT_KEYS`` of ``config``, target modules resolved for ``family`` (``default``: its adapter's list)."""
    m = config.model
    targets = m.lora.target_modules
    if targets == "default" and family is not None:
        from ..adapters import ADAPTERS

        targets = list(ADAPTERS[family].default_lora_targets) if family in ADAPTERS else targets
    return {
        "model.pretrained": m.pretrained,
        "model.lora.rank": m.lora.rank,
        "model.lora.alpha": m.lora.alpha,
        "model.lora.target_modules": sorted(targets) if isinstance(targets, list | tuple) else targets,
    }


def _same(key: str, old: Any, new: Any) -> bool:
    if key == "model.pretrained" and old != new:
        a, b = Path(str(old)).expanduser(), Path(str(new)).expanduser()
        return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()  # one local directory, spelled two ways
    if key == "model.lora.alpha":
        return isinstance(old, int | float) and isinstance(new, int | float) and math.isclose(old, new)
    if key == "model.lora.target_modules" and isinstance(old, list | tuple) and isinstance(new, list | tuple):
        return sorted(old) == sorted(new)
    return old == new


def _override(value: Any) -> str:
    return json.dumps(value) if isinstance(value, list | tuple) else str(value)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{"a.b.c": value}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
