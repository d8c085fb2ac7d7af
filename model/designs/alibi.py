"""ALiBi (Press et al. 2022): no positional transform; a per-head linear penalty on distance,
scores = q k^T / sqrt(D) - s_h (m - n), with the paper's geometric head slopes s_h."""

from __future__ import annotations

import functools
import math

import torch

from .base import Design, ScoreBias


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


@functools.lru_cache(maxsize=32)
def _slopes(n_head: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    return alibi_slopes(n_head).to(device, dtype)


class AlibiBias(ScoreBias):
    """b_h(m, n) = -s_h (m - n). The slopes are fixed, so they are no parameter or buffer (kept
    out of the state dict and of bf16 casts): float64 in `rows` (exact, then cast by the kernel),
    float32 in `score`."""

    separable = True  # -s_h (m - n) = s_h n - s_h m

    def __init__(self, n_head: int, n_embd: int = 0):
        super().__init__()
        self.n_head = n_head

    def slopes(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The head slopes [H] on `device`."""
        return _slopes(self.n_head, str(device), dtype)

    def tensors(self, heads: slice, device) -> tuple[torch.Tensor, ...]:
        return (self.slopes(device)[heads],)

    @staticmethod
    def element(t, h, m, n, gap=None) -> torch.Tensor:
        return -t[0][h] * (m - n)

    def rows(self, heads, m, n, gap=None, t=None) -> torch.Tensor:
        return -self.slopes(m.device, torch.float64)[heads, None, None] * (m - n)

    def key_values(self, heads, n, prefix=None) -> torch.Tensor:
        return (self.slopes(n.device, torch.float64)[heads, None] * n)[None]


ALIBI = Design(
    key="alibi", attention="alibi", label="alibi", name="ALiBi", colour="#2ca02c",
    summary="no rotation; a fixed per-head penalty linear in the distance",
    rope=False, bias=AlibiBias, from_origin="keep",
)
