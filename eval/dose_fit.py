"""The dose report's exploratory fit (`python -m eval.dose ... --fit-to N`): how a design's excess
perplexity ratio beyond the training length scales with training, and what that scaling says at a
dose far past the runs, as a labelled extrapolation.

Per design trained at two doses or more (the chains; a depth arm at one dose is not fitted), as
trained: ordinary least squares of log(ratio - 1) on log(training tokens per non-embedding
parameter), each run one point, so a straight line is a power law in the excess, ratio - 1 =
A x (tokens per parameter)^slope. A run whose ratio is at or below 1 has no logarithm: it is left
out and counted. Intervals are 95% seed bootstraps: whole chains (every dose of a seed) resampled
with replacement, refitted; a resample with fewer than two doses is skipped.

Nothing here is tested for significance: the fit is a description of the runs' curve, and its value
at N (e.g. the paper's 165 tokens per non-embedding parameter) assumes the curve keeps its shape
there, at the runs' depth, which no run shows. The paper's own ratios are drawn beside it for scale,
not as a target: its model has 24 layers to the runs' 2 or 4.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from eval import stats
from eval.aggregate import BOOTSTRAP_SEED, NONE


class DoseRun(Protocol):
    """What the fit reads of a published run (`eval.dose.DoseRun`)."""

    design: str
    dose: int
    seed: int
    ratios: dict[tuple[str, int], float]

    @property
    def tokens_per_param(self) -> float: ...

    def sink_retention(self, scaling: str, length: int) -> float | None: ...

# The paper's PG-19 perplexity for its 350M models trained at 512 tokens (Zhu et al. 2023, Table 1),
# as a ratio to its perplexity at 512: at 2x (1K) and 16x (8K), by multiple of the training length.
PAPER_RATIOS = {2: {"origin": 411.50 / 19.66, "coca": 33.47 / 20.11},
                16: {"origin": 3028.0 / 19.66, "coca": 157.38 / 20.11}}


@dataclass(frozen=True)
class Fit:
    """One design's line at one length: log(ratio - 1) = intercept + slope x log(tokens per parameter)."""

    slope: float
    intercept: float

    def ratio(self, tokens_per_param: float | np.ndarray) -> float | np.ndarray:
        return 1.0 + np.exp(self.intercept + self.slope * np.log(tokens_per_param))


def least_squares(x: np.ndarray, y: np.ndarray) -> Fit:
    """The least-squares line through (x, y): slope = cov(x, y) / var(x)."""
    dx = x - x.mean()
    slope = float((dx * (y - y.mean())).sum() / (dx * dx).sum())
    return Fit(slope, float(y.mean() - slope * x.mean()))


def points(runs: Sequence[DoseRun], design: str, length: int) -> tuple[dict[int, list[tuple[float, float]]], int]:
    """{seed: [(log tokens per parameter, log(ratio - 1)), ...]} of the design's runs as trained at
    `length`, and how many runs were left out for a ratio at or below 1."""
    by_seed: dict[int, list[tuple[float, float]]] = {}
    dropped = 0
    for r in runs:
        ratio = r.ratios.get((NONE, length)) if r.design == design else None
        if ratio is None:
            continue
        if ratio <= 1.0:
            dropped += 1
            continue
        by_seed.setdefault(r.seed, []).append((math.log(r.tokens_per_param), math.log(ratio - 1.0)))
    return {seed: sorted(by_seed[seed]) for seed in sorted(by_seed)}, dropped  # the runs' order changes nothing


def _fit_of(chains: Sequence[list[tuple[float, float]]]) -> Fit | None:
    xy = np.array([p for chain in chains for p in chain], dtype=np.float64)
    if len(xy) < 2 or len(np.unique(xy[:, 0])) < 2:
        return None
    return least_squares(xy[:, 0], xy[:, 1])


def bootstrap_fits(by_seed: dict[int, list[tuple[float, float]]], key: str, resamples: int) -> list[Fit]:
    """The fit of each seed-bootstrap resample (chains drawn with replacement), from a generator named
    by `key`; resamples whose chains hold fewer than two doses are skipped."""
    seeds = sorted(by_seed)
    rng = np.random.default_rng(np.random.SeedSequence(BOOTSTRAP_SEED, spawn_key=(zlib.crc32(key.encode()),)))
    draws = rng.integers(0, len(seeds), size=(resamples, len(seeds)))
    fits = (_fit_of([by_seed[seeds[i]] for i in draw]) for draw in draws)
    return [f for f in fits if f is not None]


