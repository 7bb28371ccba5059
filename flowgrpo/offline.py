"""Offline experience: groups of samples and their rewards drawn once, stored on disk, and trained on epoch after
epoch without sampling again (``sampler.rollout: offline``, :mod:`flowgrpo.rollouts.offline`; GDRO's setting,
:mod:`flowgrpo.objectives.gdro`).

A store is a directory of two files, no pickle anywhere:

``samples.safetensors``
    ``final_latents`` [G·k, *latent] in the latents' own dtype (the ODE's final samples, group-major: group g holds
    rows g·k … g·k + k - 1), ``group`` [G·k] int64 (each row's group, 0 … G-1), ``prompt_index`` [G] int64 (each
    group's row of the prompt file) and ``reward/<key>`` [G·k] float32 (each reward the config names, and
    ``total``, their weighted sum, exactly as the reward returned them).
``store.json``
    what made it: the prompts of the groups, the prompt file's sha256, the model (pretrained, height and width, family,
    latent shape and dtype), the rewards' config and keys, the seed, the whole config, the time spent sampling and
    scoring (the one-time cost), and the sha256 of ``samples.safetensors``. Written last: a store without it is
    unfinished.

:func:`build_store` samples one (``scripts/sample_offline.py``, or the offline rollout on a run's first epoch):
``sampler.offline.groups`` groups of ``grpo.group_size`` images, group g's prompt the g-th of a permutation of the
prompt file drawn from ``run.seed`` (cycled when there are more groups than prompts), sampled with the plain ODE of
the config's sampler by the base model (the LoRA adapter switched off: the reference model GDRO samples with, so a
store is a function of the config alone, whatever weights the run holds), in rollout batches of
``sampler.batch_size`` whose initial noise is a function of (``run.seed``, batch index). :func:`check_store` refuses,
as a :class:`~flowgrpo.checks.ConfigError` naming ``sampler.offline.path`` and the fix, a store that is missing,
unfinished, corrupt (a header that does not match; with ``verify``, the sha256 of ``samples.safetensors``), was made
for another model, image size, group size, reward or prompt file, or holds non-finite rewards under
``grpo.nan_policy: error``. Without ``verify`` it reads only the two headers and the small tensors (what config
validation runs); the hash reads the whole file, once, when the run opens the store. :func:`served_groups` is the
order the groups are trained in.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from .checks import ConfigError, check_range

if TYPE_CHECKING:
    from .adapters import PipelineAdapter
    from .config import Config
    from .data import PromptDataset

FORMAT = "flowgrpo-offline-store"
VERSION = 1
INFO = "store.json"
SAMPLES = "samples.safetensors"
KEY = "sampler.offline.path"
#: the latents' dtypes a store may hold, as ``store.json`` names them and the safetensors header writes them
DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
#: (images, prompts, metadata, source images or None) -> the reward's scores now ("total": [B], one key per reward)
Score = Callable[[Tensor, list[str], list[dict[str, Any]], Any], dict[str, Tensor]]


@dataclass
class OfflineConfig:
    """``sampler.offline:`` where the stored groups are (``sampler.rollout: offline``), how many a new store holds."""

    path: str | None = None  # a store's directory (scripts/sample_offline.py --out DIR); null: this run samples one
    #                          into <run directory>/offline on its first epoch, and a resume of the run reuses it
    groups: int | None = None  # groups a new store holds (this run's or the script's): null = one per prompt of
    #                            data.train, at least grpo.groups_per_epoch


@dataclass
class StoreInfo:
    """A store's ``store.json``, read and checked (:func:`read_info`)."""

    path: Path  # the store's directory
    groups: int
    group_size: int
    latent_shape: tuple[int, ...]
    prompt_indices: list[int]
    reward_keys: list[str]
    guidance_scale: float
    raw: dict[str, Any]  # the whole JSON

    @property
    def samples(self) -> Path:
        return self.path / SAMPLES

    @property
    def cost(self) -> str:
        """The one-time cost, as store.json recorded it."""
        t = self.raw["timing"]
        return f"sampled once in {t['sampling_s']:.1f} s and scored in {t['scoring_s']:.1f} s ({t['device']})"


