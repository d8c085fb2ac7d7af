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
every kernel takes them so (`enable_gqa`), and the KV cache stores only those heads. Designs
without a bias run on `scaled_dot_product_attention(is_causal=True)` (flash / memory-efficient
kernels: no N x N score matrix); a design with a bias (`Design.bias`, one `ScoreBias` module per
layer) runs on the one score-bias path: FlexAttention with a score modification where it can (see
`bias_attention`), else, for a bias that is a per-key value up to a per-row constant (ALiBi, FoX)
in fp32 / fp64, the fused CPU kernel with the bias as one more q/k dimension, else SDPA over
chunks of query rows with an additive bias computed per chunk.

Which kernels run is decided in one place, `takes_gpu_path`: the GPU path (FlexAttention with block
masks and score modifications, SDPA elsewhere: nothing but ops every device has) for a tensor off
the CPU, or anywhere under `model.kernel=flex`; the CPU path (the CPU flash kernel called directly:
per document, with a bias column, in bias tiles) only for a CPU tensor. Forcing the GPU path on a
CPU is how its code is tested without a GPU (docs/GPU.md).

This module holds the kernels and the layer; it names no design.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .designs import (
    RopeTables,
    ScoreBias,
    sink_gradient,
    sink_mass,
    sink_row_gradient,
    ssmax_init,
    ssmax_scale,
    with_sinks,
)
from .documents import Documents, causal_segments, segment_attention
from .sequence_parallel import SequenceParallel
from .sink_attention import sink_attention

# Query rows per chunk of the bias and window paths: the additive bias is [H, rows, keys]; the fused
# path's float32 error is proportional to it (`_KeyBiasAttention`).
BIAS_CHUNK = 128
# The additive-mask kernel's tile (`_AdditiveBiasAttention`, KERPLE and FIRE): query rows per chunk of
# its backward and keys per tile of both passes, so that its [H, rows, keys] tensors (bias,
# probabilities, score gradient) stay a few MiB at any length and its matmuls are 128 rows deep.
# Chosen with `python -m bench.attention` (README, Benchmarks): whole rows in smaller chunks took
# clearly more time, 1024-key tiles the same time with higher peaks at 2K.
SCORE_ROWS = 128
SCORE_KEYS = 512
# Keys per block in the fused bias kernel's backward (`_KeyBiasAttention`, ALiBi and FoX): a block's
# extended k and v and its key gradients per call are [B, H, keys, D + 1]. Chosen with
# `python -m bench.attention`: blocks of 1024 keys, with the extended copies made per block, gave a
# lower 8K peak than one call over all earlier keys or blocks of 2048, in no more time.
BACKWARD_KEYS = 1024


