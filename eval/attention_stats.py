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

Per head, the mechanism measures (`head_statistics`) of one segment, for the attention-sink account
of length failure (a sink parks attention on the first token; RoPE beyond its trained length may
disturb it):
- `sink_share`: the weight A(h, m, 0) on the first token (the EOS that starts every evaluation
  input), averaged over the queries that see any key; `sink_share_beyond` over those at positions
  m >= the training length only (None when the segment has none);
- `entropy`: -sum_n A log A over the keys, plus -r log r for the weight r that goes to no key (a
  learned sink's share, stick-breaking's remainder; 0 for a plain softmax), averaged the same way,
  with `entropy_beyond`;
- `max_logit`: the largest score s(h, m, n) (the design's bias included) per distance bin m - n:
  0, 1, 2-3, 4-7, ... (`distance_bins`); None for a bin without scores.
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
    wide = torch.promote_types(layer.q_eff.dtype, torch.float32)  # bf16 widened; a float64 model's kept
    q = layer.q_eff[0, :, start:end].to(wide)
    k = layer.k_eff[0, :, :end].to(wide)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    m = torch.arange(start, end, device=q.device)[:, None]
    n = torch.arange(end, device=q.device)[None, :]
    if layer.bias is not None:
        scores = scores + layer.bias.scores(start, end, q.device).to(wide)
    valid = (n <= m) & (m - n < layer.window) if layer.window else n <= m
    return scores, valid.expand_as(scores)


def chunk_weights(
    layer: AttentionInputs, scores: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's attention weights from its scores: (A [H, c, T], the keys each query sees, the
    weight r [H, c] that goes to no key: a learned sink's share, stick-breaking's remainder, 0 for
    a plain softmax)."""
    if layer.weights is not None:
        weights, valid = layer.weights(scores, valid)
        return weights, valid, (1 - weights.sum(-1)).clamp_min(0.0)
    logits = scores.masked_fill(~valid, -math.inf)
    if layer.sinks is None:
        return torch.softmax(logits, dim=-1), valid, scores.new_zeros(scores.shape[:-1])
    sink = layer.sinks.to(scores)[:, None, None].expand(*scores.shape[:-1], 1)  # in each row's denominator
    weights = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)
    return weights[..., :-1], valid, weights[..., -1]


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
        weights, valid, _ = chunk_weights(layer, s, valid)
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


def distance_bins(length: int) -> list[tuple[int, int]]:
    """Distances m - n of a `length`-token segment in bins (first, last): (0, 0), (1, 1), (2, 3),
    (4, 7), ..., the last ending at length - 1."""
    bins = [(0, 0)]
    while bins[-1][1] < length - 1:
        first = bins[-1][1] + 1
        bins.append((first, min(2 * first - 1, length - 1)))
    return bins


def _bin_of(distance: torch.Tensor) -> torch.Tensor:
    """The index in `distance_bins` of each distance >= 0: 0 for 0, floor(log2 d) + 1 otherwise
    (frexp: d = mantissa x 2^exponent with the mantissa in [0.5, 1), and 0 = 0 x 2^0)."""
    return torch.frexp(distance.double()).exponent.long()


def layer_head_statistics(layer: AttentionInputs, train_len: int, chunk: int = 256) -> list[dict]:
    """The mechanism measures of the module docstring for each head of one layer, `chunk` queries at a time."""
    n_heads, length, device = layer.q_eff.shape[1], layer.q_eff.shape[2], layer.q_eff.device
    n_bins = len(distance_bins(length))
    sums = torch.zeros(3, 2, n_heads, dtype=torch.float64, device=device)  # sink, entropy, queries x [all, beyond]
    max_logit = torch.full((n_heads, n_bins), -math.inf, dtype=torch.float64, device=device)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        scores, valid = chunk_scores(layer, start, end)
        s = scores.double()
        weights, valid, rest = chunk_weights(layer, s, valid)
        seen = valid.any(-1)  # [H, c]: queries with a key (stick-breaking's first has none)
        h = -torch.special.xlogy(weights, weights).sum(-1) - torch.special.xlogy(rest, rest)
        m = torch.arange(start, end, device=device)[:, None]
        for i, rows in enumerate((seen, seen & (m[:, 0] >= train_len))):
            sums[:, i] += torch.stack((weights[..., 0], h, torch.ones_like(h))).where(rows, 0.0).sum(-1)
        bins = _bin_of((m - torch.arange(end, device=device)[None, :]).clamp_min(0)).expand_as(s)
        logits = s.masked_fill(~valid, -math.inf)
        max_logit = max_logit.scatter_reduce(1, bins.reshape(n_heads, -1), logits.reshape(n_heads, -1), "amax")
    sink, entropy, queries = sums.cpu()
    max_logit = max_logit.cpu()

    def mean(x: torch.Tensor, i: int, hd: int) -> float | None:
        return (x[i, hd] / queries[i, hd]).item() if queries[i, hd] else None

    return [{
        "head": hd + 1,
        "sink_share": mean(sink, 0, hd),
        "entropy": mean(entropy, 0, hd),
        "sink_share_beyond": mean(sink, 1, hd),
        "entropy_beyond": mean(entropy, 1, hd),
        "max_logit": [x if x > -math.inf else None for x in max_logit[hd].tolist()],
    } for hd in range(n_heads)]


def head_statistics(layers: Sequence[AttentionInputs], train_len: int, chunk: int = 256) -> list[dict]:
    """`layer_head_statistics` for every layer, layers and heads numbered from 1."""
    return [{"layer": i + 1, **row} for i, layer in enumerate(layers)
            for row in layer_head_statistics(layer, train_len, chunk)]
