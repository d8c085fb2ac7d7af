"""Sliding-window causal attention (the hybrid design's windowed layers): each query over the
`window` most recent keys, its own included."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .bias_attention import BIAS_CHUNK  # the window path chunks its query rows as the bias paths do
from .block_masks import window_block_mask
from .kernel_path import _gqa, gpu_sdpa, run_flex, takes_gpu_path


def window_attention(q, k, v, window: int, kernel: str = "auto") -> torch.Tensor:
    """Causal attention over the `window` most recent keys, the query's own included: FlexAttention
    with a sliding-window block mask on the GPU path; otherwise (the CPU path, and KV-cache steps
    on either) SDPA over chunks of query rows, each against only the keys its window reaches
    (memory linear in N, time N x (chunk + window))."""
    gpu = takes_gpu_path(q, kernel)
    if gpu and q.shape[-2] == k.shape[-2]:
        mask = window_block_mask(q.shape[-2], window, str(q.device))
        return run_flex(q, k, v, block_mask=mask, enable_gqa=_gqa(q, k))
    return _chunked_window(q, k, v, window, gpu)


def _chunked_window(q, k, v, window: int, gpu: bool = False) -> torch.Tensor:
    """Query rows in chunks, each with the keys from its first row's window start to its last row;
    with gradients each chunk is recomputed in backward (no per-chunk mask or probabilities kept).
    gpu: the GPU path's SDPA (`gpu_sdpa`)."""
    tq, tk = q.shape[-2], k.shape[-2]
    offset = tk - tq
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    out = []
    for start in range(0, tq, BIAS_CHUNK):
        end = min(tq, start + BIAS_CHUNK)
        first = max(0, offset + start - window + 1)
        args = (q[..., start:end, :], k[..., first : offset + end, :], v[..., first : offset + end, :],
                offset + start - first, window, gpu)
        out.append(checkpoint(_window_rows, *args, use_reentrant=False) if grad else _window_rows(*args))
    return torch.cat(out, dim=-2)


def _window_rows(q, k, v, first: int, window: int, gpu: bool) -> torch.Tensor:
    """Rows at positions first.. (counted in the keys given) over those keys: n <= m, m - n < window."""
    m = torch.arange(first, first + q.shape[-2], device=q.device)[:, None]
    n = torch.arange(k.shape[-2], device=q.device)[None, :]
    mask = (n <= m) & (m - n < window)
    if gpu:
        return gpu_sdpa(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=_gqa(q, k))

