"""The dose-response report: how each design's perplexity ratio beyond the training length moves
with the number of training tokens (launch/reproduce_dose.sh, conf/study/dose.yaml).

Runs are published as `<design>_d<steps>_s<seed>` folders (config.yaml, ppl.json, cost.json,
machine.txt). The metric is the perplexity study's: perplexity at a length over the run's own
perplexity at the training length, one value per run, so the seed is the unit of replication.
With `--family`, the pre-registered tests come first, Holm-adjusted together:

- `difference` (a vs b at one length and scaling, at every dose): the difference of seed means,
  its 95% seed-bootstrap interval, the exact permutation p over seeds;
- `trend` (a vs b): each chain's growth g = ratio at the top dose - ratio at the lowest (one chain
  per design and seed: its doses share their first steps, `branch_from`), compared between the
  designs as above: the mean difference of g is a's effect at the top dose minus at the lowest;
- `growth` (one design): the mean of g, tested by exact sign flips over seeds (the two doses of a
  chain are paired), or with `method: t` by a one-sample t-test (sign flips over 6 seeds cannot go
  below p = 2/64);
- `interaction` (a - b at `dose`) - (a0 - b0 at `dose0`): e.g. a depth arm's gap against the
  2-layer gap at the same tokens per parameter; Welch's t-test on the four groups (Satterthwaite
  df), its interval the seed bootstrap of each group;
- `correlation` (one design): per chain, Spearman's rho across its doses between the ppl ratio and
  the test's metric; the mean rho over chains, one-sample t-test.
A test names its `dose` (a `difference` at that dose alone), its `low` and `top` doses (`trend`,
`growth`; default the family's lowest and top), and its `metric`: `ppl_ratio` (default) or
`sink_retention`, log(S_beyond / S_1x) from the run's attention statistics (attention.json: the
first token's attention share over every layer and head, S_1x on the training-length segment,
S_beyond over the queries past the training length of the test's length).

Every other number (the other lengths, the pairs not registered, `--reference` runs placed on the
figure, `--fit-to`'s power-law fit and its extrapolation: `eval.dose_fit`) is exploratory and
labelled so. The report regenerates byte for byte: fixed bootstrap
generators, rounded numbers.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.cli import OneLineParser
from data.config import DataError, check_dir
from errors import UserError, exit_code, first_line, one_line, report_error
from eval import dose_fit, plots, stats
from eval.aggregate import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, NONE, adjust_family, run_cases
from eval.results import distinct_runs, read_json, result_file, write_csv
from eval.tables import markdown

if TYPE_CHECKING:
    from train.config import TrainConfig

RUN_NAME = re.compile(r"(?P<design>.+)_d(?P<dose>\d+)_s(?P<seed>\d+)")
REFERENCE_NAME = re.compile(r"(?P<design>.+)_s(?P<seed>\d+)")
TESTS = ("difference", "trend", "growth", "interaction", "correlation")
ONE_GROUP = ("growth", "correlation")  # tests of one design's chains
METRICS = ("ppl_ratio", "sink_retention")


@dataclass
class DoseRun:
    """One published run: its design, dose (steps), seed, tokens, and ratio per (scaling, length)."""

    design: str
    dose: int
    seed: int
    train_len: int
    tokens: int
    non_embedding: int
    ratios: dict[tuple[str, int], float]
    cost: dict = field(default_factory=dict)
    machine: str = ""
    sinks: dict[tuple[str, int], tuple[float, float | None]] = field(default_factory=dict)  # (scaling, length) ->
    # the first token's mean attention share over layers, heads and queries (all, past the training length)

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.non_embedding

    def sink_retention(self, scaling: str, length: int) -> float | None:
        """log(S_beyond at `length` / S_1x at the training length), or None without both."""
        whole, beyond = self.sinks.get((scaling, self.train_len), (None, None)), self.sinks.get((scaling, length))
        if whole[0] is None or beyond is None or beyond[1] is None or whole[0] <= 0 or beyond[1] <= 0:
            return None
        return math.log(beyond[1] / whole[0])

    def value(self, metric: str, scaling: str, length: int) -> float | None:
        """The run's `metric` (METRICS) at one scaling and length, or None where it was not measured."""
        if metric == "sink_retention":
            return self.sink_retention(scaling, length)
        return self.ratios.get((scaling, length))


