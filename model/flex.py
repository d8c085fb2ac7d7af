"""The GPU path's FlexAttention calls with a score bias: the bias as a score modification
(`_flex_bias`), under the causal block mask or a batch's document mask (`model.block_masks`). All
run through `run_flex` (`model.kernel_path`)."""

from __future__ import annotations

import torch

from .block_masks import causal_block_mask
from .documents import Documents
from .kernel_path import _gqa, run_flex
from .layer_bias import LayerBias


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
    mask = documents.block_mask() if documents is not None else causal_block_mask(q.shape[-2], str(q.device))
    return run_flex(q, k, v, score_mod=mod, block_mask=mask, enable_gqa=_gqa(q, k))
