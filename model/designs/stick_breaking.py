"""Stick-breaking attention (Tan et al., ICLR 2025, arXiv 2410.17980): no softmax and no position
encoding; each query breaks a stick from its nearest earlier key backwards. For query i and key j < i,

    z_ij = q_i . k_j / sqrt(D),   beta_ij = sigmoid(z_ij),   A_ij = beta_ij prod_{j<k<i} (1 - beta_ik)

    o_i = sum_{j<i} A_ij v_j + rem_i b_h,   rem_i = 1 - sum_j A_ij = prod_{j<i} (1 - beta_ij)

with b_h [D] a learned vector per head (zeros at initialisation): the stick left over goes to it.
Strictly causal as the reference's default (`attend_current=False`): a query does not attend to
its own key, so the first token's output is b_h. Under document masking a key of another document
counts as absent (beta = 0: no weight, and no factor in the product).

Computed in log space, in float32 or wider: since beta / (1 - beta) = e^z,

    log A_ij = z_ij + sum_{j<=k<i} log(1 - beta_ik),   log(1 - beta) = -softplus(z),

so each score needs one softplus and one cumulative sum along its row, taken over the keys in
reverse order (k and v are flipped once per call: each chunk's keys are then a slice whose
running sum is the suffix sum). log rem_i is the row's whole sum, so rem >= 0 exactly. Query rows
go in chunks of `CHUNK`, each against the keys before its last row (O(chunk x T) memory); backward
recomputes each chunk's weights (`_StickBreaking`: as a per-chunk checkpoint would, without its
second forward's autograd graph or a whole-length gradient per key slice), so what is kept is q, k
and v: O(T) beside one chunk.

A weight A_ij whose log falls below the log of the dtype's smallest normal number counts as 0, and so
does rem_i (log rem_i = -inf): the stick is used up. Since sum log(1 - beta) only falls as keys go
back, once every row of a chunk has used its stick up (or has no key left in its document), no key
further back has weight: the chunk's forward goes through its keys in blocks of `BLOCK`, nearest
first, and stops there, and backward recomputes only the keys before that point (the others'
gradients are exactly 0). A trained model's rows mostly end within a few hundred keys, and so do
random ones, so at 8K most of the N x N work is never done; a row that keeps its stick (a head
that reads far back) makes its chunk go to the end, as without the rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Design

CHUNK = 64  # query rows per chunk: its scores are [B, H, CHUNK, BLOCK]
BLOCK = 256  # keys per step of a chunk's forward, nearest first, until its rows' sticks are used up
SOFTPLUS_LINEAR = 40.0  # softplus(z) = z past it: e^-40 = 4e-18 is below float64's rounding of 40


def _allowed(rows: int, keys: int, docs: tuple[torch.Tensor, torch.Tensor] | None,
             device: torch.device) -> torch.Tensor:
    """Which (row, key) pairs of a chunk count, the keys in reverse order (column c is the key c
    places before the chunk's last row, so row r sees columns c >= rows - 1 - r); docs: the rows'
    document ids [B, rows] and the keys' [B, >= keys], reversed as the keys are (None: one
    document). -> [rows, keys] or [B, 1, 1, rows, keys], made per chunk from views of the batch's
    ids, never kept: the chunks' masks together would be B T^2 / 2 bytes."""
    r = torch.arange(rows, device=device)
    allowed = torch.arange(keys, device=device)[None, :] >= (rows - 1 - r)[:, None]
    if docs is None:
        return allowed
    row_ids, key_ids = docs
    return allowed & (row_ids[:, :, None] == key_ids[:, None, :keys])[:, None, None]


def _used_up(dtype: torch.dtype) -> float:
    """The log below which a weight or a remainder counts as 0: the dtype's smallest normal number
    (CPU exp takes a slow path below it: -inf included, 6x the whole kernel's softplus at 2K)."""
    return math.log(torch.finfo(dtype).tiny)


