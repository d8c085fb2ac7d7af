"""The study's statistics (`eval.stats`, the family of `eval.aggregate`) against hand computations
and textbook values."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from data.config import DataError
from eval import aggregate, stats

# ----------------------------------------------------------------------------- permutation test


def test_permutation_p_three_vs_three_constant_groups_is_a_tenth_never_zero():
    # 20 relabellings; only the observed one and its mirror reach |diff| = 1
    assert stats.permutation_p([1, 1, 1], [0, 0, 0]) == pytest.approx(0.1, abs=1e-15)
    assert stats.smallest_p(3, 3) == pytest.approx(0.1)
    assert stats.permutation_p([0.5, 0.5], [0.5, 0.5, 0.5]) == 1.0  # no spread, same mean


def test_permutation_p_two_vs_two_by_hand():
    # pooled {1, 2, 3, 5}: a = {1,2} -2.5, {1,3} -1.5, {1,5} 0.5, {2,3} -0.5, {2,5} 1.5, {3,5} 2.5
    assert stats.permutation_p([1, 2], [3, 5]) == pytest.approx(2 / 6)  # |d| >= 2.5: 2 of 6
    assert stats.permutation_p([1, 3], [2, 5]) == pytest.approx(4 / 6)  # |d| >= 1.5: 4 of 6
    assert stats.permutation_p([1, 5], [2, 3]) == pytest.approx(1.0)  # |d| >= 0.5: all 6


def test_permutation_p_unequal_groups_counts_absolute_differences():
    # a = [3], b = [0, 0, 0]: a = 3 gives d = 3; a = 0 (3 ways) gives d = 0 - 1 = -1; p = 1 / 4
    assert stats.permutation_p([3], [0, 0, 0]) == pytest.approx(0.25)
    assert stats.smallest_p(1, 3) == pytest.approx(0.25)
    assert stats.smallest_p(10, 5) == pytest.approx(1 / 3003)


def test_permutation_p_matches_scipy_exact_enumeration_of_the_absolute_difference():
    rng = np.random.default_rng(3)
    a, b = rng.random(4), rng.random(6) + 0.3

    def abs_diff(x, y, axis=-1):
        return np.abs(x.mean(axis=axis) - y.mean(axis=axis))

    ref = sps.permutation_test((a, b), abs_diff, permutation_type="independent", vectorized=True,
                               n_resamples=np.inf, alternative="greater").pvalue
    assert stats.permutation_p(a, b) == pytest.approx(ref, abs=1e-12)


def test_permutation_p_refuses_an_empty_group():
    with pytest.raises(ValueError, match="at least one seed"):
        stats.permutation_p([], [1.0])


# ----------------------------------------------------------------------------- Holm


def test_holm_on_a_textbook_example():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> monotone 0.06
    adjusted, reject = stats.holm([0.01, 0.04, 0.03, 0.005], alpha=0.05)
    np.testing.assert_allclose(adjusted, [0.03, 0.06, 0.06, 0.02])
    assert reject.tolist() == [True, False, False, True]


# ----------------------------------------------------------------------------- cluster bootstrap


def test_bootstrap_replicates_have_the_two_level_variance_by_hand():
    """Seeds with accuracies 0.6 (5 cases), 1 (3) and 0 (4). One drawn seed X: its case mean has
    Var X = E[p(1-p)/n] + Var(p) = 0.016 + 0.168889 = 0.184889 (seed, then case resampling); the
    replicate is the mean of 3 draws: mean 1.6/3, variance 0.184889 / 3 = 0.061630."""
    seeds = [np.array([0.0, 1, 1, 0, 1]), np.array([1.0, 1, 1]), np.array([0.0, 0, 0, 0])]
    reps = stats.bootstrap_means(seeds, 200_000, np.random.default_rng(0))
    assert reps.mean() == pytest.approx(1.6 / 3, abs=0.003)  # SE 0.00055
    assert reps.var() == pytest.approx((0.016 + (1.36 / 3 - (1.6 / 3) ** 2)) / 3, abs=0.001)  # SE 0.0002


def _difference_interval(a, b, resamples: int, seed: int) -> tuple[float, float]:
    """The interval of a - b as the report forms it: each design's replicates from its own stream."""
    ra = stats.bootstrap_means(a, resamples, np.random.default_rng([seed, 0]))
    rb = stats.bootstrap_means(b, resamples, np.random.default_rng([seed, 1]))
    return stats.percentile_interval(ra - rb)


def test_bootstrap_interval_contains_the_truth_and_stays_in_range():
    rng = np.random.default_rng(1)
    a = [(rng.random(100) < 0.7).astype(float) for _ in range(10)]
    b = [(rng.random(100) < 0.4).astype(float) for _ in range(10)]
    low, high = _difference_interval(a, b, resamples=10_000, seed=0)
    assert low < 0.3 < high and high - low < 0.2
    assert _difference_interval(a, b, 10_000, seed=0) == (low, high)  # reproducible
    one = stats.percentile_interval(stats.bootstrap_means(a, 10_000, np.random.default_rng(0)))
    assert 0.0 <= one[0] < 0.7 < one[1] <= 1.0


