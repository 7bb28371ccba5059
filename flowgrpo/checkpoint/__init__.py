"""Checkpoints that resume exactly, written atomically, loaded without running code; run directories.

    <run>/
        .lock                   held (flock) by the training process that owns the run: a second trainer on the
                                same run stops with exit code 2 instead of writing the same files
        config.yaml             the resolved config of the run's first attempt (never overwritten)
        run.json                the run's identity: {"run_id": random hex, "resumed_from": the checkpoint a run
                                started by resuming another run's checkpoint continues}
        config-resume-<stamp>.yaml   the resolved config of each resumed attempt (stamp: local time it started)
        checkpoints/epoch-00020/
            adapter.safetensors     LoRA weights (peft names, float32)     adapter_config.json  the LoraConfig
            ema.safetensors         EMA of the adapter weights (if train.ema > 0)
            reference.safetensors   the KL reference's adapter weights since its last reset (grpo.kl.reset_every),
                                    metadata {"epoch": the epoch it was taken at}
            old_weights.safetensors the old weights DiffusionNFT's soft update carries across epochs
                                    (grpo.nft.old_decay_max > 0, grpo.objective: lagged)
            optimizer.pt            optimizer state (tensors and numbers only: loaded with weights_only=True);
                                    under DeepSpeed instead deepspeed/ (its files: trainable weights and every
                                    process's optimizer shard), under FSDP optimizer_full.pt (whole, by parameter
                                    name)
            state.json              epoch, optimizer steps, best eval reward, … (the sliding window and the
                                    epoch's prompt plan are functions of the epoch, so this restores them too);
                                    ``written_at`` (Unix time: what ``run.resume=latest`` orders by) and
                                    ``trained_on`` (base model, model family, LoRA rank / alpha / targets: what the
                                    weights mean; :func:`check_model_matches` compares a config against it);
                                    ``run_id`` (the run's, from run.json: a resume continues in the checkpoint's
                                    run only when that run's run.json says the same, else it starts a new run)
            config.yaml             the resolved config the checkpoint was trained with
            rng_rank{r}.json        torch / CUDA / numpy / python RNG states of every process (plain JSON)

Nothing in a checkpoint is unpickled into arbitrary objects: weights are safetensors, RNG states JSON, and the
optimizer files are read with ``torch.load(weights_only=True)`` after checking which classes they name (DeepSpeed's
files: a short allow-list of its own data classes). Checkpoints of earlier releases stored the RNG states as
pickles (``rng_rank{r}.pt``); they are still read, under the same restrictions. Every failure to read or write
one is a :class:`CheckpointError` naming the file and the fix.

The modules, each importing only those above it (and :mod:`flowgrpo.parallel` for which back-end runs):

    safe_io     CheckpointError; whole-or-nothing writes; torch files loaded without running code
    layout      file names; checkpoint_name, list_checkpoints
    rng         every process's RNG states as JSON
    compat      do a checkpoint's LoRA weights fit the model, and mean the same (resume, load and export)
    lora        the adapter weights: gathered, saved names, loaded (FSDP2 shards too)
    optimizer   the optimizer's files per back-end (DDP, DeepSpeed ZeRO-2, FSDP2)
    run_dir     run directories: created atomically, locked, their configs; open_run_dir for every process
    resume      which checkpoint run.resume means, checked without loading; which run it writes into; what a
                resume sets aside
    save        CheckpointParts, save_checkpoint, load_checkpoint, resume_run
"""

from __future__ import annotations

from .compat import (
    WEIGHT_KEYS,
    Shapes,
    check_checkpoint_fits,
    check_lora_fits,
    check_model_matches,
    lora_mismatch,
    model_lora_shapes,
    recipe_changes,
    recorded_config,
    saved_lora_shapes,
    trained_on,
)
from .layout import CHECKPOINTS, CONFIG_FILE, PREFIX, RUN_FILE, checkpoint_name, list_checkpoints
from .lora import load_adapter_weights, load_lora_state, lora_state, read_weights, trainable_names
from .resume import (
    SUPERSEDED,
    check_resume,
    owning_run,
    resolve_resume,
    resume_run_dir,
    set_aside_later,
    verify_checkpoint,
)
from .rng import LEGACY_RNG_FILE, RNG_FILE, read_rng_state, rng_state
from .run_dir import (
    LOCK_FILE,
    RUN_STAMP,
    RunLock,
    create_run_dir,
    on_main,
    open_run_dir,
    read_run_id,
    run_dirs,
    write_run_config,
    write_run_file,
)
from .safe_io import CheckpointError, check_pickle_globals, deepspeed_safe_globals, load_torch_file, write_text
from .save import CheckpointParts, load_checkpoint, resume_run, save_checkpoint

__all__ = [
    "CHECKPOINTS",
    "CONFIG_FILE",
    "LEGACY_RNG_FILE",
    "LOCK_FILE",
    "PREFIX",
    "RNG_FILE",
    "RUN_FILE",
    "RUN_STAMP",
    "SUPERSEDED",
    "WEIGHT_KEYS",
    "CheckpointError",
    "CheckpointParts",
    "RunLock",
    "Shapes",
    "check_checkpoint_fits",
    "check_lora_fits",
    "check_model_matches",
    "check_pickle_globals",
    "check_resume",
    "checkpoint_name",
    "create_run_dir",
    "deepspeed_safe_globals",
    "list_checkpoints",
    "load_adapter_weights",
    "load_checkpoint",
    "load_lora_state",
    "load_torch_file",
    "lora_mismatch",
    "lora_state",
    "model_lora_shapes",
    "on_main",
    "open_run_dir",
    "owning_run",
    "read_rng_state",
    "read_run_id",
    "read_weights",
    "recipe_changes",
    "recorded_config",
    "resolve_resume",
    "resume_run",
    "resume_run_dir",
    "rng_state",
    "run_dirs",
    "save_checkpoint",
    "saved_lora_shapes",
    "set_aside_later",
    "trainable_names",
    "trained_on",
    "verify_checkpoint",
    "write_run_config",
    "write_run_file",
    "write_text",
]
