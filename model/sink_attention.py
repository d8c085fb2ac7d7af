"""Causal attention with attention sinks (`model.designs.sinks`): every design's kernel route
when `model.sinks` is on.

- CPU, fp32 / fp64, no score bias, window or documents, as many queries as keys (training and
  evaluation of the q/k designs): the fused flash kernel (`_SinkFlash`), whose output and
  log-sum-exp take the sink afterwards (`with_sinks`); its backward given those is the sinked
  attention's, plus the sink's own gradient. Memory and time are the fused kernel's.
- CPU, fp32 / fp64, a score bias, no window: the bias's own kernel (`model.bias_attention`: the fused
  key-bias kernel for ALiBi and FoX, the tiled additive one for KERPLE and FIRE), which applies
  the sink to its output and log-sum-exp the same way.
- Anything else (a window, a KV-cache step without a bias, bf16, and the whole GPU path:
  `model.kernel_path.takes_gpu_path`, FlexAttention's score_mod cannot add a column to the softmax's
  denominator): explicit scores with the sink as one more column over chunks of query rows
  (`sink_attention_rows`), each chunk recomputed in backward (memory O(rows x keys)); under
  document masking per document (`segments`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.utils.checkpoint import checkpoint

from .bias_attention import LayerBias, _AdditiveBiasAttention, _KeyBiasAttention
from .designs import sink_attention_rows, sink_gradient, sink_mass, with_sinks
from .documents import Documents, segments
from .kernel_path import _FLASH, _FLASH_BACKWARD, takes_gpu_path

ROWS = 128  # query rows per chunk of the explicit path: its scores are [B, H, ROWS, keys]


def sink_attention(q, k, v, sinks: torch.Tensor, bias: LayerBias | None = None,
                   documents: Documents | None = None, window: int = 0, kernel: str = "auto") -> torch.Tensor:
    """softmax([q k^T / sqrt(D) + b_h(m, n), a_h]) v over the allowed keys (causal, query i at key
    position Tk - Tq + i; within its document; the `window` most recent), sinks a_h [H] of the
    query heads served (all, or a sequence-parallel rank's). kernel: `model.kernel`; the GPU path
    (`takes_gpu_path`) takes the explicit chunks, never FlexAttention."""
    if documents is not None:
        return _document_sinks(q, k, v, sinks, bias, documents, window, kernel)
    # The CPU kernels take one dtype; under bf16 autocast a RoPE design's q and k are fp32 and v bf16.
    same_dtype = q.dtype in (torch.float32, torch.float64) and k.dtype == v.dtype == q.dtype
    flash = not takes_gpu_path(q, kernel) and same_dtype and not window
    if flash and bias is None and q.shape[-2] == k.shape[-2]:
        return _SinkFlash.apply(q, k, v, sinks)
    if flash and bias is not None and bias.module.separable:  # ALiBi, FoX: the fused key-bias kernel
        values = bias.key_values(k.shape[-2], bias.prefix(), q.device)
        return _KeyBiasAttention.apply(q, k, v, values, sinks)
    if flash and bias is not None and bias.terms is None:  # KERPLE, FIRE: the tiled additive-bias kernel
        return _AdditiveBiasAttention.apply(q, k, v, bias, sinks, *bias.module.tensors(bias.heads, q.device))
    return _chunked_sinks(q, k, v, sinks, bias, window)


class _SinkFlash(torch.autograd.Function):
    """The CPU flash kernel's causal attention with the sink applied to its output and log-sum-exp;
    backward is the kernel's on (sinked output, sinked log-sum-exp) and the sink's gradient."""

    @staticmethod
    def forward(ctx, q, k, v, sinks):
        out, lse = _FLASH(q, k, v, 0.0, True)
        out, total = with_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, sinks, out, total)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, sinks, out, total = ctx.saved_tensors
        dq, dk, dv = _FLASH_BACKWARD(grad, q, k, v, out, total, 0.0, True)
        if not ctx.needs_input_grad[3]:
            return dq, dk, dv, None
        return dq, dk, dv, sink_gradient(grad, out, sink_mass(total, sinks)).to(sinks.dtype)


def _chunked_sinks(q, k, v, sinks, bias: LayerBias | None, window: int) -> torch.Tensor:
    """Chunks of query rows over the keys they reach (from their window's start), explicit scores,
    each chunk checkpointed where gradients are wanted."""
    tq, tk = q.shape[-2], k.shape[-2]
    offset = tk - tq
    prefix = None if bias is None else bias.prefix()
    grad = torch.is_grad_enabled() and any(
        x.requires_grad for x in (q, k, v, sinks, *([] if bias is None else bias.module.parameters())))
    out = []
    for start in range(0, tq, ROWS):
        end = min(tq, start + ROWS)
        first = max(0, offset + start - window + 1) if window else 0
        args = (q[..., start:end, :], k[..., first : offset + end, :], v[..., first : offset + end, :], sinks,
                bias, offset + start, first, window, None if prefix is None else prefix[..., : offset + end])
        out.append(checkpoint(_sink_rows, *args, use_reentrant=False) if grad else _sink_rows(*args))
    return torch.cat(out, dim=-2)


def _sink_rows(q, k, v, sinks, bias: LayerBias | None, row: int, key: int, window: int,
               prefix: torch.Tensor | None) -> torch.Tensor:
    """Query rows at indices row.. over the keys at indices key.. (n <= m; m - n < window)."""
    m = torch.arange(row, row + q.shape[-2], device=q.device)[:, None]
    n = torch.arange(key, key + k.shape[-2], device=q.device)[None, :]
    allowed = (n <= m) & (m - n < window) if window else n <= m
    values = None
    if bias is not None:  # the bias's rows over keys 0.., cut to the ones given
        values = bias.rows(row, q.shape[-2], key + k.shape[-2], prefix, q.device)[..., key:]
    return sink_attention_rows(q, k, v, sinks, allowed, values)


def _document_sinks(q, k, v, sinks, bias: LayerBias | None, documents: Documents, window: int,
                    kernel: str = "auto") -> torch.Tensor:
    """Each document of each row on its own (a run of one-token documents token by token: each
    sees itself and the sink); positions and a gated bias's terms as `model.attention` sets them."""
    if q.shape[-2] != k.shape[-2] or documents.ids.shape != (q.shape[0], q.shape[-2]):
        raise ValueError(f"document masking needs q and k of one length (no KV cache) and documents [B, T]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, documents {tuple(documents.ids.shape)}")
    plan = segments(documents.ids)
    if plan is None:
        return sink_attention(q, k, v, sinks, bias, None, window, kernel)
    out = q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])
    pieces = []
    for seg in plan:
        tokens = range(seg.tokens.start, seg.tokens.stop)
        pieces += [(seg.rows, slice(t, t + 1)) for t in tokens] if seg.values else [(seg.rows, seg.tokens)]
    for rows, tokens in pieces:
        piece_bias = None
        if bias is not None:
            terms = None if bias.terms is None else bias.terms[rows, :, tokens]
            piece_bias = replace(bias, terms=terms, start=0 if documents.restart else tokens.start)
        at = (rows, slice(None), tokens)
        out[at] = sink_attention(q[at], k[at], v[at], sinks, piece_bias, None, window, kernel)
    return out
