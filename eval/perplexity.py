"""Sliding-window perplexity (Press et al. 2021), the paper's long-text protocol.

A document of N tokens gives N - 1 predictions (input position i predicts token i + 1). At an
evaluation length L the model reads windows of exactly L input positions: the first window counts
the loss of all its positions; every later window ends `stride` positions after the previous one
and counts only the positions it adds, so each counted token after the first window sees at least
L - stride tokens of context. With stride = L the windows do not overlap.

The loss comes from `model.token_losses` (LM head in chunks), so memory grows linearly with L.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
from tqdm import tqdm


class TokenLossModel(Protocol):
    """What perplexity needs from a model: per-token cross entropy, 0 where the target is -100."""

    def token_losses(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def parameters(self): ...


@dataclass(frozen=True)
class Window:
    """Input positions [start, end) read by the model; the last `counted` of them count."""

    start: int
    end: int
    counted: int


@dataclass(frozen=True)
class PerplexityResult:
    """Totals over all documents at one evaluation length."""

    length: int
    stride: int
    nll: float
    tokens: int
    documents: int

    @property
    def loss(self) -> float:
        return self.nll / self.tokens

    @property
    def ppl(self) -> float:
        return safe_exp(self.loss)

    def as_dict(self) -> dict:
        return {**asdict(self), "loss": self.loss, "ppl": self.ppl}


def safe_exp(x: float) -> float:
    """exp that returns inf instead of raising (an exploding model is a result, not a crash)."""
    return math.exp(x) if x < 709.0 else math.inf


def sliding_windows(n_positions: int, length: int, stride: int) -> list[Window]:
    """The windows covering `n_positions` input positions at window `length` and `stride`."""
    if length < 1 or stride < 1:
        raise ValueError(f"length and stride must be >= 1, got length={length}, stride={stride}")
    if stride > length:
        raise ValueError(f"stride={stride} > length={length} would skip tokens")
    if n_positions < length:
        raise ValueError(f"a document of {n_positions + 1} tokens is too short for length {length}")
    windows = [Window(0, length, length)]
    end = length
    while end < n_positions:
        new_end = min(end + stride, n_positions)
        windows.append(Window(new_end - length, new_end, new_end - end))
        end = new_end
    return windows


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def document_nll(
    model: TokenLossModel,
    tokens: Sequence[int] | torch.Tensor,
    length: int,
    stride: int,
    batch_tokens: int = 16384,
) -> tuple[float, int]:
    """Summed negative log-likelihood (float64) and number of counted tokens for one document.

    Windows are batched so that one forward reads at most max(length, batch_tokens) tokens.
    """
    ids = torch.as_tensor(tokens, dtype=torch.long, device=model_device(model))
    inputs, targets = ids[:-1], ids[1:]
    windows = sliding_windows(len(inputs), length, stride)
    per_batch = max(1, batch_tokens // length)
    nll, counted = 0.0, 0
    for i in range(0, len(windows), per_batch):
        group = windows[i : i + per_batch]
        idx = torch.stack([inputs[w.start : w.end] for w in group])
        tgt = torch.stack([targets[w.start : w.end] for w in group]).clone()
        for row, w in enumerate(group):
            tgt[row, : length - w.counted] = -100
        losses = model.token_losses(idx, tgt)
        nll += losses.double().sum().item()
        counted += sum(w.counted for w in group)
    return nll, counted


def evaluate_perplexity(
    model: TokenLossModel,
    documents: Sequence[Sequence[int]],
    lengths: Sequence[int],
    stride: int,
    batch_tokens: int = 16384,
    progress: bool = True,
) -> list[PerplexityResult]:
    """Perplexity at each length over the same documents, each cut to max(lengths) + 1 tokens."""
    if not documents:
        raise ValueError("no documents to evaluate")
    longest = max(lengths)
    short = [len(d) for d in documents if len(d) < longest + 1]
    if short:
        raise ValueError(
            f"{len(short)} document(s) shorter than {longest + 1} tokens (shortest {min(short)}); "
            f"lengths up to {longest} need documents of at least {longest + 1} tokens"
        )
    docs = [list(d[: longest + 1]) for d in documents]
    results = []
    for length in lengths:
        nll, counted = 0.0, 0
        bar = tqdm(docs, desc=f"ppl L={length}", disable=not progress, leave=False)
        for doc in bar:
            d_nll, d_count = document_nll(model, doc, length, min(stride, length), batch_tokens)
            nll, counted = nll + d_nll, counted + d_count
            bar.set_postfix(ppl=f"{safe_exp(nll / counted):.2f}")
        results.append(PerplexityResult(length, min(stride, length), nll, counted, len(docs)))
    return results
