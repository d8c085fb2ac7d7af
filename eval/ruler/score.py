"""RULER's scoring (`scripts/eval/synthetic/constants.py`, `scripts/eval/evaluate.py`): a
prediction is the generated text, stripped, with control characters turned into newlines; it is
compared with the expected strings, case-insensitively, by substring:

- `all` (string_match_all, every synthetic task in RULER): the share of the expected strings the
  prediction contains; a case with 4 values and 3 of them found scores 0.75.
- `part` (string_match_part, RULER's QA tasks): 1 if it contains any of them, else 0.

A cell (task, length, scaling) is the mean over its cases, with a 95% percentile bootstrap
interval over the cases.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from eval import stats

_CONTROL = re.compile(r"[\x00-\x1f]")
BOOTSTRAP_RESAMPLES = 2000


def postprocess(text: str) -> str:
    """RULER's `postprocess_pred`: strip, control characters to newlines, strip."""
    return _CONTROL.sub("\n", text.strip()).strip()


def string_match(prediction: str, answers: Sequence[str], rule: str) -> float:
    """The score of one prediction against its expected strings under `rule` (`all` or `part`)."""
    if not answers:
        raise ValueError("a case needs at least one expected answer")
    found = [a.lower() in prediction.lower() for a in answers]
    if rule == "all":
        return sum(found) / len(found)
    if rule == "part":
        return float(any(found))
    raise ValueError(f"scoring rule {rule!r} is not one of all, part")


def cell_interval(scores: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of a cell's case scores (its cases resampled)."""
    rng = np.random.default_rng(seed)
    means = stats.bootstrap_means([np.asarray(scores, dtype=float)], BOOTSTRAP_RESAMPLES, rng)
    return stats.percentile_interval(means)


def summary(records: Sequence[dict]) -> list[dict]:
    """Per (label, task, length): cases, mean score and its interval, in order of first appearance."""
    groups: dict[tuple[str, str, int], list[float]] = {}
    for r in records:
        groups.setdefault((r["label"], r["task"], r["length"]), []).append(r["score"])
    rows = []
    for (label, task, length), scores in groups.items():
        low, high = cell_interval(scores)
        rows.append({"label": label, "task": task, "length": length, "n": len(scores),
                     "score": float(np.mean(scores)), "low": low, "high": high})
    return rows
