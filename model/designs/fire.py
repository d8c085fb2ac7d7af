"""FIRE, Functional Interpolation for Relative Positions (Li et al. 2023, arXiv 2310.04418): no
positional transform; a learned function of the normalised distance, per layer:

    b_h(m, n) = f(psi(m - n) / (psi(max(m, L)) + eps))_h,   psi(x) = log(|c| x + 1)

f is an MLP from 1 input to H outputs (one hidden layer of 32 units, ReLU), c and the threshold L
learnable. As the paper's reference code: c starts at 0.1; L = |l * 512| with the multiplier
learnable from 1; eps = 1e-6; the MLP has PyTorch's default initialisation; each layer has its
own FIRE (the paper's main variant; FIRE-S shares one across layers). m is the query position,
counted from the document start under `doc_positions`.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Design, ScoreBias
from .kerple import wide

WIDTH = 32  # the MLP's hidden units
INIT_C, INIT_L, EPS = 0.1, 512.0, 1e-6


def fire_input(c: torch.Tensor, threshold: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The MLP's input psi(m - n) / (psi(max(m, L)) + eps), with psi(x) = log(|c| x + 1)."""
    c = c.abs()
    return torch.log1p(c * (m - n)) / (torch.log1p(c * torch.maximum(m, threshold)) + EPS)


class FireBias(ScoreBias):
    """b_h(m, n) = mlp(fire_input(m, n))_h: `mlp_in` (1 -> 32), ReLU, `mlp_out` (32 -> H); `c`, and
    `l_multiplier`, L's multiplier."""

    def __init__(self, n_head: int, n_embd: int = 0):
        super().__init__()
        self.n_head = n_head
        self.mlp_in = nn.Linear(1, WIDTH)
        self.mlp_out = nn.Linear(WIDTH, n_head)
        self.c = nn.Parameter(torch.empty(1))  # 1-d: ZeRO and the checkpoints flatten parameters
        self.l_multiplier = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.mlp_in.reset_parameters()
        self.mlp_out.reset_parameters()
        with torch.no_grad():
            self.c.fill_(INIT_C)
            self.l_multiplier.fill_(1.0)

    def tensors(self, heads: slice, device) -> tuple[torch.Tensor, ...]:
        return (wide(self.c[0]), (wide(self.l_multiplier[0]) * INIT_L).abs(), wide(self.mlp_in.weight[:, 0]),
                wide(self.mlp_in.bias), wide(self.mlp_out.weight[heads]), wide(self.mlp_out.bias[heads]))

    @staticmethod
    def element(t, h, m, n, gap=None) -> torch.Tensor:
        """One element: the MLP written out over its hidden units (FlexAttention's score_mod)."""
        c, threshold, w1, b1, w2, b2 = t
        x = fire_input(c, threshold, m, n)
        out = b2[h]
        for u in range(WIDTH):
            out = out + w2[h, u] * torch.relu(w1[u] * x + b1[u])
        return out

    def rows(self, heads, m, n, gap=None, t=None) -> torch.Tensor:
        """The MLP as its pieces: per element one segment lookup and one multiply-add per head
        (~3x faster than the hidden layer's 32 units per element)."""
        c, threshold, w1, b1, w2, b2 = self.tensors(heads, m.device) if t is None else t
        x = fire_input(c, threshold, m, n)  # [rows, keys]
        breaks, slope, intercept = pieces(w1, b1, w2, b2)
        segment = torch.searchsorted(breaks, x.detach().contiguous()).flatten()
        out = torch.addcmul(intercept.index_select(1, segment), slope.index_select(1, segment), x.flatten())
        return out.view(-1, *x.shape)  # [H, rows, keys]


def pieces(w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
           b2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """f_h(x) = b2_h + sum_u w2_hu relu(w1_u x + b1_u) is linear between its sorted breakpoints
    -b1_u / w1_u: (breaks [32], slope [H, 33], intercept [H, 33]) with f_h(x) = slope_h[s] x +
    intercept_h[s] on segment s = the number of breaks below x. Unit u is active on segment s when
    x is past its break (s > its rank) and w1_u > 0, or before it and w1_u < 0 (w1_u = 0: when
    b1_u > 0); slope and intercept are sums of w2 w1 and w2 b1 over the active units, so the
    weights get their gradients through them (and x through the slope)."""
    flat = w1 == 0
    breaks = torch.where(flat, torch.inf, -b1 / torch.where(flat, 1.0, w1)).detach()
    order = breaks.argsort()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    past = rank[None, :] < torch.arange(len(order) + 1, device=order.device)[:, None]  # [33, 32]
    active = torch.where(flat, b1 > 0, torch.where(w1 > 0, past, ~past)).to(w2.dtype)
    return breaks[order].contiguous(), (w2 * w1) @ active.T, (w2 * b1) @ active.T + b2[:, None]


FIRE = Design(
    key="fire", attention="fire", label="fire", name="FIRE", colour="#e377c2",
    summary="no rotation; a learned MLP of the log-normalised distance",
    rope=False, bias=FireBias, from_origin="keep",
)
