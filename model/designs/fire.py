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


    def prepared(self, t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(c, L, breaks, slope, intercept): the MLP as its linear pieces (`pieces`), once per call."""
        c, threshold, w1, b1, w2, b2 = t
        return c, threshold, *pieces(w1, b1, w2, b2)

    def causal_block(self, heads, first, rows, keys, start, t, device, dtype) -> torch.Tensor:
        """The CPU kernel's tile (`ScoreBias.causal_block`) by runs: x falls along each row (the
        distance grows to the left) and is 0 from the diagonal on, so each linear piece covers one
        run of a row's keys. One search per row and breakpoint finds the runs; each element then
        reads its run's piece, and the pieces' gradients are sums over runs (`_RunPieces`): no
        per-element search, scatter or mask."""
        c, threshold, breaks, slope, intercept = t
        m = torch.arange(first, first + rows, device=device)[:, None] + start
        n = torch.minimum(torch.arange(keys.start, keys.stop, device=device)[None, :] + start, m)
        masked = (keys.stop - first - 1 - torch.arange(rows, device=device)).clamp(0, keys.stop - keys.start)
        return _RunPieces.apply(fire_input(c, threshold, m, n), slope, intercept, breaks, masked, dtype)


class _RunPieces(torch.autograd.Function):
    """b_h = slope_h[s] x + intercept_h[s] on x [rows, keys] (falling along each row, the last
    masked[i] keys of row i masked), s the piece of x (`pieces`), as `dtype` [H, rows, keys] with
    the dtype's lowest value at masked keys. A row's keys in order are runs of the pieces from the
    last (32) to the first, then the masked keys: a run's length is the difference of two counts
    of keys with x above a breakpoint (`searchsorted` in the row), and the gradients of slope and
    intercept are `segment_reduce` sums over the runs, of g x and g."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor, breaks: torch.Tensor,
                masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows, keys = x.shape
        H, n_pieces = slope.shape
        # above[i, k]: keys of row i with x > breaks[k], a prefix of the row (x falls along it; the
        # running minimum keeps the counts falling even if rounding ever broke that by an ulp)
        above = torch.searchsorted(-x.detach(), (-breaks).expand(rows, -1).contiguous()).cummin(1).values
        edges = torch.cat([above.new_full((rows, 1), keys), above, above.new_zeros(rows, 1)], 1)
        runs = (edges[:, :-1] - edges[:, 1:]).flip(1)  # [rows, pieces]: run lengths, the last piece first
        zero_run = n_pieces - 1 - int(torch.searchsorted(breaks, breaks.new_zeros(1)))
        runs[:, zero_run] -= masked  # n > m: the end of the zero run
        runs = torch.cat([runs, masked[:, None]], 1)  # [rows, pieces + 1], each row's sum: keys
        order = torch.arange(n_pieces, device=x.device, dtype=torch.int32).flip(0)  # int32: half an int64 index
        piece = torch.cat([order, order.new_full((1,), n_pieces)])  # the masked run reads an extra piece
        index = piece.repeat(rows).repeat_interleave(runs.flatten(), output_size=rows * keys)
        slope = torch.cat([slope, slope.new_zeros(H, 1)], 1)  # the masked piece: 0 x + lowest
        intercept = torch.cat([intercept, intercept.new_full((H, 1), torch.finfo(dtype).min)], 1)
        # two [H, pairs] at a time: the intercepts read, then the slopes added in place
        slopes = slope.index_select(1, index)
        out = x.new_empty(H, rows, keys)  # returned whole, not as a view: the kernel may reuse it
        torch.index_select(intercept, 1, index, out=out.view(H, -1)).addcmul_(slopes, x.flatten())
        ctx.save_for_backward(x, slopes, runs)  # kept by the backward's recompute only (a tile's)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, slopes, runs = ctx.saved_tensors
        H, rows, keys = grad.shape
        g = grad.to(x.dtype).reshape(H, rows * keys)
        lengths = runs.flatten().expand(H, -1).contiguous()

        def run_sums(values: torch.Tensor) -> torch.Tensor:  # [H, rows * keys] -> [H, pieces], pieces 0..32
            sums = torch.segment_reduce(values, "sum", lengths=lengths, axis=1, unsafe=True)
            return sums.view(H, rows, -1)[..., :-1].sum(1).flip(-1)  # the masked run dropped

        # one [H, rows * keys] temporary at a time beside g
        grad_intercept = run_sums(g) if ctx.needs_input_grad[2] else None
        grad_slope = run_sums(g * x.flatten()) if ctx.needs_input_grad[1] else None
        grad_x = None  # the masked run's slope is 0: no gradient there
        if ctx.needs_input_grad[0]:
            grad_x = (slopes * g).sum(0).view(rows, keys)  # not in place: the saved slopes stay intact
        return grad_x, grad_slope, grad_intercept, None, None, None


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