def test_bootstrap_interval_collapses_to_a_point_for_constant_data():
    a = [np.ones(4), np.ones(7), np.ones(2)]
    b = [np.zeros(5), np.zeros(5)]
    assert _difference_interval(a, b, resamples=2000, seed=5) == (1.0, 1.0)


# ----------------------------------------------------------------------------- power


def test_pooled_sd_and_detectable_difference_by_hand():
    # a var 1 (2 dof), b var 2 (1 dof): pooled sqrt((2 + 2) / 3)
    assert stats.pooled_sd([1, 2, 3], [2, 4]) == pytest.approx(math.sqrt(4 / 3))
    assert stats.sample_sd([1, 2, 3]) == pytest.approx(1.0)
    # z(1 - 0.05 / 50) = 3.0902, z(0.8) = 0.8416 (normal tables); sd 0.2, 10 vs 10 seeds
    expected = (3.0902 + 0.8416) * 0.2 * math.sqrt(1 / 10 + 1 / 10)
    assert stats.detectable_difference(0.2, 10, 10, alpha=0.05, m=25) == pytest.approx(expected, abs=1e-4)


# ----------------------------------------------------------------------------- the family


def _cells(setups: dict[tuple[str, str], list[list[float]]], metric: str = "passkey", length: int = 512):
    return {(metric, length): {k: [np.array(v, float) for v in seeds] for k, seeds in setups.items()}}


def test_the_committed_family_is_five_comparisons_at_five_lengths():
    family = aggregate.load_family(aggregate.FAMILY_FILE)
    assert family.size == 25 and family.metric == "passkey" and family.alpha == 0.05
    assert family.lengths == (512, 1024, 2048, 4096, 8192) and family.resamples == 10_000
    assert ("coca", "dynamic:8", "origin", "dynamic:8") in family.comparisons


def test_the_extension_family_is_five_comparisons_at_one_length_some_across_scalings():
    family = aggregate.load_family(aggregate.FAMILY_FILE.with_name("extension.yaml"))
    assert family.size == 5 and family.lengths == (4096,) and family.metric == "passkey"
    assert ("dropin_coca", "none", "coca", "none") in family.comparisons
    assert ("extend_yarn", "none", "continue_origin", "dynamic:8") in family.comparisons


def test_a_family_entry_gives_one_scaling_or_one_per_side(tmp_path: Path):
    family = tmp_path / "family.yaml"
    body = ("metric: passkey\nlengths: [512]\nalpha: 0.05\nadjust: holm\ninterval: cluster_bootstrap\n"
            "test: exact_permutation_over_seeds\ncomparisons:\n")
    family.write_text(body + "  - {a: coca, b: origin, scaling_a: none, scaling_b: 'dynamic:8'}\n")
    assert aggregate.load_family(family).comparisons == (("coca", "none", "origin", "dynamic:8"),)
    for entry in ("{a: coca, b: origin, scaling: none, scaling_b: none}", "{a: coca, b: origin, scaling_a: none}"):
        family.write_text(body + f"  - {entry}\n")
        with pytest.raises(DataError, match="scaling_a and scaling_b"):
            aggregate.load_family(family)


def test_a_bad_family_file_is_one_line_error(tmp_path: Path):
    bad = tmp_path / "family.yaml"
    bad.write_text("metric: passkey\nlengths: [512]\n")
    with pytest.raises(DataError, match="needs metric, lengths, comparisons"):
        aggregate.load_family(bad)
    with pytest.raises(DataError, match="no such file"):
        aggregate.load_family(tmp_path / "missing.yaml")


def test_family_zero_variance_cells_get_the_exact_p_and_holm_keeps_the_registered_size():
    """coca 1, 1, 1 vs origin 0, 0, 0 (both without spread): effect 1 [1, 1], p = 0.1; alibi has no
    runs, so it is not tested and enters Holm as p = 1: adjusted 0.1 * 2 = 0.2, not significant."""
    family = aggregate.Family(Path("f.yaml"), "passkey", (512,),
                              (("coca", "none", "origin", "none"), ("alibi", "none", "origin", "none")), 0.05, 2000)
    cells = _cells({("coca", "none"): [[1, 1]] * 3, ("origin", "none"): [[0, 0, 0]] * 3})
    rows = aggregate.family_tests(cells, aggregate.Bootstraps(cells, 2000), family)
    coca, alibi = rows
    assert coca["tested"] and coca["diff"] == 1.0 and (coca["low"], coca["high"]) == (1.0, 1.0)
    assert coca["p"] == pytest.approx(0.1) and coca["p_holm"] == pytest.approx(0.2)
    assert not coca["significant"]
    assert not alibi["tested"] and math.isnan(alibi["p_holm"]) and not alibi["significant"]
    power = aggregate.detectable(rows, family)
    assert power[0]["smallest_p"] == pytest.approx(0.1) and power[0]["level"] == pytest.approx(0.025)
    assert power[0]["detectable"] == 0.0 and "detectable" not in power[1]  # no spread: any difference


