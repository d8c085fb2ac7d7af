"""ALiBi (Press et al. 2022): no positional transform; a per-head linear penalty on distance,
scores = q k^T / sqrt(D) - s_h (m - n), with the paper's geometric head slopes s_h."""

from __future__ import annotations

import math

import torch

from .base import Design


def alibi_slopes(n_head: int) -> torch.Tensor:
    """Press et al.'s head slopes: 2^(-8/H), 2^(-16/H), ... with their rule for H not a power of 2."""

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_head).is_integer():
        return torch.tensor(power_of_2(n_head), dtype=torch.float64)
    closest = 2 ** math.floor(math.log2(n_head))
    extra = alibi_slopes(2 * closest)[0::2][: n_head - closest]
    return torch.cat((torch.tensor(power_of_2(closest), dtype=torch.float64), extra))


ALIBI = Design(
    key="alibi", attention="alibi", label="alibi", name="ALiBi", colour="#2ca02c",
    summary="no rotation; a fixed per-head penalty linear in the distance",
    rope=False, slopes=alibi_slopes, from_origin="keep",
)