def load_run(path: Path, pattern: re.Pattern = RUN_NAME) -> DoseRun:
    """A published (or local) run folder; `pattern` names its design, dose and seed. A reference
    run (`REFERENCE_NAME`: no dose in its name) has its config's max_steps as its dose, and the
    design its config selects where its folder names none (`text_s1`: Origin on text)."""
    from model.config import count_parameters  # deferred: torch
    from model.designs.registry import DESIGNS, design_of

    match = pattern.fullmatch(path.name)
    if match is None:
        raise DataError(f"{path}: a dose run's folder is named <design>_d<steps>_s<seed>")
    config = path / "config.yaml"
    results = result_file(path, "ppl.json") or result_file(path / "eval", "ppl.json")
    if not config.is_file() or results is None:
        missing = "config.yaml" if not config.is_file() else "ppl.json"
        raise DataError(f"{path}: {missing} is missing (not a finished, evaluated run)")
    cfg = _train_config(config)
    ppl = read_json(results, "delete it and rerun `python -m eval task=ppl` for that run")
    if not (isinstance(ppl, dict) and isinstance(ppl.get("meta"), dict) and "train_len" in ppl["meta"]
            and isinstance(ppl.get("rows"), list)):
        raise DataError(f"{results} is not a `python -m eval` ppl result (needs meta.train_len and a rows list)")
    cases = run_cases({"ppl": ppl})
    ratios = {(scaling, length): float(v.mean()) for (metric, scaling, length), v in cases.items()
              if metric == "ppl_ratio"}
    cost_file = result_file(path, "cost.json")
    cost = read_json(cost_file, "rewrite it or delete it") if cost_file else {}
    machine = (path / "machine.txt").read_text().strip().splitlines() if (path / "machine.txt").is_file() else []
    steps = int(match.group("dose")) if "dose" in pattern.groupindex else cfg.max_steps
    design = match.group("design")
    if design not in DESIGNS and "dose" not in pattern.groupindex:  # a dose run keeps its name (a variant's)
        design = design_of(cfg.model.attention, cfg.model.design_params).key
    attention = result_file(path, "attention.json") or result_file(path / "eval", "attention.json")
    sinks = _sink_shares(read_json(attention, "delete it and rerun `python -m eval task=attention` for that run"),
                         attention) if attention else {}
    return DoseRun(design, steps, int(match.group("seed")), cfg.model.max_seq_len,
                   steps * cfg.batch_size * cfg.model.max_seq_len, count_parameters(cfg.model)["non_embedding"],
                   ratios, cost, machine[-1] if machine else "", sinks)


def _sink_shares(result: object, path: Path) -> dict[tuple[str, int], tuple[float, float | None]]:
    """(scaling, length) -> the first token's share averaged over layers and heads (each head's over
    its queries), over all queries and over those past the training length (None where none are)."""
    heads = result.get("heads") if isinstance(result, dict) else None
    try:
        cells: dict[tuple[str, int], list[dict]] = {}
        for head in heads:
            cells.setdefault((str(head["scaling"]), int(head["length"])), []).append(head)
        out = {}
        for key, rows in cells.items():
            beyond = [r["sink_share_beyond"] for r in rows]
            out[key] = (float(np.mean([r["sink_share"] for r in rows])),
                        None if None in beyond else float(np.mean(beyond)))
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path} is not a `python -m eval task=attention` result (its heads need scaling, "
                        f"length, sink_share and sink_share_beyond; {type(e).__name__}: {e})") from None
    return out


def _train_config(path: Path) -> TrainConfig:
    """A run's saved config.yaml as this code's `TrainConfig`, or a `DataError` naming the file."""
    from train.config import to_train_config  # deferred: torch

    try:
        raw = OmegaConf.load(path)
        if not isinstance(raw, DictConfig):
            raise ValueError("not a mapping of settings")
        return to_train_config(raw)
    except yaml.MarkedYAMLError as e:
        why = f"not YAML: {e.problem} at line {e.problem_mark.line + 1}" if e.problem_mark else f"not YAML: {e}"
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        why = f"not YAML: {first_line(e)}"
    except (UserError, OmegaConfBaseException, ValueError, TypeError) as e:
        why = f"not a run's config: {one_line(e)}"
    raise DataError(f"{path} is {why}")


# ----------------------------------------------------------------------------- the family


@dataclass(frozen=True)
class DoseFamily:
    path: Path
    doses: tuple[int, ...]
    tests: tuple[dict, ...]
    alpha: float
    resamples: int


def load_family(path: Path) -> DoseFamily:
    if not path.is_file():
        raise DataError(f"--family {path}: no such file")
    try:
        raw = yaml.safe_load(path.read_text())
        tests = tuple(dict(t) for t in raw["family"])
        family = DoseFamily(path, tuple(sorted(int(d) for d in raw["doses"])), tests, float(raw["alpha"]),
                            int(raw.get("bootstrap_resamples", BOOTSTRAP_RESAMPLES)))
        for t in tests:
            if t["test"] not in TESTS or not {"length", "scaling"} <= set(t):
                raise ValueError(f"{t}: test must be one of {', '.join(TESTS)}, with length and scaling")
            one = t["test"] in ONE_GROUP
            if one != ("design" in t) or (not one) != ({"a", "b"} <= set(t)):
                raise ValueError(f"{t}: growth and correlation name a design; the others name a and b")
            if t["test"] == "interaction" and not {"a0", "b0", "dose", "dose0"} <= set(t):
                raise ValueError(f"{t}: interaction names a, b at dose and a0, b0 at dose0")
            metric = t.get("metric", "ppl_ratio")
            if metric not in METRICS or t.get("method", "sign_flip") not in ("sign_flip", "t"):
                raise ValueError(f"{t}: metric is one of {', '.join(METRICS)}; method sign_flip or t")
            # a difference reads either metric; a correlation relates the ratio to another; the rest read the ratio
            if t["test"] != "difference" and (metric == "ppl_ratio") == (t["test"] == "correlation"):
                raise ValueError(f"{t}: a correlation relates the ppl ratio to another metric; trend, growth and "
                                 "interaction read the ppl ratio")
    except (yaml.YAMLError, AttributeError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"--family {path} needs doses, alpha and a family of tests ({type(e).__name__}: {e})") from None
    if raw.get("metric") != "ppl_ratio" or raw.get("adjust") != "holm":
        raise DataError(f"--family {path}: this report implements metric: ppl_ratio, adjust: holm")
    return family


