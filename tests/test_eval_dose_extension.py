"""The dose report's tests for the dose extension study (conf/study/dose_extension.yaml): per-test
doses, growth by t-test, the depth interaction, the sink retention read from attention.json and its
per-chain rank correlation with the ratio, each against a definition written here in float64
(ranks, variances and Welch's df by hand; scipy only for the t distribution's tail)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
from test_eval_dose import study_config

from data.config import DataError
from eval import dose, dose_fit

DOSES = (100, 200, 400)
SEEDS = (1, 2, 3, 4)


def _folder(root: Path, design: str, steps: int, seed: int, ratio: float, shares: tuple[float, float] | None,
            layers: int = 2) -> Path:
    """A published run: config (the study preset, `layers` layers), ppl.json with the ratio at 4096
    and 512 (a third of its excess), attention.json whose heads give the first token `shares` =
    (at 256, past 256 of 4096) on average over two layers and two heads."""
    path = root / f"{design}_d{steps}_s{seed}"
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(study_config(steps, seed, layers))
    rows = [{"scaling": "none", "length": n, "ppl": 30.0 * r}
            for n, r in ((256, 1.0), (512, 1.0 + (ratio - 1.0) / 3), (4096, ratio))]
    (path / "ppl.json").write_text(json.dumps({"meta": {"train_len": 256, "seed": seed}, "rows": rows}))
    if shares is not None:
        heads = []
        for layer, head, spread in ((1, 1, 0.5), (1, 2, 1.5), (2, 1, 0.8), (2, 2, 1.2)):  # spreads average 1
            heads.append({"scaling": "none", "length": 256, "layer": layer, "head": head,
                          "sink_share": shares[0] * spread, "sink_share_beyond": None})
            heads.append({"scaling": "none", "length": 4096, "layer": layer, "head": head,
                          "sink_share": 0.5, "sink_share_beyond": shares[1] * spread})
        (path / "attention.json").write_text(json.dumps({"heads": heads}))
    return path


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("dose_extension")
    rng = np.random.default_rng(11)
    truth: dict[tuple[str, int, int], tuple[float, float]] = {}  # (design, dose, seed) -> (ratio, retention)
    for design, slope, keep in (("origin", 1.0, -0.4), ("coca", 0.3, -0.2)):
        for seed in SEEDS:
            for steps in DOSES:
                ratio = 1.0 + slope * steps / 100 + 0.2 * float(rng.standard_normal())
                retention = keep * steps / 100 + 0.8 * float(rng.standard_normal())  # rho varies by chain
                at_1x = 0.05 + 0.01 * seed
                _folder(root, design, steps, seed, ratio, (at_1x, at_1x * math.exp(retention)))
                truth[(design, steps, seed)] = (ratio, retention)
    for design, shift in (("origin_l4", 0.9), ("coca_l4", 0.2)):
        for seed in SEEDS:
            ratio = 1.5 + shift + 0.15 * float(rng.standard_normal())
            _folder(root, design, 200, seed, ratio, None, layers=4)
            truth[(design, 200, seed)] = (ratio, math.nan)
    family = root / "family.yaml"
    family.write_text("""metric: ppl_ratio
doses: [100, 200, 400]
alpha: 0.05
adjust: holm
bootstrap_resamples: 2000
family:
  - {test: difference, a: coca, b: origin, length: 4096, scaling: none, dose: 400}
  - {test: growth, design: origin, length: 4096, scaling: none, low: 200, top: 400, method: t}
  - {test: interaction, a: coca_l4, b: origin_l4, dose: 200, a0: coca, b0: origin, dose0: 100, length: 4096,
     scaling: none}
  - {test: difference, metric: sink_retention, a: coca, b: origin, length: 4096, scaling: none, dose: 400}
  - {test: correlation, metric: sink_retention, design: origin, length: 4096, scaling: none}
