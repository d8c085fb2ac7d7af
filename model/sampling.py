"""Choosing the next token from logits: greedy, or temperature, top-k and nucleus (top-p) sampling.

Used by the one decoding loop, `GPT.stream` (and `GPT.generate` on top of it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, greedy: bool) -> None:
    """One-line `ValueError`s for settings that cannot sample (greedy ignores temperature)."""
    if not greedy and not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (or use greedy=True)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Logits [..., V] with tokens outside the top k, and outside the smallest set whose probability
    reaches top_p (nucleus), set to -inf; the most likely token always stays."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, greedy: bool,
               generator: torch.Generator | None) -> torch.Tensor:
    """One token [B] per row of logits [B, V]: the argmax, or a draw from softmax(filtered logits /
    temperature) with `generator` (None: torch's global one)."""
    if greedy:
        return logits.argmax(dim=-1)
    probs = F.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)[:, 0]
