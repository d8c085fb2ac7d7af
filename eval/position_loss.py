"""Mean loss at each token position (the Forgetting Transformer's per-position loss figure, Lin et
al. 2025): every held-out document is read once from its first token to the longest length, and
the loss of predicting token i + 1 is averaged over documents at each position i.

Windowed perplexity averages a whole window, so a model that holds its loss up to some point past
the training length and loses it after looks like one that loses a little everywhere; the curve
shows where each design starts to lose. Spans summarise it for tables: the mean loss over the
positions of (L/2, L] for each doubling L of the training length (the first span is [0, L0]).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

from eval.perplexity import TokenLossModel


@torch.inference_mode()
def position_losses(model: TokenLossModel, documents: Sequence[Sequence[int]], length: int,
                    progress: bool = False, desc: str = "position loss") -> np.ndarray:
    """Mean loss [length] at input positions 0 .. length - 1 over documents of >= length + 1 ids."""
    short = [len(d) for d in documents if len(d) < length + 1]
    if short:
        raise ValueError(f"a document of {short[0]} tokens cannot give {length} positions (needs {length + 1})")
    device = next(model.parameters()).device
    total = np.zeros(length)
    for doc in tqdm(documents, desc=desc, unit="doc", disable=not progress, leave=False):
        ids = torch.tensor([list(doc[: length + 1])], device=device)
        total += model.token_losses(ids[:, :-1], ids[:, 1:])[0].double().cpu().numpy()
    return total / len(documents)


def spans(train_len: int, length: int) -> list[tuple[int, int]]:
    """[0, L0), then [L/2, L) for L = 2 L0, 4 L0, ... up to `length` (the last span ends there)."""
    out, start, end = [], 0, train_len
    while start < length:
        out.append((start, min(end, length)))
        start, end = end, 2 * end
    return out


def span_rows(curve: np.ndarray, train_len: int) -> list[dict]:
    """The mean loss over each span of `spans` (`length`: the span's end, `start`: its start)."""
    return [{"start": a, "length": b, "loss": float(curve[a:b].mean())} for a, b in spans(train_len, len(curve))]


def log_bins(curve: np.ndarray, per_octave: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The curve averaged over geometric bins of positions (`per_octave` bins per doubling, one
    position per bin at the start): the figure's line, as smooth at 16K as at 16 on a log axis.
    Returns each bin's centre position (from 1) and mean loss."""
    edges = np.unique(np.round(2 ** (np.arange(0, per_octave * np.log2(len(curve)) + 2) / per_octave)).astype(int))
    edges = np.concatenate([[0], edges[edges < len(curve)], [len(curve)]])
    edges = np.unique(edges)
    centres = np.array([(a + b + 1) / 2 for a, b in zip(edges[:-1], edges[1:])])
    means = np.array([curve[a:b].mean() for a, b in zip(edges[:-1], edges[1:])])
    return centres, means