""")
    runs = [dose.load_run(path) for path in sorted(root.iterdir()) if path.is_dir()]
    return runs, dose.load_family(family), truth


def _ranks(x: list[float]) -> list[float]:
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    for rank, i in enumerate(order):
        ranks[i] = float(rank + 1)
    return ranks


def _pearson(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    return sxy / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))


def _var(x: list[float]) -> float:
    m = sum(x) / len(x)
    return sum((v - m) ** 2 for v in x) / (len(x) - 1)


def _one_sample_t_p(x: list[float]) -> float:
    t = (sum(x) / len(x)) / math.sqrt(_var(x) / len(x))
    return 2 * scipy.stats.t.sf(abs(t), len(x) - 1)


def test_depth_variants_keep_their_names_and_count_their_parameters(study):
    runs, _, _ = study
    by_name = {(r.design, r.dose, r.seed): r for r in runs}
    two, four = by_name[("origin", 200, 1)], by_name[("origin_l4", 200, 1)]
    assert four.non_embedding > 1.9 * two.non_embedding and four.tokens == two.tokens
    assert four.tokens_per_param < 0.53 * two.tokens_per_param


def test_sink_retention_is_the_log_of_the_mean_shares(study):
    runs, _, truth = study
    for r in runs:
        expected = truth[(r.design, r.dose, r.seed)][1]
        got = r.value("sink_retention", "none", 4096)
        assert (got is None) if math.isnan(expected) else got == pytest.approx(expected, abs=1e-12)
    assert runs[0].value("sink_retention", "none", 512) is None  # no attention statistics at 512


def test_each_new_test_is_its_definition(study):
    runs, family, truth = study
    rows = dose.family_tests(runs, family)
    assert [r["test"] for r in rows] == ["difference", "growth", "interaction", "difference (sink_retention)",
                                         "correlation (sink_retention)"]
    ratio = {key: value[0] for key, value in truth.items()}
    retention = {key: value[1] for key, value in truth.items()}

    diff = rows[0]
    coca, origin = ([ratio[(d, 400, s)] for s in SEEDS] for d in ("coca", "origin"))
    assert diff["dose"] == 400 and diff["effect"] == pytest.approx(sum(coca) / 4 - sum(origin) / 4, abs=1e-12)
    assert diff["n_a"] == diff["n_b"] == 4 and diff["p"] == pytest.approx(2 / 70)  # separated: the exact floor

    g = [ratio[("origin", 400, s)] - ratio[("origin", 200, s)] for s in SEEDS]
    assert rows[1]["dose"] == "400-200" and rows[1]["effect"] == pytest.approx(sum(g) / 4, abs=1e-12)
    assert rows[1]["p"] == pytest.approx(_one_sample_t_p(g), rel=1e-9) and rows[1]["smallest_p"] == 0.0

    groups = [[ratio[(d, n, s)] for s in SEEDS] for d, n in (("coca_l4", 200), ("origin_l4", 200), ("coca", 100),
                                                              ("origin", 100))]
    means = [sum(x) / len(x) for x in groups]
    effect = means[0] - means[1] - means[2] + means[3]
    parts = [_var(x) / len(x) for x in groups]
    df = sum(parts) ** 2 / sum(v * v / (len(x) - 1) for v, x in zip(parts, groups))
    p = 2 * scipy.stats.t.sf(abs(effect) / math.sqrt(sum(parts)), df)
    inter = rows[2]
    assert inter["a"] == "coca_l4 - origin_l4" and inter["b"] == "coca - origin" and inter["dose"] == "200 vs 100"
    assert inter["effect"] == pytest.approx(effect, abs=1e-12) and inter["p"] == pytest.approx(p, rel=1e-9)
    assert inter["n_a"] == inter["n_b"] == 8 and inter["low"] < effect < inter["high"]

    sink = rows[3]
    kept, lost = ([retention[(d, 400, s)] for s in SEEDS] for d in ("coca", "origin"))
    assert sink["effect"] == pytest.approx(sum(kept) / 4 - sum(lost) / 4, abs=1e-12)

    rhos = [_pearson(_ranks([ratio[("origin", n, s)] for n in DOSES]), _ranks([retention[("origin", n, s)]
                                                                               for n in DOSES])) for s in SEEDS]
    corr = rows[4]
    assert corr["dose"] == "every" and corr["n_a"] == 4
    assert corr["effect"] == pytest.approx(sum(rhos) / 4, abs=1e-12)
    assert _var(rhos) > 0 and corr["p"] == pytest.approx(_one_sample_t_p(rhos), rel=1e-9)
    assert all(r["p_holm"] >= r["p"] for r in rows if r["tested"])


def test_a_t_test_of_equal_values_is_not_run():
    """Every chain's rho -1 (or every growth equal): t is undefined, so the row enters untested (p 1)."""
    row = dose._one_group([-1.0, -1.0, -1.0], "k", 100, 5, 0.05, method="t")
    assert row["tested"] is False and math.isnan(row["p"])