@dataclass(frozen=True)
class LayerBias:
    """A layer's score bias bound to one forward: the module, the per-token terms of its keys
    (a gated bias's, e.g. FoX's log forget gates [B, H, Tk]; None otherwise), the position of key
    0 (`start`: a document piece's offset in its row where positions do not restart) and the query
    heads served."""

    module: ScoreBias
    terms: torch.Tensor | None = None
    start: int = 0
    heads: slice = field(default_factory=lambda: slice(None))

    def prefix(self) -> torch.Tensor | None:
        """F [B, H, Tk]: the running sums of the terms, in float64 (exact differences F_m - F_n)."""
        return None if self.terms is None else self.terms.to(torch.float64).cumsum(dim=-1)

    def rows(self, first: int, rows: int, keys: int, prefix: torch.Tensor | None,
             device: torch.device, t: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """b_h(m, n) of queries first..first+rows-1 over keys 0..keys-1 (indices; positions add
        `start`): [B, H, rows, keys], or [H, rows, keys] for a bias that is the same in every row
        (from the module's `tensors` t where given: `ScoreBias.rows`)."""
        m = torch.arange(first, first + rows, device=device)[:, None] + self.start
        n = torch.arange(keys, device=device)[None, :] + self.start
        n = torch.minimum(n, m)  # masked pairs (n > m) read n = m: the formulas stay finite there
        gap = None
        if prefix is not None:  # float64: F_m - F_n exact
            gap = prefix[..., first : first + rows, None] - prefix[..., None, :keys]
        return self.module.rows(self.heads, m, n, gap, t)

    def key_values(self, keys: int, prefix: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """c_h(n) of keys 0..keys-1 (positions add `start`) of a separable bias (b = c_h(n) -
        c_h(m)): [1 or B, H, keys], float64."""
        n = torch.arange(keys, device=device) + self.start
        return self.module.key_values(self.heads, n, None if prefix is None else prefix[..., :keys])

    def scores(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Batch row 0's bias of queries start..end-1 over keys 0..end-1: [H, rows, end] (what
        evaluation adds to q_eff . k_eff / sqrt(D))."""
        prefix = self.prefix()
        values = self.rows(start, end - start, end, None if prefix is None else prefix[:1, :, :end], device)
        return values[0] if values.dim() == 4 else values


class AttentionInputs(NamedTuple):
    """A layer's attention inputs: scores = q_eff @ k_eff.T / sqrt(D) + b_h(m, n), n <= m (and
    m - n < window where there is one)."""

    q_eff: torch.Tensor  # [B, H, T, D]
    k_eff: torch.Tensor  # [B, H, T, D] (under GQA each kv head repeated for the query heads it serves)
    bias: LayerBias | None  # the score bias (`LayerBias.scores`), for a design with one
    window: int = 0  # a sliding window's keys (0: every earlier key)
    sinks: torch.Tensor | None = None  # the sink logits a_h [H] in each softmax's denominator (`model.sinks`)


# ---- kernels -------------------------------------------------------------------------------------


def _gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether k/v have fewer heads than q (grouped-query attention): the kernels' `enable_gqa`."""
    return k.shape[1] != q.shape[1]


def takes_gpu_path(x: torch.Tensor, kernel: str = "auto") -> bool:
    """Whether attention on x takes the GPU path: x is off the CPU (the CPU path calls CPU-only
    ops), or `kernel` (`model.kernel`) is "flex", which forces it on a CPU tensor. The one device
    test of the kernels."""
    return kernel == "flex" or x.device.type != "cpu"


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
    tq, tk, gqa = q.shape[-2], k.shape[-2], _gqa(q, k)
    if tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if tq == 1:  # one new token sees the whole cache
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _needs_backward(bias: LayerBias, *xs: torch.Tensor) -> bool:
    tensors = [*xs, *bias.module.parameters(), *([bias.terms] if bias.terms is not None else [])]
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def bias_attention(q, k, v, bias: LayerBias, kernel: str = "auto") -> torch.Tensor:
    """Attention with a score bias on the fastest correct kernel available. GPU path: FlexAttention
    with a score modification (O(N) memory) where queries and keys are the same positions; with
    fewer queries than keys (a KV-cache step, the last rows of `logits_to_keep`) SDPA over chunks
    with the bias computed per chunk (`_chunked_bias`: any device, and no compile per cache
    length). CPU path, training and evaluation alike: the fused kernels of `_cpu_bias` (CPU
    FlexAttention has no backward, and in forward it is about half as fast as they are and needs
    a compile per shape)."""
    if not takes_gpu_path(q, kernel):
        return _cpu_bias(q, k, v, bias)
    if q.shape[-2] == k.shape[-2]:
        return _flex_bias(q, k, v, bias)
    return _chunked_bias(q, k, v, bias)


def _cpu_bias(q, k, v, bias: LayerBias) -> torch.Tensor:
    """The CPU kernel of a bias, in float32 or float64: a separable one (ALiBi, FoX) rides the fused
    flash kernel as one more q/k dimension (`_KeyBiasAttention`), one without per-token terms
    (KERPLE, FIRE) as its additive mask (`_AdditiveBiasAttention`); bf16 / fp16 inputs (whose
    rounding of the extra dimension would be too coarse) and any other bias, the exact additive path."""
    if q.dtype in (torch.float32, torch.float64):
        if bias.module.separable:
            values = bias.key_values(k.shape[-2], bias.prefix(), q.device)
            return _KeyBiasAttention.apply(q, k, v, values)
        if bias.terms is None:
            return _AdditiveBiasAttention.apply(q, k, v, bias, None, *bias.module.tensors(bias.heads, q.device))
    return _chunked_bias(q, k, v, bias)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _extended(x: torch.Tensor, heads: int) -> torch.Tensor:
    """x [B, h, T, D] as [B, heads, T, D + 1] (kv heads repeated for their query heads under GQA)
    with a zero last column: the buffer the extra dimension is written into."""
    B, h, T, D = x.shape
    out = x.new_zeros(B, heads, T, D + 1)
    out.view(B, h, heads // h, T, D + 1)[..., :D].copy_(x[:, :, None])
    return out


def _narrowed(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of `_extended`'s input from its output's: the first D columns, summed over the
    query heads that share a kv head."""
    return _grouped(grad[..., :-1], heads)


def _grouped(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """A gradient [B, H, T, D] per query head summed over the query heads of each of `heads` kv heads."""
    B, H, T, D = grad.shape
    return grad if H == heads else grad.reshape(B, heads, H // heads, T, D).sum(2)


def _chunks(tq: int, offset: int):
    """Per chunk of query rows: (rows, their key positions, the chunk's middle row's position) and
    its two kernel calls, (keys, causal): its own square block under the kernel's (top-left)
    causal mask, then every earlier key unmasked."""
    for start in range(0, tq, BIAS_CHUNK):
        end = min(tq, start + BIAS_CHUNK)
        first, last = offset + start, offset + end
        parts = [(slice(first, last), True)] + ([(slice(0, first), False)] if first else [])
        yield slice(start, end), last, offset + (start + end - 1) // 2, parts


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, part: torch.Tensor,
           part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over some keys (out, lse; None: none yet) and over others (part, part_lse) as
    attention over both: each weighted by its share of the combined log-sum-exp."""
    if out is None:
        return part, part_lse
    both = torch.logaddexp(lse, part_lse)
    return out * (lse - both).exp()[..., None] + part * (part_lse - both).exp()[..., None], both


def _key_blocks(keys: int):
    """The keys in blocks of at most BACKWARD_KEYS, the fused kernel's backward's unit: one block's
    extended k and v and its key gradients per call, [B, H, <= BACKWARD_KEYS, D + 1], not the row's."""
    for start in range(0, keys, BACKWARD_KEYS):
        yield slice(start, min(keys, start + BACKWARD_KEYS))


class _KeyBiasAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(D) + c_h(n) - c_h(m)) v (causal, query i at key position Tk - Tq + i)
    on the fused CPU flash kernel: softmax drops -c_h(m), so q gets a column of ones and k the
    column (c_h(n) - c_h(centre)) sqrt(D) (v a zero one, the kernel wants one head size).

    The centre is the middle row of each chunk of query rows: float32 rounds the column to about
    |c_h(n) - c_h(centre)| 2^-24, which near a row's diagonal, where its probability mass is, is
    at most half a chunk's span of the bias, at any length (far keys carry large values but
    exp(-large) weight). Each chunk is two kernel calls merged by their log-sum-exps; backward
    calls the kernel's backward on the same keys with the merged output and log-sum-exp, block of
    earlier keys by block (`_key_blocks`: the extended copies are a block's, not the whole k and v),
    so nothing is recomputed and only q, k, v (views of the
    projection), c, the output and the log-sum-exps are kept, as for Origin. c's gradient is the
    column's (FoX's gates); the centre is a constant, as the output does not depend on it."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, values: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        B, H, tq, D = q.shape
        scale = D**-0.5
        k_ext, v_ext = _extended(k, H), _extended(v, H)
        out, lse = q.new_empty(B, H, tq, D + 1), q.new_empty(B, H, tq)
        for rows, keys, centre, parts in _chunks(tq, k.shape[-2] - tq):
            q_c = F.pad(q[..., rows, :], (0, 1), value=1.0)
            _write_column(k_ext[..., :keys, :], values, slice(0, keys), centre, scale)
            merged = total = None
            for part, causal in parts:
                o, lse_part = _FLASH(q_c, k_ext[..., part, :], v_ext[..., part, :], 0.0, causal, scale=scale)
                merged, total = _merge(merged, total, o, lse_part)
            out[..., rows, :], lse[..., rows] = merged, total
        mass = None
        if sinks is not None:  # the sink a_h in the kernel's units, a_h + c_h(m) - c_h(centre), per chunk
            first, shifted = k.shape[-2] - tq, torch.empty_like(lse, dtype=values.dtype)
            for rows, _, centre, _ in _chunks(tq, first):
                own = values[..., first + rows.start : first + rows.stop]
                shifted[..., rows] = own - values[..., centre : centre + 1]
            shifted += sinks.to(values.dtype)[:, None]
            out, lse = with_sinks(out, lse, shifted)
            mass = sink_mass(lse, shifted)
        ctx.save_for_backward(q, k, v, values, out, lse, sinks, mass)
        return out[..., :D]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, values, out, lse, sinks, mass = ctx.saved_tensors
        B, H, tq, D = q.shape
        scale, offset = D**-0.5, k.shape[-2] - tq
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        column = q.new_zeros(B, H, k.shape[-2]) if ctx.needs_input_grad[3] else None

        def call(rows: slice, part: slice, centre: int, causal: bool, k_ext: torch.Tensor, v_ext: torch.Tensor):
            """The kernel's backward for query rows `rows` over keys `part` (k_ext, v_ext: their extension)."""
            _write_column(k_ext, values, part, centre, scale)
            q_c, grad_c = F.pad(q[..., rows, :], (0, 1), value=1.0), F.pad(grad[..., rows, :], (0, 1))
            dq, dk, dv = _FLASH_BACKWARD(grad_c, q_c, k_ext, v_ext, out[..., rows, :], lse[..., rows], 0.0, causal,
                                         scale=scale)
            grad_q[..., rows, :] += dq[..., :D]
            grad_k[..., part, :] += _narrowed(dk, k.shape[1])
            grad_v[..., part, :] += _narrowed(dv, v.shape[1])
            if column is not None:
                column[..., part] += dk[..., -1]

        # each block of earlier keys extended once, then every chunk of rows after it
        for block in _key_blocks(k.shape[-2]):
            k_ext, v_ext = _extended(k[..., block, :], H), _extended(v[..., block, :], H)
            for rows, _, centre, parts in _chunks(tq, offset):
                own = parts[0][0]  # the chunk's square block; its earlier keys are those before it
                n = min(block.stop, own.start) - block.start
                if n > 0:
                    call(rows, slice(block.start, block.start + n), centre, False, k_ext[..., :n, :], v_ext[..., :n, :])
        for rows, _, centre, parts in _chunks(tq, offset):  # each chunk's own square block
            part = parts[0][0]
            call(rows, part, centre, True, _extended(k[..., part, :], H), _extended(v[..., part, :], H))
        grad_values = row_sink = None
        if sinks is not None:  # each row's sink logit in the kernel's units, a_h + c_h(m) - c_h(centre)
            row_sink = sink_row_gradient(grad, out[..., :D], mass)
        if column is not None:  # the column is c_h(n) / scale
            grad_values = column.to(torch.float64) / scale
            if row_sink is not None:  # c_h(m) in its row's sink (the centre cancels, as without a sink)
                grad_values[..., offset:] += row_sink.to(torch.float64)
            if values.shape[0] != B:
                grad_values = grad_values.sum(0, keepdim=True)
        if sinks is None:
            return grad_q, grad_k, grad_v, grad_values
        grad_sinks = row_sink.sum(dim=(0, 2)).to(sinks.dtype) if ctx.needs_input_grad[4] else None
        return grad_q, grad_k, grad_v, grad_values, grad_sinks


def _per_query_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v [B, h, T, D] with each kv head repeated for the query heads it serves (GQA)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


class _AdditiveBiasAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(D) + b_h(m, n)) v for a bias that reads no per-token terms (KERPLE, FIRE)
    in fp32 / fp64 on CPU, tile by tile: per chunk of BIAS_CHUNK query rows and tile of about
    SCORE_KEYS keys (`_score_tiles`), the bias (`ScoreBias.causal_block`, from the module's `tensors`,
    inputs here so that their gradients flow to the parameters, `prepared` once per call) and the
    fused flash kernel with it as an additive mask, the tiles merged by log-sum-exp. Only q, k, v,
    the output and the log-sum-exps are kept (as for Origin); backward, per chunk of SCORE_ROWS
    rows and tile, recomputes the bias and runs the softmax backward itself (the kernel's backward
    gives no score gradient, which the bias's tensors need): P = exp(S + b - lse),
    dS = P (dO v^T - rowsum(dO O))."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: LayerBias, sinks: torch.Tensor | None,
                *tensors: torch.Tensor) -> torch.Tensor:
        B, H, tq, D = q.shape
        offset = k.shape[-2] - tq
        ctx.bias = bias
        given = (q, k, v, *tensors)
        k, v = _per_query_head(k, H), _per_query_head(v, H)
        prepared = bias.module.prepared(tensors)
        out, lse = torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(B, H, tq)
        for start in range(0, tq, BIAS_CHUNK):
            end = min(tq, start + BIAS_CHUNK)
            rows, first = slice(start, end), offset + start
            merged = total = None
            for keys in _score_tiles(first, offset + end):
                mask = bias.module.causal_block(bias.heads, first, end - start, keys, bias.start, prepared, q.device,
                                                q.dtype)[None]
                o, lse_tile = _FLASH(q[..., rows, :], k[..., keys, :], v[..., keys, :], 0.0, False, attn_mask=mask,
                                     scale=D**-0.5)
                merged, total = _merge(merged, total, o, lse_tile)
            out[..., rows, :], lse[..., rows] = merged, total
        mass = None
        if sinks is not None:  # attention sinks (`model.sink_attention`): a_h in every row's denominator
            out, lse = with_sinks(out, lse, sinks)
            mass = sink_mass(lse, sinks)
        ctx.save_for_backward(out, lse, sinks, mass, *given)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, lse, sinks, mass, q, k, v, *tensors = ctx.saved_tensors
        kv_heads, module, heads, start = k.shape[1], ctx.bias.module, ctx.bias.heads, ctx.bias.start
        B, H, tq, D = q.shape
        offset, scale = k.shape[-2] - tq, D**-0.5
        k, v = _per_query_head(k, H), _per_query_head(v, H)
        wanted = [t.detach().requires_grad_(need) for t, need in zip(tensors, ctx.needs_input_grad[5:])]
        needed = [t for t in wanted if t.requires_grad]
        with torch.enable_grad():
            prepared = module.prepared(wanted)
        inner = [t for t in prepared if t.requires_grad]  # the tiles' gradients go to these, then to `needed`
        grad_q = torch.empty_like(q)
        grad_k, grad_v = (q.new_zeros(B * H, k.shape[-2], D) for _ in range(2))  # accumulated in place
        grad_inner = [torch.zeros_like(t) for t in inner]
        for begin in range(0, tq, SCORE_ROWS):
            end = min(tq, begin + SCORE_ROWS)
            rows, n, first = slice(begin, end), end - begin, offset + begin
            q_c = q[..., rows, :].reshape(B * H, n, D)
            g_c = grad[..., rows, :].reshape(B * H, n, D)
            q_scaled = q_c * scale
            minus_lse = lse[..., rows, None].neg()
            delta = (grad[..., rows, :] * out[..., rows, :]).sum(-1).view(B * H, n, 1)
            grad_q_c = q.new_zeros(B * H, n, D)
            for keys in _score_tiles(first, offset + end):
                w = keys.stop - keys.start
                with torch.enable_grad():  # at B = 1 the tile comes as b - lse (a design adds it in its pass)
                    values = module.causal_block(heads, first, n, keys, start, prepared, q.device, q.dtype,
                                                 shift=minus_lse[0] if B == 1 else None)
                k_t, v_t = k[..., keys, :].reshape(B * H, w, D), v[..., keys, :].reshape(B * H, w, D)
                # P = exp(b - lse + (q scale) k^T): the scores accumulated onto b - lse, in the tile's
                # own storage (no op of its graph keeps its output)
                p = values.detach() if B == 1 else values.detach() + minus_lse
                p = p.view(B * H, n, w).baddbmm_(q_scaled, k_t.mT).exp_()
                ds = (g_c @ v_t.mT).sub_(delta).mul_(p)  # masked pairs: exp(lowest) = 0
                grad_v[:, keys].baddbmm_(p.mT, g_c)
                del p
                grad_q_c.baddbmm_(ds, k_t)
                grad_k[:, keys].baddbmm_(ds.mT, q_c, alpha=scale)
                if inner:
                    ds = ds.view(B, H, n, w)
                    ds = ds[0] if B == 1 else ds.sum(0)  # the bias is the same in every row of the batch
                    for total, g in zip(grad_inner, torch.autograd.grad(values, inner, ds, materialize_grads=True)):
                        total += g
            grad_q[..., rows, :] = grad_q_c.view(B, H, n, D).mul_(scale)
        grads = iter(torch.autograd.grad(inner, needed, grad_inner, materialize_grads=True) if inner else ())
        grad_k, grad_v = (g.view(B, H, -1, D) for g in (grad_k, grad_v))
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            grad_sinks = sink_gradient(grad, out, mass).to(sinks.dtype)
        return (grad_q, _grouped(grad_k, kv_heads), _grouped(grad_v, kv_heads), None, grad_sinks,
                *(next(grads) if t.requires_grad else None for t in wanted))


