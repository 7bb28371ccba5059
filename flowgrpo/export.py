"""Export a checkpoint to plain diffusers: a LoRA directory for ``pipe.load_lora_weights`` or a merged pipeline.

    python scripts/export.py --checkpoint runs/<run>/checkpoints/epoch-00100 --out my-lora
    python scripts/export.py --checkpoint ... --out my-pipeline --merge [--ema]

Before anything is written, the checkpoint's LoRA weights must fit the configured model exactly (every saved
weight is a LoRA weight of the model, of the same shape, and the other way round), and the output directory
must be new, empty or (with ``overwrite``) an earlier output of the same kind, and must not hold, contain or lie
inside the base model, the Hugging Face cache or the checkpoint. Outputs are written beside their destination
under a temporary name and renamed into place, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .adapters import PipelineAdapter, family, unwrap
from .checkpoint import (
    CheckpointError,
    Shapes,
    check_checkpoint_fits,
    load_adapter_weights,
    model_lora_shapes,
    read_weights,
)
from .config import Config, load_config
from .pipelines import build_adapter, detect_kind, family_options, load_pipeline, resolve_source, tiny_sources

LORA_FILE = "pytorch_lora_weights.safetensors"


# ---------------------------------------------------------------------------- which config, which model
def run_config(checkpoint: Path, overrides: list[str] | None = None) -> Config:
    """The resolved config a checkpoint's run was trained with (``<run>/config.yaml``), read to evaluate or export its
    weights: what only training reads (an offline store) need not exist any more."""
    check_checkpoint_dir(Path(checkpoint))
    path = Path(checkpoint).parent.parent / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: is {checkpoint} a checkpoint inside a run? (or pass --config)")
    return load_config(path, ["run.resume=null", *(overrides or [])], training=False)


def ema_hint(config: Config, ema: bool) -> str | None:
    """A note when the raw weights are asked for but the run chose its checkpoints by its EMA weights' scores."""
    if ema or not config.eval.use_ema:
        return None
    return (
        "note: this run evaluated (and chose its best checkpoint by) its EMA weights (eval.use_ema); these are the "
        "last trained weights: pass --ema for the EMA weights"
    )


def check_checkpoint_dir(checkpoint: Path, *, ema: bool = False) -> None:
    """``checkpoint`` is a directory holding the adapter files export and evaluate read."""
    if not checkpoint.is_dir():
        what = "is not a directory" if checkpoint.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {checkpoint} {what}; pass --checkpoint <run>/checkpoints/epoch-NNNNN")
    for name in ("adapter.safetensors", "adapter_config.json", *(["ema.safetensors"] if ema else [])):
        if not (checkpoint / name).is_file():
            hint = " (the run had train.ema = 0)" if name == "ema.safetensors" else " (not a complete checkpoint?)"
            raise CheckpointError(f"checkpoint {checkpoint} has no {name}{hint}")


def model_kind(config: Config) -> str:
    """``sd3`` or ``flux``: ``model.kind``, or read from ``model.pretrained``'s ``model_index.json``."""
    if config.model.kind != "auto":
        return config.model.kind
    try:
        return detect_kind(config.model.pretrained)
    except json.JSONDecodeError as err:  # a corrupt model_index.json; the loader's own message names no file
        raise CheckpointError(
            f"model.pretrained={config.model.pretrained!r}: its model_index.json is not valid JSON ({err}); "
            "repair or re-download the model"
        ) from None


# ---------------------------------------------------------------------------- the checkpoint must fit the model
# The checks themselves (names and shapes, what the weights were trained on) are flowgrpo.checkpoint.compat's,
# shared with resuming; what export adds is the model's expected LoRA shapes without loading its weights.
def expected_lora_shapes(config: Config) -> Shapes:
    """The LoRA weights ``config.model`` would have, from its transformer's config alone (no weights are read)."""
    from accelerate import init_empty_weights
    from peft import LoraConfig

    kind = model_kind(config)
    source = config.model.pretrained
    tiny = source in tiny_sources()
    adapter = family(kind).adapter
    if tiny:  # built in code, and small
        from .tiny import build_tiny_pipeline

        components = build_tiny_pipeline(kind).components
    with init_empty_weights():  # parameters on the meta device: shapes without memory
        if not tiny:
            components = _empty_components(resolve_source(source), kind)
        transformer = adapter.lora_model(components, **family_options(config.model))  # Wan2.2: both experts
        lora = config.model.lora
        targets = adapter.default_lora_targets if lora.target_modules == "default" else lora.target_modules
        try:
            exclude = adapter.lora_exclude(transformer) or None  # as PipelineAdapter.add_lora
            transformer.add_adapter(
                LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(targets), exclude_modules=exclude)
            )
        except ValueError as err:
            message = f"model.lora.target_modules {targets} do not match the {kind} transformer: {err}"
            raise CheckpointError(message) from None
    return model_lora_shapes(transformer)


