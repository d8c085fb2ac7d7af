"""FlexAttention's block masks for the GPU path: causal, a sliding window, documents, and a window
within documents. Each is built from tile arithmetic, never by evaluating its mask function on the
N x N pairs (`create_block_mask` does, densely: a [T, T] and a [B, 1, T, T] tensor, 9 GiB at 32K):
a tile pair (128 x 128 tokens) is skipped where no pair in it is allowed, computed without the mask
where every pair is, and masked element-wise (its `mask_mod`) only on the rest. The tile tables are
[B, tiles, tiles]: 64K entries at 32K tokens."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as BLOCK
from torch.nn.attention.flex_attention import BlockMask


def _causal(b, h, m, n):
    """The causal mask function: one object for every length (the compile's variant reads it)."""
    return m >= n


@functools.lru_cache(maxsize=32)
def causal_block_mask(length: int, device: str) -> BlockMask:
    """Causal: row tile i has full tiles 0..i-1 and a partial diagonal tile i."""
    tiles = -(-length // BLOCK)
    rows = torch.arange(tiles, dtype=torch.int32, device=device)
    diagonal = rows[:, None].expand(tiles, tiles).contiguous()  # only column 0 is read
    before = rows[None, :].expand(tiles, tiles).contiguous()  # first i columns are read
    return BlockMask.from_kv_blocks(
        torch.ones_like(rows)[None, None], diagonal[None, None], rows[None, None], before[None, None],
        BLOCK_SIZE=BLOCK, mask_mod=_causal, seq_lengths=(length, length),
    )


def _window_tiles(tiles: int, window: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(meets, full) [tiles, tiles] of the window n <= m, m - n < window: tile pair (i, j) holds an
    allowed pair iff j == i or its nearest pair, m - n = (i - j - 1) BLOCK + 1, is in the window, and
    only allowed ones iff j < i and its farthest, (i - j + 1) BLOCK - 1, is."""
    i = torch.arange(tiles, device=device)[:, None]
    j = torch.arange(tiles, device=device)[None, :]
    meets = (j == i) | ((j < i) & ((i - j - 1) * BLOCK + 1 < window))
    full = (j < i) & ((i - j + 1) * BLOCK - 1 < window)
    return meets, full


@functools.lru_cache(maxsize=32)
def window_block_mask(length: int, window: int, device: str) -> BlockMask:
    """A causal sliding window of `window` keys, the query's own included (cached per length,
    window and device)."""

    def mask_mod(b, h, m, n):
        return (n <= m) & (m - n < window)

    meets, full = _window_tiles(-(-length // BLOCK), window, device)
    return _from_tiles(meets[None] & ~full[None], full[None], mask_mod, length)


def document_block_mask(documents: torch.Tensor, window: int = 0) -> BlockMask:
    """doc[m] == doc[n], n <= m (and m - n < window where window > 0) from per-tile document ranges:
    a tile's first and last token bound its documents, as ids never decrease."""
    B, T = documents.shape
    tiles = -(-T // BLOCK)
    pad = tiles * BLOCK - T  # padded keys sit after every query: the causal test drops them
    padded = F.pad(documents, (0, pad), value=-1) if pad else documents
    tile = torch.arange(tiles, device=documents.device)
    first_doc = documents[:, tile * BLOCK]
    last_doc = documents[:, torch.clamp(tile * BLOCK + BLOCK - 1, max=T - 1)]
    q_tile, k_tile = tile[:, None], tile[None, :]
    # Tile j <= i meets tile i iff its last document reaches tile i's first.
    meets = (k_tile <= q_tile) & (last_doc[:, None, :] >= first_doc[:, :, None])
    one_doc = first_doc == last_doc  # [B, tiles]
    same = one_doc[:, :, None] & one_doc[:, None, :] & (first_doc[:, :, None] == first_doc[:, None, :])
    full = (k_tile < q_tile) & same  # no boundary and off the diagonal: no element-wise mask
    if window:
        in_window, whole = _window_tiles(tiles, window, documents.device)
        meets, full = meets & in_window, full & whole

        def mask_mod(b, h, m, n):
            return (padded[b, m] == padded[b, n]) & (m >= n) & (m - n < window)
    else:
        def mask_mod(b, h, m, n):
            return (padded[b, m] == padded[b, n]) & (m >= n)

    return _from_tiles(meets & ~full, full, mask_mod, T)


def _from_tiles(partial: torch.Tensor, full: torch.Tensor, mask_mod, length: int) -> BlockMask:
    """The BlockMask of [B, tiles, tiles] partial and full tiles."""
    num_partial, partial_idx = _to_indices(partial)
    num_full, full_idx = _to_indices(full)
    return BlockMask.from_kv_blocks(num_partial, partial_idx, num_full, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(length, length))


def _to_indices(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, tiles, tiles] booleans -> (count [B, 1, tiles], column indices [B, 1, tiles, tiles]), the
    selected columns first in increasing order (the layout `BlockMask.from_kv_blocks` reads)."""
    counts = dense.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]
