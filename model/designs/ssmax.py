"""Scalable softmax (SSMax, Nakanishi 2025, arXiv 2501.19399): the softmax over a query's n
scores z becomes n^(s z) / sum n^(s z'), i.e. the scores multiplied by s_h log n before it, with a
learned s_h per head in each layer (`model.ssmax`). n is the number of keys the query attends to:
its own position + 1 counted from its document's start under document masking (whether or not
positions restart there), capped at a sliding window's W, and counted over the cache as well in
generation. Applied as a scale of q_eff, as the length temperature: the dot-product scores are
scaled; a design's score bias is added unscaled (for a design without one this is the paper's
definition exactly). A query that sees one key has n = 1 and scale 0: its softmax over one key is
1 whatever the scale.

Initialisation: s_h = 1 / log(L0), L0 the training length, so that a fresh model's scale is 1 at
n = L0 (plain attention there) and below 1 at shorter contexts.
"""

from __future__ import annotations

import math

import torch


def ssmax_init(train_len: int) -> float:
    """s_h's starting value 1 / log(L0) (L0 >= 2)."""
    return 1.0 / math.log(train_len)


def key_counts(positions: torch.Tensor) -> torch.Tensor:
    """n per query [..., T]: the keys a causal query at `positions` (from its document's start)
    attends to, itself included."""
    return positions + 1


def ssmax_scale(s: torch.Tensor, counts: torch.Tensor, window: int = 0) -> torch.Tensor:
    """s_h log n per head and query, as q's multiplier: [H, T, 1] for counts [T], [B, H, T, 1]
    for counts [B, T]; n capped at `window` where the layer has one. log n in float64, then s's
    dtype (gradients flow to s)."""
    n = counts.clamp(max=window) if window else counts
    log_n = torch.log(n.to(torch.float64)).to(s.dtype)
    return s[:, None, None] * log_n[..., None, :, None]
