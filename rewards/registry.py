"""Reward registry and ``build_reward``: turn a config's ``rewards:`` section into one combined reward.

Accepted specs (the config's ``rewards:`` value):

    {ocr: 1.0, pickscore: 0.5}                               # name -> weight
    {clipscore: {weight: 1.0, model: ViT-L-14, pretrained: openai}}   # name -> options
    [{name: ocr, weight: 1.0}, {name: remote, url: "http://127.0.0.1:8765/score", key: geneval}]
    {"my_pkg.my_rewards:Brightness": 0.2}                    # custom class (or factory) by path

``weight`` defaults to 1.0; ``key`` renames a reward's output (needed to use one reward twice);
``frames`` (videos only) sets how an image reward scores clips, ``{every: 4, reduce: positive_mean}``
(``rewards.video.FrameReward``; without it: the mean over every frame);
every other option goes to the reward's constructor, and ``device`` defaults to ``build_reward``'s.

A custom reward (class or factory) is called as ``reward(images, prompts, metadata)``; to receive the source image
of each edit as well (image editing), give its ``__call__`` a ``source_images`` parameter (``None`` when the data has
no source images), or subclass ``BaseReward`` with ``uses_source_images = True``, as ``consistency`` does.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from .base import BaseReward, Reward
from .combine import CombinedReward, RewardEntry
from .nan_policy import check_nan_policy
from .video import FrameReward

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
    if isinstance(factory, type) and not _callable_as_reward(factory):
        raise ValueError(f"reward '{name}': {factory.__name__} is not a reward: {_NOT_A_REWARD}")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins without a signature: pass options through
        signature = None
    if signature is not None:
        _check_options(name, signature, options, device)
    try:
        reward = factory(**options)
    except TypeError as err:  # a constructor's own type check; the options matched its signature
        raise ValueError(f"reward '{name}': building it with options {sorted(options)} failed: {err}") from err
    if not callable(reward) or not _callable_as_reward(reward):
        raise ValueError(f"reward '{name}' built a {type(reward).__name__}, which is not a reward: {_NOT_A_REWARD}")
    return reward


_NOT_A_REWARD = (
    "a reward is called as reward(images, prompts, metadata) and returns scores (subclass rewards.BaseReward and "
    "implement score(), or give a factory that returns such an object)"
)


def _check_options(name: str, signature: inspect.Signature, options: dict[str, Any], device: Any) -> None:
    """Options the factory does not accept, or required ones the config lacks, are config errors (not TypeErrors)."""
    params = signature.parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "device" in params or takes_kwargs:
        options.setdefault("device", device)
    named = {n: p for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY)}
    unknown = sorted(set(options) - set(named))
    if unknown and not takes_kwargs:
        raise ValueError(f"reward '{name}': unknown option(s) {', '.join(unknown)}; accepted: {', '.join(named)}")
    required = [
        n for n, p in params.items() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    missing = [n for n in required if n not in options]
    if missing:
        example = ", ".join(f"{n}: ..." for n in missing)
        raise ValueError(
            f"reward '{name}' needs option(s) {', '.join(missing)}, which the config does not give: write "
            f"rewards: [{{name: {name}, {example}}}]"
        )


def _callable_as_reward(target: Any) -> bool:
    """Whether ``target`` (an instance, or a class for its instances) can be called with (images, prompts, metadata).

    A torch module is called through ``forward``, whose signature ``__call__`` hides (``torch.nn.Linear`` takes
    one input, so it is no reward although its instances are callable)."""
    is_class = isinstance(target, type)
    cls = target if is_class else type(target)
    if isinstance(target, BaseReward) or (is_class and issubclass(target, BaseReward)):
        return True
    if issubclass(cls, torch.nn.Module):
        function = cls.forward if is_class else target.forward
    elif is_class:
        if not any("__call__" in vars(k) for k in cls.__mro__):  # instances would not be callable
            return False
        function = cls.__call__
    else:
        function = target
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to check (builtins): trust it
        return True
    args = ("self", "images", "prompts", "metadata") if is_class else ("images", "prompts", "metadata")
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


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


def _key(name: str, options: Mapping[str, Any]) -> str:
    """A reward's key: its ``key`` option, else its name (an import path's class or function name)."""
    return str(options.get("key", name.rpartition(":")[2].rpartition(".")[2] if ":" in name else name))


def reward_weights(spec: Any) -> dict[str, Any]:
    """``{key: weight}`` of the rewards in ``spec``, keyed as :func:`build_reward` keys them, without building any
    (a config's checks; ``build_reward`` validates the weights)."""
    return {_key(str(e["name"]), e): e.get("weight", 1.0) for e in _entries(spec)}


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
        key = _key(name, item)
        item.pop("key", None)
        if key == "total" or "/" in key:
            raise ValueError(f"rewards.{name}: key '{key}' is reserved; choose another with key=...")
        if any(e.key == key for e in built):
            raise ValueError(f"rewards: key '{key}' appears twice; give each a distinct key=... option")
        frames = item.pop("frames", None)
        reward = _instantiate(name, item, device)
        if frames is not None:
            reward = _frame_reward(name, key, reward, frames)
        built.append(RewardEntry(key, float(weight), reward))
    return CombinedReward(built, nan_policy=nan_policy)


def _frame_reward(name: str, key: str, reward: Reward, frames: Any) -> FrameReward:
    """The ``frames`` option: how an image reward scores videos (``rewards.video.FrameReward``)."""
    if not isinstance(frames, Mapping):
        raise ValueError(f"rewards.{name}.frames must be a mapping such as {{every: 4, reduce: mean}}; got {frames!r}")
    unknown = sorted(set(frames) - {"every", "reduce"})
    if unknown:
        raise ValueError(f"rewards.{name}.frames: unknown option(s) {', '.join(unknown)}; accepted: every, reduce")
    try:
        return FrameReward(reward, name=key, **frames)
    except ValueError as err:
        raise ValueError(f"rewards.{name}: {err}") from None