def fit_rows(runs: Sequence[DoseRun], lengths: Sequence[int], train_len: int, target: float,
             resamples: int) -> list[dict]:
    """Per chain design and length: the runs and seeds fitted, the doses, the slope and the ratio the
    line gives at `target` tokens per parameter with their 95% seed-bootstrap intervals (NaN from one
    seed), the paper's ratio at that multiple of the training length where it has one."""
    rows = []
    for design in sorted({r.design for r in runs}):
        doses = sorted({r.dose for r in runs if r.design == design})
        if len(doses) < 2:
            continue
        for length in lengths:
            by_seed, dropped = points(runs, design, length)
            fit = _fit_of(list(by_seed.values()))
            if fit is None:
                continue
            key = f"fit|{design}|{length}"
            fits = bootstrap_fits(by_seed, key, resamples) if len(by_seed) > 1 else []
            slope_low = slope_high = at_low = at_high = math.nan
            if fits:
                slope_low, slope_high = stats.percentile_interval(np.array([f.slope for f in fits]))
                at_low, at_high = stats.percentile_interval(np.array([f.ratio(target) for f in fits]))
            top = max(r.tokens_per_param for r in runs if r.design == design)
            rows.append({"design": design, "length": length, "multiple": length // train_len,
                         "runs": sum(len(c) for c in by_seed.values()), "seeds": len(by_seed), "dropped": dropped,
                         "doses": " ".join(map(str, doses)), "slope": fit.slope, "slope_low": slope_low,
                         "slope_high": slope_high, "intercept": fit.intercept, "top_tokens_per_param": top,
                         "ratio_at_top": float(fit.ratio(top)), "target": target,
                         "ratio_at_target": float(fit.ratio(target)), "target_low": at_low, "target_high": at_high,
                         "paper": PAPER_RATIOS.get(length // train_len, {}).get(design, math.nan),
                         "resamples_used": len(fits)})
    return rows


def figure(runs: Sequence[DoseRun], rows: Sequence[dict], train_len: int, resamples: int):
    """A panel per length: each run's ratio - 1 against tokens per parameter (both log axes), each
    design's fitted line with its 95% seed band, solid over the doses run and dashed on to the target
    (the extrapolation), and the paper's ratio at the target as a star."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.plots import design_color

    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.2 * len(lengths), 4.0), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for row in (r for r in rows if r["length"] == length):
            design, color = row["design"], design_color(row["design"])
            by_seed, _ = points(runs, design, length)
            xy = np.exp(np.array([p for chain in by_seed.values() for p in chain]))
            ax.scatter(xy[:, 0], xy[:, 1], s=10, color=color, alpha=0.55, linewidths=0)
            fit = Fit(row["slope"], row["intercept"])
            low = min(xy[:, 0])
            grid = np.exp(np.linspace(math.log(low), math.log(row["target"]), 60))
            inside = grid <= row["top_tokens_per_param"] * (1 + 1e-9)
            excess = fit.ratio(grid) - 1.0
            ax.plot(grid[inside], excess[inside], "-", color=color, label=f"{design}: slope {row['slope']:.2f}")
            ax.plot(grid[~inside], excess[~inside], "--", color=color, alpha=0.8)
            fits = bootstrap_fits(by_seed, f"fit|{design}|{length}", resamples) if row["seeds"] > 1 else []
            if fits:
                band = np.array([f.ratio(grid) - 1.0 for f in fits])
                ax.fill_between(grid, *np.percentile(band, [2.5, 97.5], axis=0), color=color, alpha=0.15,
                                linewidth=0)
            if row["paper"] == row["paper"]:
                ax.scatter([row["target"]], [row["paper"] - 1.0], marker="*", s=90, color=color, edgecolors="k",
                           linewidths=0.5, label=f"paper's {design} (350M, 24 layers)", zorder=3)
        ax.axvline(rows[0]["target"], color="0.6", lw=0.8, ls=":")
        ax.set(xscale="log", yscale="log", xlabel="training tokens per non-embedding parameter",
               ylabel=f"perplexity ratio - 1 at {length} (/ at {train_len})",
               title=f"{length // train_len}x the training length, as trained")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Exploratory fit; dashed: extrapolated to {rows[0]['target']:g} tokens per parameter", fontsize=9)
    fig.tight_layout()
    return fig


def sink_figure(runs: Sequence[DoseRun], length: int, train_len: int, even: float):
    """Each run's ratio at `length` against its sink retention there (log of the first token's share past
    the training length over its share at it), as trained; one colour per design, one marker per dose.
    `even`: the retention of attention spread evenly over the keys (a vertical line; 0: the share kept)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.plots import design_color

    markers = "osD^v<>pPX"
    doses = sorted({r.dose for r in runs})
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    for design in sorted({r.design for r in runs}):
        for dose in doses:
            here = [r for r in runs if r.design == design and r.dose == dose
                    and r.sink_retention(NONE, length) is not None and (NONE, length) in r.ratios]
            if here:
                ax.scatter([r.sink_retention(NONE, length) for r in here], [r.ratios[(NONE, length)] for r in here],
                           s=22, color=design_color(design), marker=markers[doses.index(dose) % len(markers)],
                           label=f"{design}, {dose} steps", alpha=0.8, linewidths=0)
    ax.axvline(even, color="0.5", lw=0.8, ls=":", label="an even spread over the keys")
    ax.set(xlabel=f"sink retention at {length}: log(share past {train_len} / share at {train_len})",
           ylabel=f"perplexity ratio at {length} (/ at {train_len})", title="Sink retention and the ratio, per run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