def _values(runs: Sequence[DoseRun], design: str, dose: int, scaling: str, length: int,
            metric: str = "ppl_ratio") -> dict[int, float]:
    """Seed -> `metric` (the ratio by default) of one design at one dose."""
    found = {r.seed: r.value(metric, scaling, length) for r in runs if r.design == design and r.dose == dose}
    return {seed: value for seed, value in found.items() if value is not None}


def growth(runs: Sequence[DoseRun], design: str, low: int, top: int, scaling: str, length: int) -> dict[int, float]:
    """Seed -> ratio at the top dose minus at the lowest, for the seeds that have both."""
    at_low, at_top = (_values(runs, design, d, scaling, length) for d in (low, top))
    return {seed: at_top[seed] - at_low[seed] for seed in sorted(at_low.keys() & at_top.keys())}


def chain_correlations(runs: Sequence[DoseRun], design: str, metric: str, scaling: str,
                       length: int) -> dict[int, float]:
    """Seed -> Spearman's rho across the chain's doses between the ppl ratio and `metric`, for the
    chains with both at three doses or more (rho of a constant is undefined: such a chain is left out)."""
    out = {}
    for seed in sorted({r.seed for r in runs if r.design == design}):
        pairs = [(r.ratios.get((scaling, length)), r.value(metric, scaling, length))
                 for r in sorted(runs, key=attrgetter("dose")) if r.design == design and r.seed == seed]
        pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
        if len(pairs) >= 3 and len({x for x, _ in pairs}) > 1 and len({y for _, y in pairs}) > 1:
            out[seed] = float(stats.sps.spearmanr(*zip(*pairs)).statistic)
    return out


def sign_flip_p(values: Sequence[float]) -> float:
    """Exact two-sided p of a mean of paired differences: the share of the 2^n sign assignments
    whose |mean| is at least the observed one (observed included, so p >= 2 / 2^n)."""
    x = np.asarray(values, float)
    if len(x) == 0:
        raise ValueError("a sign-flip test needs at least one seed")
    signs = np.array(list(product((1.0, -1.0), repeat=len(x))))
    means = np.abs(signs @ x) / len(x)
    tol = 1e-9 * max(1.0, float(np.abs(x).max()))
    return float(np.mean(means >= abs(x.mean()) - tol))


def _bootstrap(values: Sequence[float], key: str, resamples: int) -> np.ndarray:
    """Seed-bootstrap replicates of a mean, from a generator named by `key` (order-independent)."""
    rng = np.random.default_rng(np.random.SeedSequence(BOOTSTRAP_SEED, spawn_key=(zlib.crc32(key.encode()),)))
    return stats.bootstrap_means([np.array([v]) for v in values], resamples, rng)


def _interval_of_mean(values: Sequence[float], key: str, resamples: int) -> tuple[float, float]:
    """95% seed-bootstrap interval of a mean; NaNs for a single seed (its spread is unknown)."""
    if len(values) < 2:
        return math.nan, math.nan
    return stats.percentile_interval(_bootstrap(values, key, resamples))


def _two_groups(a: Sequence[float], b: Sequence[float], key: str, resamples: int, m: int, alpha: float) -> dict:
    row = {"n_a": len(a), "n_b": len(b)}
    if not a or not b:
        return row | {"tested": False, "p": math.nan}
    diff = stats.mean_difference(a, b)
    low = high = math.nan
    if len(a) > 1 and len(b) > 1:
        replicates = _bootstrap(a, key + "|a", resamples) - _bootstrap(b, key + "|b", resamples)
        low, high = stats.percentile_interval(replicates)
    sd = stats.pooled_sd(a, b)
    return row | {"tested": True, "effect": diff, "low": low, "high": high, "p": stats.permutation_p(a, b),
                  "smallest_p": stats.smallest_p(len(a), len(b)),
                  "detectable": stats.detectable_difference(sd, len(a), len(b), alpha, m) if sd == sd else math.nan}


def _z(alpha: float, m: int) -> float:
    """Holm's first level, two-sided, plus 80% power: the detectable effect in standard errors."""
    return float(stats.sps.norm.ppf(1 - alpha / (2 * m)) + stats.sps.norm.ppf(stats.POWER))


