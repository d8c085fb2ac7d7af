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
go in chunks of `CHUNK`, each against the keys before its last row (O(chunk x T) memory); with
gradients each chunk is recomputed in backward (`torch.utils.checkpoint`), so what is kept is
q, k, v and the outputs: O(T) beside one chunk.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .base import Design

CHUNK = 64  # query rows per chunk: its scores are [B, H, CHUNK, keys]


def _rows(q: torch.Tensor, k_rev: torch.Tensor, v_rev: torch.Tensor, rows: int,
          same: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: q [B, Hkv, G * rows, D] (scaled by 1 / sqrt(D)) over keys given in reverse order,
    k_rev, v_rev [B, Hkv, N, D], column c the key c places before the chunk's last row (so row r may
    see columns c >= rows - 1 - r); same [B, rows, N] whether a key is in the row's document (None:
    all are). -> (sum_j A_ij v_j [B, Hkv, G * rows, D], log rem [B, Hkv, G * rows])."""
    B, Hkv, GR, D = q.shape
    N = k_rev.shape[-2]
    z = (q @ k_rev.transpose(-1, -2)).view(B, Hkv, GR // rows, rows, N)
    r = torch.arange(rows, device=q.device)
    allowed = torch.arange(N, device=q.device)[None, :] >= (rows - 1 - r)[:, None]  # [rows, N]
    if same is not None:
        allowed = allowed & same[:, None, None]  # [B, 1, 1, rows, N]
    log_keep = (-F.softplus(z)).masked_fill(~allowed, 0.0)  # log(1 - beta); absent keys: log 1
    suffix = log_keep.cumsum(-1)  # sum_{j<=k<i} log(1 - beta_ik)
    weights = (z + suffix).masked_fill(~allowed, -math.inf).exp()
    out = weights.view(B, Hkv, GR, N) @ v_rev
    return out, suffix[..., -1].reshape(B, Hkv, GR)


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
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k_rev, v_rev))
    outs, log_rems = [], []
    for s in range(0, Tq, CHUNK):
        rows = min(Tq, s + CHUNK) - s
        last = offset + s + rows - 1  # the chunk's last row's position: its keys are 0..last-1
        lo = 0 if starts is None else int(starts[:, offset + s].min())
        if last <= lo:  # no row of the chunk sees a key
            outs.append(q.new_zeros(B, Hkv, G, rows, D))
            log_rems.append(q.new_zeros(B, Hkv, G, rows))
            continue
        keys = slice(Tk - last, Tk - lo)
        q_rows = q[..., s : s + rows, :].reshape(B, Hkv, G * rows, D)
        same = None
        if documents is not None:
            same = documents[:, offset + s : offset + s + rows, None] == ids_rev[:, None, keys]
        args = (q_rows, k_rev[..., keys, :], v_rev[..., keys, :], rows, same)
        out, log_rem = checkpoint(_rows, *args, use_reentrant=False) if grad else _rows(*args)
        outs.append(out.view(B, Hkv, G, rows, D))
        log_rems.append(log_rem.view(B, Hkv, G, rows))
    return torch.cat(outs, -2).view(B, H, Tq, D), torch.cat(log_rems, -1).view(B, H, Tq)


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
    rope=False, from_origin="keep", attend=StickBreaking,
)