def _empty_transformer(source: str, kind: str, subfolder: str = "transformer") -> Any:
    """The transformer of a local directory or hub id, built from its config (call under ``init_empty_weights``)."""
    cls = family(kind).transformer_class
    try:
        return cls.from_config(cls.load_config(source, subfolder=subfolder))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"model.pretrained={source!r}: cannot read its {subfolder}/config.json ({err})") from None


def _empty_components(source: str, kind: str) -> dict[str, Any]:
    """The family's ``lora_components`` the model has (its ``model_index.json`` names them), built from their configs
    (call under ``init_empty_weights``): ``{"transformer": ...}``, Wan2.2 also ``transformer_2``."""
    from .pipelines import read_model_index

    index = read_model_index(source)
    names = [n for n in family(kind).adapter.lora_components if n == "transformer" or index.get(n, [None])[0]]
    return {name: _empty_transformer(source, kind, name) for name in names}


def adapter_from_checkpoint(
    config: Config, checkpoint: Path, *, ema: bool = False, device: str = "cpu", dtype: str | None = None
) -> PipelineAdapter:
    """The run's pipeline with its LoRA adapter loaded from ``checkpoint`` (EMA weights with ``ema``)."""
    checkpoint = Path(checkpoint)
    check_checkpoint_dir(checkpoint, ema=ema)
    # Checked before the model's weights are loaded (gigabytes for real models); loading checks the keys again.
    check_checkpoint_fits(checkpoint, config, expected_lora_shapes(config), ema=ema)
    adapter = build_adapter(config.model, device, dtype)
    load_adapter_weights(unwrap(adapter.transformer), checkpoint, ema=ema)
    return adapter


# ---------------------------------------------------------------------------- output directories
def protected_dirs(config: Config) -> list[Path]:
    """Directories no output may replace, lie inside or contain: the base model and the Hugging Face cache."""
    from huggingface_hub import constants

    dirs = [Path(constants.HF_HUB_CACHE)]
    base = Path(resolve_source(config.model.pretrained)).expanduser()
    if config.model.pretrained not in tiny_sources() and base.is_dir():
        dirs.append(base)
    return dirs


def check_output_dir(
    out: Path,
    *,
    overwrite: bool,
    kind: str,
    protected: Sequence[Path] = (),
    keep: Sequence[Path] = (),
) -> None:
    """Refuse ``out`` unless it is new or empty, or ``overwrite`` is set and it holds an earlier output of ``kind``
    (``lora`` | ``pipeline`` | ``eval``). ``out`` may not be, contain or lie inside a ``protected`` directory, and
    may not be or contain a ``keep`` directory (it may lie inside one: ``<checkpoint>/eval``)."""
    target = out.expanduser().resolve()
    for path in protected:
        p = path.expanduser().resolve()
        if target == p or p in target.parents or target in p.parents:
            raise CheckpointError(
                f"--out {out} would write into or over {path}, which must stay as it is; choose a directory outside it"
            )
    for path in keep:
        p = path.expanduser().resolve()
        if target == p or target in p.parents:
            raise CheckpointError(f"--out {out} would replace {path}; choose a directory outside it")
    if not out.exists():
        return
    if not out.is_dir():
        raise CheckpointError(f"--out {out} is a file, not a directory; choose another --out")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if not overwrite:
        raise CheckpointError(
            f"--out {out} is not empty ({len(entries)} entries, e.g. {entries[0]}); pass "
            "--overwrite to replace it, or choose a new directory"
        )
    if not _looks_like(entries, kind):
        raise CheckpointError(
            f"--out {out} holds files that are not an earlier {kind} export (e.g. {entries[0]}); --overwrite "
            "replaces only those: remove it yourself or choose a new directory"
        )