def _one_group(g: Sequence[float], key: str, resamples: int, m: int, alpha: float, method: str = "sign_flip") -> dict:
    row = {"n_a": len(g), "n_b": len(g)}
    sd = stats.sample_sd(g) if g else math.nan
    if not g or (method == "t" and not sd > 0):  # t undefined (one chain, or all equal): not tested (p = 1)
        return row | {"tested": False, "p": math.nan}
    low, high = _interval_of_mean(g, key, resamples)
    detectable = float(_z(alpha, m) * sd / math.sqrt(len(g))) if sd == sd else math.nan
    if method == "t":
        p, smallest = float(stats.sps.ttest_1samp(g, 0.0).pvalue), 0.0
    else:
        p, smallest = sign_flip_p(g), 2.0 / 2 ** len(g)
    return row | {"tested": True, "effect": float(np.mean(g)), "low": low, "high": high, "p": p,
                  "smallest_p": smallest, "detectable": detectable}


def _interaction(groups: Sequence[Sequence[float]], key: str, resamples: int, m: int, alpha: float) -> dict:
    """(mean a - mean b) - (mean a0 - mean b0) of four independent seed groups: Welch's t-test
    (Satterthwaite df), the seed bootstrap of each group for the interval."""
    a, b, a0, b0 = groups
    row = {"n_a": len(a) + len(b), "n_b": len(a0) + len(b0)}
    if min(map(len, groups)) < 2:
        return row | {"tested": False, "p": math.nan}
    signs = (1.0, -1.0, -1.0, 1.0)
    effect = sum(sign * float(np.mean(g)) for sign, g in zip(signs, groups))
    parts = [stats.sample_sd(g) ** 2 / len(g) for g in groups]
    se = math.sqrt(sum(parts))
    df = sum(parts) ** 2 / sum(v ** 2 / (len(g) - 1) for v, g in zip(parts, groups))
    p = float(2 * stats.sps.t.sf(abs(effect) / se, df)) if se > 0 else math.nan
    replicates = sum(sign * _bootstrap(g, f"{key}|{i}", resamples) for i, (sign, g) in enumerate(zip(signs, groups)))
    low, high = stats.percentile_interval(replicates)
    return row | {"tested": se > 0, "effect": effect, "low": low, "high": high, "p": p, "smallest_p": 0.0,
                  "detectable": _z(alpha, m) * se}


def family_tests(runs: Sequence[DoseRun], family: DoseFamily) -> list[dict]:
    """One row per registered test (a `difference` once per dose), Holm-adjusted together; a test
    without runs enters with p = 1, so the family keeps its registered size."""
    planned = [(t, dose) for t in family.tests
               for dose in ((t["dose"],) if "dose" in t else family.doses if t["test"] == "difference" else (None,))]
    m, rows = len(planned), []
    for t, dose in planned:
        scaling, length, metric = str(t["scaling"]), int(t["length"]), t.get("metric", "ppl_ratio")
        low, top = int(t.get("low", family.doses[0])), int(t.get("top", family.doses[-1]))
        name = t["test"] if metric == "ppl_ratio" else f"{t['test']} ({metric})"
        key = f"{t['test']}|{t.get('a', t.get('design'))}|{t.get('b')}|{dose}|{scaling}|{length}"
        if metric != "ppl_ratio":
            key += f"|{metric}"
        row = {"test": name, "a": t.get("a", t.get("design")), "b": t.get("b", ""), "dose": dose or f"{top}-{low}",
               "scaling": scaling, "length": length}
        args = (key, family.resamples, m, family.alpha)
        if t["test"] == "difference":
            a, b = (list(_values(runs, t[k], dose, scaling, length, metric).values()) for k in ("a", "b"))
            row |= _two_groups(a, b, *args)
        elif t["test"] == "trend":
            a, b = (list(growth(runs, t[k], low, top, scaling, length).values()) for k in ("a", "b"))
            row |= _two_groups(a, b, *args)
        elif t["test"] == "growth":
            row |= _one_group(list(growth(runs, t["design"], low, top, scaling, length).values()), *args,
                              method=t.get("method", "sign_flip"))
        elif t["test"] == "interaction":
            row |= {"a": f"{t['a']} - {t['b']}", "b": f"{t['a0']} - {t['b0']}", "dose": f"{dose} vs {t['dose0']}"}
            groups = [list(_values(runs, t[k], d, scaling, length).values())
                      for k, d in (("a", dose), ("b", dose), ("a0", t["dose0"]), ("b0", t["dose0"]))]
            row |= _interaction(groups, *args)
        else:
            row["dose"] = "every"
            row |= _one_group(list(chain_correlations(runs, t["design"], metric, scaling, length).values()), *args,
                              method="t")
        rows.append(row)
    return adjust_family(rows, family.alpha)


# ----------------------------------------------------------------------------- summaries


