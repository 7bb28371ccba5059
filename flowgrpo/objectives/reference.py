"""GARDO's adaptive reference, ``grpo.kl.reset_every``: the KL's reference model is reset to the current policy
every N epochs.

The reference is the adapter-disabled model (``PipelineAdapter.adapter_disabled``) until the first reset. At the start
of the training of every epoch ``e`` that is a positive multiple of N (or, if that epoch trained nothing, of the next
epoch that trains), the reference becomes a snapshot of the trainable (LoRA) weights as they are then
(:class:`~.nft.OldWeights`, held as ``PipelineAdapter.reference_snapshot``): every reference forward
(``PipelineAdapter.reference``, the KL term's and dpo's, dgpo's and gdro's reference) swaps it in. At the reset point
the policy equals its reference, so the KL is exactly 0 there, and it grows again from the new anchor.

The reset epochs are a function of the epoch number, and a checkpoint stores the snapshot (``reference.safetensors``,
with the epoch it was taken at: :mod:`flowgrpo.checkpoint.save`), so a resumed run continues with the same reference.

GARDO's code (tinnerhrhe/GARDO ``scripts/train_sd3_grpo_gardo.py``, ``train_sd3_nft_gardo.py``) resets at an epoch's
start when ``epoch − last reset > reset_freq`` (15: every 16 epochs) or when an optimizer step of the previous epoch
logged a KL above ``kl_thres`` (3e-4 for Flow-GRPO on OCR; 0.15 for DiffusionNFT, moved at each reset to
``max(thres − 0.01, 0.1)`` after more than 15 epochs and ``min(thres + 0.01, 0.05)`` after fewer than 5). The KL
trigger is not built: it would make the reset epochs depend on the run's history (more state to checkpoint).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..checks import ConfigError
from .nft import OldWeights

if TYPE_CHECKING:
    from ..adapters import PipelineAdapter
    from ..config import Config

REFUSES_SHARDED = (
    "swaps a snapshot of the trainable weights into the parameters for the reference forward, written for parameters "
    "that are whole tensors on every process (one process, DDP); under DeepSpeed or FSDP set grpo.kl.reset_every: 0"
)


def check_sharded(config: Config, sharded: bool) -> None:
    """Refuse ``grpo.kl.reset_every`` under DeepSpeed or FSDP (``sharded``): the trainer calls it with the objective's
    own refusal, before the reward and the model load and before the run directory exists."""
    every = config.grpo.kl.reset_every
    if every and sharded:
        raise ConfigError(f"grpo.kl.reset_every={every} {REFUSES_SHARDED}")


class KLReference:
    """The reset schedule of the KL's reference model (module docstring): takes the snapshot, and hands it to and from
    checkpoints. Inactive (every method does nothing) with ``grpo.kl.reset_every: 0``. Under DeepSpeed or FSDP the
    trainer has refused it already (:func:`check_sharded`)."""

    def __init__(self, config: Config, adapter: PipelineAdapter) -> None:
        self.every = config.grpo.kl.reset_every
        self.adapter = adapter
        self.epoch: int | None = None  # the epoch whose training started with the snapshot taken

    @property
    def snapshot(self) -> OldWeights | None:
        """The reference's weights since the last reset, or None: the adapter-disabled model."""
        return self.adapter.reference_snapshot

    def due(self, epoch: int) -> int:
        """The latest reset epoch at or before ``epoch`` (0: none yet)."""
        return epoch // self.every * self.every if self.every else 0

    def begin_epoch(self, epoch: int, params: list[torch.nn.Parameter]) -> None:
        """Before ``epoch``'s first update: reset the reference to the trainable weights if a reset is due."""
        due = self.due(epoch)
        if due and (self.epoch is None or self.epoch < due):
            self.adapter.reference_snapshot = OldWeights(params)
            self.epoch = epoch

    def load(self, saved: list[torch.Tensor] | None, epoch: int | None, params: list[torch.nn.Parameter]) -> None:
        """Restore a checkpoint's snapshot (``saved``, in ``params``' order, taken at ``epoch``); None: it holds none,
        the reference is the adapter-disabled model until the next reset (:meth:`begin_epoch` takes one at once if one
        was due: a checkpoint written without ``reset_every``)."""
        if not self.every or saved is None:
            self.adapter.reference_snapshot, self.epoch = None, None
            return
        self.adapter.reference_snapshot, self.epoch = OldWeights(params, saved), epoch
