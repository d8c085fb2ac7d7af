"""Learning-rate schedule: linear warm-up, then cosine or linear decay to a floor.

A pure function of the step, so resuming needs only the step counter; DeepSpeed drives it as a
`LambdaLR` (stepped once per optimizer step and saved in its checkpoints).
"""

from __future__ import annotations

import math

import torch

from train.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based) of a run of `max_steps` steps."""
    if step < optim.warmup_steps:
        return optim.warmup_init_lr + (optim.lr - optim.warmup_init_lr) * (step + 1) / optim.warmup_steps
    if optim.decay == "constant":
        return optim.lr
    span = max(1, max_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    if optim.decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return optim.min_lr + (optim.lr - optim.min_lr) * shape


def scheduler_factory(optim: OptimConfig, max_steps: int):
    """The `lr_scheduler` callable `deepspeed.initialize` applies to the base optimizer.

    The factor is a plain function, which LambdaLR leaves out of its state: a checkpoint keeps
    only the step, and a resumed run follows the schedule of its current config.
    """

    def factor(step: int) -> float:
        return lr_at(step, optim, max_steps) / optim.lr

    def build(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    return build
