"""The study's statistics: effect, interval, test, correction and power, for per-seed accuracies.

The unit of replication is the seed (a trained model); within a seed, the evaluation cases are a
sample of prompts. A cell holds, for each design, one array of case values per seed (passkey: 1
or 0 per case; recall: the share of a case's queries answered; perplexity ratio: one value per
seed). These functions are what `eval.aggregate` applies to every cell; `conf/study/comparisons.yaml`
names the cells whose tests form the pre-registered family.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from itertools import combinations

import numpy as np
from scipy import stats as sps
from statsmodels.stats.multitest import multipletests

Seeds = Sequence[np.ndarray]  # one array of case values per seed
LEVEL = 0.95
POWER = 0.8
MAX_RELABELLINGS = 2_000_000  # C(22, 11) = 705432: 11 seeds each still fits


def seed_values(seeds: Seeds) -> np.ndarray:
    """Each seed's value: the mean of its case values (its accuracy on its own prompts)."""
    return np.array([np.mean(s) for s in seeds], dtype=float)


def mean_difference(a: Sequence[float], b: Sequence[float]) -> float:
    """The effect: mean of a's per-seed values minus mean of b's.

    Seeds are weighted equally, not cases: a seed is one trained model, and the question is about
    designs (what a new seed of each would do), so every model counts once whatever its case count.
    """
    return float(np.mean(a) - np.mean(b))


