"""RULER's summary numbers (Hsieh et al. 2024, its main table): per model and length, the average of
the task scores; and the effective length, the longest length up to which that average holds.

RULER's effective length is the longest length whose average passes 85.6% (Llama-2-7B's average
at 4K). Here the average must also stay within `MARGIN` of the model's own 1x average (at its
training length), so that a model strong at 1x is not called effective where it has lost much of
that; and every length up to it must pass ("stays"). So it is never longer than RULER's.

An average covers the tasks evaluated at that length (a task whose prompt does not fit a length is
skipped there, and qa_1 / qa_2 need downloads): its task count goes with it, and averages over
different task sets are not comparable with each other, nor with RULER's 13-task averages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Optional

import numpy as np

THRESHOLD = 0.856  # RULER's: Llama-2-7B's average over its 13 tasks at 4K
MARGIN = 0.05  # how far under its own 1x average a model's average may fall and still count


def base_length(lengths: Sequence[int], train_len: Optional[int]) -> int:
    """The length whose average is the model's 1x score: its training length, else the longest
    evaluated below it, else (no training length, or none below) the shortest evaluated."""
    below = [n for n in lengths if train_len is not None and n <= train_len]
    return max(below) if below else min(lengths)


def summarize(rows: Sequence[Mapping], train_lens: Mapping[str, Optional[int]]) -> list[dict]:
    """Per label of `rows` (cells of label, task, length and score): its average and task count per
    length, its 1x length and average, the bar (the larger of THRESHOLD and 1x - MARGIN) and the
    effective length (None where even the shortest length is under the bar)."""
    scores: dict[str, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        scores[r["label"]][r["length"]][r["task"]] = r["score"]
    out = []
    for label, by_length in scores.items():
        lengths = sorted(by_length)
        points = [{"length": n, "average": float(np.mean(list(by_length[n].values()))), "tasks": len(by_length[n])}
                  for n in lengths]
        base = base_length(lengths, train_lens.get(label))
        base_average = next(p["average"] for p in points if p["length"] == base)
        bar = max(THRESHOLD, base_average - MARGIN)
        effective = None
        for p in points:
            if p["average"] < bar:
                break
            effective = p["length"]
        out.append({"label": label, "lengths": points, "base_length": base, "base_average": base_average,
                    "bar": bar, "effective_length": effective, "longest": lengths[-1],
                    "same_tasks": len({frozenset(by_length[n]) for n in lengths}) == 1})
    return out