def test_exploratory_pairs_leave_out_the_family_cells():
    family = aggregate.Family(Path("f.yaml"), "passkey", (512,), (("coca", "none", "origin", "none"),), 0.05, 500)
    cells = _cells({("coca", "none"): [[1.0]] * 3, ("origin", "none"): [[0.0]] * 3,
                    ("alibi", "none"): [[0.5]] * 3})
    boots = aggregate.Bootstraps(cells, 500)
    pairs = {frozenset({t["a"], t["b"]}) for t in aggregate.significance(cells, boots, family)}
    assert pairs == {frozenset({"coca", "alibi"}), frozenset({"origin", "alibi"})}
    assert len(aggregate.significance(cells, boots)) == 3  # without a family: every pair


def test_perplexity_ratios_of_different_training_lengths_are_not_paired():
    """A ratio is to the design's own training length: extend (1024) and origin (256) ratios have
    different bases, so no exploratory pair compares them; passkey accuracy has no base."""
    cells = _cells({("extend", "none"): [[1.1]] * 3, ("origin", "none"): [[1.5]] * 3,
                    ("coca", "none"): [[1.4]] * 3}, metric="ppl_ratio")
    cells |= _cells({("extend", "none"): [[1.0]] * 3, ("origin", "none"): [[0.0]] * 3})
    boots = aggregate.Bootstraps(cells, 500)
    lens = {"extend": 1024, "origin": 256, "coca": 256}
    pairs = {(t["metric"], frozenset({t["a"], t["b"]})) for t in aggregate.significance(cells, boots, None, lens)}
    assert pairs == {("ppl_ratio", frozenset({"origin", "coca"})), ("passkey", frozenset({"extend", "origin"}))}
    assert len(aggregate.significance(cells, boots)) == 4  # lengths unknown: every pair


def test_a_family_comparison_across_scalings_tests_a_as_trained_against_b_scaled():
    """extend 1, 1, 1 as trained vs origin + dynamic:8 0, 0, 0: tested (p = 0.1, the 3 vs 3 floor);
    origin as trained (0.5) is not its b, and the pair leaves the exploratory list."""
    family = aggregate.Family(Path("f.yaml"), "passkey", (512,), (("extend", "none", "origin", "dynamic:8"),),
                              0.05, 500)
    cells = _cells({("extend", "none"): [[1.0]] * 3, ("origin", "dynamic:8"): [[0.0]] * 3,
                    ("origin", "none"): [[0.5]] * 3})
    boots = aggregate.Bootstraps(cells, 500)
    (row,) = aggregate.family_tests(cells, boots, family)
    assert row["tested"] and (row["scaling"], row["scaling_b"]) == ("none", "dynamic:8")
    assert row["diff"] == 1.0 and row["p"] == pytest.approx(0.1)
    pairs = {(t["a"], t["scaling"], t["b"], t["scaling_b"]) for t in aggregate.significance(cells, boots, family)}
    assert ("origin", "dynamic:8", "extend", "none") not in pairs and ("extend", "none", "origin", "none") in pairs
    assert aggregate.detectable([row], family)[0]["smallest_p"] == pytest.approx(0.1)


def test_detectable_difference_is_given_per_length_from_that_lengths_spread():
    """Two lengths with different seed spreads: each row's detectable difference is the normal
    approximation (z(1 - alpha / 2m) + z(0.8)) x pooled SD x sqrt(1/n_a + 1/n_b) of its own cell."""
    from scipy.stats import norm

    family = aggregate.Family(Path("f.yaml"), "ppl_ratio", (1024, 4096), (("coca", "none", "origin", "none"),),
                              0.05, 500)
    a4, b4, a16, b16 = [1.0, 1.1, 1.2], [1.3, 1.4, 1.6, 1.5], [1.0, 1.5, 2.0], [1.9, 2.9, 2.4, 1.4]
    cells = _cells({("coca", "none"): [[v] for v in a4], ("origin", "none"): [[v] for v in b4]}, "ppl_ratio", 1024)
    cells |= _cells({("coca", "none"): [[v] for v in a16], ("origin", "none"): [[v] for v in b16]}, "ppl_ratio", 4096)
    rows = aggregate.family_tests(cells, aggregate.Bootstraps(cells, 500), family)
    power = aggregate.detectable(rows, family)
    assert [r["length"] for r in power] == [1024, 4096]
    z = norm.ppf(1 - 0.05 / 4) + norm.ppf(0.8)
    for row, (a, b) in zip(power, ((a4, b4), (a16, b16))):
        squares = (len(a) - 1) * np.var(a, ddof=1) + (len(b) - 1) * np.var(b, ddof=1)
        pooled = math.sqrt(squares / (len(a) + len(b) - 2))
        assert row["pooled_sd"] == pytest.approx(pooled, rel=1e-12)
        assert row["detectable"] == pytest.approx(z * pooled * math.sqrt(1 / 3 + 1 / 4), rel=1e-12)
    assert power[1]["detectable"] > 4 * power[0]["detectable"]