def summary(runs: Sequence[DoseRun], resamples: int) -> list[dict]:
    """Per design, dose, scaling and length: seeds, tokens per parameter, mean ratio, its SD and
    95% seed-bootstrap interval."""
    rows = []
    cells = sorted({(r.design, r.dose, s, n) for r in runs for (s, n) in r.ratios},
                   key=lambda c: (c[0], c[1], c[2] != NONE, c[2], c[3]))
    for design, dose, scaling, length in cells:
        here = [r for r in runs if r.design == design and r.dose == dose and (scaling, length) in r.ratios]
        values = [r.ratios[(scaling, length)] for r in here]
        low, high = _interval_of_mean(values, f"{design}|{dose}|{scaling}|{length}", resamples)
        rows.append({"design": design, "dose": dose, "tokens_per_param": here[0].tokens_per_param, "scaling": scaling,
                     "length": length, "n": len(values), "mean": float(np.mean(values)),
                     "sd": stats.sample_sd(values), "low": low, "high": high})
    return rows


def value_rows(runs: Sequence[DoseRun]) -> list[dict]:
    return [{"design": r.design, "dose": r.dose, "seed": r.seed, "tokens": r.tokens, "non_embedding": r.non_embedding,
             "tokens_per_param": r.tokens_per_param, "scaling": scaling, "length": length, "ratio": ratio}
            for r in sorted(runs, key=lambda r: (r.design, r.dose, r.seed))
            for (scaling, length), ratio in sorted(r.ratios.items(), key=lambda kv: (kv[0][0] != NONE, kv[0]))]


def cost_rows(runs: Sequence[DoseRun]) -> list[dict]:
    return [{"run": f"{r.design}_d{r.dose}_s{r.seed}", "train_s": r.cost.get("train_s", math.nan),
             "eval_s": r.cost.get("eval_s", math.nan), "machine": r.machine}
            for r in sorted(runs, key=lambda r: (r.design, r.dose, r.seed))]


def _reference_cells(reference: Sequence[DoseRun], design: str, scaling: str,
                     length: int) -> list[tuple[int, list[float], list[int]]]:
    """(steps, values, seeds) of one design's reference runs, per number of steps."""
    out = []
    for steps in sorted({r.dose for r in reference if r.design == design}):
        here = [r for r in reference if r.design == design and r.dose == steps and (scaling, length) in r.ratios]
        if here:
            out.append((steps, [r.ratios[(scaling, length)] for r in here], [r.seed for r in here]))
    return out


def reference_rows(runs: Sequence[DoseRun], reference: Sequence[DoseRun], lengths: Sequence[int]) -> list[dict]:
    """Reference runs (another schedule, from scratch) beside the WSD runs of the same design and
    steps: each side's seed mean and SD, the difference of means, and the paired difference over
    the seeds both have (a WSD run and a reference run of one seed share data order and init)."""
    rows = []
    for design in sorted({r.design for r in reference}):
        for scaling in sorted({s for r in reference for (s, _) in r.ratios}, key=lambda s: (s != NONE, s)):
            for length in lengths:
                for steps, ref_values, ref_seeds in _reference_cells(reference, design, scaling, length):
                    wsd = _values(runs, design, steps, scaling, length)
                    if not wsd:
                        continue
                    paired = [wsd[s] - v for s, v in zip(ref_seeds, ref_values) if s in wsd]
                    ours = list(wsd.values())
                    rows.append({"design": design, "steps": steps, "scaling": scaling, "length": length,
                                 "n_wsd": len(ours), "wsd_mean": float(np.mean(ours)), "wsd_sd": stats.sample_sd(ours),
                                 "n_reference": len(ref_values), "reference_mean": float(np.mean(ref_values)),
                                 "reference_sd": stats.sample_sd(ref_values),
                                 "difference": float(np.mean(ours) - np.mean(ref_values)),
                                 "paired_seeds": len(paired),
                                 "paired_difference": float(np.mean(paired)) if paired else math.nan})
    return rows


# ----------------------------------------------------------------------------- the figure


