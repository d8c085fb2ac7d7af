"""Document masking for packed rows: a token attends only to earlier tokens of its own document.

A packed row holds several documents; `documents` [B, T] gives each token's document id,
non-decreasing along the row (`data.synthetic.document_ids`: the EOS that starts a document
belongs to it). The allowed pairs are block diagonal and causal: doc[m] == doc[n] and n <= m.

Two kernels, both exact and neither building an N x N tensor:

- GPU: FlexAttention with a BlockMask built from per-tile document ranges ([B, tiles, tiles]
  booleans, tiles of 128 tokens; `model.block_masks.document_block_mask`): a tile pair is skipped
  when its documents cannot meet, computed without a mask where one document covers both tiles,
  and masked element-wise only on the tiles that hold a boundary or the diagonal. A design's
  distance bias is its score modification.
- CPU: causal attention on each document of a row, nothing masked (`segments`): the flash
  kernel's own forward and backward per document, written into one output and one set of
  gradients (`causal_segments`), so memory stays that of the fused kernel on the whole row and
  time at most that (documents are shorter than rows); the bias kernel (ALiBi's) on each document
  (`segment_attention`). A masked kernel would not do: CPU SDPA keeps a float32 copy of its mask
  for backward.

Positions restarting at each document (`model.doc_positions`) are `positions`. A distance bias
-slope * (m - n) depends on the distance only, so it counts from the document start either way; a
bias that reads the query position (FIRE's) reads it from the document start under
`doc_positions`, else from the row's, and a gated bias's prefix sums (FoX's) restart at every
document (`model.attention`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from .block_masks import document_block_mask


class Documents:
    """A batch's document ids [B, T], with the GPU kernel's block masks built once per batch (the
    forward's, shared by every layer and by the recomputation of activation checkpointing), not once
    per layer. restart: positions restart at each document (`model.doc_positions`), which a
    positional score bias then reads."""

    def __init__(self, ids: torch.Tensor, restart: bool = False):
        self.ids = ids
        self.restart = restart
        self._masks: dict[int, BlockMask] = {}

    def block_mask(self, window: int = 0) -> BlockMask:
        """The document mask, within a sliding window of `window` keys where > 0 (built on first use)."""
        if window not in self._masks:
            self._masks[window] = document_block_mask(self.ids, window)
        return self._masks[window]

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        return starts(self.ids)

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        return positions(self.ids)


def starts(documents: torch.Tensor) -> torch.Tensor:
    """[B, T]: the index of the first token of each token's document."""
    T = documents.shape[-1]
    index = torch.arange(T, device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return torch.where(first, index, torch.zeros_like(index)).cummax(dim=-1).values


def positions(documents: torch.Tensor) -> torch.Tensor:
    """[B, T]: each token's position within its document (0 at the document's first token)."""
    return torch.arange(documents.shape[-1], device=documents.device) - starts(documents)


# ---- CPU: one causal attention per document -------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """Rows `rows`, tokens `tokens` of a batch that attend only within themselves: one document
    each, or (`values`) a run of one-token documents, whose outputs are their values (softmax over
    one key is 1)."""

    rows: slice
    tokens: slice
    values: bool = False


def segments(documents: torch.Tensor) -> list[Segment] | None:
    """The batch as segments of causal attention, in row-major order; None when every row is one
    document.

    Consecutive rows that are one document each form one segment (the fused kernel on all of them
    at once); in the other rows each document of two or more tokens is a segment, and so is each
    run of one-token documents (a synthetic row's padding EOS).
    """
    B, T = documents.shape
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    single = (first.sum(dim=-1) == 1).tolist()
    if all(single):
        return None
    plan, b = [], 0
    while b < B:
        if single[b]:
            end = b + 1
            while end < B and single[end]:
                end += 1
            plan.append(Segment(slice(b, end), slice(0, T)))
            b = end
            continue
        row = slice(b, b + 1)
        bounds = [*first[b].nonzero().flatten().tolist(), T]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi - lo == 1 and plan and plan[-1].values and plan[-1].rows == row:  # extends a run
                plan[-1] = Segment(row, slice(plan[-1].tokens.start, hi), True)
            else:
                plan.append(Segment(row, slice(lo, hi), hi - lo == 1))
        b += 1
    return plan


def causal_segments(q, k, v, documents: torch.Tensor) -> torch.Tensor:
    """Document-masked attention as the CPU flash kernel's causal attention on each segment.

    The kernel's own forward and backward run on each segment (views, no copies) and write into
    one output and one set of gradients, so time is that of causal attention on the pieces (at
    most that of the rows) and memory that of the fused kernel on the whole batch: nothing is
    masked, concatenated or zero-padded per piece.
    """
    plan = segments(documents)
    if plan is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return _CausalSegments.apply(q, k, v, plan)


class _CausalSegments(torch.autograd.Function):
    """`causal_segments` with gradients: the saved output and log-sum-exp are the kernel's, as in
    SDPA's own backward."""

    @staticmethod
    def forward(ctx, q, k, v, plan: list[Segment]):
        B, H, T, D = q.shape
        group = H // k.shape[1]
        out = q.new_empty(B, T, H, D).transpose(1, 2)  # the kernel's layout: [B, T, C] is a view
        lse = q.new_zeros(B, H, T, dtype=torch.promote_types(q.dtype, torch.float32))  # the kernel's
        for seg in plan:
            at = (seg.rows, slice(None), seg.tokens)
            if seg.values:
                out[at] = _per_query_head(v[at], group)
            else:
                out[at], lse[at] = _FLASH(q[at], k[at], v[at], 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group = q.shape[1] // k.shape[1]
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for seg in ctx.plan:
            at = (seg.rows, slice(None), seg.tokens)
            if seg.values:  # out = v: only the values get a gradient, summed over each kv head's group
                grad_q[at], grad_k[at] = 0.0, 0.0
                grad_v[at] = grad[at].unflatten(1, (-1, group)).sum(dim=2) if group > 1 else grad[at]
            else:
                grad_q[at], grad_k[at], grad_v[at] = _FLASH_BACKWARD(
                    grad[at], q[at], k[at], v[at], out[at], lse[at], 0.0, True)
        return grad_q, grad_k, grad_v, None


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # what SDPA runs on CPU
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def segment_attention(q, k, v, documents: torch.Tensor, attend: Callable) -> torch.Tensor:
    """Document-masked attention as a causal kernel `attend(q, k, v, rows, tokens)` on each segment
    (for the bias kernel, whose chunked kernel bounds its own memory; `rows` and `tokens` say where
    the piece sits, for a bias's positions and per-token terms): the pieces are splits of q, k, v
    and the output their concatenation."""
    plan = segments(documents)
    if plan is None:
        return attend(q, k, v, slice(None), slice(0, q.shape[-2]))
    group = q.shape[1] // v.shape[1]
    rows = [(key, list(pieces)) for key, pieces in itertools.groupby(plan, key=lambda seg: seg.rows)]
    sizes = [key.stop - key.start for key, _ in rows]
    out = []
    for (_, pieces), q_rows, k_rows, v_rows in zip(rows, q.split(sizes), k.split(sizes), v.split(sizes)):
        lengths = [seg.tokens.stop - seg.tokens.start for seg in pieces]
        splits = (x.split(lengths, dim=-2) for x in (q_rows, k_rows, v_rows))
        parts = [_per_query_head(vp, group) if seg.values else attend(qp, kp, vp, seg.rows, seg.tokens)
                 for seg, qp, kp, vp in zip(pieces, *splits)]
        out.append(torch.cat(parts, dim=-2))
    return torch.cat(out)


def _per_query_head(v: torch.Tensor, group: int) -> torch.Tensor:
    """v [B, n_kv_head, T, D] as [B, n_head, T, D]: kv head j serves query heads j*group..(j+1)*group-1."""
    return v.repeat_interleave(group, dim=1) if group > 1 else v
