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

    def causal_block(self, heads, first, rows, keys, start, t, device, dtype, shift=None) -> torch.Tensor:
        """The CPU kernel's tile (`ScoreBias.causal_block`) from the pieces a tile crosses: x spans a
        short range in a tile, so few breakpoints fall inside it (`_TilePieces`): no per-element
        search or lookup."""
        c, threshold, breaks, slope, intercept = t
        m = torch.arange(first, first + rows, device=device)[:, None] + start
        n = torch.minimum(torch.arange(keys.start, keys.stop, device=device)[None, :] + start, m)
        masked = (keys.stop - first - 1 - torch.arange(rows, device=device)).clamp(0, keys.stop - keys.start)
        return _TilePieces.apply(fire_input(c, threshold, m, n), slope, intercept, breaks, masked, dtype, shift)


BREAKS_AT_ONCE = 2  # breakpoints per matmul in `_TilePieces`, its temporary [2 x this, pairs]: 4 and 8 lift FIRE's
# peak to 1.11x and 1.16x Origin's at 2K (bench.attention), 2 keeps it at 1.10x, at the same time


class _TilePieces(torch.autograd.Function):
    """b_h = slope_h[s] x + intercept_h[s] on x [rows, keys], s the piece of x (`pieces`), as `dtype`
    [H, rows, keys] with the dtype's lowest value at each row i's last masked[i] keys (plus `shift`
    [H, rows, 1] elsewhere, if given: a constant, added in the first pass). Written from
    the tile's lowest piece lo, whose line every element starts on, plus, for each breakpoint k the
    tile's x crosses, the step from piece k to k + 1 where x is past it:

        b_h = slope_h[lo] x + intercept_h[lo] + sum_k [x > break_k] (dslope_hk x + dintercept_hk)

    one matmul per BREAKS_AT_ONCE breakpoints ([H, 2k] by [2k, pairs]); a tile far from its
    diagonal spans a short range of x and crosses few or none. The backward is the same matmul's:
    the pieces' gradients are g [H, pairs] times [x, 1, [x > break] x, [x > break]]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor, breaks: torch.Tensor,
                masked: torch.Tensor, dtype: torch.dtype, shift: torch.Tensor | None) -> torch.Tensor:
        rows, keys = x.shape
        flat = x.detach().reshape(1, -1)
        lo, hi = (int(i) for i in torch.searchsorted(breaks, torch.stack([flat.min(), flat.max()])))
        line = intercept[:, lo, None, None] if shift is None else intercept[:, lo, None, None] + shift
        out = x.new_empty(slope.shape[0], rows, keys)  # returned whole, not as a view: the kernel may reuse it
        torch.addcmul(line, slope[:, lo, None, None], x.detach()[None], out=out)
        pairs = out.view(-1, rows * keys)
        dslope, dintercept = slope.diff(dim=1), intercept.diff(dim=1)  # [H, 32]: the steps between pieces
        for k0 in range(lo, hi, BREAKS_AT_ONCE):
            ks = slice(k0, min(hi, k0 + BREAKS_AT_ONCE))
            pairs.addmm_(torch.cat([dslope[:, ks], dintercept[:, ks]], 1), _past(flat, breaks[ks]))
        out = out.to(dtype)
        mask = _masked(masked, keys)
        if mask is not None:
            out.masked_fill_(mask, torch.finfo(dtype).min)
        ctx.lo, ctx.hi, ctx.n_pieces = lo, hi, slope.shape[1]
        ctx.save_for_backward(x, slope, breaks, mask)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, slope, breaks, mask = ctx.saved_tensors
        H, rows, keys = grad.shape
        lo, hi = ctx.lo, ctx.hi
        g = grad.to(x.dtype).reshape(H, -1)
        flat = x.reshape(1, -1)
        grad_slope, grad_intercept = g.new_zeros(H, ctx.n_pieces), g.new_zeros(H, ctx.n_pieces)
        base = g @ torch.cat([flat, torch.ones_like(flat)]).T  # [H, 2]
        grad_slope[:, lo], grad_intercept[:, lo] = base[:, 0], base[:, 1]
        grad_x = (slope[:, lo] @ g)[None] if ctx.needs_input_grad[0] else None  # [1, pairs]
        # A masked pair is constant (no gradient) but reads the lowest piece at x = 0, the tile's least
        # x, so no step is past it: take its g back from the intercept, and its grad_x out.
        if mask is not None:
            grad_intercept[:, lo] -= grad[:, mask].to(x.dtype).sum(1)
            if grad_x is not None:
                grad_x.masked_fill_(mask.view(1, -1), 0)
        dslope = slope.diff(dim=1)
        for k0 in range(lo, hi, BREAKS_AT_ONCE):
            ks = slice(k0, min(hi, k0 + BREAKS_AT_ONCE))
            past = _past(flat, breaks[ks])  # [2k, pairs]: [x > break] x, then [x > break]
            k = past.shape[0] // 2
            steps = g @ past.T  # [H, 2k]: the gradients of the steps, d(piece k + 1) - d(piece k)
            for total, step in ((grad_slope, steps[:, :k]), (grad_intercept, steps[:, k:])):
                total[:, ks.start + 1:ks.stop + 1] += step
                total[:, ks] -= step
            if grad_x is not None:  # each element's slope: the lowest piece's plus the steps past it
                grad_x += (dslope[:, ks].T @ g).mul_(past[k:]).sum(0)
        grad_x = None if grad_x is None else grad_x.view(rows, keys)
        return grad_x, grad_slope, grad_intercept, None, None, None, None


def _past(flat: torch.Tensor, breaks: torch.Tensor) -> torch.Tensor:
    """[2k, pairs]: [x > break_k] x for each of the k breakpoints, then [x > break_k]."""
    k = len(breaks)
    past = flat.new_empty(2 * k, flat.shape[1])
    torch.gt(flat, breaks[:, None], out=past[k:])
    torch.mul(past[k:], flat, out=past[:k])
    return past


def _masked(masked: torch.Tensor, keys: int) -> torch.Tensor | None:
    """[rows, keys]: row i's last masked[i] keys; None where no row has any."""
    if not bool(masked.any()):
        return None
    return torch.arange(keys, device=masked.device)[None, :] >= keys - masked[:, None]


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
