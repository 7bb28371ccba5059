"""The optimizer and its learning-rate schedule, from ``train.*``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from diffusers.optimization import get_scheduler

from .checks import ConfigError

if TYPE_CHECKING:
    from .config import Config


def make_optimizer(config: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    t = config.train
    kwargs = {"lr": t.lr, "weight_decay": t.weight_decay, "betas": tuple(t.betas), "eps": t.eps}
    if t.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError("train.optimizer=adamw8bit needs `pip install bitsandbytes`; or use adamw") from None
        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def make_lr_factor(config: Config, total_steps: int) -> Callable[[int], float]:
    """The factor on ``train.lr`` at an optimizer step: diffusers' ``get_scheduler`` multiplier for
    ``train.lr_schedule`` over ``train.lr_schedule_steps`` optimizer steps, or over ``total_steps`` (run.epochs × the
    steps per epoch) when that is null; past the schedule's end the factor stays at its last value (diffusers' cosine
    would rise again). The trainer sets the lr before every backward from the epoch and the accumulation cycle
    within it, so a resumed run continues the schedule with nothing more to checkpoint, and a skipped non-finite step
    does not shift it. On another process count the steps per epoch may differ (unless ``train.updates_per_epoch``
    fixes them): the run-long schedule keeps its fraction, one of ``train.lr_schedule_steps`` its step count at the
    new rate."""
    t = config.train
    length = t.lr_schedule_steps or total_steps
    if t.lr_schedule != "constant" and t.lr_warmup_steps >= length:  # validate() checked train.lr_schedule_steps
        raise ConfigError(
            f"train.lr_warmup_steps={t.lr_warmup_steps} is not shorter than the run's {length} "
            "optimizer steps; lower it"
        )
    # get_scheduler wants an optimizer; at train.lr because polynomial's end lr (1e-7) is absolute.
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=t.lr)
    scheduler = get_scheduler(t.lr_schedule, probe, num_warmup_steps=t.lr_warmup_steps, num_training_steps=length)
    factor = scheduler.lr_lambdas[0]
    return lambda step: factor(min(step, length))
