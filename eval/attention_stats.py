"""Per-layer statistics of pre-softmax attention scores beyond the training length.

The seed article (Figure 11) shows that Origin's scores at ~4x the training length have outliers
10-20x larger than CoCA's and almost no attention on nearby tokens in the last layer. Here, from a
layer's `q_eff`, `k_eff` (and a design's score bias, e.g. ALiBi's, KERPLE's, FIRE's, FoX's) as
returned by `GPT.capture_qk`, the causal scores

    s(h, m, n) = q_eff[h, m] . k_eff[h, n] / sqrt(D) + b_h(m, n),   n <= m

are computed for a chunk of queries at a time (memory chunk x T per head), and summarised:
- `max_score`, `min_score`, `mean_score`, `std_score` over all valid scores;
- outliers: scores above their own query row's mean + `sigma` x the row's std (per head and
  query, over the keys it may see); `outlier_count` and `outlier_ratio` (of all valid scores);
  `max_zscore` is the largest (s - row mean) / row std seen;
- `local_mass`: attention weight on the nearest `window` keys a query sees (m - window < n <= m
  for softmax), averaged over heads and queries; with attention sinks (`model.sinks`) the sink's
  logit is in each softmax's denominator, so the mass on keys may be below 1.
A design whose attention is not a softmax (stick-breaking's) gives its weights and the keys its
queries see (`Design.weights`: n < m for stick-breaking, whose weights sum to at most 1); its
statistics are over those keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class ScoreBias(Protocol):
    def scores(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """b_h(m, n) of batch row 0's queries start..end-1 over keys 0..end-1: [H, rows, end]."""


class AttentionInputs(Protocol):
    q_eff: torch.Tensor  # [B, H, T, D]
    k_eff: torch.Tensor  # [B, H, T, D]
    bias: ScoreBias | None  # the design's score bias (`model.bias_attention.LayerBias`), or None
    window: int  # a sliding window's keys: only m - n < window are scores (0: every n <= m)
    sinks: torch.Tensor | None  # attention sinks' logits a_h [H], in each softmax's denominator, or None
    weights: Callable | None  # (scores, causal mask) -> (weights, keys seen); None: softmax (`Design.weights`)


def chunk_scores(layer: AttentionInputs, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of queries [start, end) against keys [0, end) of batch row 0: ([H, c, end], valid mask)."""
    q = layer.q_eff[0, :, start:end].float()
    k = layer.k_eff[0, :, :end].float()
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    m = torch.arange(start, end, device=q.device)[:, None]
    n = torch.arange(end, device=q.device)[None, :]
    if layer.bias is not None:
        scores = scores + layer.bias.scores(start, end, q.device).float()
    valid = (n <= m) & (m - n < layer.window) if layer.window else n <= m
    return scores, valid.expand_as(scores)


def layer_statistics(layer: AttentionInputs, sigma: float = 6.0, window: int = 16, chunk: int = 256) -> dict:
    """Summary statistics of one layer's causal scores (those its queries see), `chunk` queries at a time."""
    n_heads, length = layer.q_eff.shape[1], layer.q_eff.shape[2]
    total = total_sq = 0.0
    count = outliers = 0
    max_score, min_score, max_z, local = -math.inf, math.inf, 0.0, 0.0
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        scores, valid = chunk_scores(layer, start, end)
        s = scores.double()
        if layer.weights is None:
            logits = s.masked_fill(~valid, -math.inf)
            if layer.sinks is not None:  # the sink's logit in each row's denominator, its column dropped after
                sink = layer.sinks.to(s)[:, None, None].expand(*s.shape[:-1], 1)
                logits = torch.cat((logits, sink), dim=-1)
            weights = torch.softmax(logits, dim=-1)[..., : s.shape[-1]]
        else:
            weights, valid = layer.weights(s, valid)
        n_valid = valid.sum(-1, keepdim=True).clamp_min(1)  # a row without keys (stick-breaking's first) adds none
        masked = torch.where(valid, s, 0.0)
        total += masked.sum().item()
        total_sq += (masked * masked).sum().item()
        count += int(valid.sum())
        max_score = max(max_score, s.masked_fill(~valid, -math.inf).max().item())
        min_score = min(min_score, s.masked_fill(~valid, math.inf).min().item())
        row_mean = masked.sum(-1, keepdim=True) / n_valid
        row_std = (torch.where(valid, (s - row_mean) ** 2, 0.0).sum(-1, keepdim=True) / n_valid).sqrt()
        outliers += int((valid & (s > row_mean + sigma * row_std)).sum())
        z = torch.where(valid & (row_std > 0), (s - row_mean) / row_std.clamp_min(1e-300), 0.0)
        max_z = max(max_z, z.max().item())
        nearer = valid.flip(-1).cumsum(-1).flip(-1)  # the keys a query sees at or after n
        local += (weights * (valid & (nearer <= window))).sum().item()
    mean = total / count
    return {
        "max_score": max_score,
        "min_score": min_score,
        "mean_score": mean,
        "std_score": math.sqrt(max(total_sq / count - mean * mean, 0.0)),
        "outlier_count": outliers,
        "outlier_ratio": outliers / count,
        "max_zscore": max_z,
        "local_mass": local / (n_heads * length),
        "n_scores": count,
    }


def last_query_scores(layer: AttentionInputs) -> torch.Tensor:
    """Scores of the final query against every key, per head: [H, T] (what Figure 11 plots)."""
    length = layer.q_eff.shape[2]
    scores, _ = chunk_scores(layer, length - 1, length)
    return scores[:, 0]


def attention_statistics(
    layers: Sequence[AttentionInputs], sigma: float = 6.0, window: int = 16, chunk: int = 256
) -> list[dict]:
    """`layer_statistics` for every layer, numbered from 1 as in the paper."""
    return [{"layer": i + 1, **layer_statistics(layer, sigma, window, chunk)} for i, layer in enumerate(layers)]
