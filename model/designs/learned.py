"""What the learned score biases share (KERPLE's, FIRE's, FoX's parameters): a floor kept as the
reference codes keep it, and the precision a bias is computed in."""

from __future__ import annotations

import torch


def positive(p: torch.Tensor, floor: float) -> torch.Tensor:
    """p kept >= floor as the reference codes' in-place clamp keeps it (the value is clamped, the
    gradient passes as if it were not, so a parameter below the floor can come back), without
    writing to the parameter: safe under ZeRO-3, compile and checkpointing."""
    return p + (p.clamp(min=floor) - p).detach()


def wide(p: torch.Tensor) -> torch.Tensor:
    """A parameter in float32 at least (bf16 weights give a float32 bias; float64 stays float64)."""
    return p if p.dtype in (torch.float32, torch.float64) else p.float()