def store_groups(config: Config, num_prompts: int) -> int:
    """How many groups a new store holds: ``sampler.offline.groups``, or one per prompt (at least an epoch's)."""
    wanted = config.sampler.offline.groups
    return wanted if wanted is not None else max(num_prompts, config.grpo.groups_per_epoch)


def store_prompts(num_prompts: int, groups: int, seed: int) -> list[int]:
    """Each group's prompt index: a permutation of the prompts drawn from ``seed``, cycled."""
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed * 100_019 + 3)).tolist()
    return [order[g % num_prompts] for g in range(groups)]


def served_groups(num_groups: int, groups_per_epoch: int, *, seed: int, epoch: int) -> list[int]:
    """The store's groups that epoch ``epoch`` trains, in order: the epochs walk through an endless sequence of
    permutations of the G groups, pass p's drawn from (``seed``, p), ``groups_per_epoch`` at a time. A function of
    (seed, epoch) alone, so a resumed run replays the same groups in the same order; every group once per pass."""
    start, end = epoch * groups_per_epoch, (epoch + 1) * groups_per_epoch
    out: list[int] = []
    for p in range(start // num_groups, (end - 1) // num_groups + 1):
        order = torch.randperm(num_groups, generator=torch.Generator().manual_seed(seed * 1_000_039 + p)).tolist()
        lo, hi = max(start - p * num_groups, 0), min(end - p * num_groups, num_groups)
        out.extend(order[lo:hi])
    return out


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples as lists, keys as strings), for comparisons with a stored copy."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _resample() -> str:
    return f"python scripts/sample_offline.py --config <your config> --out NEW_DIR, then set {KEY}: NEW_DIR"


# ---------------------------------------------------------------------------------------------- writing a store
@torch.no_grad()
def build_store(
    config: Config,
    adapter: PipelineAdapter,
    data: PromptDataset,
    score: Score,
    out: Path,
    *,
    progress: bool = False,
    should_stop: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
) -> StoreInfo | None:
    """Sample and score a new store into ``out`` (which must not hold one): :data:`module docstring <flowgrpo.offline>`
    says what. None when ``should_stop()`` said so after a rollout batch (nothing is written)."""
    from tqdm.auto import tqdm

    from .rollout import rollout

    g, s, m = config.grpo, config.sampler, config.model
    height, width = m.size
    groups, k = store_groups(config, len(data)), g.group_size
    prompt_of_group = store_prompts(len(data), groups, config.run.seed)
    rows = [(group, prompt_of_group[group]) for group in range(groups) for _ in range(k)]  # group-major
    batches = [rows[i : i + s.batch_size] for i in range(0, len(rows), s.batch_size)]
    latents: list[Tensor] = []
    scores: list[dict[str, Tensor]] = []
    sampling = scoring = 0.0
    log(f"offline store: sampling {groups} groups × {k} images once ({len(batches)} rollout batches) into {out}")
    with adapter.unwrapped(), adapter.adapter_disabled():  # the base model, whatever the run's weights
        for index, batch in enumerate(tqdm(batches, desc="offline store", leave=False, disable=not progress)):
            indices = [p for _, p in batch]
            prompts, metadata = [data.prompts[i] for i in indices], [dict(data.metadata[i]) for i in indices]
            sources = data.sources_of(indices)
            start = time.perf_counter()
            generator = torch.Generator().manual_seed(config.run.seed * 1_000_033 + 17 * index + 5)
            trajectory = rollout(
                adapter,
                prompts,
                [group for group, _ in batch],
                s,
                range(0, 0),  # no SDE window: the plain ODE (a forward-process objective needs noise_level 0)
                generator,
                height=height,
                width=width,
                metadata=metadata,
                noise_seed=config.run.seed,
                sources=sources,
            )
            latents.append(trajectory.final_latents.cpu())
            sampling += time.perf_counter() - start
            start = time.perf_counter()
            batch_scores = score(trajectory.images, prompts, metadata, trajectory.source_images)
            scores.append({key: value.detach().float().cpu() for key, value in batch_scores.items()})
            scoring += time.perf_counter() - start
            if should_stop():
                return None
    final = torch.cat(latents)
    tensors = {
        "final_latents": final.contiguous(),
        "group": torch.arange(groups).repeat_interleave(k),
        "prompt_index": torch.tensor(prompt_of_group, dtype=torch.long),
        **{f"reward/{key}": torch.cat([b[key] for b in scores]).contiguous() for key in sorted(scores[0])},
    }
    info = {
        "format": FORMAT,
        "version": VERSION,
        "groups": groups,
        "group_size": k,
        "prompts": [data.prompts[i] for i in prompt_of_group],
        "data_train": config.data.train,
        "data_train_sha256": file_sha256(Path(config.data.train)),
        "model": {
            "pretrained": m.pretrained,
            "height": height,
            "width": width,
            "num_frames": m.num_frames,
            "family": adapter.family,
            "latent_shape": list(final.shape[1:]),
            "latent_dtype": str(final.dtype).removeprefix("torch."),
        },
        "guidance_scale": s.guidance_scale,
        "rewards": {"config": _plain(config.rewards), "keys": sorted(scores[0])},
        "seed": config.run.seed,
        "timing": {"sampling_s": sampling, "scoring_s": scoring, "device": str(adapter.device)},
        "config": config.to_dict(),
    }
    write_store(out, tensors, info)
    stored = read_info(out)
    log(f"offline store: {groups} groups × {k} images {stored.cost}; written to {out}")
    if bad := nonfinite_groups(tensors["reward/total"], k):
        log(
            f"offline store: {len(bad)} of {groups} groups hold a non-finite reward; train on it with "
            "grpo.nan_policy: drop (they train with advantage 0), grpo.nan_policy: error refuses the store"
        )
    return stored