def _score_tiles(first: int, keys: int):
    """The keys 0..keys-1 of query rows at first.. in tiles of about SCORE_KEYS (the additive
    kernel's unit in both passes, [B, H, rows, tile] tensors): the earlier keys in blocks, the last
    one running on to the end, so that every row has a key in every tile."""
    starts = range(0, max(first, 1), SCORE_KEYS)
    for a, b in zip(starts, [*starts[1:], keys]):
        yield slice(a, b)


def _write_column(k_ext: torch.Tensor, values: torch.Tensor, part: slice, centre: int, scale: float) -> None:
    """The extra column of k_ext, k extended over the keys `part`: (c_h(n) - c_h(centre)) / scale,
    rounded once from float64."""
    k_ext[..., -1] = (values[..., part] - values[..., centre : centre + 1]) / scale


def _chunked_bias(q, k, v, bias: LayerBias) -> torch.Tensor:
    """SDPA over chunks of query rows with an additive bias [B or 1, H, rows, keys], computed per
    chunk from the bias's parameters (and prefix sums).

    With gradients, each chunk is recomputed in the backward pass (activation checkpointing), so
    autograd keeps no per-chunk bias or probabilities: memory stays O(chunk x N), not O(N^2), and
    the bias's parameters get their gradients from the recomputed chunks.
    """
    tq, tk = q.shape[-2], k.shape[-2]
    offset = tk - tq
    grad = _needs_backward(bias, q, k, v)
    prefix = bias.prefix()
    out = []
    for start in range(0, tq, BIAS_CHUNK):
        end = min(tq, start + BIAS_CHUNK)
        keys = offset + end
        f = None if prefix is None else prefix[..., :keys]
        args = (q[..., start:end, :], k[..., :keys, :], v[..., :keys, :], bias, offset + start, f)
        out.append(checkpoint(_bias_rows, *args, use_reentrant=False) if grad else _bias_rows(*args))
    return torch.cat(out, dim=-2)


