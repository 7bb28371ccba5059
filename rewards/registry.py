"""Reward registry and ``build_reward``: turn a config's ``rewards:`` section into one combined reward.

Accepted specs (the config's ``rewards:`` value):

    {ocr: 1.0, pickscore: 0.5}                               # name -> weight
    {clipscore: {weight: 1.0, model: ViT-L-14, pretrained: openai}}   # name -> options
    [{name: ocr, weight: 1.0}, {name: remote, url: "http://127.0.0.1:8765/score", key: geneval}]
    {"my_pkg.my_rewards:Brightness": 0.2}                    # custom class (or factory) by path

``weight`` defaults to 1.0; ``key`` renames a reward's output (needed to use one reward twice);
every other option goes to the reward's constructor, and ``device`` defaults to ``build_reward``'s.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from .base import Reward
from .combine import CombinedReward, RewardEntry
from .nan_policy import check_nan_policy

REWARDS: dict[str, Callable[..., Reward]] = {}
_R = TypeVar("_R")


def register_reward(name: str) -> Callable[[_R], _R]:
    """Class decorator: make a reward available to configs as ``name``."""

    def wrap(cls: _R) -> _R:
        if name in REWARDS and REWARDS[name] is not cls:
            raise ValueError(f"reward name '{name}' is already registered to {REWARDS[name]!r}")
        if isinstance(cls, type):
            cls.name = name  # the key a reward's scores carry when called on its own
        REWARDS[name] = cls
        return cls

    return wrap


def available_rewards() -> list[str]:
    return sorted(REWARDS)


def resolve_reward(name: str) -> Callable[..., Reward]:
    """A registered name, or ``"package.module:Attr"`` naming a reward class or factory."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"reward '{name}': cannot import module '{module_name}' ({err})") from err
        target: Any = module
        for part in attr.split("."):
            if not hasattr(target, part):
                raise ValueError(f"reward '{name}': module '{module_name}' has no attribute '{attr}'")
            target = getattr(target, part)
        if not callable(target):
            raise ValueError(f"reward '{name}': '{attr}' is not a class or function")
        return target
    if name not in REWARDS:
        close = difflib.get_close_matches(name, REWARDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(
            f"unknown reward '{name}'; registered: {', '.join(available_rewards())}{hint} "
            "(custom rewards: 'package.module:ClassName')"
        )
    return REWARDS[name]


def _instantiate(name: str, options: dict[str, Any], device: str | torch.device) -> Reward:
    factory = resolve_reward(name)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature: pass options through
        params = None
    if params is not None:
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        if "device" in params or takes_kwargs:
            options.setdefault("device", device)
        accepted = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
        unknown = sorted(set(options) - set(accepted))
        if unknown and not takes_kwargs:
            raise ValueError(
                f"reward '{name}': unknown option(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}"
            )
    reward = factory(**options)
    if not callable(reward):
        raise ValueError(f"reward '{name}' built a {type(reward).__name__}, which is not callable")
    return reward


def _entries(spec: Any) -> list[dict[str, Any]]:
    """Normalise every accepted spec form to a list of ``{name, weight, key, **options}`` dicts."""
    if isinstance(spec, str):
        return [{"name": spec}]
    if isinstance(spec, Mapping):
        out = []
        for name, value in spec.items():
            if isinstance(value, Mapping):
                if "name" in value:
                    raise ValueError(f"rewards.{name}: do not repeat 'name' inside its options")
                out.append({"name": name, **value})
            else:
                out.append({"name": name, "weight": value})
        return out
    if isinstance(spec, Sequence):
        out = []
        for i, item in enumerate(spec):
            if isinstance(item, str):
                item = {"name": item}
            if not isinstance(item, Mapping) or "name" not in item:
                raise ValueError(f"rewards[{i}] must be a reward name or a dict with a 'name' key; got {item!r}")
            out.append(dict(item))
        return out
    raise ValueError(
        f"rewards must be a dict {{name: weight}} or a list of {{name, weight, ...options}}; got {type(spec).__name__}"
    )


def build_reward(spec: Any, device: str | torch.device = "cpu", *, nan_policy: str = "error") -> CombinedReward:
    """Build every reward in ``spec`` once and combine them: output = each key's raw scores + ``total``.

    ``nan_policy``: ``"error"`` raises on a non-finite score naming the reward; ``"drop"`` lets
    them through for ``apply_nan_policy`` to drop the affected groups.
    """
    check_nan_policy(nan_policy)
    entries = _entries(spec)
    if not entries:
        raise ValueError("rewards is empty; give at least one reward, e.g. {ocr: 1.0}")
    built: list[RewardEntry] = []
    for item in entries:
        name = str(item.pop("name"))
        weight = item.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"rewards.{name}: weight must be a finite number; got {weight!r}")
        key = str(item.pop("key", name.rpartition(":")[2].rpartition(".")[2] if ":" in name else name))
        if key == "total" or "/" in key:
            raise ValueError(f"rewards.{name}: key '{key}' is reserved; choose another with key=...")
        if any(e.key == key for e in built):
            raise ValueError(f"rewards: key '{key}' appears twice; give each a distinct key=... option")
        built.append(RewardEntry(key, float(weight), _instantiate(name, item, device)))
    return CombinedReward(built, nan_policy=nan_policy)
