"""Document masking for packed rows: a token attends only to earlier tokens of its own document.

A packed row holds several documents; `documents` [B, T] gives each token's document id,
non-decreasing along the row (`data.synthetic.document_ids`: the EOS that starts a document
belongs to it). The allowed pairs are block diagonal and causal: doc[m] == doc[n] and n <= m.

Two kernels, both exact and neither building an N x N tensor:

- GPU: FlexAttention with a BlockMask built from per-tile document ranges ([B, tiles, tiles]
  booleans, tiles of 128 tokens): a tile pair is skipped when its documents cannot meet, computed
  without a mask where one document covers both tiles, and masked element-wise only on the tiles
  that hold a boundary or the diagonal. ALiBi is its score modification.
- CPU: the model's causal kernel on each document of a row (`segment_attention`): no mask at all,
  so memory stays that of causal attention and time at most that (documents are shorter than
  rows). A masked kernel would not do: CPU SDPA keeps a float32 copy of its mask for backward.

Positions restarting at each document (`model.doc_positions`) are `positions`. ALiBi's bias
-slope * (m - n) depends on the distance only, so it counts from the document start either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


class Documents:
    """A batch's document ids [B, T], with the GPU kernel's block mask built once per forward (not
    once per layer)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    @functools.cached_property
    def block_mask(self):
        return document_block_mask(self.ids)


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


def segment_attention(q, k, v, documents: torch.Tensor, attend: Callable) -> torch.Tensor:
    """Document-masked attention as plain causal attention `attend(q, k, v)` on each document.

    Consecutive rows that are one document each go through `attend` together, as slices (views,
    no copies: the fused kernel, as unmasked); in the other rows each document of two or more
    tokens is its own call, and runs of one-token documents (a synthetic row's padding EOS) are
    their values (softmax over one key is 1). Nothing is masked, so memory and time are those of
    causal attention on the pieces. Under GQA (v with fewer heads than q) a one-token document's
    output is its kv head's value in each query head of the group.
    """
    B, T = documents.shape
    group = q.shape[1] // v.shape[1]
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    single = (first.sum(dim=-1) == 1).tolist()
    if all(single):
        return attend(q, k, v)
    out, b = [], 0
    while b < B:
        if single[b]:
            end = b + 1
            while end < B and single[end]:
                end += 1
            out.append(attend(q[b:end], k[b:end], v[b:end]))
            b = end
            continue
        bounds = [*first[b].nonzero().flatten().tolist(), T]
        pieces, singles_from = [], None  # a run of one-token documents: their values, in one slice
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi - lo == 1:
                singles_from = lo if singles_from is None else singles_from
                continue
            if singles_from is not None:
                pieces.append(_per_query_head(v[b : b + 1, :, singles_from:lo], group))
                singles_from = None
            pieces.append(attend(q[b : b + 1, :, lo:hi], k[b : b + 1, :, lo:hi], v[b : b + 1, :, lo:hi]))
        if singles_from is not None:
            pieces.append(_per_query_head(v[b : b + 1, :, singles_from:T], group))
        out.append(torch.cat(pieces, dim=-2))
        b += 1
    return torch.cat(out)


def _per_query_head(v: torch.Tensor, group: int) -> torch.Tensor:
    """v [B, n_kv_head, T, D] as [B, n_head, T, D]: kv head j serves query heads j*group..(j+1)*group-1."""
    return v.repeat_interleave(group, dim=1) if group > 1 else v


# ---- GPU: FlexAttention ----------------------------------------------------------------------------


def document_block_mask(documents: torch.Tensor):
    """The BlockMask of doc[m] == doc[n], n <= m from per-tile document ranges (no T x T tensor)."""
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as BLOCK
    from torch.nn.attention.flex_attention import BlockMask

    B, T = documents.shape
    tiles = -(-T // BLOCK)
    pad = tiles * BLOCK - T  # padded keys sit after every query: the causal test drops them
    padded = F.pad(documents, (0, pad), value=-1) if pad else documents
    tile = torch.arange(tiles, device=documents.device)
    first_doc = documents[:, tile * BLOCK]  # ids never decrease: a tile's first and last token
    last_doc = documents[:, torch.clamp(tile * BLOCK + BLOCK - 1, max=T - 1)]  # bound its documents
    q_tile, k_tile = tile[:, None], tile[None, :]
    # Tile j <= i meets tile i iff its last document reaches tile i's first.
    meets = (k_tile <= q_tile) & (last_doc[:, None, :] >= first_doc[:, :, None])
    one_doc = first_doc == last_doc  # [B, tiles]
    same = one_doc[:, :, None] & one_doc[:, None, :] & (first_doc[:, :, None] == first_doc[:, None, :])
    full = (k_tile < q_tile) & same  # no boundary and off the diagonal: no element-wise mask
    partial = meets & ~full

    def mask_mod(b, h, m, n):
        return (padded[b, m] == padded[b, n]) & (m >= n)

    num_partial, partial_idx = _to_indices(partial)
    num_full, full_idx = _to_indices(full)
    return BlockMask.from_kv_blocks(num_partial, partial_idx, num_full, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(T, T))


def _to_indices(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, tiles, tiles] booleans -> (count [B, 1, tiles], column indices [B, 1, tiles, tiles]), the
    selected columns first in increasing order (the layout `BlockMask.from_kv_blocks` reads)."""
    counts = dense.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]