def _weights(q: torch.Tensor, k_rev: torch.Tensor, rows: int, allowed: torch.Tensor,
             carry: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's scores z, weights A (0 where not allowed or used up) [B, Hkv, G * rows, N] and
    sum log(1 - beta) over its keys [B, Hkv, G * rows], for q [B, Hkv, G * rows, D] (scaled by
    1 / sqrt(D)) over k_rev [B, Hkv, N, D]; carry: that sum over the nearer keys (None: none)."""
    B, Hkv, GR, _ = q.shape
    N = k_rev.shape[-2]
    z = q @ k_rev.transpose(-1, -2)
    # log(1 - beta); softplus's default turns linear past z = 20, off by e^-z (2e-9 in float64's A)
    weights = F.softplus(z, threshold=SOFTPLUS_LINEAR).neg_()
    masked = weights.view(B, Hkv, GR // rows, rows, N).masked_fill_(~allowed, 0.0)  # absent keys: log 1
    masked.cumsum_(-1)  # sum_{j<=k<i} log(1 - beta_ik)
    if carry is not None:
        weights.add_(carry[..., None])
    log_kept = weights[..., -1].clone()
    weights.add_(z)  # log A = z + that
    dead = masked.masked_fill_(~allowed, -math.inf) < _used_up(z.dtype)
    masked.masked_fill_(dead, 0.0).exp_().masked_fill_(dead, 0.0)
    return z, weights, log_kept


def _chunk_forward(q_rows: torch.Tensor, k_rev: torch.Tensor, v_rev: torch.Tensor, rows: int,
                   allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One chunk's sum_j A_ij v_j and log rem [B, Hkv, G * rows] over its keys k_rev, v_rev, in
    blocks of `BLOCK` keys nearest first, and how many keys it went through before every row's stick
    was used up or its keys ran out (allowed [rows, N] or [B, 1, 1, rows, N])."""
    B, Hkv, GR, _ = q_rows.shape
    N = k_rev.shape[-2]
    used_up = _used_up(q_rows.dtype)
    # the key after each row's last allowed one (its keys are one run of columns: its document's)
    columns = torch.arange(N, device=q_rows.device)
    ends = torch.where(allowed, columns + 1, 0).amax(-1)  # [rows] or [B, 1, 1, rows]
    out, log_kept = None, None
    for start in range(0, N, BLOCK):
        end = min(N, start + BLOCK)
        _, weights, log_kept = _weights(q_rows, k_rev[..., start:end, :], rows, allowed[..., start:end], log_kept)
        part = weights @ v_rev[..., start:end, :]
        out = part if out is None else out.add_(part)
        done = (log_kept.view(B, Hkv, GR // rows, rows) < used_up) | (ends <= end)
        if end == N or bool(done.all()):
            break
    return out, log_kept.masked_fill(log_kept < used_up, -math.inf), end


class _StickBreaking(torch.autograd.Function):
    """The chunked kernel with its own backward: forward keeps q, k, v (and the chunk plan) only;
    backward recomputes each chunk's z and A and takes, with dL = A * (dO . v),

        dz = dL - sigmoid(z) (sum_{k >= j} dL_k + d log rem),   masked,

    (the suffix sum over keys at or before j's column: log A_j and log rem sum log(1 - beta_k) over
    them), then dq = dz k, dk = dz^T q, dv = A^T dO, accumulated per key slice in place: memory is
    one chunk's [B, H, rows, keys] tensors beside q, k, v and their gradients."""

    @staticmethod
    def forward(ctx, q, k_rev, v_rev, plan):
        B, Hkv, G, Tq, D = q.shape
        out, log_rem = q.new_zeros(B, Hkv, G, Tq, D), q.new_zeros(B, Hkv, G, Tq)
        backward_plan = []  # each chunk's keys up to where its forward stopped
        for s, rows, keys, docs in plan:
            q_rows = q[..., s : s + rows, :].reshape(B, Hkv, G * rows, D)
            chunk, rem, used = _chunk_forward(q_rows, k_rev[..., keys, :], v_rev[..., keys, :], rows,
                                              _allowed(rows, keys.stop - keys.start, docs, q.device))
            out[..., s : s + rows, :] = chunk.view(B, Hkv, G, rows, D)
            log_rem[..., s : s + rows] = rem.view(B, Hkv, G, rows)
            backward_plan.append((s, rows, slice(keys.start, keys.start + used), docs))
        ctx.save_for_backward(q, k_rev, v_rev)
        ctx.plan = backward_plan
        return out, log_rem

    @staticmethod
    def backward(ctx, grad_out, grad_log_rem):
        q, k_rev, v_rev = ctx.saved_tensors
        B, Hkv, G, Tq, D = q.shape
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k_rev), torch.zeros_like(v_rev)
        for s, rows, keys, docs in ctx.plan:
            allowed = _allowed(rows, keys.stop - keys.start, docs, q.device)
            q_rows = q[..., s : s + rows, :].reshape(B, Hkv, G * rows, D)
            z, weights, _ = _weights(q_rows, k_rev[..., keys, :], rows, allowed)
            grad_rows = grad_out[..., s : s + rows, :].reshape(B, Hkv, G * rows, D)
            grad_v[..., keys, :] += weights.transpose(-1, -2) @ grad_rows
            grad_log = (grad_rows @ v_rev[..., keys, :].transpose(-1, -2)).mul_(weights)  # dL
            del weights
            suffix = grad_log.cumsum(-1).neg_().add_(grad_log.sum(-1, keepdim=True)).add_(grad_log)
            suffix.add_(grad_log_rem[..., s : s + rows].reshape(B, Hkv, G * rows, 1)).mul_(z.sigmoid_())
            grad_z = grad_log.sub_(suffix)
            grad_z.view(B, Hkv, G, rows, -1).masked_fill_(~allowed, 0.0)
            grad_q[..., s : s + rows, :] = (grad_z @ k_rev[..., keys, :]).view(B, Hkv, G, rows, D)
            grad_k[..., keys, :] += grad_z.transpose(-1, -2) @ q_rows
        return grad_q, grad_k, grad_v, None


def stick_breaking(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_{j<i} A_ij v_j, log rem_i) of the module docstring: q [B, H, Tq, D], the last Tq of the
    Tk positions of k, v [B, Hkv, Tk, D] (a KV cache's), query head h reading kv head h // (H / Hkv);
    documents [B, Tk]: each position's document id, non-decreasing (None: one document). Returns
    [B, H, Tq, D] and [B, H, Tq] in float32 or q's wider dtype."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[-2]
    if H % Hkv or Tq > Tk:
        raise ValueError(f"stick-breaking attention needs kv heads dividing the query heads and no more "
                         f"queries than keys; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if documents is not None and documents.shape != (B, Tk):
        raise ValueError(f"documents must be [B, Tk] = {(B, Tk)}; got {tuple(documents.shape)}")
    wide = torch.promote_types(q.dtype, torch.float32)
    G, offset = H // Hkv, Tk - Tq
    q = (q.to(wide) / math.sqrt(D)).view(B, Hkv, G, Tq, D)
    k_rev, v_rev = k.to(wide).flip(-2), v.to(wide).flip(-2)  # key n at index Tk - 1 - n
    starts = None
    if documents is not None:  # each position's document start: keys before a chunk's earliest are absent
        index = torch.arange(Tk, device=documents.device).expand(B, Tk)
        first = torch.ones_like(documents, dtype=torch.bool)
        first[:, 1:] = documents[:, 1:] != documents[:, :-1]
        starts = torch.where(first, index, 0).cummax(-1).values
        ids_rev = documents.flip(-1)
    plan = []  # per chunk of query rows that sees a key: (first row, rows, its keys in k_rev, their documents)
    for s in range(0, Tq, CHUNK):
        rows = min(Tq, s + CHUNK) - s
        last = offset + s + rows - 1  # the chunk's last row's position: its keys are 0..last-1
        lo = 0 if starts is None else int(starts[:, offset + s].min())
        if last <= lo:  # no row of the chunk sees a key: output 0, log rem 0
            continue
        keys = slice(Tk - last, Tk - lo)
        docs = None if documents is None else (documents[:, offset + s : offset + s + rows], ids_rev[:, keys])
        plan.append((s, rows, keys, docs))
    out, log_rem = _StickBreaking.apply(q, k_rev, v_rev, plan)
    return out.view(B, H, Tq, D), log_rem.view(B, H, Tq)


def attention_weights(scores: torch.Tensor, causal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights A_mn of the module docstring from scores z [..., rows, keys] and the causal mask
    n <= m (each row's keys one run ending at its own position), in the scores' dtype, for the
    attention statistics: (A, the keys each query sees: n < m). Direct, not the kernel's: log A_mn =
    log sigmoid z_mn + sum_{n<k<m} log(1 - sigmoid z_mk), with log sigmoid z = -log(1 + e^-z)."""
    own = causal & (causal.cumsum(-1) == causal.sum(-1, keepdim=True))  # each row's last key: itself
    seen = causal & ~own
    log_kept = torch.where(seen, -torch.logaddexp(torch.zeros_like(scores), scores), 0.0)
    after = log_kept.flip(-1).cumsum(-1).flip(-1) - log_kept  # over the keys k > n
    log_a = after - torch.logaddexp(torch.zeros_like(scores), -scores)
    return torch.where(seen, log_a.exp(), 0.0), seen


class StickBreaking(nn.Module):
    """A layer's stick-breaking attention, with the learned per-head vector b_h [H, D] that the
    remainder of each query's stick multiplies (`head_bias`, zeros at initialisation: IBM
    dolomite-engine's `SBAttention.head_bias`)."""

    def __init__(self, n_head: int, head_dim: int):
        super().__init__()
        self.head_bias = nn.Parameter(torch.zeros(n_head, head_dim))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None,
                heads: slice = slice(None)) -> torch.Tensor:
        """o_i [B, H, Tq, D] in q's dtype (`stick_breaking`'s arguments); `heads`: the query heads
        served (all of them, or one rank's share under sequence parallelism)."""
        out, log_rem = stick_breaking(q, k, v, documents)
        bias = self.head_bias[heads].to(out.dtype)[:, None, :]  # [H, 1, D]
        return (out + log_rem.exp()[..., None] * bias).to(q.dtype)


STICK_BREAKING = Design(
    key="stick_breaking", attention="stick_breaking", label="stick-breaking", name="Stick-breaking",
    colour="#843c39",
    summary="no softmax, no position encoding: sigmoid stick-breaking from the nearest earlier key back",
    rope=False, from_origin="keep", attend=StickBreaking, weights=attention_weights,
)
