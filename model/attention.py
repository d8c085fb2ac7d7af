"""Causal self-attention: each design is a q/k transform (and optionally a score bias) before one
shared kernel. The designs, their math and their records live in `model.designs` (the registry):

    origin       q_eff = rope(q, m)              k_eff = rope(k, n)
    coca slack   q_eff = q * rope(q, m)          k_eff = rope(t, n)          (the released code)
    coca strict  q_eff = rope([|q_j|^2, 0], m)   k_eff = rope([t_j, 0], n)   (paper Eq. 9, exact)
    alibi        q_eff = q                       k_eff = k, plus bias -slope_h * (m - n)
    kerple, fire, fox: q and k as they are, plus a learned bias b_h(m, n) (`model.designs`)

Scores are q_eff . k_eff / sqrt(head_dim) [+ b_h(m, n)] under the causal mask (with document
masking, also only within the query's document: `model.documents`). With grouped-query attention
(arch=llama, n_kv_head < n_head) k (CoCA's t) and v have n_kv_head heads, each shared by
n_head / n_kv_head consecutive query heads (Llama's layout: query head h uses kv head h // group);
every kernel takes them so (`enable_gqa`), and the KV cache stores only those heads.

This module holds the layer (`CausalSelfAttention`, `LayerCache`, `AttentionInputs`) and the
dispatch to the kernels (`causal_attention`, per document `_document_attention`); it names no design.
The kernels live beside it, one job each:

    model.kernel_path       `takes_gpu_path`, the one device test; the CPU flash ops; `run_flex`
    model.bias_attention    `LayerBias` and the score-bias kernels (CPU fused and tiled, chunked SDPA)
    model.flex              FlexAttention's block masks and score modification (the GPU path)
    model.window_attention  sliding windows (the hybrid's windowed layers)
    model.sink_attention    every route with attention sinks (`model.sinks`)

Designs without a bias run on `scaled_dot_product_attention(is_causal=True)` (flash /
memory-efficient kernels: no N x N score matrix); a design with a bias (`Design.bias`, one
`ScoreBias` module per layer) on `bias_attention`. The GPU path (`takes_gpu_path`: a tensor off the
CPU, or anywhere under `model.kernel=flex`) runs FlexAttention and SDPA, nothing but ops every device
has; the CPU path calls the CPU flash kernel directly (per document, with a bias column, in bias
tiles). Forcing the GPU path on a CPU is how its code is tested without a GPU (docs/GPU.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .bias_attention import LayerBias, _cpu_bias, bias_attention
from .config import ModelConfig
from .designs import RopeTables, ssmax_init, ssmax_scale
from .documents import Documents, causal_segments, segment_attention
from .flex import _flex_bias
from .kernel_path import _gqa, gpu_sdpa, run_flex, takes_gpu_path
from .sequence_parallel import SequenceParallel
from .sink_attention import sink_attention
from .window_attention import _chunked_window, window_attention


class AttentionInputs(NamedTuple):
    """A layer's attention inputs: scores = q_eff @ k_eff.T / sqrt(D) + b_h(m, n), n <= m (and
    m - n < window where there is one), and how they become weights: softmax, or the design's."""

    q_eff: torch.Tensor  # [B, H, T, D]
    k_eff: torch.Tensor  # [B, H, T, D] (under GQA each kv head repeated for the query heads it serves)
    bias: LayerBias | None  # the score bias (`LayerBias.scores`), for a design with one
    window: int = 0  # a sliding window's keys (0: every earlier key)
    sinks: torch.Tensor | None = None  # the sink logits a_h [H] in each softmax's denominator (`model.sinks`)
    weights: Callable | None = None  # a design's weights from its scores (`Design.weights`); None: softmax