def _bias_rows(q, k, v, bias: LayerBias, first: int, prefix: torch.Tensor | None) -> torch.Tensor:
    """Attention of query rows first.. over keys 0..first+rows-1 (later keys are masked)."""
    rows, keys = q.shape[-2], k.shape[-2]
    m = torch.arange(first, first + rows, device=q.device)[:, None]
    n = torch.arange(keys, device=q.device)[None, :]
    values = bias.rows(first, rows, keys, prefix, q.device)
    mask = values.to(q.dtype).masked_fill(~(n <= m), torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=_gqa(q, k))


@functools.cache
def _compiled_flex():
    """FlexAttention compiled whole: a graph break would leave it to torch's dense reference (an
    N x N score matrix) without a word."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, fullgraph=True)


def run_flex(q, k, v, **options) -> torch.Tensor:
    """The GPU path's one call of FlexAttention (`options`: its block_mask, score_mod, enable_gqa),
    compiled: Triton kernels on a GPU, C++ on a CPU, where torch has its forward only."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError("model.kernel=flex on a CPU runs forward only (torch's CPU FlexAttention has no "
                         "backward): use it for evaluation and generation, and train with model.kernel=auto")
    return _compiled_flex()(q, k, v, **options)


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
        mask = _document_window_mask(documents.ids, window)
        return run_flex(q, k, v, block_mask=mask, enable_gqa=_gqa(q, k))
    if gpu:
        if bias is not None:
            return _flex_bias(q, k, v, bias, documents)
        return run_flex(q, k, v, block_mask=documents.block_mask, enable_gqa=_gqa(q, k))
    if bias is None:
        return causal_segments(q, k, v, documents.ids)

    def piece(qp, kp, vp, rows: slice, tokens: slice) -> torch.Tensor:
        terms = None if bias.terms is None else bias.terms[rows, :, tokens]
        return _cpu_bias(qp, kp, vp, replace(bias, terms=terms, start=0 if documents.restart else tokens.start))

    return segment_attention(q, k, v, documents.ids, piece)


