"""Causal self-attention: each design is a q/k transform (and optionally a distance bias) before one
shared kernel. The designs, their math and their records live in `model.designs` (the registry):

    origin       q_eff = rope(q, m)              k_eff = rope(k, n)
    coca slack   q_eff = q * rope(q, m)          k_eff = rope(t, n)          (the released code)
    coca strict  q_eff = rope([|q_j|^2, 0], m)   k_eff = rope([t_j, 0], n)   (paper Eq. 9, exact)
    alibi        q_eff = q                       k_eff = k, plus bias -slope_h * (m - n)

Scores are q_eff . k_eff / sqrt(head_dim) under the causal mask (with document masking, also only
within the query's document: `model.documents`). With grouped-query attention (arch=llama,
n_kv_head < n_head) k (CoCA's t) and v have n_kv_head heads, each shared by n_head / n_kv_head
consecutive query heads (Llama's layout: query head h uses kv head h // group); every kernel takes
them so (`enable_gqa`), and the KV cache stores only those heads. Designs without a bias run on
`scaled_dot_product_attention(is_causal=True)` (flash / memory-efficient kernels: no N x N score
matrix); a design with slopes runs on FlexAttention with a score modification where it can (see
`bias_attention`), else on SDPA over chunks of query rows with an additive bias.

This module holds the kernels and the layer; it names no design.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .designs import RopeTables
from .designs.base import distance_bias
from .documents import Documents, causal_segments, segment_attention
from .sequence_parallel import SequenceParallel

Slopes = Callable[[int], torch.Tensor]  # n_head -> [H] float64: a design's distance-bias slopes

# On CPU, FlexAttention runs compiled forward only (no backward in torch 2.13) and compiling costs
# ~30 s once per process plus a few seconds per new length; below this query length the chunked
# SDPA path is used instead (see `bias_attention`).
CPU_FLEX_MIN_LEN = 1024
# Query rows per chunk of the additive-bias path: the bias is [H, rows, keys].
BIAS_CHUNK = 256


class AttentionInputs(NamedTuple):
    """A layer's attention inputs: scores = q_eff @ k_eff.T / sqrt(D) - slope * (m - n), n <= m."""

    q_eff: torch.Tensor  # [B, H, T, D]
    k_eff: torch.Tensor  # [B, H, T, D] (under GQA each kv head repeated for the query heads it serves)
    slopes: torch.Tensor | None  # [H] float32, for a design with a distance bias


# ---- kernels -------------------------------------------------------------------------------------


def _gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether k/v have fewer heads than q (grouped-query attention): the kernels' `enable_gqa`."""
    return k.shape[1] != q.shape[1]


def causal_attention(q, k, v, slopes: Slopes | None = None, documents: Documents | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) [- slope_h (m - n)]) v, query i at position Tk - Tq + i (KV-cache
    aware); with `documents`, only over earlier keys of the query's own document (`model.documents`)."""
    if documents is not None:
        return _document_attention(q, k, v, documents, slopes)
    if slopes is not None:
        return bias_attention(q, k, v, slopes)
    tq, tk, gqa = q.shape[-2], k.shape[-2], _gqa(q, k)
    if tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if tq == 1:  # one new token sees the whole cache
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def bias_attention(q, k, v, slopes: Slopes) -> torch.Tensor:
    """Attention with a distance bias (ALiBi's) on the fastest correct kernel available.

    FlexAttention with a score modification (O(N) memory) on GPU, and on CPU for long inputs that
    need no backward pass; otherwise (CPU training, short inputs, KV-cache steps) SDPA over chunks
    of query rows with an additive bias that uses a large finite negative for masked keys (never
    -inf, which has produced NaN in CPU SDPA at long lengths).
    """
    tq, tk = q.shape[-2], k.shape[-2]
    needs_backward = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if tq == tk and (q.is_cuda or (not needs_backward and tq >= CPU_FLEX_MIN_LEN)):
        return _flex_bias(q, k, v, slopes)
    return _chunked_bias(q, k, v, slopes)


def _chunked_bias(q, k, v, slopes_of: Slopes) -> torch.Tensor:
    """SDPA over chunks of query rows with an additive distance bias [H, rows, keys].

    With gradients, each chunk is recomputed in the backward pass (activation checkpointing), so
    autograd keeps no per-chunk bias or probabilities: memory stays O(chunk x N), not O(N^2).
    """
    tq, tk = q.shape[-2], k.shape[-2]
    slopes = slopes_of(q.shape[1]).to(q.device)[:, None, None]  # float64: exact bias
    offset = tk - tq
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    out = []
    for start in range(0, tq, BIAS_CHUNK):
        end = min(tq, start + BIAS_CHUNK)
        args = (q[..., start:end, :], k[..., : offset + end, :], v[..., : offset + end, :], slopes, offset + start)
        out.append(checkpoint(_bias_rows, *args, use_reentrant=False) if grad else _bias_rows(*args))
    return torch.cat(out, dim=-2)