def causal_attention(q, k, v, bias: LayerBias | None = None, documents: Documents | None = None,
                     window: int = 0, kernel: str = "auto") -> torch.Tensor:
    """softmax(q k^T / sqrt(D) [+ b_h(m, n)]) v, query i at position Tk - Tq + i (KV-cache aware);
    with `documents`, only over earlier keys of the query's own document (`model.documents`); with
    `window` > 0, only over the `window` most recent keys, its own included (no bias then).
    kernel: `model.kernel` (`takes_gpu_path`)."""
    if window and bias is not None:
        raise ValueError("a sliding window with a score bias is not implemented")
    if documents is not None:
        return _document_attention(q, k, v, documents, bias, window, kernel)
    if bias is not None:
        return bias_attention(q, k, v, bias, kernel)
    if window:
        return window_attention(q, k, v, window, kernel)
    tq, tk = q.shape[-2], k.shape[-2]
    options = {"is_causal": True} if tq == tk else {}  # one new token (tq == 1) sees the whole cache
    if tq != tk and tq != 1:
        options["attn_mask"] = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    if takes_gpu_path(q, kernel):
        return gpu_sdpa(q, k, v, **options)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=_gqa(q, k), **options)


def _document_attention(q, k, v, documents: Documents, bias: LayerBias | None, window: int = 0,
                        kernel: str = "auto") -> torch.Tensor:
    """Document-masked attention: FlexAttention on the GPU path, each document's causal attention
    on the CPU path (a bias's positions and prefix sums count from each document's start, or from
    the row's where positions do not restart)."""
    if q.shape[-2] != k.shape[-2] or documents.ids.shape != (q.shape[0], q.shape[-2]):
        raise ValueError(f"document masking needs q and k of one length (no KV cache) and documents [B, T]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, documents {tuple(documents.ids.shape)}")
    gpu = takes_gpu_path(q, kernel)
    if window:  # a window counts the distance, so within a document it is the document's own
        if not gpu:
            return segment_attention(q, k, v, documents.ids,
                                     lambda q, k, v, rows, tokens: _chunked_window(q, k, v, window))
        return run_flex(q, k, v, block_mask=documents.block_mask(window), enable_gqa=_gqa(q, k))
    if gpu:
        if bias is not None:
            return _flex_bias(q, k, v, bias, documents)
        return run_flex(q, k, v, block_mask=documents.block_mask(), enable_gqa=_gqa(q, k))
    if bias is None:
        return causal_segments(q, k, v, documents.ids)

    def piece(qp, kp, vp, rows: slice, tokens: slice) -> torch.Tensor:
        terms = None if bias.terms is None else bias.terms[rows, :, tokens]
        return _cpu_bias(qp, kp, vp, replace(bias, terms=terms, start=0 if documents.restart else tokens.start))

    return segment_attention(q, k, v, documents.ids, piece)


# ---- module --------------------------------------------------------------------------------------


class LayerCache:
    """One layer's KV cache: k_eff (Origin: rope(k); CoCA: rope(t), or Strict's k_eff) and v, each
    with the layer's n_kv_head heads, and a gated bias's per-token terms (FoX's log forget gates)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.terms: torch.Tensor | None = None
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # FoX Pro's: the last unshifted k, v

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, k: torch.Tensor, v: torch.Tensor, terms: torch.Tensor | None = None):
        """(k, v, terms) of every token so far: the cached ones, then these."""
        if self.keys is not None:
            k, v = torch.cat((self.keys, k), dim=-2), torch.cat((self.values, v), dim=-2)
            if terms is not None:
                terms = torch.cat((self.terms, terms), dim=-1)
        self.keys, self.values, self.terms = k, v, terms
        return k, v, terms

    def previous_inputs(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The unshifted k and v [B, kv heads, 1, D] of the last cached token (None: the cache is
        empty), keeping these tokens' last in their place (FoX Pro's shift: `model.designs.fox`)."""
        previous, self.last = self.last, (k[..., -1:, :], v[..., -1:, :])
        return previous


def _recomputed(function, *args):
    """function(*args), its activations recomputed in backward (torch's checkpoint) where autograd records."""
    return checkpoint(function, *args, use_reentrant=False) if torch.is_grad_enabled() else function(*args)