def write_store(out: Path, tensors: dict[str, Tensor], info: dict[str, Any]) -> None:
    """``samples.safetensors`` (its sha256 added to ``info``), then ``store.json``; each written under a temporary
    name and renamed into place, the JSON last, so an interrupted write leaves no store that looks finished."""
    out = Path(out)
    if (out / INFO).exists():
        raise FileExistsError(f"{out} already holds an offline store ({INFO}); choose another directory")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tmp-{SAMPLES}"
    save_file(tensors, str(tmp))
    os.replace(tmp, out / SAMPLES)
    info = {**info, "samples_sha256": file_sha256(out / SAMPLES)}
    tmp = out / f".tmp-{INFO}"
    tmp.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out / INFO)


def remove_unfinished(out: Path) -> None:
    """Clear what an interrupted :func:`write_store` left in ``out`` (no ``store.json``): the run rebuilds it."""
    if out.is_dir() and not (out / INFO).exists():
        shutil.rmtree(out)


# ---------------------------------------------------------------------------------------------- reading a store
def read_info(path: Path, key: str = KEY, *, verify: bool = False) -> StoreInfo:
    """``store.json`` of the store at ``path``, checked against ``samples.safetensors``: the tensors' names, dtypes
    and shapes in its header, the rows' group order, and with ``verify`` its sha256 (reads the whole file); a
    :class:`ConfigError` naming ``key`` and the fix otherwise."""
    path = Path(path)
    where = f"{key}={path}"
    if not (path / INFO).is_file():
        raise ConfigError(
            f"{where} holds no offline store ({INFO} is missing): sample one with "
            f"python scripts/sample_offline.py --config <your config> --out {path}, or set {key}: null to sample it "
            "into the run directory on the first epoch"
        )
    try:
        raw = json.loads((path / INFO).read_text(encoding="utf-8"))
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"its {INFO} is not a {FORMAT}")
        if raw.get("version") != VERSION:
            raise ValueError(f"version {raw.get('version')!r}, this code reads version {VERSION}")
        groups, k = int(raw["groups"]), int(raw["group_size"])
        shape = tuple(int(n) for n in raw["model"]["latent_shape"])
        keys = [str(name) for name in raw["rewards"]["keys"]]
        prompts = [int(i) for i in _stored_prompt_indices(path, raw, groups, k, shape, keys, verify)]
        info = StoreInfo(path, groups, k, shape, prompts, keys, float(raw["guidance_scale"]), raw)
        info.cost  # noqa: B018  (the timing fields must be there)
    except (ValueError, KeyError, TypeError, OSError, SafetensorError) as err:
        raise ConfigError(
            f"{where}: the offline store is corrupt or unfinished ({err}); sample it again: {_resample()}"
        ) from None
    return info


