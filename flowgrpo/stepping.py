"""Gradient accumulation and optimizer steps, alike on one process, DDP, DeepSpeed ZeRO-2 and FSDP2.

One backward per loss term; an optimizer step every ``per_update`` backwards (the terms of ``train.batch_size ×
accumulation`` samples). What each back-end needs at a cycle's boundaries:

- DDP decides in the forward whether the backward all-reduces, so a term that does not end a cycle runs its forward
  and backward inside ``no_sync``.
- DeepSpeed reduces, clips and steps inside the backward that ends a cycle (``accelerator.sync_gradients`` says
  which), so that backward must run on every rank even when the loss is not finite: it then backs up a zero loss.
- DDP / FSDP: a non-finite loss that ends a cycle still runs the cycle's reduction (the forward armed it), on a loss
  zeroed through its own graph, and the update is dropped on every process alike.

Finiteness is agreed over processes (every process skips together). The lr is set before every backward from the
epoch and the cycle within it (:func:`flowgrpo.optim.make_lr_factor`), so a resume continues the schedule.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch import Tensor

from .parallel import any_process, is_deepspeed, zero_loss, zeroed


@dataclass
class TermOutcome:
    """What one backward did."""

    stats: dict[str, Tensor] | None  # the loss's metrics, or None when the loss was not finite on some process
    cycle_ended: bool  # this backward ended an accumulation cycle (an update was taken, skipped or dropped)
    grad_norm: float | None = None  # the update's gradient norm, when an update was taken
    update_skipped: bool = False  # the cycle's gradients were not finite: no update (DeepSpeed / scaler: skipped)


class AccumulatingStepper:
    """Backwards and optimizer steps over the accumulation cycles of one epoch (:meth:`start_epoch` resets)."""

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        *,
        per_update: int,
        steps_per_epoch: int,
        lr: float,
        lr_factor: Callable[[int], float],
        max_grad_norm: float,
    ) -> None:
        self.accelerator, self.model, self.optimizer, self.params = accelerator, model, optimizer, params
        self.per_update, self.steps_per_epoch = per_update, steps_per_epoch
        self.lr, self.lr_factor, self.max_grad_norm = lr, lr_factor, max_grad_norm
        self.epoch = self.backwards = 0

    def start_epoch(self, epoch: int) -> None:
        self.epoch, self.backwards = epoch, 0

    def term(
        self, loss_fn: Callable[[], tuple[Tensor, dict[str, Tensor]]], on_loss: Callable[[dict | None], None]
    ) -> TermOutcome:
        """Run ``loss_fn`` (the forward) and its backward; ``on_loss(stats or None)`` right after the backward, before
        any update (it may raise to stop training); then, at a cycle's end, clip, step and zero the gradients."""
        acc = self.accelerator
        deepspeed = is_deepspeed(acc)
        # Before the backward: DeepSpeed steps inside the one that ends a cycle.
        step = self.epoch * self.steps_per_epoch + self.backwards // self.per_update
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * self.lr_factor(step)
        self.backwards += 1
        sync = self.backwards % self.per_update == 0
        acc.sync_gradients = sync
        ctx = contextlib.nullcontext() if sync or acc.num_processes == 1 else acc.no_sync(self.model)
        with ctx:
            loss, stats = loss_fn()
            finite = not any_process(acc, not bool(torch.isfinite(loss.detach())))
            if finite:
                acc.backward(loss / self.per_update)
            elif sync and deepspeed:
                # The engine's cycle must still end (and step) on every rank: this micro-step adds nothing, the
                # update goes ahead with the cycle's finite micro-steps.
                acc.backward(zero_loss(self.params))
            elif sync:
                acc.backward(zeroed(loss))
        on_loss(stats if finite else None)
        outcome = TermOutcome(stats if finite else None, cycle_ended=sync)
        if not sync:
            return outcome
        if finite or deepspeed:
            # DeepSpeed has already clipped and stepped (in the backward) and reports its norm here.
            grad_norm = float(acc.clip_grad_norm_(self.params, self.max_grad_norm))
            # A finite loss can still overflow in its backward. The norm is taken after the reduction, so every
            # process drops the update alike (clipping would have turned the inf into NaN). (fp16's gradient scaler
            # skips such steps in step() and lowers its scale: leave it to it.)
            skip = not deepspeed and acc.scaler is None and not math.isfinite(grad_norm)
            if not skip:
                self.optimizer.step()
            if skip or self.optimizer.step_was_skipped:  # (DeepSpeed skips non-finite ones itself)
                outcome.update_skipped = True
            else:
                outcome.grad_norm = grad_norm
        # else (DDP, FSDP): every process drops this cycle's gradients alike.
        self.optimizer.zero_grad(set_to_none=True)
        return outcome
