"""The GPU path's window block masks (`model.block_masks`), built from tile arithmetic instead of
evaluating the mask on the T x T pairs, checked element by element against the definition:
n <= m, m - n < window (and doc[m] == doc[n] within documents)."""

from __future__ import annotations

import pytest
import torch

from model.block_masks import causal_block_mask, document_block_mask, window_block_mask


def _tiles(mask, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, partial) [tiles, tiles] of batch row `row` of a BlockMask."""
    tiles = mask.kv_num_blocks.shape[-1]
    full = torch.zeros(tiles, tiles, dtype=torch.bool)
    partial = torch.zeros(tiles, tiles, dtype=torch.bool)
    for i in range(tiles):
        full[i, mask.full_kv_indices[row, 0, i, : mask.full_kv_num_blocks[row, 0, i]].long()] = True
        partial[i, mask.kv_indices[row, 0, i, : mask.kv_num_blocks[row, 0, i]].long()] = True
    return full, partial


def _covers_exactly(mask, allowed: torch.Tensor, row: int = 0) -> None:
    """Full tiles hold only allowed pairs, left-out tiles none, partial ones some but not all (or sit
    on the diagonal, where padding may fill them), and the mask function is the definition."""
    t = allowed.shape[0]
    block = mask.BLOCK_SIZE[0]
    full, partial = _tiles(mask, row)
    assert not (full & partial).any()
    m, n = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
    assert torch.equal(mask.mask_mod(torch.tensor(row), torch.tensor(0), m, n), allowed)
    for i in range(full.shape[0]):
        for j in range(full.shape[1]):
            tile = allowed[i * block : (i + 1) * block, j * block : (j + 1) * block]
            if full[i, j]:
                assert tile.all()
            elif partial[i, j]:
                assert tile.any() and (not tile.all() or i == j or tile.shape[0] < block)
            else:
                assert not tile.any()


@pytest.mark.parametrize(("length", "window"), [(700, 37), (700, 128), (700, 129), (700, 300), (256, 1000)])
def test_window_block_mask_covers_exactly_the_window(length, window):
    m, n = torch.meshgrid(torch.arange(length), torch.arange(length), indexing="ij")
    _covers_exactly(window_block_mask(length, window, "cpu"), (n <= m) & (m - n < window))


@pytest.mark.parametrize("window", [37, 200])
@pytest.mark.parametrize("lengths", [[300, 1, 1, 97, 301], [128, 128, 256], [5] * 60])
def test_document_window_block_mask_covers_exactly_the_window_within_documents(lengths, window):
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    t = docs.shape[0]
    m, n = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
    allowed = (docs[:, None] == docs[None, :]) & (n <= m) & (m - n < window)
    batch = torch.stack([docs, torch.zeros_like(docs)])  # a second row of one document
    mask = document_block_mask(batch, window)
    _covers_exactly(mask, allowed, row=0)
    _covers_exactly(mask, (n <= m) & (m - n < window), row=1)


def test_causal_block_mask_covers_exactly_the_causal_pairs():
    m, n = torch.meshgrid(torch.arange(300), torch.arange(300), indexing="ij")
    _covers_exactly(causal_block_mask(300, "cpu"), n <= m)