def figure(runs: Sequence[DoseRun], reference: Sequence[DoseRun], length: int, train_len: int, resamples: int):
    """The ratio at `length` against training tokens per non-embedding parameter (log axis), one
    line per design with its 95% seed band and seeds as dots, a panel per scaling; reference runs
    (another schedule, e.g. the published cosine study) as hollow markers with their interval."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    from eval.plots import design_color

    scalings = sorted({s for r in runs for (s, n) in r.ratios if n == length}, key=lambda s: (s != NONE, s))
    fig, axes = plt.subplots(1, len(scalings), figsize=(5.2 * len(scalings), 3.8), squeeze=False, sharey=True)
    for ax, scaling in zip(axes[0], scalings):
        for design in sorted({r.design for r in runs}):
            color = design_color(design)
            doses = sorted({r.dose for r in runs if r.design == design})
            points = []
            for dose in doses:
                here = [r for r in runs if r.design == design and r.dose == dose and (scaling, length) in r.ratios]
                if not here:
                    continue
                values = [r.ratios[(scaling, length)] for r in here]
                x = here[0].tokens_per_param
                ax.scatter([x] * len(values), values, s=9, color=color, alpha=0.45, linewidths=0)
                low, high = _interval_of_mean(values, f"{design}|{dose}|{scaling}|{length}", resamples)
                points.append((x, float(np.mean(values)), low, high))
            if points:
                xs, means, lows, highs = map(np.array, zip(*points))
                ax.plot(xs, means, "-o", color=color, label=f"{design} (WSD)", markersize=4)
                ax.fill_between(xs, lows, highs, color=color, alpha=0.18, linewidth=0)
            for i, (steps, values, _) in enumerate(_reference_cells(reference, design, scaling, length)):
                low, high = _interval_of_mean(values, f"ref|{design}|{steps}|{scaling}|{length}", resamples)
                mean = float(np.mean(values))
                x = next(r.tokens_per_param for r in reference if r.design == design and r.dose == steps)
                ax.errorbar([x], [mean], yerr=[[mean - low], [high - mean]] if len(values) > 1 else None, fmt="D",
                            mfc="none", color=color, capsize=3,
                            label=f"{design}, reference runs (cosine)" if i == 0 else None)
        ax.set_xscale("log")
        ax.set_xticks(sorted({r.tokens_per_param for r in runs}))  # one tick per dose
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:.3g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("training tokens per non-embedding parameter")
        ax.set_title("as trained" if scaling == NONE else f"+ {scaling}")
        ax.axhline(1.0, color="0.6", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"perplexity at {length} / at {train_len}")
    legend: dict = {}  # every panel's entries once: a design trained at one dose may be in one panel only
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    axes[0][0].legend(legend.values(), legend.keys(), fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- the report


def _num(x: float, digits: int = 3) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def _p(x: float) -> str:
    return "n/a" if x != x else f"{x:.2g}"


def _interval(mean: float, low: float, high: float, signed: bool = False) -> str:
    sign = "+" if signed else ""
    if low != low:
        return f"{mean:{sign}.3f}"
    return f"{mean:{sign}.3f} [{low:{sign}.3f}, {high:{sign}.3f}]"


EXTRA_KINDS = (  # the family table's further kinds, each said where a family uses it
    ("t", "`growth` with method t: a one-sample t-test over the chains, no exact floor."),
    ("interaction", "`interaction`: (a - b at the first dose) - (a0 - b0 at the second), Welch's t-test over the "
                    "four seed groups; seeds: a's and b's / a0's and b0's."),
    ("correlation", "`correlation`: the mean over chains of Spearman's rho across a chain's doses between the "
                    "ratio and the metric, one-sample t-test; seeds: the chains with three doses or more."),
    ("sink_retention", "`sink_retention`: log(S_beyond / S_1x), the first token's attention share past the "
                       "training length of the test's length over its share at the training length (0: kept)."),
)


def sink_rows(runs: Sequence[DoseRun], length: int) -> list[dict]:
    """Per design and dose, as trained: the first token's share at the training length and past it
    at `length`, and the sink retention's seed mean and SD."""
    rows = []
    for design, dose in sorted({(r.design, r.dose) for r in runs if r.sinks}):
        here = [r for r in runs if r.design == design and r.dose == dose and r.sink_retention(NONE, length) is not None]
        if not here:
            continue
        retention = [r.sink_retention(NONE, length) for r in here]
        rows.append({"design": design, "dose": dose, "tokens_per_param": here[0].tokens_per_param, "n": len(here),
                     "share_1x": float(np.mean([r.sinks[(NONE, r.train_len)][0] for r in here])),
                     "share_beyond": float(np.mean([r.sinks[(NONE, length)][1] for r in here])),
                     "retention": float(np.mean(retention)), "retention_sd": stats.sample_sd(retention)})
    return rows


def _uniform_share(first: int, last: int) -> float:
    """The first token's share averaged over queries first..last of a row spread evenly over its keys."""
    return float(np.mean(1.0 / np.arange(first + 1, last + 2)))


