"""Sampling from a trained model for `python -m generate`: a prompt's ids in, ids out as they come.

The decoding loop itself is the model's (`model.GPT.stream`: KV cache, greedy, temperature, top-k,
top-p, seed, stop ids); this is its one-prompt form over plain lists of ids.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from model import GPT


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
    """Yield up to `max_new_tokens` ids continuing `prompt` (stopping after `stop`, if given); a
    seed always gives the same tokens."""
    idx = torch.tensor([prompt], device=model.wte.weight.device)
    stops = () if stop is None else (stop,)
    for token in model.stream(idx, max_new_tokens, temperature, top_k, top_p, greedy, seed, stops):
        yield int(token[0])
