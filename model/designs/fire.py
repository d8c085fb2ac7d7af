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

import functools

import torch
from torch import nn

from .base import Design, ScoreBias
from .learned import wide

WIDTH = 32  # the MLP's hidden units
INIT_C, INIT_L, EPS = 0.1, 512.0, 1e-6


def fire_input(c: torch.Tensor, threshold: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The MLP's input psi(m - n) / (psi(max(m, L)) + eps), with psi(x) = log(|c| x + 1)."""
    return torch.log1p(c.abs() * (m - n)) / _denominator(c, threshold, m)


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

    def flex_tensors(self, heads: slice, device) -> tuple[torch.Tensor, ...]:
        """`tensors` with every value `element` reads as its own tensor, each read once: c twice (x's
        numerator and denominator), L, each hidden unit's weight, bias and output weights [H], and
        the output bias [H] (copies: the gradients still reach the parameters)."""
        c, threshold, w1, b1, w2, b2 = self.tensors(heads, device)
        units = [u.clone() for x in (w1, b1) for u in x.split(1)]
        return (c[None].clone(), c[None].clone(), threshold[None], *units, *(w.clone() for w in w2.unbind(1)), b2)

    @staticmethod
    def element(t, h, m, n, gap=None) -> torch.Tensor:
        """One element from `flex_tensors`: the MLP written out over its hidden units (FlexAttention's
        score_mod)."""
        c, c_again, threshold = t[0][0], t[1][0], t[2][0]
        w1, b1, w2, b2 = t[3 : 3 + WIDTH], t[3 + WIDTH : 3 + 2 * WIDTH], t[3 + 2 * WIDTH : 3 + 3 * WIDTH], t[-1]
        x = torch.log1p(c.abs() * (m - n)) / _denominator(c_again, threshold, m)
        out = b2[h]
        for u in range(WIDTH):
            out = out + w2[u][h] * torch.relu(w1[u][0] * x + b1[u][0])
        return out

    def rows(self, heads, m, n, gap=None, t=None) -> torch.Tensor:
        """The MLP as its pieces: per element one segment lookup and one multiply-add per head
        (far fewer operations than the hidden layer's 32 units per element)."""
        c, threshold, w1, b1, w2, b2 = self.tensors(heads, m.device) if t is None else t
        x = fire_input(c, threshold, m, n)  # [rows, keys]
        breaks, slope, intercept = pieces(w1, b1, w2, b2)
        segment = torch.searchsorted(breaks, x.detach().contiguous()).flatten()
        out = torch.addcmul(intercept.index_select(1, segment), slope.index_select(1, segment), x.flatten())
        return out.view(-1, *x.shape)  # [H, rows, keys]

    def prepared(self, t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(c, L, breaks, lines): the MLP as its linear pieces (`pieces`), once per call; lines
        [H, 2, 33] holds each piece's slope and intercept."""
        c, threshold, w1, b1, w2, b2 = t
        breaks, slope, intercept = pieces(w1, b1, w2, b2)
        return c, threshold, breaks, torch.stack([slope, intercept], 1)

    def causal_block(self, heads, first, rows, keys, start, t, device, dtype, shift=None) -> torch.Tensor:
        """The CPU kernel's tile (`ScoreBias.causal_block`) from the pieces a tile crosses: x spans a
        short range in a tile, so few breakpoints fall inside it (`_FireTile`): no per-element
        search or lookup, and no autograd graph per element. Computed in `dtype` (FIRE's tensors
        are cast to it: a no-op where they share q's dtype, as in a model)."""
        c, threshold, breaks, lines = t if t[0].dtype == dtype else (p.to(dtype) for p in t)
        m = torch.arange(first + start, first + start + rows, device=device, dtype=dtype)[:, None]
        n = torch.arange(keys.start + start, keys.stop + start, device=device, dtype=dtype)[None, :]
        return _FireTile.apply(c, threshold, lines, breaks, m, n, shift)


BREAKS_AT_ONCE = 2  # breakpoints per matmul in `_FireTile`: its terms are [2 + 2 x this, pairs] in the forward
# and [3 + 3 x this, pairs] in the backward, beside the tile's [H, pairs]


class _FireTile(torch.autograd.Function):
    """FIRE's bias b_h(m, n) = slope_h[s] x + intercept_h[s] on x = fire_input(c, L, m, n) [rows,
    keys] (positions m [rows, 1], n [1, keys]), s the piece of x (`pieces`; `lines` [H, 2, 33]
    holds the pieces' slopes and intercepts): [H, rows, keys] with the dtype's lowest value where
    n > m (plus `shift` [H, rows, 1] elsewhere, if given). Written from the tile's lowest piece lo,
    whose line every element starts on, plus, for each breakpoint k the tile's x crosses, the step
    from piece k to k + 1 where x is past it:

        b_h = slope_h[lo] x + intercept_h[lo] + sum_k [x > break_k] (dslope_hk x + dintercept_hk)

    as matmuls [H, 2 + 2k] by [2 + 2k, pairs] (`_terms`) of BREAKS_AT_ONCE breakpoints each. In a
    tile with masked pairs, the first matmul's 1 is [n <= m] and one more term, [n > m], has the
    lowest value as its weight (a masked pair has x = 0, past no breakpoint: its other terms are
    0). A tile far from its diagonal spans a short range of x and crosses few or none.

    The backward takes every gradient from one product per matmul: g [H, pairs] by the same terms
    with a(d) = dA/d|c| added, per query row (a batched matmul over the rows), then weighted per
    row. With x = A(d) / D(m), A(d) = log(1 + |c| d), D(m) = log(1 + |c| M) + eps, M = max(m, L):

        dx/d|c| = a(d) / D(m) - x M / ((1 + |c| M) D(m)),   a(d) = d / (1 + |c| d)
        dx/dL   = -x |c| / ((1 + |c| M) D(m)) [L > m]      (half where L = m, as torch.maximum)

    and each pair's dx, times the slope of its piece, is summed with g: no per-pair gradient of
    x is formed."""

    @staticmethod
    def forward(ctx, c: torch.Tensor, threshold: torch.Tensor, lines: torch.Tensor, breaks: torch.Tensor,
                m: torch.Tensor, n: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
        diagonal = bool(n[0, -1] > m[0, 0])  # some pair is masked
        d = (m - n).clamp_(min=0)  # [rows, keys]; 0 at the masked pairs, where x is then 0
        den = _denominator(c, threshold, m)  # [rows, 1]
        x = torch.log1p(c.abs() * d).div_(den)  # fire_input's x, op for op
        lo, hi = torch.searchsorted(breaks, torch.stack(torch.aminmax(x))).tolist()
        H, (rows, keys) = lines.shape[0], x.shape
        flat = x.view(1, -1)
        out = x.new_empty(H, rows, keys)  # returned whole, not as a view: the kernel may reuse it
        pairs = out.view(H, -1)
        spread = _spread(lo, hi, lines.shape[2], x.dtype, x.device)
        for part, crossed in _groups(lo, hi):
            base = part.start == 0  # the first matmul writes the lowest piece's line too
            weights = (lines @ spread[part].T).view(H, -1)  # [H, 2 j]: the x terms', then the 1 terms'
            terms = _terms(flat, breaks[crossed], base, (m, n) if base and diagonal else None)
            if base and diagonal:
                weights = torch.cat([weights, weights.new_full((H, 1), torch.finfo(x.dtype).min)], 1)
            if base:
                torch.mm(weights, terms, out=pairs)
            else:
                pairs.addmm_(weights, terms)
        if shift is not None:
            out.add_(shift)
        ctx.lo, ctx.hi, ctx.diagonal = lo, hi, diagonal
        ctx.save_for_backward(c, threshold, lines, breaks, m, n, d, x, den)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        c, threshold, lines, breaks, m, n, d, x, den = ctx.saved_tensors
        need_c, need_l = ctx.needs_input_grad[:2]
        H, rows, keys = grad.shape
        lo, hi = ctx.lo, ctx.hi
        ac, den = c.abs(), den[:, 0]
        positions = (m, n) if ctx.diagonal else None
        m = m[:, 0]
        big = torch.maximum(m, threshold)  # M [rows]
        per_big = 1 / ((1 + ac * big) * den)
        tie = torch.where(threshold > m, 1.0, torch.where(threshold == m, 0.5, 0.0)).to(x.dtype)
        # per row: the plain sums, then the weights of dx/d|c|'s two terms and of dx/dL's
        by_row = torch.stack([torch.ones_like(den), 1 / den, big * per_big, tie * ac * per_big])
        flat = x.view(1, -1)
        a = (d / (1 + ac * d)).view(1, -1)
        g = grad.transpose(0, 1)  # [rows, H, keys]
        spread = _spread(lo, hi, lines.shape[2], x.dtype, x.device)
        grad_lines = torch.zeros_like(lines)
        by_slope = x.new_zeros(3, H, len(spread))
        for part, crossed in _groups(lo, hi):
            base = part.start == 0
            terms = _terms(flat, breaks[crossed], base, positions if base else None, a)  # x, 1, a: j each
            per_row = torch.bmm(g, terms.view(-1, rows, keys).permute(1, 2, 0))  # [rows, H, 3 j]
            sums = (by_row @ per_row.view(rows, -1)).view(4, H, 3, -1)
            grad_lines += sums[0, :, :2] @ spread[part]  # the pieces' slopes and intercepts
            # each column's x enters with its piece's (or step's) slope: dx/d|c|, then dx/dL
            by_slope[:, :, part] = torch.stack([sums[1, :, 2], -sums[2, :, 0], -sums[3, :, 0]])
        slopes = lines[:, 0] @ spread.T  # [H, columns]
        grad_c = (slopes * by_slope[:2].sum(0)).sum() * torch.sign(c) if need_c else None
        grad_l = (slopes * by_slope[2]).sum() if need_l else None
        return grad_c, grad_l, grad_lines, None, None, None, None


def _denominator(c: torch.Tensor, threshold: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """D(m) = psi(max(m, L)) + eps, `fire_input`'s denominator."""
    return torch.log1p(c.abs() * torch.maximum(m, threshold)) + EPS


@functools.lru_cache(maxsize=4096)
def _spread(lo: int, hi: int, n_pieces: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1 + hi - lo, pieces]: the tile's columns over the pieces: piece lo, then the step from
    piece k to k + 1 for each crossed breakpoint k (+1 at k + 1, -1 at k)."""
    spread = torch.zeros(1 + hi - lo, n_pieces, dtype=dtype, device=device)
    spread[0, lo] = 1
    steps = torch.arange(hi - lo, device=device)
    spread[1 + steps, lo + 1 + steps] = 1
    spread[1 + steps, lo + steps] = -1
    return spread


def _groups(lo: int, hi: int) -> list[tuple[slice, slice]]:
    """The columns of `_spread` (piece lo, then a step per crossed breakpoint) in matmuls of
    BREAKS_AT_ONCE breakpoints, the first with piece lo; with each, its breakpoints' indices."""
    return [(slice(0 if k == lo else 1 + k - lo, 1 + min(hi, k + BREAKS_AT_ONCE) - lo),
             slice(k, min(hi, k + BREAKS_AT_ONCE))) for k in range(lo, max(hi, lo + 1), BREAKS_AT_ONCE)]


def _terms(flat: torch.Tensor, breaks: torch.Tensor, base: bool, positions: tuple | None = None,
           a: torch.Tensor | None = None) -> torch.Tensor:
    """[terms, pairs] of x [1, pairs] and the k `breaks`, in blocks: x (with `base`) and [x > break]
    x; 1 (with `base`) and [x > break]; if `a` is given, a (with `base`) and [x > break] a. Where
    `positions` (m, n) are given (a tile with masked pairs), the 1 is [n <= m], and without `a`
    (the forward) one more term follows, [n > m]."""
    k, b, width = len(breaks), int(base), flat.shape[1]
    blocks = 2 if a is None else 3
    out = flat.new_empty(blocks * (b + k) + (positions is not None and a is None), width)
    x_rows, one_rows, a_rows = (out[i * (b + k):(i + 1) * (b + k)] for i in range(3))
    if k:
        torch.gt(flat, breaks[:, None], out=one_rows[b:])
        torch.mul(one_rows[b:], flat, out=x_rows[b:])
        if a is not None:
            torch.mul(one_rows[b:], a, out=a_rows[b:])
    if base:
        x_rows[0] = flat[0]
        if a is not None:
            a_rows[0] = a[0]
    if positions is None:
        one_rows[:b] = 1
    else:
        m, n = positions
        shape = (m.shape[0], n.shape[1])
        torch.le(n, m, out=one_rows[0].view(shape))
        if a is None:
            torch.gt(n, m, out=out[-1].view(shape))
    return out


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