def _stored_prompt_indices(
    path: Path, raw: dict[str, Any], groups: int, k: int, shape: tuple[int, ...], keys: list[str], verify: bool
) -> list[int]:
    """Check ``samples.safetensors`` against ``store.json`` (with ``verify`` the hash first, then the header), and
    read its prompt indices."""
    if not (path / SAMPLES).is_file():
        raise ValueError(f"{SAMPLES} is missing")
    if verify and file_sha256(path / SAMPLES) != raw["samples_sha256"]:
        raise ValueError(f"{SAMPLES} does not match the sha256 in {INFO}")
    latent_dtype = str(raw["model"]["latent_dtype"])
    if latent_dtype not in DTYPES:
        raise ValueError(f"model.latent_dtype {latent_dtype!r} in {INFO} is not one of {', '.join(DTYPES)}")
    expected = {  # name: (shape, dtype as the safetensors header writes it)
        "final_latents": ((groups * k, *shape), DTYPES[latent_dtype]),
        "group": ((groups * k,), "I64"),
        "prompt_index": ((groups,), "I64"),
        **{f"reward/{name}": ((groups * k,), "F32") for name in keys},
    }
    with safe_open(str(path / SAMPLES), framework="pt") as f:
        found = {
            name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
            for name in f.keys()  # noqa: SIM118 (not a dict)
        }
        if found != expected:
            raise ValueError(f"{SAMPLES} holds {found}, {INFO} describes {expected}")
        if not torch.equal(f.get_tensor("group"), torch.arange(groups).repeat_interleave(k)):
            raise ValueError(f"the rows of {SAMPLES} are not in group order")
        return f.get_tensor("prompt_index").tolist()


def check_store(config: Config, path: Path, key: str = KEY, *, verify: bool = False) -> StoreInfo:
    """The store at ``path``, refused (a :class:`ConfigError` naming the key and the fix) unless it was made for this
    config's model and image size (``model.size``), group size, rewards and prompt file, holds at least an epoch's
    groups, and, under ``grpo.nan_policy: error``, only finite rewards. ``verify``: check the sha256 of its samples too
    (reads the whole file: once per run, when it opens the store; config validation reads the headers only)."""
    info = read_info(path, key, verify=verify)
    raw, m = info.raw, config.model
    where, fix = f"{key}={path}", _resample()
    made = raw["model"]
    for name, ours in (("pretrained", m.pretrained), ("num_frames", m.num_frames)):
        if made[name] != ours:
            raise ConfigError(
                f"{where} was sampled with model.{name}={made[name]} (latents {list(info.latent_shape)}), but this "
                f"config has model.{name}={ours}; set model.{name}: {made[name]}, or sample a store for this model: "
                f"{fix}"
            )
    height, width = made.get("height", made.get("resolution")), made.get("width", made.get("resolution"))
    if (height, width) != m.size:  # (stores written before model.height / width record "resolution" alone)
        square = height == width and m.height is None  # name the keys this config sizes its images with
        stored = f"model.resolution={height}" if height == width else f"model.height={height}, model.width={width}"
        wanted = f"model.resolution: {height}" if square else f"model.height: {height} and model.width: {width}"
        raise ConfigError(
            f"{where} was sampled with {stored} (latents {list(info.latent_shape)}), but this config has "
            f"{m.size_keys}; set {wanted}, or sample a store for this model: {fix}"
        )
    if info.group_size != config.grpo.group_size:
        raise ConfigError(
            f"{where} holds groups of {info.group_size} images, but grpo.group_size={config.grpo.group_size}; set "
            f"grpo.group_size: {info.group_size}, or sample a store with this group size: {fix}"
        )
    if info.groups < config.grpo.groups_per_epoch:
        raise ConfigError(
            f"{where} holds {info.groups} groups, fewer than one epoch's grpo.groups_per_epoch="
            f"{config.grpo.groups_per_epoch}; set grpo.groups_per_epoch: {info.groups} or less, or sample a larger "
            f"store (sampler.offline.groups): {fix}"
        )
    if raw["rewards"]["config"] != _plain(config.rewards):
        raise ConfigError(
            f"{where} was scored with rewards {json.dumps(raw['rewards']['config'])}, but this config's rewards are "
            f"{json.dumps(_plain(config.rewards))}; set rewards to the store's, or sample a store scored with these: "
            f"{fix}"
        )
    train = Path(config.data.train)
    if train.is_file() and file_sha256(train) != raw["data_train_sha256"]:
        raise ConfigError(
            f"{where} was sampled from the prompts of data.train={raw['data_train']}, and data.train={train} holds "
            f"other prompts (another sha256); set data.train to the store's prompt file, or sample a store from "
            f"these prompts: {fix}"
        )
    check_finite_rewards(config, info, load_rewards(info)["total"], key)
    return info