def write(runs: Sequence[DoseRun], out: Path, family: DoseFamily | None, reference: Sequence[DoseRun],
          length: int, train_len: int, fit_to: float | None = None) -> list[Path]:
    """The report, its tables and figures; `fit_to`: add the exploratory fit (`eval.dose_fit`) at 2x
    and at `length`, extrapolated to that many tokens per non-embedding parameter."""
    resamples = family.resamples if family else BOOTSTRAP_RESAMPLES
    out.mkdir(parents=True, exist_ok=True)
    order = attrgetter("design", "dose", "seed")  # the report does not depend on the order runs are given in
    runs, reference = sorted(runs, key=order), sorted(reference, key=order)
    rows = summary(runs, resamples)
    written = [write_csv(out / "dose_values.csv", value_rows(runs)), write_csv(out / "dose_summary.csv", rows),
               write_csv(out / "dose_cost.csv", cost_rows(runs))]
    lines = ["# Dose-response report", "",
             f"{len(runs)} runs: " + ", ".join(f"{d} {sorted({r.dose for r in runs if r.design == d})}"
                                             for d in sorted({r.design for r in runs})) +
             f" (steps). Metric: perplexity at the length / at {train_len}, one value per run; intervals are "
             "95% seed-bootstrap intervals of the seed mean.", ""]
    if family is not None:
        tests = family_tests(runs, family)
        written.append(write_csv(out / "dose_family.csv", tests))
        lines += [f"## The pre-registered family ({family.path.name}, {len(tests)} tests, Holm at {family.alpha})", "",
                  markdown(["test", "a", "b", "dose", "scaling", "length", "seeds", "effect [95% interval]", "p",
                            "Holm p", "detectable", "smallest p"],
                           [[t["test"], t["a"], t["b"] or "-", t["dose"], t["scaling"], t["length"],
                             t["n_a"] if t["test"].split()[0] in ONE_GROUP else f"{t['n_a']} / {t['n_b']}",
                             _interval(t["effect"], t["low"], t["high"], signed=True) if t["tested"] else "not run",
                             _p(t["p"]), _p(t["p_holm"]), _num(t.get("detectable", math.nan)),
                             _p(t.get("smallest_p", math.nan))] for t in tests]), "",
                  "`difference`: a - b of seed means at that dose; `trend`: (a - b at the top dose) - (a - b at the "
                  "lowest), from each chain's growth; `growth`: the design's ratio at the top dose - at the lowest, "
                  "paired by seed (exact sign flips). `detectable`: the smallest effect the test detects with 80% "
                  "power at Holm's first level, from the observed seed SD.", ""]
        used = {value for t in family.tests for value in (t["test"], t.get("method"), t.get("metric"))}
        extra = [sentence for kind, sentence in EXTRA_KINDS if kind in used]
        lines += ([" ".join(extra), ""] if extra else []) + ["## Everything below is exploratory", ""]
    lines += ["## Ratio per design, dose, scaling and length", "",
              markdown(["design", "dose", "tokens / param", "scaling", "length", "seeds", "mean [95% interval]", "SD"],
                       [[r["design"], r["dose"], _num(r["tokens_per_param"], 2), r["scaling"], r["length"], r["n"],
                         _interval(r["mean"], r["low"], r["high"]), _num(r["sd"])] for r in rows]), "",
              *_sink_section(runs, length, train_len)]
    if sink_rows(runs, length):
        even = math.log(_uniform_share(train_len, length - 1) / _uniform_share(0, train_len - 1))
        png = plots.save(dose_fit.sink_figure(runs, length, train_len, even), out / "dose_sink.png", tight=False)
        written.append(png)
        lines += [f"![ratio against sink retention at {length}, per run]({png.name})", ""]
    if fit_to is not None:
        fits = dose_fit.fit_rows(runs, sorted({2 * train_len, length}), train_len, fit_to, resamples)
        written.append(write_csv(out / "dose_fit.csv", fits))
        lines += _fit_section(fits, fit_to)
        if fits:
            png = plots.save(dose_fit.figure(runs, fits, train_len, resamples), out / "dose_fit.png", tight=False)
            written.append(png)
            lines += [f"![ratio - 1 against training tokens, fitted and extrapolated]({png.name})", ""]
    lines += ["## Cost per run (wall seconds on the machine named)", "",
              markdown(["run", "train s", "eval s", "machine"],
                       [[c["run"], c["train_s"], c["eval_s"], c["machine"]] for c in cost_rows(runs)]), ""]
    if reference:
        refs = reference_rows(runs, reference, sorted({n for r in runs for (_, n) in r.ratios if n > train_len}))
        written.append(write_csv(out / "dose_reference.csv", refs))
        lines += ["## WSD runs against reference runs of another schedule (cosine, from scratch)", "",
                  f"{len(reference)} reference runs, on the figure as hollow markers. Paired: the mean of "
                  "WSD - reference over the seeds both have (same seed: same data order and initialisation).", "",
                  markdown(["design", "steps", "scaling", "length", "WSD seeds", "WSD mean ± SD", "reference seeds",
                            "reference mean ± SD", "WSD - reference", "paired seeds", "paired difference"],
                           [[r["design"], r["steps"], r["scaling"], r["length"], r["n_wsd"],
                             f"{r['wsd_mean']:.3f} ± {_num(r['wsd_sd'])}", r["n_reference"],
                             f"{r['reference_mean']:.3f} ± {_num(r['reference_sd'])}", f"{r['difference']:+.3f}",
                             r["paired_seeds"], "n/a" if r["paired_seeds"] == 0 else f"{r['paired_difference']:+.3f}"]
                            for r in refs]), ""]
    fig = figure(runs, reference, length, train_len, resamples)
    png = plots.save(fig, out / "dose_ratio.png", tight=False)
    written.append(png)
    lines += [f"![ratio at {length} against training tokens]({png.name})", ""]
    md = out / "dose_report.md"
    md.write_text("\n".join(lines))
    return [md, *written]