def sample_sd(values: Sequence[float]) -> float:
    """Sample standard deviation (n - 1 in the denominator); NaN for a single value."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else math.nan


def bootstrap_means(seeds: Seeds, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`resamples` cluster-bootstrap replicates of one design's seed mean.

    Each replicate draws the design's seeds with replacement, then, independently for every
    drawn seed, as many cases as that seed has, with replacement from its cases; the replicate is
    the mean of the drawn seeds' case means. Resampling both levels puts both sources of
    uncertainty in the interval: which models training produced (seeds) and which prompts they
    were scored on (cases). A seed drawn twice gets two independent case resamples.

    The case level is drawn as counts: n draws with replacement from a seed's n cases add up to
    sum_k c_k * v_k over its distinct values v_k, with (c_k) ~ Multinomial(n, share of cases equal
    to v_k). That is the same distribution as drawing case indices, with work per distinct value
    instead of per case (a passkey seed has 2 distinct values).
    """
    counts = np.array([len(s) for s in seeds])
    if len(seeds) == 0 or counts.min() == 0:
        raise ValueError("a bootstrap needs at least one seed with at least one case")
    levels = np.unique(np.concatenate([np.asarray(s, float) for s in seeds]))
    shares = np.array([[np.mean(np.asarray(s, float) == v) for v in levels] for s in seeds])
    n_seeds = len(seeds)
    chunk = max(1, 2_000_000 // (n_seeds * len(levels)))  # bounds the (chunk, seeds, levels) arrays
    out = np.empty(resamples)
    for start in range(0, resamples, chunk):
        b = min(chunk, resamples - start)
        drawn = rng.integers(0, n_seeds, size=(b, n_seeds))
        n = counts[drawn]
        drawn_counts = rng.multinomial(n, shares[drawn])
        out[start: start + b] = ((drawn_counts @ levels) / n).mean(axis=1)
    return out


def percentile_interval(replicates: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval of bootstrap replicates: it stays inside the range the statistic can
    take (an accuracy interval inside [0, 1]), unlike mean +- t * SE on bounded values. With few
    seeds it is too narrow (3 seeds give 10 distinct seed draws); the report says how many seeds
    each cell has. For a difference a - b, pass a's replicates minus b's, each design resampled
    with its own generator (independent trainings: `eval.aggregate.Bootstraps`)."""
    low, high = np.percentile(replicates, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


@lru_cache(maxsize=32)
def _relabellings(n_a: int, n_b: int) -> np.ndarray:
    """0/1 matrix, one row per way to choose which n_a of the n_a + n_b pooled values are `a`."""
    n = n_a + n_b
    total = math.comb(n, n_a)
    if total > MAX_RELABELLINGS:
        raise ValueError(f"an exact permutation test of {n_a} vs {n_b} seeds has {total} relabellings "
                         f"(more than {MAX_RELABELLINGS}); too many to enumerate")
    member = np.zeros((total, n))
    for row, chosen in enumerate(combinations(range(n), n_a)):
        member[row, list(chosen)] = 1.0
    member.setflags(write=False)
    return member


def permutation_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Exact two-sided permutation p-value for the difference of means of per-seed values.

    Under the null hypothesis that the design does not matter, the seed values are exchangeable
    between the two groups: every one of the C(n_a + n_b, n_a) relabellings of the pooled values
    is equally likely. p is the share of relabellings whose |mean difference| is at least the
    observed one (the observed labelling included, so p >= 1 / C; with equal group sizes the
    mirrored labelling ties it, so p >= 2 / C: 0.1 for 3 vs 3, and 5 seeds each are needed to get
    below 0.05). It assumes no distribution, so it fits bounded values in steps of 1/cases, and it
    is defined for groups with no spread: two constant groups with different means get the exact
    p of their labelling, never 0. Ties in |difference| are counted with a relative tolerance of
    1e-9, since equal differences of float means can differ in the last bits.

    Counting |difference| (rather than doubling the smaller tail, as
    `scipy.stats.permutation_test` does for `two-sided`) is the two-sided test of the effect the
    report states; for unequal group sizes the two differ. Enumeration is one matrix product over a
    cached relabelling matrix, so the ~1000 tests of a report take seconds (scipy's exact mode
    took 3 s for one 10 vs 10 test).
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) == 0 or len(b) == 0:
        raise ValueError("a permutation test needs at least one seed in each group")
    pooled = np.concatenate([a, b])
    member = _relabellings(len(a), len(b))
    sums = member @ pooled
    diffs = sums / len(a) - (pooled.sum() - sums) / len(b)
    observed = abs(a.mean() - b.mean())
    tol = 1e-9 * max(1.0, float(np.abs(pooled).max()))
    return float(np.mean(np.abs(diffs) >= observed - tol))


def smallest_p(n_a: int, n_b: int) -> float:
    """The smallest p `permutation_p` can return for these group sizes (distinct values):
    1 / C(n_a + n_b, n_a), or 2 / C when the groups are the same size (the mirror labelling ties)."""
    return (2.0 if n_a == n_b else 1.0) / math.comb(n_a + n_b, n_a)


def holm(pvalues: Sequence[float], alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Holm's step-down adjustment (statsmodels): adjusted p-values and which reject at `alpha`.

    Holm controls the family-wise error at `alpha` under any dependence between the tests (the
    family's cells share models and prompts), and is uniformly more powerful than Bonferroni.
    """
    reject, adjusted, _, _ = multipletests(np.asarray(pvalues, float), alpha=alpha, method="holm")
    return adjusted, reject


def pooled_sd(a: Sequence[float], b: Sequence[float]) -> float:
    """The pooled sample SD of two groups' per-seed values; NaN without 2 values in one group."""
    dof = len(a) + len(b) - 2
    if dof < 1:
        return math.nan
    ss = sum((len(g) - 1) * float(np.var(g, ddof=1)) for g in (a, b) if len(g) > 1)
    return math.sqrt(ss / dof)


def detectable_difference(sd: float, n_a: int, n_b: int, alpha: float, m: int, power: float = POWER) -> float:
    """The smallest difference of seed means the design detects with `power`, by the normal
    approximation: (z(1 - alpha / (2m)) + z(power)) * sd * sqrt(1/n_a + 1/n_b).

    The level is that of Holm's first step (alpha / m, two-sided), the strictest any family test
    faces: a difference this large is detected even as the family's smallest p. `sd` is the pooled
    seed SD observed in the cell. The approximation treats seed means as normal with known SD; it
    ignores the permutation test's discreteness (below `smallest_p` nothing is significant, however
    large the difference: see the report's minimum-p column) and the case sampling inside a seed.
    """
    z = sps.norm.ppf(1 - alpha / (2 * m)) + sps.norm.ppf(power)
    return float(z * sd * math.sqrt(1 / n_a + 1 / n_b))
