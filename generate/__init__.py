"""Sampling from a trained model, one token at a time over a KV cache (`python -m generate`)."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from model import GPT
from model.gpt import KVCache


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Logits [V] with tokens outside the top k, and outside the smallest set whose probability
    reaches top_p (nucleus), set to -inf; the most likely token always stays."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def sample(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    seed: int = 0,
    stop: int | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` ids continuing `prompt` (stopping after `stop`, if given).

    Greedy takes the argmax; otherwise logits / temperature are filtered by top_k and top_p and
    sampled from a generator seeded with `seed`, so a seed always gives the same tokens.
    """
    device = model.wte.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(model.cfg.n_layer)
    logits = model(torch.tensor([prompt], device=device), cache=cache, logits_to_keep=1)[0, -1]
    for step in range(max_new_tokens):
        if greedy:
            token = int(logits.argmax())
        else:
            probs = F.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        yield token
        if token == stop or step + 1 == max_new_tokens:
            return
        logits = model(torch.tensor([[token]], device=device), cache=cache, logits_to_keep=1)[0, -1]