def nonfinite_groups(total: Tensor, group_size: int) -> list[int]:
    """The groups (rows ``g·k … g·k + k - 1``) whose ``total`` reward is NaN or infinite for some image (any reward
    the total weighs that is not finite makes it so)."""
    bad = ~torch.isfinite(total.reshape(-1, group_size)).all(dim=1)
    return torch.nonzero(bad).flatten().tolist()


def check_finite_rewards(config: Config, info: StoreInfo, total: Tensor, key: str = KEY) -> None:
    """Refuse a store holding non-finite rewards under ``grpo.nan_policy: error`` (the run would fail in the first
    epoch that serves such a group); under ``drop`` each epoch drops them as it would drop freshly scored ones."""
    bad = nonfinite_groups(total, info.group_size)
    if bad and config.grpo.nan_policy == "error":
        raise ConfigError(
            f"{key}={info.path} holds non-finite rewards in {len(bad)} of its {info.groups} groups (first: group "
            f"{bad[0]}, prompt {info.raw['prompts'][bad[0]]!r}), and grpo.nan_policy=error would stop the run at the "
            f"first epoch serving one; set grpo.nan_policy: drop (those groups then train with advantage 0), or "
            f"sample a store whose rewards are finite: {_resample()}"
        )


def load_rewards(info: StoreInfo) -> dict[str, Tensor]:
    """Every stored reward ([G·k] float32 each, by key)."""
    with safe_open(str(info.samples), framework="pt") as f:
        return {name: f.get_tensor(f"reward/{name}") for name in info.reward_keys}


def load_latents(info: StoreInfo, groups: list[int]) -> Tensor:
    """The final latents of ``groups`` ([len(groups)·k, *latent], each group's k rows in stored order), read from the
    file group by group (the whole store need not fit in memory)."""
    k = info.group_size
    with safe_open(str(info.samples), framework="pt") as f:
        rows = f.get_slice("final_latents")
        parts = [rows[g * k : (g + 1) * k] for g in groups]
    return torch.cat(parts) if parts else torch.empty(0)


def check_offline_section(config: Config) -> None:
    """The section's own ranges (``groups`` matters only where a store is sampled: ``path`` null, or the script)."""
    o = config.sampler.offline
    check_range("sampler.offline.groups", o.groups, 1)
    if o.path is None and o.groups is not None and o.groups < config.grpo.groups_per_epoch:
        raise ConfigError(
            f"sampler.offline.groups={config.sampler.offline.groups} is fewer than one epoch's "
            f"grpo.groups_per_epoch={config.grpo.groups_per_epoch}; set sampler.offline.groups: "
            f"{config.grpo.groups_per_epoch} or more (null: one group per prompt)"
        )


__all__ = [
    "OfflineConfig",
    "StoreInfo",
    "build_store",
    "check_finite_rewards",
    "check_offline_section",
    "check_store",
    "load_latents",
    "load_rewards",
    "nonfinite_groups",
    "read_info",
    "served_groups",
    "store_groups",
    "store_prompts",
    "write_store",
]
