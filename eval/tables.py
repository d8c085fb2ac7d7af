"""The Markdown tables of evaluation results: number formatting, pivots of rows by length, and the
passkey and recall summaries (by length, mode and depth)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from eval import plots


def fmt(x) -> str:
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"
    return str(x)


def markdown(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pivot(rows: Sequence[dict], label_key: str, value_key: str) -> tuple[list[int], dict[str, dict[int, float]]]:
    """{label: {length: value}} and the sorted lengths, keeping the order labels first appear in."""
    table: dict[str, dict[int, float]] = {}
    for r in rows:
        table.setdefault(r[label_key], {})[r["length"]] = r[value_key]
    lengths = sorted({r["length"] for r in rows})
    return lengths, table


def pivot_markdown(lengths: list[int], table: dict[str, dict[int, float]], first: str) -> str:
    header = [first] + [plots._k(x) for x in lengths]
    return markdown(header, [[label] + [vals.get(x, "") for x in lengths] for label, vals in table.items()])


def passkey_summary(cases: Sequence[dict], modes: Sequence[str]) -> list[dict]:
    """Accuracy per (label, length) for each scoring mode, plus how often the modes agree."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for c in cases:
        groups[(c["label"], c["length"])].append(c)
    rows = []
    for (label, length), group in groups.items():
        row = {"label": label, "length": length, "n": len(group)}
        for mode in modes:
            row[f"{mode}_accuracy"] = sum(c[f"{mode}_correct"] for c in group) / len(group)
        if len(modes) > 1:
            row["modes_agree"] = sum(len({c[f"{m}_correct"] for m in modes}) == 1 for c in group) / len(group)
        rows.append(row)
    return rows


def recall_summary(cases: Sequence[dict]) -> list[dict]:
    """Accuracy per (label, length): right answers over all queries of its cases."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for c in cases:
        groups[(c["label"], c["length"])].append(c)
    return [{"label": label, "length": length, "n": len(group), "pairs": group[0]["pairs"],
             "accuracy": sum(c["correct"] for c in group) / sum(c["queries"] for c in group)}
            for (label, length), group in groups.items()]


def depth_bins(depths: Sequence[float]) -> list[float]:
    """The depths themselves for a sweep (few distinct values), otherwise 5 equal bins' centres."""
    distinct = sorted(set(depths))
    return distinct if len(distinct) <= 10 else [0.1, 0.3, 0.5, 0.7, 0.9]


def depth_grid(cases: Sequence[dict], mode: str) -> tuple[list[int], list[float], np.ndarray]:
    """Accuracy by depth x length (NaN where no case fell)."""
    lengths = sorted({c["length"] for c in cases})
    bins = depth_bins([c["depth"] for c in cases])
    hits = np.zeros((len(bins), len(lengths)))
    counts = np.zeros_like(hits)
    for c in cases:
        i = int(np.argmin([abs(c["depth"] - b) for b in bins]))
        j = lengths.index(c["length"])
        hits[i, j] += c[f"{mode}_correct"]
        counts[i, j] += 1
    with np.errstate(invalid="ignore"):
        return lengths, bins, hits / counts
