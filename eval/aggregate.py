"""Runs that differ only in their seed, summarised and compared (the statistics: `eval.stats`).

`python -m eval.report` groups runs into designs (`eval.seeds.seed_groups`) and hands each
design's runs here. Every cell (metric, design + scaling, length) holds one array of case values
per seed: passkey 1/0 per case, recall the share of a case's queries answered, the perplexity
ratio to the training length one value per seed. From them:

- per cell: the seed mean, the sample SD of the seed values, and the 95% cluster-bootstrap
  interval of the seed mean (seeds, then cases within seeds);
- the pre-registered family (`conf/study/comparisons.yaml`): for each comparison and length the
  difference of seed means (a - b), its 95% cluster-bootstrap interval, the exact permutation
  p over seeds, Holm's adjusted p over the family, and the smallest difference each comparison
  could detect;
- exploratory: every other pair of setups under the same scaling, and every setup with a scaling
  against every setup as trained, with the same effect, interval and permutation p, unadjusted.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import numpy as np
import yaml
from omegaconf import OmegaConf

from data.config import DataError
from eval import stats

ALPHA = 0.05
METRICS = ("ppl_ratio", "passkey", "recall")
LOWER_IS_BETTER = {"ppl_ratio"}
NONE = "none"  # the scaling label of a model as trained
FAMILY_FILE = Path(__file__).resolve().parents[1] / "conf" / "study" / "comparisons.yaml"
BOOTSTRAP_SEED = 19  # numpy Generator seed of every bootstrap: a report regenerates to the digit
BOOTSTRAP_RESAMPLES = 10_000
ATTENTION_STATS = ("max_score", "std_score", "max_zscore", "local_mass")

Setup = tuple[str, str]  # (design, scaling)
Cells = dict[tuple[str, int], dict[Setup, list[np.ndarray]]]  # (metric, length) -> setup -> per seed


# ----------------------------------------------------------------------------- cells


def run_cases(results: dict) -> dict[tuple[str, str, int], np.ndarray]:
    """One run's case values per (metric, scaling, length); passkey in the evaluation's first mode."""
    out: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    if "ppl" in results:
        train_len = results["ppl"]["meta"]["train_len"]
        by_scaling: dict[str, dict[int, float]] = defaultdict(dict)
        for r in results["ppl"]["rows"]:
            by_scaling[r["scaling"]][r["length"]] = r["ppl"]
        for scaling, by_length in by_scaling.items():
            base = by_length.get(train_len)
            for length, ppl in by_length.items():
                if base is not None:
                    out[("ppl_ratio", scaling, length)].append(ppl / base)
    if "passkey" in results:
        mode = results["passkey"]["modes"][0]
        for c in results["passkey"]["cases"]:
            out[("passkey", c["scaling"], c["length"])].append(float(c[f"{mode}_correct"]))
    if "recall" in results:
        for c in results["recall"]["cases"]:
            out[("recall", c["scaling"], c["length"])].append(c["correct"] / c["queries"])
    return {k: np.array(v) for k, v in out.items()}


def per_seed_values(design: str, seed: int, run: str, results: dict) -> list[dict]:
    """One row per cell of one run: its seed value (mean of its case values) and case count."""
    return [{"group": design, "seed": seed, "run": run, "metric": metric, "scaling": scaling,
             "length": length, "cases": len(v), "value": float(v.mean())}
            for (metric, scaling, length), v in run_cases(results).items()]


def collect(runs: Iterable[tuple[str, dict]]) -> Cells:
    """The cells of (design, results) pairs, one entry per run in the order given."""
    cells: Cells = defaultdict(lambda: defaultdict(list))
    for design, results in runs:
        for (metric, scaling, length), values in run_cases(results).items():
            cells[(metric, length)][(design, scaling)].append(values)
    return cells


def label(design: str, scaling: str) -> str:
    return design if scaling == NONE else f"{design} + {scaling}"


class Bootstraps:
    """Cluster-bootstrap replicates of each setup's seed mean, drawn once per cell and reused by
    every interval that cell enters. Each cell has its own generator, spawned from
    `BOOTSTRAP_SEED` and the cell's name, so designs are resampled independently and a cell's
    replicates do not depend on which other runs the report was given."""

    def __init__(self, cells: Cells, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED):
        self.cells, self.resamples, self.seed = cells, resamples, seed
        self._cache: dict[tuple, np.ndarray] = {}

    def means(self, metric: str, length: int, setup: Setup) -> np.ndarray:
        key = (metric, length, *setup)
        if key not in self._cache:
            name = zlib.crc32("|".join(map(str, key)).encode())
            rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(name,)))
            self._cache[key] = stats.bootstrap_means(self.cells[(metric, length)][setup], self.resamples, rng)
        return self._cache[key]


def summarise(cells: Cells, boots: Bootstraps) -> list[dict]:
    """Seed mean, sample SD and 95% cluster-bootstrap interval per (metric, setup, length). A
    single seed gets no interval (NaN): the spread between trainings is then unknown."""
    out = []
    for (metric, length), setups in cells.items():
        for (design, scaling), seeds in setups.items():
            values = stats.seed_values(seeds)
            low, high = (stats.percentile_interval(boots.means(metric, length, (design, scaling)))
                         if len(values) > 1 else (math.nan, math.nan))
            out.append({"metric": metric, "label": label(design, scaling), "group": design,
                        "scaling": scaling, "length": length, "n": len(values),
                        "cases": int(sum(len(s) for s in seeds)), "mean": float(values.mean()),
                        "sd": stats.sample_sd(values), "low": low, "high": high})
    return out


def compare_pair(cells: Cells, boots: Bootstraps, metric: str, length: int, a: Setup, b: Setup) -> dict:
    """Effect (a - b) of seed means, its 95% cluster-bootstrap interval (NaN where a side has a
    single seed) and the permutation p."""
    va, vb = stats.seed_values(cells[(metric, length)][a]), stats.seed_values(cells[(metric, length)][b])
    low, high = math.nan, math.nan
    if min(len(va), len(vb)) > 1:
        low, high = stats.percentile_interval(boots.means(metric, length, a) - boots.means(metric, length, b))
    return {"n_a": len(va), "n_b": len(vb), "mean_a": float(va.mean()), "mean_b": float(vb.mean()),
            "diff": stats.mean_difference(va, vb), "low": low, "high": high, "p": stats.permutation_p(va, vb),
            "pooled_sd": stats.pooled_sd(va, vb)}


# ----------------------------------------------------------------------------- the family


@dataclass(frozen=True)
class Family:
    """The pre-registered comparisons (conf/study/comparisons.yaml): a under its scaling vs b under
    its scaling (most often the same one), at each length, on one metric, Holm-adjusted at `alpha`."""

    path: Path
    metric: str
    lengths: tuple[int, ...]
    comparisons: tuple[tuple[str, str, str, str], ...]  # (a, scaling of a, b, scaling of b)
    alpha: float
    resamples: int  # bootstrap replicates of every interval in the report

    @property
    def size(self) -> int:
        return len(self.comparisons) * len(self.lengths)


def load_family(path: Path) -> Family:
    """The family file, or a `DataError` naming what is missing or wrong in it."""
    if not path.is_file():
        raise DataError(f"--family {path}: no such file")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path))
    except yaml.YAMLError as e:  # OmegaConf parses with PyYAML
        raise DataError(f"--family {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    try:
        comparisons = tuple(_comparison(c) for c in raw["comparisons"])
        family = Family(path, str(raw["metric"]), tuple(int(x) for x in raw["lengths"]), comparisons,
                        float(raw["alpha"]), int(raw.get("bootstrap_resamples", BOOTSTRAP_RESAMPLES)))
        methods = (raw.get("adjust"), raw.get("test"), raw.get("interval"))
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"--family {path} needs metric, lengths, comparisons (a, b, and scaling or "
                        f"scaling_a and scaling_b) and alpha "
                        f"({type(e).__name__}: {e})") from None
    if methods != ("holm", "exact_permutation_over_seeds", "cluster_bootstrap"):
        raise DataError(f"--family {path}: this report implements adjust: holm, "
                        "test: exact_permutation_over_seeds, interval: cluster_bootstrap")
    if family.metric not in METRICS or not family.comparisons or not family.lengths:
        raise DataError(f"--family {path}: metric must be one of {', '.join(METRICS)}, "
                        "with at least one comparison and one length")
    return family


def _comparison(entry: dict) -> tuple[str, str, str, str]:
    """(a, scaling of a, b, scaling of b) of one `comparisons` entry: `scaling` for both sides, or
    `scaling_a` and `scaling_b`; a KeyError for an entry with neither, or with both."""
    if "scaling" in entry and ("scaling_a" in entry or "scaling_b" in entry):
        raise KeyError(f"{entry}: give scaling, or scaling_a and scaling_b, not both")
    both = entry.get("scaling")
    scaling_a, scaling_b = (both, both) if both is not None else (entry["scaling_a"], entry["scaling_b"])
    return str(entry["a"]), str(scaling_a), str(entry["b"]), str(scaling_b)


def family_tests(cells: Cells, boots: Bootstraps, family: Family) -> list[dict]:
    """One row per comparison and length, Holm-adjusted over the whole pre-registered family.

    A cell without runs of both designs is listed as not tested and enters Holm's adjustment with
    p = 1, so the family keeps the size it was registered with (m = comparisons x lengths): the
    other tests are adjusted no less than planned.
    """
    rows = []
    for a, scaling_a, b, scaling_b in family.comparisons:
        for length in family.lengths:
            row = {"a": a, "b": b, "scaling": scaling_a, "scaling_b": scaling_b, "length": length}
            setups = cells.get((family.metric, length), {})
            if (a, scaling_a) in setups and (b, scaling_b) in setups:
                pair = compare_pair(cells, boots, family.metric, length, (a, scaling_a), (b, scaling_b))
                row |= {"tested": True, **pair}
            else:
                row |= {"tested": False, "n_a": len(setups.get((a, scaling_a), [])),
                        "n_b": len(setups.get((b, scaling_b), [])), "p": math.nan}
            rows.append(row)
    return adjust_family(rows, family.alpha)


def adjust_family(rows: list[dict], alpha: float) -> list[dict]:
    """Holm over a family's test rows, in place: `p_holm` and `significant` on each. A row not
    tested enters with p = 1, so the family keeps the size it was registered with."""
    adjusted, reject = stats.holm([r["p"] if r["tested"] else 1.0 for r in rows], alpha)
    for r, p_holm, significant in zip(rows, adjusted, reject):
        r["p_holm"] = float(p_holm) if r["tested"] else math.nan
        r["significant"] = bool(significant) and r["tested"]
    return rows


def detectable(rows: Sequence[dict], family: Family) -> list[dict]:
    """Per comparison and length: the smallest difference it could detect
    (`stats.detectable_difference` at Holm's first-step level, from that cell's pooled seed SD: the
    spread differs between lengths, so one value per length), and the smallest p its seed counts
    allow against that level."""
    out = []
    for r in rows:
        row = {"a": r["a"], "b": r["b"], "scaling": r["scaling"], "scaling_b": r["scaling_b"], "length": r["length"],
               "level": family.alpha / family.size}
        if r["tested"] and not math.isnan(r["pooled_sd"]):
            row |= {"n_a": r["n_a"], "n_b": r["n_b"], "pooled_sd": r["pooled_sd"],
                    "detectable": stats.detectable_difference(r["pooled_sd"], r["n_a"], r["n_b"], family.alpha,
                                                              family.size),
                    "smallest_p": stats.smallest_p(r["n_a"], r["n_b"])}
        out.append(row)
    return out


# ----------------------------------------------------------------------------- exploratory


def significance(cells: Cells, boots: Bootstraps, family: Family | None = None,
                 train_lens: dict[str, int | None] | None = None) -> list[dict]:
    """Every pair of setups that share their scaling, and every setup with a scaling against
    every setup as trained (the paper's question is whether a design with a scaling keeps what it
    or another design loses without one), per metric and length, except the family's own tests:
    effect, interval and permutation p, unadjusted (exploratory). `a` carries `scaling`, `b`
    carries `scaling_b`. Perplexity ratios are compared only between designs of one training
    length (`train_lens`, by design): each ratio's base is its own design's training length."""
    registered = set()
    if family is not None:
        registered = {(family.metric, length, frozenset({(a, sa), (b, sb)}))
                      for a, sa, b, sb in family.comparisons for length in family.lengths}
    out = []
    for (metric, length), setups in cells.items():
        for first, second in combinations(setups, 2):
            if first[1] != second[1]:
                if NONE not in (first[1], second[1]):
                    continue
                if first[1] == NONE:  # the setup with the scaling first
                    first, second = second, first
            if (metric, length, frozenset({first, second})) in registered:
                continue
            if metric == "ppl_ratio" and train_lens and train_lens.get(first[0]) != train_lens.get(second[0]):
                continue
            t = compare_pair(cells, boots, metric, length, first, second)
            out.append({"metric": metric, "scaling": first[1], "scaling_b": second[1], "length": length,
                        "a": first[0], "b": second[0], **t, "significant": t["p"] < ALPHA})
    return out


def attention_summary(runs: Iterable[tuple[str, dict]]) -> list[dict]:
    """Mean and sample SD over seeds of each attention statistic, per design, scaling and layer."""
    values: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    for design, results in runs:
        for r in results.get("attention", {}).get("rows", []):
            values[(design, r["scaling"], r["layer"])].append(r)
    out = []
    for (design, scaling, layer), rows in values.items():
        row = {"label": label(design, scaling), "layer": layer, "n": len(rows)}
        for key in ATTENTION_STATS:
            row[key] = float(np.mean([r[key] for r in rows]))
            row[f"{key}_sd"] = stats.sample_sd([r[key] for r in rows])
        out.append(row)
    return out
