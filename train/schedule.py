"""Learning-rate schedule: linear warm-up, then cosine, linear or warmup-stable-decay to a floor.

A pure function of the step, so resuming needs only the step counter. DeepSpeed drives it as an
`LRScheduler` (stepped once per optimizer step and saved in its checkpoints) whose saved state is
the step alone: a resumed run follows the schedule of its *current* config from the resumed step
on (`train.resume` lists the settings a resume may change).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from train.config import OptimConfig, wsd_decay_start

# Per-group optimizer settings taken from the config the optimizer was built with (the checkpoint's
# param groups carry the values of the run that wrote it). `lr_scale`: a group's peak lr relative to
# optim.lr (Muon's group, muP's per-layer factors: `train.optim`); 1 where a group has none.
GROUP_SETTINGS = ("betas", "eps", "weight_decay", "lr_scale", "momentum", "nesterov", "ns_steps", "adjust_lr_fn")


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based) of a run of `max_steps` steps."""
    if step < optim.warmup_steps:
        return optim.warmup_init_lr + (optim.lr - optim.warmup_init_lr) * (step + 1) / optim.warmup_steps
    if optim.decay == "constant":
        return optim.lr
    start = wsd_decay_start(optim, max_steps) if optim.decay == "wsd" else optim.warmup_steps
    if step < start:
        return optim.lr
    span = max(1, max_steps - start)
    progress = min(1.0, (step - start) / span)
    if optim.decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return optim.min_lr + (optim.lr - optim.min_lr) * shape


def first_difference(a: OptimConfig, a_steps: int, b: OptimConfig, b_steps: int, steps: int) -> int | None:
    """The first of the first `steps` steps at which two schedules' learning rates differ, if any."""
    for step in range(steps):
        if lr_at(step, a, a_steps) != lr_at(step, b, b_steps):
            return step
    return None


class Schedule(torch.optim.lr_scheduler.LRScheduler):
    """`lr_at` of this run's config at the scheduler's step; its state is that step only.

    A checkpoint restores the step, never the learning rates, so a changed `optim.lr`, `min_lr`,
    warm-up, decay or `max_steps` takes effect on resume (torch's LambdaLR would restore the old
    run's base learning rates and scale the new schedule by them).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, optim: OptimConfig, max_steps: int):
        self.optim, self.max_steps = optim, max_steps
        self.group_settings = [{key: group[key] for key in GROUP_SETTINGS if key in group}
                               for group in optimizer.param_groups]
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        lr = lr_at(self.last_epoch, self.optim, self.max_steps)
        return [lr * group.get("lr_scale", 1.0) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accepts this class's state and the LambdaLR state of older checkpoints (same keys)."""
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        self.apply()

    def apply(self) -> None:
        """Set every param group to this config's values at the current step.

        Called after a checkpoint load: DeepSpeed restores the optimizer's saved param groups
        (lr, betas, eps, weight decay of the run that wrote it) after the scheduler under ZeRO.
        """
        lr = lr_at(self.last_epoch, self.optim, self.max_steps)
        for group, settings in zip(self.optimizer.param_groups, self.group_settings, strict=True):
            group.update(settings)
            group["lr"] = lr * group.get("lr_scale", 1.0)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def scheduler_factory(optim: OptimConfig, max_steps: int):
    """The `lr_scheduler` callable `deepspeed.initialize` applies to the base optimizer."""

    def build(optimizer: torch.optim.Optimizer) -> Schedule:
        return Schedule(optimizer, optim, max_steps)

    return build
