"""The length-aware attention temperature (log-length scaling: Chiang & Cholak 2022; Llama 4's
attention temperature tuning; YaRN's mscale is one): query i's dot-product scores are multiplied by
max(1, log(i + 1) / log(L0)), L0 the training length, so that attention does not flatten as the
context grows. It applies to every design, as a per-position scale of q_eff before the kernel
(a design's distance bias is not scaled)."""

from __future__ import annotations

import math

import torch


def length_temperature(positions: torch.Tensor, train_len: int) -> torch.Tensor:
    """max(1, log(i + 1) / log(L0)) per position i, in float64: exactly 1 up to position L0 - 1."""
    return (torch.log1p(positions.to(torch.float64)) / math.log(train_len)).clamp(min=1.0)