# ---- sliding window ---------------------------------------------------------------------------------


def window_attention(q, k, v, window: int, kernel: str = "auto") -> torch.Tensor:
    """Causal attention over the `window` most recent keys, the query's own included: FlexAttention
    with a sliding-window block mask on the GPU path; otherwise (the CPU path, and KV-cache steps
    on either) SDPA over chunks of query rows, each against only the keys its window reaches
    (memory linear in N, time N x (chunk + window))."""
    if takes_gpu_path(q, kernel) and q.shape[-2] == k.shape[-2]:
        mask = _window_block_mask(q.shape[-2], window, str(q.device))
        return run_flex(q, k, v, block_mask=mask, enable_gqa=_gqa(q, k))
    return _chunked_window(q, k, v, window)


def _chunked_window(q, k, v, window: int) -> torch.Tensor:
    """Query rows in chunks, each with the keys from its first row's window start to its last row;
    with gradients each chunk is recomputed in backward (no per-chunk mask or probabilities kept)."""
    tq, tk = q.shape[-2], k.shape[-2]
    offset = tk - tq
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    out = []
    for start in range(0, tq, BIAS_CHUNK):
        end = min(tq, start + BIAS_CHUNK)
        first = max(0, offset + start - window + 1)
        args = (q[..., start:end, :], k[..., first : offset + end, :], v[..., first : offset + end, :],
                offset + start - first, window)
        out.append(checkpoint(_window_rows, *args, use_reentrant=False) if grad else _window_rows(*args))
    return torch.cat(out, dim=-2)


