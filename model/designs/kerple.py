"""KERPLE-log (Chi et al. 2022, arXiv 2205.09921): no positional transform; ALiBi's linear penalty
replaced by a learned logarithmic one, per head and layer:

    b_h(m, n) = -r1_h * log(1 + r2_h * (m - n)),   r1_h, r2_h > 0

As the paper's code: r1 drawn from U(0, 2) and r2 from U(0, 1), both kept >= 0.01 by a clamp
(here on the value, with the gradient passed through: `learned.positive`).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Design, ScoreBias
from .learned import positive, wide

FLOOR = 1e-2  # the reference code's clamp of r1 and r2


class KerpleBias(ScoreBias):
    """b_h(m, n) = -r1_h log(1 + r2_h (m - n)) with learned r1, r2 [H] (`r1`, `r2`)."""

    def __init__(self, n_head: int, n_embd: int = 0):
        super().__init__()
        self.n_head = n_head
        self.r1 = nn.Parameter(torch.empty(n_head))
        self.r2 = nn.Parameter(torch.empty(n_head))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.r1.uniform_(0.0, 2.0)
            self.r2.uniform_(0.0, 1.0)

    def tensors(self, heads: slice, device) -> tuple[torch.Tensor, ...]:
        return tuple(positive(wide(p[heads]), FLOOR) for p in (self.r1, self.r2))

    @staticmethod
    def element(t, h, m, n, gap=None) -> torch.Tensor:
        r1, r2 = t
        return -r1[h] * torch.log1p(r2[h] * (m - n))

    def distance_table(self, heads, distances: torch.Tensor, t) -> torch.Tensor:
        r1, r2 = t
        return -r1[:, None] * torch.log1p(r2[:, None] * distances)

    def rows(self, heads, m, n, gap=None, t=None) -> torch.Tensor:
        """The bias of each distance once ([H, distances]), then looked up per pair: one gather per
        head and element instead of a log1p and two multiplies (and their gradients)."""
        t = self.tensors(heads, m.device) if t is None else t
        d = (m - n).expand(m.shape[0], n.shape[1])
        table = self.distance_table(heads, torch.arange(int(d.max()) + 1, device=m.device), t)
        return table.index_select(1, d.flatten()).view(-1, *d.shape)


KERPLE = Design(
    key="kerple", attention="kerple", label="kerple", name="KERPLE-log", colour="#8c564b",
    summary="no rotation; a learned per-head penalty logarithmic in the distance",
    rope=False, bias=KerpleBias, from_origin="keep",
)