def _across_heads(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm` over the channels of all heads of each token: x [B, H, T, D] as [B, T, H * D] (head h's
    channel d is channel h * D + d), back as [B, H, T, D]."""
    B, H, T, D = x.shape
    return norm(x.transpose(1, 2).reshape(B, T, H * D)).view(B, T, H, D).transpose(1, 2)


class CausalSelfAttention(nn.Module):
    """The attention layer of both architectures: their projections, then the shared q/k transform
    and kernel. neox: one fused, biased projection laid out per head as in GPT-NeoX ([H, 3, D] rows
    of `qkv`); llama: separate `q`, `k`, `v` without biases, k (CoCA's t) and v of n_kv_head heads.
    A design with a score bias adds its module, `score_bias` (its parameters are the layer's)."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.design = cfg.layer_design(index)
        self.fused = cfg.arch == "neox"
        if self.fused:
            self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        else:
            kv = cfg.kv_heads * cfg.head_dim
            self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
            self.k = nn.Linear(cfg.n_embd, kv, bias=False)
            self.v = nn.Linear(cfg.n_embd, kv, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=self.fused)
        self.score_bias = self.design.bias(cfg.n_head, cfg.n_embd) if self.design.bias else None
        transform = self.design.transform  # a q/k transform with parameters (PoPE's phase bias)
        self.qk_transform = transform(cfg.params, cfg.n_head, cfg.rope_width()) if transform else None
        # a design's own attention in place of softmax, with its parameters (stick-breaking's `head_bias`)
        self.attend = self.design.attend(cfg.n_head, cfg.head_dim) if self.design.attend else None
        # the softmax modifiers (`model.designs.sinks`, `model.designs.ssmax`): per-head parameters [H]
        self.sinks = nn.Parameter(torch.empty(cfg.n_head).normal_(0.0, cfg.init_std)) if cfg.sinks else None
        self.ssmax = nn.Parameter(torch.full((cfg.n_head,), ssmax_init(cfg.max_seq_len))) if cfg.ssmax else None
        # `model.qk_norm`: RMSNorm of q and k (CoCA's t) over all of each one's heads, scale per channel
        norm = cfg.qk_norm
        self.q_norm = nn.RMSNorm(cfg.n_head * cfg.head_dim, eps=cfg.layernorm_eps) if norm else None
        self.k_norm = nn.RMSNorm(cfg.kv_heads * cfg.head_dim, eps=cfg.layernorm_eps) if norm else None
        pro = self.design.pro  # FoX Pro's parts around the kernel (`Design.pro`)
        self.pro = pro(cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.n_embd, cfg.layernorm_eps) if pro else None
        self.sequence_parallel: SequenceParallel | None = None  # `model.sequence_parallel.enable`
        self.kernel = cfg.kernel  # `takes_gpu_path`
        # the norms' and shifts' activations are recomputed in backward (below), unless the whole block
        # already is (`model.activation_checkpointing`: a second recomputation would save nothing)
        self.recompute = (cfg.qk_norm or pro is not None) and not cfg.activation_checkpointing

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, D]; k (or CoCA's t) and v [B, n_kv_head, T, D]."""
        B, T, _ = x.shape
        if self.fused:
            return self.qkv(x).view(B, T, self.n_head, 3, self.head_dim).transpose(1, 2).unbind(dim=3)
        return tuple(proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))

    def _inputs(self, x: torch.Tensor, cache: LayerCache | None,
                documents: Documents | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`heads`, then FoX Pro's shifts and norms or `model.qk_norm`'s norms."""
        q, k, v = self.heads(x)
        if self.pro is not None:
            q, k, v = self._pro_inputs(x, q, k, v, cache, documents)
        if self.q_norm is not None:
            q, k = _across_heads(self.q_norm, q), _across_heads(self.k_norm, k)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables | None,
        cache: LayerCache | None = None,
        capture: list[AttentionInputs] | None = None,
        documents: Documents | None = None,
        queries: int = 0,
        q_scale: torch.Tensor | None = None,
        key_counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, C] continuing `cache` (if any); rope: cos/sin at the positions of these T tokens;
        documents: each token's document, for document masking (None: one document). queries > 0:
        the output of the last `queries` positions only [B, queries, C], over the keys of all T.
        q_scale: each query's score multiplier ([T, 1] or [B, 1, T, 1]: the length temperature).
        key_counts: the keys each query attends to ([T] or [B, T], before a window), for SSMax."""
        B, T, C = x.shape
        if self.recompute and cache is None:
            # recomputed in backward from x, which the projections keep anyway: autograd would keep each
            # norm's and shift's input and output (QK-norm 1.35x Origin's memory at 8K, FoX Pro 1.8x)
            q, k, v = _recomputed(self._inputs, x, None, documents)
        else:
            q, k, v = self._inputs(x, cache, documents)
        q, k = (self.design.qk if self.qk_transform is None else self.qk_transform)(q, k, rope)
        if q_scale is not None:
            q = q * q_scale
        if self.ssmax is not None:
            q = q * ssmax_scale(self.ssmax, key_counts, self.design.window).to(q.dtype)
        score_bias = self.score_bias
        terms = score_bias.terms(x) if score_bias is not None and score_bias.gated else None
        if cache is not None:
            k, v, terms = cache.append(k, v, terms)
        if queries:
            q, T = q[..., -queries:, :], queries
        sp, heads = self.sequence_parallel, slice(None)
        if sp is not None:  # this rank's tokens -> this rank's heads over the whole row (and back below)
            q, k, v, terms, heads = sp.attention_inputs(q, k, v, terms, self.n_head)
        bias = None if score_bias is None else LayerBias(score_bias, terms, heads=heads)
        if capture is not None:
            if self.attend is not None and self.design.weights is None:
                raise ValueError(f"capture_qk: {self.design.name} attention has no softmax and no weights from scores")
            k_eff = k.repeat_interleave(self.n_head // self.kv_heads, dim=1) if _gqa(q, k) else k
            sinks = None if self.sinks is None else self.sinks[heads].detach()
            capture.append(AttentionInputs(q, k_eff, bias, self.design.window, sinks, self.design.weights))
        width = v.shape[-1]
        if q.shape[-1] != width:  # q_eff wider than v (PoPE's): v zero-padded, the fused kernels want one size
            v = F.pad(v, (0, q.shape[-1] - width))
        if self.attend is not None:
            y = self.attend(q, k, v, None if documents is None else documents.ids, heads)
        elif self.sinks is None:
            y = causal_attention(q, k, v, bias, documents, self.design.window, self.kernel)
        else:
            y = sink_attention(q, k, v, self.sinks[heads], bias, documents, self.design.window,
                               self.kernel)
        y = y[..., :width]
        if sp is not None:
            y = sp.to_sequence(y)
        if self.pro is not None:  # recomputed in backward as the inputs are (from x and y, kept anyway)
            y = _recomputed(self.pro.output, x[:, -T:], y) if self.recompute else self.pro.output(x[:, -T:], y)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def _pro_inputs(self, x, q, k, v, cache: LayerCache | None, documents: Documents | None):
        """`Design.pro`'s q, k, v: each token's k and v shifted toward its predecessor's, which for the
        first of these tokens is the cache's last, or the previous sequence rank's last (zero at the
        row's start); a document's first token has none."""
        sp, T = self.sequence_parallel, k.shape[-2]
        previous = None
        if cache is not None:
            previous = cache.previous_inputs(k, v)
        elif sp is not None:
            previous = sp.previous_token(torch.stack((k, v))).unbind(0)  # one exchange for both
        starts = None
        if documents is not None:  # the whole rows' under sequence parallelism: this rank's tokens
            first = 0 if sp is None else sp.span(T)[0]
            starts = documents.positions[:, first : first + T] == 0
        return self.pro.inputs(x, q, k, v, previous, starts)
