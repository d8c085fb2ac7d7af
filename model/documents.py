"""Document masking for packed rows: a token attends only to earlier tokens of its own document.

A packed row holds several documents; `documents` [B, T] gives each token's document id,
non-decreasing along the row (`data.synthetic.document_ids`: the EOS that starts a document
belongs to it). The allowed pairs are block diagonal and causal: doc[m] == doc[n] and n <= m.

Two kernels, both exact and neither building an N x N tensor:

- GPU: FlexAttention with a BlockMask built from per-tile document ranges ([B, tiles, tiles]
  booleans, tiles of 128 tokens): a tile pair is skipped when its documents cannot meet, computed
  without a mask where one document covers both tiles, and masked element-wise only on the tiles
  that hold a boundary or the diagonal. ALiBi is its score modification.
- CPU: SDPA over chunks of query rows, each over the keys from the earliest document start among
  its rows to its last row, with a boolean (Origin, CoCA) or additive (ALiBi) mask of that chunk.
  Long rows recompute each chunk in the backward pass (activation checkpointing) so that autograd
  keeps no per-chunk mask: memory stays linear in the row length.

Positions restarting at each document (`model.doc_positions`) are `positions`. ALiBi's bias
-slope * (m - n) depends on the distance only, so it counts from the document start either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .transforms import alibi_bias, alibi_slopes

# Query rows per chunk of the CPU path; its mask is [B, rows, keys].
CHUNK = 256
# From this row length on, the CPU path recomputes each chunk in the backward pass rather than
# keeping its mask ([B, rows, keys] booleans, T^2 / 2 bytes a row in all) for it.
RECOMPUTE_FROM = 2048


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


# ---- CPU: chunks of query rows ---------------------------------------------------------------------


def chunked_document_attention(q, k, v, documents: torch.Tensor, alibi: bool = False) -> torch.Tensor:
    T = q.shape[-2]
    first = starts(documents).amin(dim=0).tolist()  # per query: the earliest key any row lets it see
    slopes = alibi_slopes(q.shape[1]).to(q.device)[:, None, None] if alibi else None
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    recompute = grad and T >= RECOMPUTE_FROM
    out = []
    for lo in range(0, T, CHUNK):
        hi = min(T, lo + CHUNK)
        key = first[lo]
        args = (q[..., lo:hi, :], k[..., key:hi, :], v[..., key:hi, :], documents[:, lo:hi], documents[:, key:hi],
                lo, key, slopes)
        out.append(checkpoint(_rows, *args, use_reentrant=False) if recompute else _rows(*args))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-2)


def _rows(q, k, v, doc_q, doc_k, first_query: int, first_key: int, slopes) -> torch.Tensor:
    """Query rows at positions first_query.. over the keys first_key..first_query + rows - 1."""
    m = torch.arange(first_query, first_query + q.shape[-2], device=q.device)[:, None]
    n = torch.arange(first_key, first_key + k.shape[-2], device=q.device)[None, :]
    allowed = (doc_q[:, :, None] == doc_k[:, None, :]) & (n <= m)  # [B, rows, keys]
    if slopes is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=alibi_bias(slopes, m, n, allowed[:, None], q.dtype))


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
