"""The memory a run's latents and rollout buffers need, estimated from the config and the model's latent geometry
before anything is allocated or written: a run that cannot fit is refused with one paragraph, not a crash (or an
hour of swapping) after its run directory exists.

Per process, with

    L = latent elements per sample = C · F' · (H / f) · (W / f): C latent channels, f the VAE's spatial factor,
        F' latent frames ((num_frames - 1) / 4 + 1 for Wan, 1 for images); FLUX's and Qwen-Image's 2×2 packing
        keeps L. Read off the adapter at its smallest size and scaled by area: ``latent_shape`` is never asked
        for the configured size (FLUX's builds position ids of that length)
    P = pixel values per sample = 3 · F · H · W (F = model.num_frames for video, 1 for images)
    N = samples per process per epoch = ⌈grpo.group_size · grpo.groups_per_epoch / processes⌉
    S = stored steps = sampler.window.size (0: sampler.num_steps - window.end_margin) for an objective that
        re-scores the window's SDE transitions (clipped); 1 under ``sampler.rollout: branch`` or ``entropy_merge``
        (each image keeps its branch step); 0 for one that trains on the final samples (awm, nft);
        W under ``sampler.rollout: tree``: each edge of a group's tree stored once, dealt over its
        leaves (rollouts/tree.py ``stored_slots``, the most of any epoch)
    B = sampler.batch_size, b = bytes per latent element (model.dtype; the rollout noise is drawn as float32)

the buffers are

    device (the accelerator; RAM on a CPU run)
        stored trajectory   N · (2S + 1) · L · b   latents before and after each stored step, final latents
        sampling means      N · S · L · 4          each stored step's mean, float32, for an objective that asks for
                                                   them (``Objective.needs_sampling_means``: GRPO-Guard)
        rollout batch       3 · B · L · b          the chain's state, its velocity and the next state (5 · B · L · b
                                                   under ``branch`` / ``entropy_merge``: trunks, branched images,
                                                   before/after a step)
        decoded batch       B · P · 4              the VAE's float32 images of one rollout batch
        stage predictions   (S + 1) · B · L · b    ``sampler.rollout: dense`` with ``sampler.dense.value: x0``: the
                                                   one-step predictions of one rollout batch's stages, kept until
                                                   the batch is sampled
    host (RAM)
        initial noise       B · L · 4              drawn on the CPU (the trainer's generator), then moved
        sampled images      N · P · 4              the epoch's images, kept as float32 for the sample grids

a lower bound: the networks' activations, CFG's doubled batch, the text embeddings and the allocator's slack come
on top. So a run is refused only when even this cannot fit into the memory available now (after the model is
loaded): on CUDA ``torch.cuda.mem_get_info``; RAM from psutil (else /proc/meminfo, else ``os.sysconf``), capped
by a cgroup limit, shared by the processes of one machine (``LOCAL_WORLD_SIZE``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .checks import ConfigError, height_width

if TYPE_CHECKING:
    from .config import Config

FLOAT32 = 4  # bytes: noise, decoded images
BRANCHED = ("branch", "entropy_merge")  # rollouts that store one transition per image (rollouts/branch.py, merged.py)


@dataclass(frozen=True)
class Geometry:
    """One sample at the configured size: latent elements, pixel values, bytes per latent element."""

    latent_elements: int
    latent_shape: str  # for messages, e.g. "4×2×12500×12500"
    pixels: int
    latent_bytes: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of each buffer (module docstring), on the device and in RAM (on a CPU run both are RAM)."""

    device: dict[str, int]
    host: dict[str, int]
    samples: int  # N
    stored_steps: int  # S

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def geometry(adapter: Any, size: int | tuple[int, int]) -> Geometry:
    """The latent and pixel size of one sample of ``size`` pixels, ``(height, width)`` (an int: square), from the
    adapter's latent shape at that size when it is on the adapter's grid, else at its smallest size
    (``size_multiple``) scaled by area: nothing of the configured size is built."""
    height, width = height_width(size)
    m = int(adapter.size_multiple)
    if height % m == 0 and width % m == 0:  # its own shape: LTX-2's audio tokens do not grow with the image
        grown = [int(d) for d in adapter.latent_shape(height, width)]
        elements = math.prod(grown)
    else:
        small = tuple(int(d) for d in adapter.latent_shape(m, m))
        elements = math.prod(small) * height * width // (m * m)
        # The dimensions that grow with the image: the last two of (C, [F',] h, w); FLUX / Qwen-Image: the tokens.
        grown = list(small)
        if len(small) >= 3:
            grown[-2:] = [small[-2] * height // m, small[-1] * width // m]
        else:
            grown[0] = small[0] * height * width // (m * m)
    frames = int(getattr(adapter, "num_frames", 1) or 1)
    return Geometry(
        latent_elements=elements,
        latent_shape="×".join(str(d) for d in grown),
        pixels=3 * frames * height * width,
        latent_bytes=torch.empty(0, dtype=adapter.latent_dtype).element_size(),
    )


def stored_steps(config: Config, stores_transitions: bool) -> int:
    """S: the transitions a sample keeps (the window's SDE steps; none for an objective on final samples)."""
    if not stores_transitions:
        return 0
    s = config.sampler
    if s.rollout == "tree":  # each tree edge once, dealt over its leaves
        from .rollouts.tree import stored_slots

        return stored_slots(config)
    if s.rollout in BRANCHED:  # one transition per image: its branch step (the window is refused there)
        return 1
    return s.window.size or max(s.num_steps - s.window.end_margin, 0)


def estimate(
    config: Config,
    shape: Geometry,
    *,
    world_size: int = 1,
    stores_transitions: bool = True,
    stores_means: bool = False,
) -> MemoryEstimate:
    """The buffers of the module docstring for ``config`` and a sample of ``shape``, per process (``stores_means``:
    the rollout also keeps each stored step's sampling mean)."""
    g = config.grpo
    n = math.ceil(g.group_size * g.groups_per_epoch / max(world_size, 1))
    steps = stored_steps(config, stores_transitions)
    batch = min(config.sampler.batch_size, n) if n else config.sampler.batch_size
    latent, b = shape.latent_elements, shape.latent_bytes
    device = {
        "stored trajectory": n * (2 * steps + 1) * latent * b,
        "rollout batch": (5 if config.sampler.rollout in (*BRANCHED, "tree") else 3) * batch * latent * b,
        "decoded batch": batch * shape.pixels * FLOAT32,
    }
    if stores_means and steps:
        device["sampling means"] = n * steps * latent * FLOAT32
    dense = getattr(config.sampler, "dense", None)  # sampler.rollout: dense's section
    if config.sampler.rollout == "dense" and dense is not None and dense.value == "x0" and steps:
        device["stage predictions"] = (steps + 1) * batch * latent * b
    return MemoryEstimate(
        device=device,
        host={
            "initial noise": batch * latent * FLOAT32,
            "sampled images": n * shape.pixels * FLOAT32,
        },
        samples=n,
        stored_steps=steps,
    )


def host_available() -> int | None:
    """RAM available now, in bytes: psutil, else /proc/meminfo's MemAvailable, else ``os.sysconf``; capped by the
    cgroup's memory limit (containers). None when nothing says."""
    found: list[int] = []
    try:
        import psutil

        found.append(int(psutil.virtual_memory().available))
    except (ImportError, OSError):
        found += [v for v in (_meminfo_available(), _sysconf_available()) if v is not None][:1]
    limit = _cgroup_available()
    if limit is not None:
        found.append(limit)
    return min(found) if found else None


def device_available(device: torch.device) -> int | None:
    """Memory available now on ``device``: CUDA's free memory, the RAM on a CPU; None for other devices."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type == "cpu":
        return host_available()
    return None


def check_memory(
    config: Config,
    adapter: Any,
    *,
    world_size: int = 1,
    stores_transitions: bool = True,
    stores_means: bool = False,
    available: tuple[int | None, int | None] | None = None,
) -> MemoryEstimate:
    """Refuse a config whose latents and rollout buffers cannot fit (module docstring): a :class:`ConfigError`
    naming the size keys set (model.resolution, or model.height / model.width) and the sampler / grpo keys that size
    them, the estimate, what is available, and the largest size of the same aspect ratio that would fit.
    ``available``: (device, host) bytes instead of measuring them (tests). Returns the estimate."""
    shape = geometry(adapter, config.model.size)
    found = estimate(
        config, shape, world_size=world_size, stores_transitions=stores_transitions, stores_means=stores_means
    )
    device = torch.device(adapter.device)
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)  # processes sharing this machine's RAM
    if available is None:
        available = (device_available(device) if device.type != "cpu" else None, host_available())
    on_device, on_host = available
    # (what, bytes needed, bytes available, the buffers): a CPU run keeps everything in RAM
    checks: list[tuple[str, int, int, dict[str, int]]] = []
    if device.type == "cpu":
        if on_host is not None:
            parts = {**found.device, **found.host}
            checks.append(("RAM", local * sum(parts.values()), on_host, parts))
    else:
        if on_device is not None:
            checks.append((f"the {device.type} device", found.device_total, on_device, found.device))
        if on_host is not None:
            checks.append(("RAM", local * found.host_total, on_host, found.host))
    for where, needed, free, parts in checks:
        if needed > free:
            raise ConfigError(_message(config, shape, found, where, needed, free, parts, local, adapter))
    return found


def _message(
    config: Config,
    shape: Geometry,
    found: MemoryEstimate,
    where: str,
    needed: int,
    free: int,
    parts: dict[str, int],
    local: int,
    adapter: Any,
) -> str:
    m, s, g = config.model, config.sampler, config.grpo
    frames = f" with model.num_frames={m.num_frames}" if m.num_frames else ""
    listed = ", ".join(f"{name} {_size(v)}" for name, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
    shared = f" for each of the {local} processes on this machine" if local > 1 else " per process"
    # Every buffer grows with the image's area: the largest size of the same aspect ratio whose buffers fit, each
    # side on the size grid.
    multiple = int(adapter.size_multiple)
    shrink = math.sqrt(free / needed)
    fits = [int(side * shrink) // multiple * multiple for side in m.size]
    keys = "model.resolution" if m.height is None else "model.height and model.width"
    fitting = f"{fits[0]}, a multiple" if m.height is None else f"{fits[0]} × {fits[1]}, multiples"
    lower = (
        f"lower {keys} (these buffers fit up to about {fitting} of {multiple})"
        if min(fits) >= multiple
        else f"lower {keys}"
    )
    steps_hint = (
        f"the stored steps (sampler.window.size={s.window.size}, sampler.num_steps={s.num_steps}: "
        f"{found.stored_steps} kept per sample)"
        if s.rollout not in BRANCHED
        else f"the stored steps (one per image under sampler.rollout={s.rollout})"
    )
    if s.rollout == "tree":
        steps_hint = (
            f"the stored steps ({found.stored_steps} slots per image under sampler.rollout=tree; "
            "sampler.tree.prune_steps drops some)"
        )
    return (
        f"{m.size_keys}{frames} needs at least {_size(needed)} of {where} for its latents and "
        f"rollout buffers{shared} ({listed}; each sample's latents are {shape.latent_shape} "
        f"= {shape.latent_elements:,} values), but {_size(free)} is available, so the run would fail or swap "
        f"after starting. {lower.capitalize()}, or keep fewer samples and steps per process: "
        f"grpo.group_size × grpo.groups_per_epoch ({g.group_size} × {g.groups_per_epoch} = {found.samples} samples "
        f"per process; more processes share them), {steps_hint} and sampler.batch_size ({s.batch_size})"
    )


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # pragma: no cover


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf_available() -> int | None:
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def _cgroup_available() -> int | None:
    """A container's memory limit minus its use (cgroup v2, else v1); None without a limit."""
    for folder, limit_name, usage_name, cache_key in (
        ("/sys/fs/cgroup", "memory.max", "memory.current", "file"),
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache"),
    ):
        try:
            limit = (Path(folder) / limit_name).read_text().strip()
            usage = int((Path(folder) / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 writes a huge number for none
            return None
        return max(int(limit) - usage + _cgroup_stat(Path(folder) / "memory.stat", cache_key), 0)
    return None


def _cgroup_stat(path: Path, key: str) -> int:
    """One value of a cgroup's memory.stat (the page cache counts as used but is given back on demand); 0 if none."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
