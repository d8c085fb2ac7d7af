"""Runs that differ only in their seed, summarised: mean, 95% confidence interval, significance.

`python -m eval.report` groups runs by `meta.config_id` (the training config without seed and
names, recorded by `python -m eval`) and, where a group has several seeds, reduces each metric
per (design + scaling, length) over seeds:

- the cell metrics: perplexity ratio to the training length (`ppl_ratio`), passkey accuracy
  (`passkey`), recall accuracy (`recall`), one value per seed;
- mean and the 95% confidence interval of the mean, `t(0.975, n - 1) * s / sqrt(n)` with the
  sample standard deviation `s` (n = seeds);
- for each pair of designs under the same scaling, Welch's two-sided t-test on the per-seed
  values at each length, significant at p < 0.05 (no correction for multiple comparisons: the
  table says so). With no spread at all in either group the test is undefined; equal means are
  then "not significant" and different ones are reported with p = 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import combinations
from typing import Sequence

from scipy import stats

LEVEL = 0.95
ALPHA = 0.05
METRICS = ("ppl_ratio", "passkey", "recall")
LOWER_IS_BETTER = {"ppl_ratio"}


def mean_ci(values: Sequence[float], level: float = LEVEL) -> tuple[float, float]:
    """Mean and the half-width of its `level` confidence interval (Student t); NaN width for n = 1."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of Welch's t-test; 0 or 1 where both samples have no spread."""
    if len(a) < 2 or len(b) < 2:
        return math.nan
    if max(a) == min(a) and max(b) == min(b):
        return 1.0 if a[0] == b[0] else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def per_seed_values(group: str, seed: int, run: str, results: dict) -> list[dict]:
    """The cell metrics of one run's results (labels are scalings: `none`, `dynamic:4`...)."""
    rows = []

    def add(metric: str, scaling: str, length: int, value: float) -> None:
        rows.append({"group": group, "seed": seed, "run": run, "metric": metric, "scaling": scaling,
                     "length": length, "value": value})

    if "ppl" in results:
        train_len = results["ppl"]["meta"]["train_len"]
        by_scaling: dict[str, dict[int, float]] = defaultdict(dict)
        for r in results["ppl"]["rows"]:
            by_scaling[r["scaling"]][r["length"]] = r["ppl"]
        for scaling, by_length in by_scaling.items():
            base = by_length.get(train_len)
            for length, ppl in by_length.items():
                if base is not None:
                    add("ppl_ratio", scaling, length, ppl / base)
    if "passkey" in results:
        mode = results["passkey"]["modes"][0]
        cells: dict[tuple[str, int], list[bool]] = defaultdict(list)
        for c in results["passkey"]["cases"]:
            cells[(c["scaling"], c["length"])].append(c[f"{mode}_correct"])
        for (scaling, length), hits in cells.items():
            add("passkey", scaling, length, sum(hits) / len(hits))
    if "recall" in results:
        sums: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
        for c in results["recall"]["cases"]:
            s = sums[(c["scaling"], c["length"])]
            s[0] += c["correct"]
            s[1] += c["queries"]
        for (scaling, length), (right, total) in sums.items():
            add("recall", scaling, length, right / total)
    return rows


def label(group: str, scaling: str) -> str:
    return group if scaling == "none" else f"{group} + {scaling}"


def summarise(rows: Sequence[dict]) -> list[dict]:
    """Mean and 95% CI per (metric, group, scaling, length) over seeds."""
    cells: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        cells[(r["metric"], r["group"], r["scaling"], r["length"])].append(r["value"])
    out = []
    for (metric, group, scaling, length), values in cells.items():
        mean, ci = mean_ci(values)
        out.append({"metric": metric, "label": label(group, scaling), "group": group, "scaling": scaling,
                    "length": length, "n": len(values), "mean": mean, "ci95": ci,
                    "low": mean - ci, "high": mean + ci})
    return out


NONE = "none"  # the scaling label of a model as trained


def significance(rows: Sequence[dict]) -> list[dict]:
    """Welch's test per metric and length for every pair of setups (group, scaling) that share
    their scaling, and for every setup with a scaling against every setup as trained: the paper's
    question is whether a design with a scaling keeps what it or another design loses without one.
    `a` carries `scaling`, `b` carries `scaling_b`."""
    cells: dict[tuple, dict[tuple[str, str], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        cells[(r["metric"], r["length"])][(r["group"], r["scaling"])].append(r["value"])
    out = []
    for (metric, length), setups in cells.items():
        for first, second in combinations(setups, 2):
            if first[1] != second[1]:
                if NONE not in (first[1], second[1]):
                    continue
                if first[1] == NONE:  # the setup with the scaling first
                    first, second = second, first
            (a, scaling), (b, scaling_b) = first, second
            va, vb = setups[(a, scaling)], setups[(b, scaling_b)]
            p = welch_p(va, vb)
            ma, mb = sum(va) / len(va), sum(vb) / len(vb)
            out.append({"metric": metric, "scaling": scaling, "scaling_b": scaling_b, "length": length, "a": a, "b": b,
                        "mean_a": ma, "mean_b": mb, "diff": ma - mb, "p": p,
                        "significant": bool(p < ALPHA) if not math.isnan(p) else False})
    return out
