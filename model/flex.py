"""The GPU path's FlexAttention pieces: block masks (causal, sliding window, a window within
documents; the document mask itself is `model.documents`'), and a score bias as a score
modification (`_flex_bias`). All run through `run_flex` (`model.kernel_path`)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from .documents import Documents
from .kernel_path import _gqa, run_flex

if TYPE_CHECKING:
    from .bias_attention import LayerBias


@functools.lru_cache(maxsize=32)
def _causal_block_mask(length: int, device: str):
    """Causal BlockMask built from block indices: row tile i has full tiles 0..i-1 and a partial
    diagonal tile i. (`create_block_mask` would evaluate the mask on all N x N pairs: 2.6 GB at 16K.)"""
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as BLOCK
    from torch.nn.attention.flex_attention import BlockMask

    tiles = -(-length // BLOCK)
    rows = torch.arange(tiles, dtype=torch.int32, device=device)
    diagonal = rows[:, None].expand(tiles, tiles).contiguous()  # only column 0 is read
    before = rows[None, :].expand(tiles, tiles).contiguous()  # first i columns are read
    return BlockMask.from_kv_blocks(
        torch.ones_like(rows)[None, None], diagonal[None, None], rows[None, None], before[None, None],
        BLOCK_SIZE=BLOCK, mask_mod=lambda b, h, m, n: m >= n, seq_lengths=(length, length),
    )


def _score_mod(element, tensors: tuple[torch.Tensor, ...], positions: torch.Tensor | None,
               prefix: tuple[torch.Tensor, ...] | None):
    """FlexAttention's score_mod for a bias: `element` (a design's static function) on the captured
    `tensors` (parameters: gradients flow to them), at token positions (`positions` [B, T] where
    they restart at documents, else the indices) and, for a gated bias, the gap sums from the
    prefix sums F [B, H, T] as float32 (hi, lo) pairs: hi_m - hi_n is exact wherever the gap is
    small against F (Sterbenz), so the gap keeps float32's relative precision at any length; the
    keys read a copy of the pair (`_flex_prefix`). The closure holds tensors and one function per
    design only: every layer shares one compiled kernel."""

    def score_mod(score, b, h, m, n):
        pm, pn = (positions[b, m], positions[b, n]) if positions is not None else (m, n)
        pn = torch.minimum(pn, pm)  # masked pairs read n = m: finite values and gradients
        gap = None
        if prefix is not None:
            hi, lo, hi_key, lo_key = prefix
            gap = (hi[b, h, m] - hi_key[b, h, n]) + (lo[b, h, m] - lo_key[b, h, n])
        return score + element(tensors, h, pm, pn, gap)

    return score_mod


def _flex_prefix(bias: LayerBias, documents: Documents | None) -> tuple[torch.Tensor, ...] | None:
    """F for FlexAttention as float32 (hi, lo) with hi + lo = the float64 sums, restarted at each
    document; twice, (hi, lo) for the queries and a copy for the keys: inductor lowers a score_mod's
    backward to the GPU only where it indexes each tensor that needs gradients once (found by
    `bench.gpu_path`: with one pair read at m and n, FoX had no GPU backward)."""
    prefix = bias.prefix()
    if prefix is None:
        return None
    if documents is not None:
        first = documents.starts[:, None, :].expand_as(prefix)
        before = torch.where(first > 0, prefix.gather(-1, (first - 1).clamp(min=0)), 0.0)
        prefix = prefix - before
    hi = prefix.to(torch.float32)
    lo = (prefix - hi.to(torch.float64)).to(torch.float32)
    return hi, lo, hi.clone(), lo.clone()


def _flex_bias(q, k, v, bias: LayerBias, documents: Documents | None = None) -> torch.Tensor:
    module = bias.module
    tensors = module.flex_tensors(bias.heads, q.device)
    positions = documents.positions if documents is not None and documents.restart else None
    mod = _score_mod(type(module).element, tensors, positions, _flex_prefix(bias, documents))
    mask = documents.block_mask if documents is not None else _causal_block_mask(q.shape[-2], str(q.device))
    return run_flex(q, k, v, score_mod=mod, block_mask=mask, enable_gqa=_gqa(q, k))


@functools.lru_cache(maxsize=32)
def _window_block_mask(length: int, window: int, device: str):
    """The block mask of a sliding window (cached: one per length, window and device)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, m, n):
        return (n <= m) & (m - n < window)

    return create_block_mask(mask_mod, None, None, length, length, device=device)


def _document_window_mask(ids: torch.Tensor, window: int):
    """The block mask of a sliding window within each document (evaluated over the B x T x T pairs:
    a cost the GPU pays once per forward, shared by the windowed layers' calls)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, m, n):
        return (ids[b, m] == ids[b, n]) & (n <= m) & (m - n < window)

    return create_block_mask(mask_mod, ids.shape[0], None, ids.shape[1], ids.shape[1], device=str(ids.device))