def _fit_section(fits: Sequence[dict], target: float) -> list[str]:
    """The exploratory fit's table (eval.dose_fit), labelled as a description and an extrapolation."""
    head = [f"## Fit of log(ratio - 1) against log tokens per parameter (exploratory; at {target:g}: extrapolated)",
            "", "Per chain design, as trained, each run one point; intervals: 95% seed bootstraps of whole "
            f"chains. The ratio at {target:g} tokens per non-embedding parameter is the line carried past the "
            "runs, at their depth: a labelled extrapolation, not a prediction any run supports. The paper's "
            "ratio (350M, 24 layers, PG-19) is shown for scale.", ""]
    if not fits:
        return head + ["No design has runs at two doses yet: nothing is fitted.", ""]
    dropped = sum(f["dropped"] for f in fits)
    return head + [markdown(
        ["design", "length", "runs (seeds)", "doses", "slope [95% interval]", "ratio at the top dose (fitted)",
         f"ratio at {target:g} [95% interval], extrapolated", "paper's ratio"],
        [[f["design"], f"{f['length']} ({f['multiple']}x)", f"{f['runs']} ({f['seeds']})", f["doses"],
          _interval(f["slope"], f["slope_low"], f["slope_high"]),
          f"{f['ratio_at_top']:.3f} at {f['top_tokens_per_param']:.1f}",
          _interval(f["ratio_at_target"], f["target_low"], f["target_high"]), _num(f["paper"], 2)] for f in fits]),
        "", *([f"Left out: {dropped} run(s) with a ratio at or below 1 (no logarithm).", ""] if dropped else [])]


def _sink_section(runs: Sequence[DoseRun], length: int, train_len: int) -> list[str]:
    """The sink table (runs with attention statistics only; none: no section)."""
    sinks = sink_rows(runs, length)
    if not sinks:
        return []
    even = (_uniform_share(0, train_len - 1), _uniform_share(train_len, length - 1))
    return ["## The first token's attention share (sink), as trained", "",
            f"Share on the first token over every layer, head and query: at {train_len} tokens, and over the "
            f"queries past {train_len} of {length}. A row spread evenly over its keys gives {even[0]:.4f} and "
            f"{even[1]:.5f}. Retention: log(past / at {train_len}), seed mean and SD.", "",
            markdown(["design", "dose", "tokens / param", "seeds", f"share at {train_len}", f"share past it, {length}",
                      "retention", "SD"],
                     [[r["design"], r["dose"], _num(r["tokens_per_param"], 2), r["n"], f"{r['share_1x']:.4f}",
                       f"{r['share_beyond']:.5f}", f"{r['retention']:+.3f}", _num(r["retention_sd"])]
                      for r in sinks]), ""]


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0; 1 for an unusable input (a run without results), 2 for a wrong command line."""
    parser = OneLineParser(prog="python -m eval.dose", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="<design>_d<steps>_s<seed> run folders")
    parser.add_argument("--out", type=Path, default=Path("eval_report/dose"), help="output folder")
    parser.add_argument("--family", type=Path, help="the pre-registration (conf/study/dose.yaml)")
    parser.add_argument("--reference", type=Path, nargs="*", default=[],
                        help="<design>_s<seed> runs of another schedule (their steps from their config) to "
                             "place beside the WSD runs (exploratory)")
    parser.add_argument("--length", type=int, default=4096, help="the figure's length (default 16x of 256)")
    parser.add_argument("--fit-to", type=float, metavar="TOKENS_PER_PARAM",
                        help="add the exploratory fit of log(ratio - 1) on log tokens per parameter at 2x and "
                             "--length, extrapolated to this many tokens per non-embedding parameter")
    args: argparse.Namespace = parser.parse_args(argv)
    try:
        check_dir(args.out, "--out")
        if args.fit_to is not None and not (math.isfinite(args.fit_to) and args.fit_to > 0):
            raise DataError(f"--fit-to {args.fit_to:g}: tokens per parameter must be positive")
        family = load_family(args.family) if args.family else None
        distinct_runs([*args.runs, *args.reference])
        runs = [load_run(p) for p in args.runs]
        designs = {r.design for r in runs}
        reference = [r for r in (load_run(p, REFERENCE_NAME) for p in args.reference) if r.design in designs]
        lengths = {n for r in runs for (_, n) in r.ratios}
        if args.length not in lengths:
            raise DataError(f"--length {args.length}: no run was evaluated at it (their lengths: "
                            f"{', '.join(map(str, sorted(lengths)))})")
        train_lens = {r.train_len for r in runs}
        if len(train_lens) != 1:
            raise DataError(f"the runs have different training lengths ({sorted(train_lens)}): one report per length")
        for path in write(runs, args.out, family, reference, args.length, train_lens.pop(), args.fit_to):
            print(path)
    except (FileNotFoundError, ValueError) as e:
        return report_error(e, exit_code(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