def _bias_rows(q, k, v, slopes: torch.Tensor, first: int) -> torch.Tensor:
    """Attention of query rows at positions first.. over keys 0..first+rows-1 (later keys are masked)."""
    m = torch.arange(first, first + q.shape[-2], device=q.device)[:, None]
    n = torch.arange(k.shape[-2], device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=distance_bias(slopes, m, n, n <= m, q.dtype),
                                          enable_gqa=_gqa(q, k))


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


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


@functools.lru_cache(maxsize=32)
def _slopes(slopes_of: Slopes, n_head: int, device: str) -> torch.Tensor:
    """float32 slopes on a device (kept out of the state dict and of bf16/fp16 casts)."""
    return slopes_of(n_head).to(device, torch.float32)


@functools.lru_cache(maxsize=32)
def _bias_score_mod(slopes_of: Slopes, n_head: int, device: str):
    """One score_mod per (design, heads, device): slopes are the same in every layer, so all share
    one compile."""
    slopes = _slopes(slopes_of, n_head, device)

    def score_mod(score, b, h, m, n):
        return score - slopes[h] * (m - n)

    return score_mod


def _document_attention(q, k, v, documents: Documents, slopes: Slopes | None) -> torch.Tensor:
    """Document-masked attention: FlexAttention on GPU, each document's causal attention on CPU."""
    if q.shape[-2] != k.shape[-2] or documents.ids.shape != (q.shape[0], q.shape[-2]):
        raise ValueError(f"document masking needs q and k of one length (no KV cache) and documents [B, T]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, documents {tuple(documents.ids.shape)}")
    if not q.is_cuda:
        if slopes is not None:
            return segment_attention(q, k, v, documents.ids, functools.partial(_chunked_bias, slopes_of=slopes))
        return causal_segments(q, k, v, documents.ids)
    mod = _bias_score_mod(slopes, q.shape[1], str(q.device)) if slopes is not None else None
    return _compiled_flex()(q, k, v, score_mod=mod, block_mask=documents.block_mask, enable_gqa=_gqa(q, k))


def _flex_bias(q, k, v, slopes: Slopes) -> torch.Tensor:
    device = str(q.device)
    flex = _compiled_flex()
    mod = _bias_score_mod(slopes, q.shape[1], device)
    return flex(q, k, v, score_mod=mod, block_mask=_causal_block_mask(q.shape[-2], device), enable_gqa=_gqa(q, k))


# ---- module --------------------------------------------------------------------------------------


class LayerCache:
    """One layer's KV cache: k_eff (Origin: rope(k); CoCA: rope(t), or Strict's k_eff) and v, each
    with the layer's n_kv_head heads."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:
            k, v = torch.cat((self.keys, k), dim=-2), torch.cat((self.values, v), dim=-2)
        self.keys, self.values = k, v
        return k, v


class CausalSelfAttention(nn.Module):
    """The attention layer of both architectures: their projections, then the shared q/k transform
    and kernel. neox: one fused, biased projection laid out per head as in GPT-NeoX ([H, 3, D] rows
    of `qkv`); llama: separate `q`, `k`, `v` without biases, k (CoCA's t) and v of n_kv_head heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.design = cfg.design
        self.fused = cfg.arch == "neox"
        if self.fused:
            self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        else:
            kv = cfg.kv_heads * cfg.head_dim
            self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
            self.k = nn.Linear(cfg.n_embd, kv, bias=False)
            self.v = nn.Linear(cfg.n_embd, kv, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=self.fused)
        self.sequence_parallel: SequenceParallel | None = None  # `model.sequence_parallel.enable`

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, D]; k (or CoCA's t) and v [B, n_kv_head, T, D]."""
        B, T, _ = x.shape
        if self.fused:
            return self.qkv(x).view(B, T, self.n_head, 3, self.head_dim).transpose(1, 2).unbind(dim=3)
        return tuple(proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables | None,
        cache: LayerCache | None = None,
        capture: list[AttentionInputs] | None = None,
        documents: Documents | None = None,
        queries: int = 0,
    ) -> torch.Tensor:
        """x [B, T, C] continuing `cache` (if any); rope: cos/sin at the positions of these T tokens;
        documents: each token's document, for document masking (None: one document). queries > 0:
        the output of the last `queries` positions only [B, queries, C], over the keys of all T."""
        B, T, C = x.shape
        q, k, v = self.heads(x)
        q, k = self.design.qk(q, k, rope)
        if cache is not None:
            k, v = cache.append(k, v)
        if queries:
            q, T = q[..., -queries:, :], queries
        slopes = self.design.slopes
        if capture is not None:
            k_eff = k.repeat_interleave(self.n_head // self.kv_heads, dim=1) if _gqa(q, k) else k
            capture.append(AttentionInputs(q, k_eff, None if slopes is None else _slopes(slopes, self.n_head,
                                                                                            str(x.device))))
        sp = self.sequence_parallel
        if sp is not None:  # this rank's tokens -> this rank's heads over the whole row, and back
            q, k, v, slopes = sp.attention_inputs(q, k, v, slopes, self.n_head)
        y = causal_attention(q, k, v, slopes, documents)
        if sp is not None:
            y = sp.to_sequence(y)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))