def test_the_report_says_the_sinks_and_the_new_kinds(study, tmp_path):
    runs, family, _ = study
    md = dose.write(runs, tmp_path / "report", family, [], 4096, 256)[0].read_text()
    assert "`interaction`: (a - b at the first dose)" in md and "`correlation`: the mean over chains" in md
    assert "## The first token's attention share (sink), as trained" in md
    assert f"gives {np.mean(1 / np.arange(1, 257)):.4f} and {np.mean(1 / np.arange(257, 4097)):.5f}" in md


@pytest.mark.parametrize("test, needle", [
    ("{test: interaction, a: coca_l4, b: origin_l4, length: 4096, scaling: none}", "interaction names a, b at dose"),
    ("{test: correlation, design: origin, length: 4096, scaling: none}", "a correlation relates the ppl ratio"),
    ("{test: growth, design: origin, metric: sink_retention, length: 4096, scaling: none}", "interaction read"),
    ("{test: difference, a: coca, b: origin, metric: loss, length: 4096, scaling: none}", "metric is one of"),
    ("{test: growth, design: origin, method: z, length: 4096, scaling: none}", "method sign_flip or t"),
])
def test_a_malformed_new_test_is_refused_naming_it(test, needle, tmp_path):
    family = tmp_path / "family.yaml"
    family.write_text(f"metric: ppl_ratio\ndoses: [100]\nalpha: 0.05\nadjust: holm\nfamily:\n  - {test}\n")
    with pytest.raises(DataError, match="needs doses, alpha") as refused:
        dose.load_family(family)
    assert needle in str(refused.value)


def test_attention_statistics_without_a_head_field_are_one_line_naming_the_file(tmp_path):
    path = _folder(tmp_path, "origin", 100, 1, 1.5, (0.05, 0.01))
    (path / "attention.json").write_text(json.dumps({"heads": [{"scaling": "none", "sink_share": 0.1}]}))
    with pytest.raises(DataError, match="attention.json is not a `python -m eval task=attention` result"):
        dose.load_run(path)


def test_the_registered_family_file_loads():
    family = dose.load_family(Path(__file__).resolve().parents[1] / "conf" / "study" / "dose_extension.yaml")
    assert len(family.tests) == 9 and family.doses == (750, 1500, 3000, 6000, 12000)


# ---- the exploratory fit (eval.dose_fit) ----------------------------------------------------------------------


def _law_run(design: str, steps: int, seed: int, excess: float) -> dose.DoseRun:
    """A run at `steps` x 1000 tokens over 100 non-embedding parameters whose ratio at 512 and 4096 is
    1 + `excess`."""
    ratios = {("none", 512): 1 + excess, ("none", 4096): 1 + excess}
    return dose.DoseRun(design, steps, seed, 256, steps * 1000, 100, ratios)


def test_the_fit_is_the_least_squares_line_of_log_excess_on_log_tokens(study):
    """Against scipy's linregress in float64 over the same points (every chain run as trained), and the
    value at the target is 1 + exp(the line there); the depth arms (one dose) are not fitted."""
    runs, _, truth = study
    rows = dose_fit.fit_rows(runs, [512, 4096], 256, 165.0, 500)
    assert {(r["design"], r["length"]) for r in rows} == {(d, n) for d in ("origin", "coca") for n in (512, 4096)}
    for row in rows:
        here = [r for r in runs if r.design == row["design"] and r.ratios[("none", row["length"])] > 1]
        x = np.log([r.tokens / r.non_embedding for r in here])
        y = np.log([r.ratios[("none", row["length"])] - 1 for r in here])
        want = scipy.stats.linregress(x, y)
        assert row["slope"] == pytest.approx(want.slope, rel=1e-12, abs=1e-12)
        assert row["ratio_at_target"] == pytest.approx(1 + math.exp(want.intercept + want.slope * math.log(165.0)),
                                                       rel=1e-12)
        assert row["runs"] == len(here) and row["dropped"] == len(SEEDS) * len(DOSES) - len(here)
        assert row["slope_low"] < row["slope_high"] and row["target_low"] < row["target_high"]
    assert rows == dose_fit.fit_rows(list(reversed(runs)), [512, 4096], 256, 165.0, 500)  # fixed generators