def _looks_like(entries: list[str], kind: str) -> bool:
    """Whether a directory is an earlier output of ``kind`` (what ``--overwrite`` may replace whole)."""
    if kind == "lora":
        return all(
            e == LORA_FILE
            or (e.startswith(LORA_FILE.removesuffix(".safetensors") + "_") and e.endswith(".safetensors"))
            for e in entries
        )
    if kind == "pipeline":
        return "model_index.json" in entries
    return all(Path(e).suffix in (".json", ".png", ".gif") and e.startswith("eval") for e in entries)


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield an empty directory beside ``out``; when the block succeeds it replaces ``out`` (moved aside, then
    deleted). On failure it is removed, with any parent directories this call created."""
    created = _missing_parents(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        yield tmp
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in created:  # deepest first
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def _swap_in(new: Path, out: Path) -> None:
    """Rename ``new`` to ``out``; an existing ``out`` is moved aside first and deleted after (put back on failure)."""
    old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
    if out.exists() or out.is_symlink():
        os.replace(out, old)
    try:
        os.replace(new, out)
    except OSError:
        if old.exists() or old.is_symlink():
            os.replace(old, out)
        raise
    if old.is_symlink():
        old.unlink()
    else:
        shutil.rmtree(old, ignore_errors=True)


def _missing_parents(path: Path) -> list[Path]:
    missing = []
    for parent in path.parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


# ---------------------------------------------------------------------------- writing
def lora_file(component: str) -> str:
    """The exported LoRA file of a pipeline component: ``pytorch_lora_weights.safetensors`` for the transformer,
    ``pytorch_lora_weights_<component>.safetensors`` for another (Wan2.2's ``transformer_2``)."""
    return LORA_FILE if component == "transformer" else LORA_FILE.replace(".safetensors", f"_{component}.safetensors")


def load_exported_lora(pipe: Any, directory: str | Path, **kwargs: Any) -> list[str]:
    """Load every LoRA file of an export into ``pipe`` with diffusers' own ``load_lora_weights``, each into its
    component (``transformer_2``'s with ``load_into_transformer_2=True``, as diffusers loads Wan2.2 LoRAs); returns
    the components loaded (what ``pipe.fuse_lora(components=...)`` takes)."""
    loaded = []
    for component in ("transformer", "transformer_2"):
        if (Path(directory) / lora_file(component)).is_file():
            into = {"load_into_transformer_2": True} if component == "transformer_2" else {}
            pipe.load_lora_weights(str(directory), weight_name=lora_file(component), **into, **kwargs)
            loaded.append(component)
    return loaded


def save_diffusers_lora(config: Config, checkpoint: Path, out: Path, *, ema: bool = False) -> Path:
    """``out/pytorch_lora_weights.safetensors`` straight from the checkpoint files (no model is loaded), with the
    adapter metadata so that ``lora_alpha`` survives ``load_lora_weights``; one file per component the weights belong
    to (Wan2.2's experts: also ``pytorch_lora_weights_transformer_2.safetensors``, :func:`lora_file`). Returns the
    first file written."""
    file = Path(checkpoint) / "adapter_config.json"
    try:
        metadata: dict[str, Any] = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file} cannot be read as JSON ({err}); the checkpoint is damaged") from None
    spec = family(model_kind(config))
    parts = spec.adapter.split_lora(read_weights(checkpoint, ema=ema))
    for component, weights in parts.items():
        meta = dict(metadata)
        if meta.get("exclude_modules"):
            # load_lora_weights injects LoRA where the weights are (and warns about an exclude list it never used):
            # name exactly those modules instead (PipelineAdapter.lora_exclude).
            meta["target_modules"] = sorted({key.rsplit(".lora_", 1)[0] for key in weights})
            meta["exclude_modules"] = None
        spec.pipeline_class.save_lora_weights(  # its keys say transformer.<...>: load_lora_weights' component
            str(out),
            transformer_lora_layers=weights,
            transformer_lora_adapter_metadata=meta,
            weight_name=lora_file(component),
        )
    return out / lora_file(next(iter(parts)))


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    merge: bool = False,
    ema: bool = False,
    config: Config | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a diffusers LoRA directory (default) or, with ``merge``, a full pipeline with fused weights.

    Raises ``CheckpointError`` (a ``ValueError``), before writing anything, when the checkpoint does not fit the
    config's model or ``out`` may not be written (see :func:`check_output_dir`)."""
    checkpoint, out = Path(checkpoint), Path(out)
    check_checkpoint_dir(checkpoint, ema=ema)
    config = config or run_config(checkpoint)
    check_output_dir(
        out,
        overwrite=overwrite,
        kind="pipeline" if merge else "lora",
        protected=protected_dirs(config),
        keep=[checkpoint],
    )
    check_checkpoint_fits(checkpoint, config, expected_lora_shapes(config), ema=ema)
    with atomic_dir(out) as tmp:
        if not merge:
            save_diffusers_lora(config, checkpoint, tmp, ema=ema)
        else:
            _save_merged(config, checkpoint, tmp, ema=ema)
    return out


def _save_merged(config: Config, checkpoint: Path, out: Path, *, ema: bool) -> None:
    # Merge through diffusers itself: the pipeline loads the exported LoRA, fuses it, and is saved whole.
    with tempfile.TemporaryDirectory() as lora_dir:
        save_diffusers_lora(config, checkpoint, Path(lora_dir), ema=ema)
        m = config.model
        pipe = load_pipeline(m.pretrained, kind=m.kind, dtype=m.dtype, device="cpu")
        pipe.fuse_lora(components=load_exported_lora(pipe, lora_dir))
        pipe.unload_lora_weights()
    pipe.save_pretrained(str(out), safe_serialization=True)