def _window_rows(q, k, v, first: int, window: int) -> torch.Tensor:
    """Rows at positions first.. (counted in the keys given) over those keys: n <= m, m - n < window."""
    m = torch.arange(first, first + q.shape[-2], device=q.device)[:, None]
    n = torch.arange(k.shape[-2], device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(n <= m) & (m - n < window), enable_gqa=_gqa(q, k))


@functools.lru_cache(maxsize=32)
def _window_block_mask(length: int, window: int, device: str):
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


# ---- module --------------------------------------------------------------------------------------


class LayerCache:
    """One layer's KV cache: k_eff (Origin: rope(k); CoCA: rope(t), or Strict's k_eff) and v, each
    with the layer's n_kv_head heads, and a gated bias's per-token terms (FoX's log forget gates)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.terms: torch.Tensor | None = None

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
        self.sequence_parallel: SequenceParallel | None = None  # `model.sequence_parallel.enable`
        self.kernel = cfg.kernel  # `takes_gpu_path`

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
        q_scale: torch.Tensor | None = None,
        key_counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, C] continuing `cache` (if any); rope: cos/sin at the positions of these T tokens;
        documents: each token's document, for document masking (None: one document). queries > 0:
        the output of the last `queries` positions only [B, queries, C], over the keys of all T.
        q_scale: each query's score multiplier ([T, 1] or [B, 1, T, 1]: the length temperature).
        key_counts: the keys each query attends to ([T] or [B, T], before a window), for SSMax."""
        B, T, C = x.shape
        q, k, v = self.heads(x)
        if self.q_norm is not None:
            q, k = _across_heads(self.q_norm, q), _across_heads(self.k_norm, k)
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
            if self.attend is not None:
                raise ValueError(f"capture_qk gives the inputs of softmax attention; {self.design.name} has none")
            k_eff = k.repeat_interleave(self.n_head // self.kv_heads, dim=1) if _gqa(q, k) else k
            sinks = None if self.sinks is None else self.sinks[heads].detach()
            capture.append(AttentionInputs(q, k_eff, bias, self.design.window, sinks))
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
        return self.proj(y.transpose(1, 2).reshape(B, T, C))