def test_an_exact_power_law_is_recovered_and_its_bootstrap_has_no_spread():
    """ratio - 1 = 0.02 x (tokens per parameter)^0.8 on every seed: slope 0.8, the ratio at 165 the law's,
    every resample the same line; one seed gives no interval; a ratio at or below 1 is left out, counted."""
    law = [_law_run(d, s, seed, 0.02 * (s * 10) ** (0.8 if d == "origin" else 0.3))
           for d in ("origin", "coca") for s in (75, 150, 300) for seed in (1, 2, 3)]
    rows = {r["design"]: r for r in dose_fit.fit_rows(law, [4096], 256, 165.0, 200)}
    assert rows["origin"]["slope"] == pytest.approx(0.8, abs=1e-12)
    assert rows["origin"]["ratio_at_target"] == pytest.approx(1 + 0.02 * 165 ** 0.8, rel=1e-12)
    assert rows["origin"]["target_low"] == pytest.approx(rows["origin"]["target_high"], rel=1e-12)
    assert rows["coca"]["slope_low"] == pytest.approx(0.3, abs=1e-12) and rows["origin"]["resamples_used"] == 200
    one_seed = [r for r in law if r.seed == 1] + [_law_run("origin", 600, 1, -0.01)]
    (row,) = [r for r in dose_fit.fit_rows(one_seed, [4096], 256, 165.0, 200) if r["design"] == "origin"]
    assert row["dropped"] == 1 and row["runs"] == 3 and math.isnan(row["target_low"])
    assert row["slope"] == pytest.approx(0.8, abs=1e-12)


def test_bootstrap_fits_skip_resamples_of_one_dose_and_repeat_exactly():
    """Two chains of one dose each: a resample drawing the same chain twice has one dose (no line)."""
    by_seed = {1: [(0.0, 0.0)], 2: [(1.0, 2.0)]}
    fits = dose_fit.bootstrap_fits(by_seed, "k", 400)
    assert 0 < len(fits) < 400 and all(f.slope == pytest.approx(2.0) for f in fits)
    assert fits == dose_fit.bootstrap_fits(by_seed, "k", 400)


def test_fit_to_adds_the_labelled_section_and_is_checked(study, tmp_path):
    runs, family, _ = study
    plain = dose.write(runs, tmp_path / "plain", family, [], 4096, 256)
    assert "## Fit of" not in plain[0].read_text() and not (tmp_path / "plain" / "dose_fit.csv").exists()
    assert (tmp_path / "plain" / "dose_sink.png").is_file()
    md = dose.write(runs, tmp_path / "fit", family, [], 4096, 256, fit_to=165.0)[0].read_text()
    assert "## Fit of log(ratio - 1) against log tokens per parameter (exploratory; at 165: extrapolated)" in md
    assert md.index("## Everything below is exploratory") < md.index("## Fit of")
    assert (tmp_path / "fit" / "dose_fit.png").is_file() and (tmp_path / "fit" / "dose_fit.csv").is_file()



@pytest.mark.parametrize("bad", ["0", "-3", "nan", "inf"])
def test_fit_to_must_be_a_positive_number(study, tmp_path, capsys, bad):
    _, family, _ = study
    folders = sorted(str(p) for p in family.path.parent.glob("*_d*_s*"))
    assert dose.main([*folders, "--fit-to", bad, "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --fit-to {float(bad):g}: tokens per parameter must be positive"]
    assert not (tmp_path / "out" / "dose_report.md").exists()
