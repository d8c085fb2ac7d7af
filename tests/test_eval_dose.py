"""The dose-response report (`eval.dose`): its registered tests against independent definitions
(exact enumeration written here as loops, Holm by hand), its summaries, and that it regenerates
byte for byte; the launcher's published folders load."""

from __future__ import annotations

import functools
import gzip
import json
import math
import subprocess
import sys
from itertools import combinations, product
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from data.config import DataError
from eval import dose
from train.config import compose

REPO = Path(__file__).resolve().parents[1]
LENGTHS = (256, 1024, 4096)


@functools.cache
def _preset(layers: int) -> str:
    return OmegaConf.to_yaml(compose(["experiment=study_ppl", f"model.n_layer={layers}"]))


def study_config(steps: int, seed: int, layers: int = 2) -> str:
    """The study preset's config.yaml at `steps`, `seed` and `layers`: composed once per depth (Hydra
    takes about 0.3 s a composition), then the two run keys set."""
    cfg = OmegaConf.create(_preset(layers))
    cfg.max_steps, cfg.seed = steps, seed
    return OmegaConf.to_yaml(cfg)


def _run(root: Path, design: str, steps: int, seed: int, ratios: dict[tuple[str, int], float]) -> Path:
    """A published run folder: the study preset's config at `steps`, and ppl.json whose ppl at
    each length is the given ratio times a base perplexity of 40 + seed."""
    path = root / f"{design}_d{steps}_s{seed}"
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(study_config(steps, seed))
    base = 40.0 + seed
    rows = [{"scaling": s, "length": n, "ppl": base * ratios.get((s, n), 1.0)}
            for s in ("none", "dynamic:8") for n in LENGTHS]
    (path / "ppl.json").write_text(json.dumps({"meta": {"train_len": 256, "seed": seed}, "rows": rows}))
    (path / "cost.json").write_text(json.dumps({"train_s": 100 * seed, "eval_s": 7}))
    (path / "machine.txt").write_text("2026-12-04T00:00:00Z a CPU\n")
    return path


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Two designs x 3 seeds x doses 100 and 400 (a chain per seed), one top-only design."""
    root = tmp_path_factory.mktemp("dose")
    rng = np.random.default_rng(3)
    values: dict[tuple[str, int, int, str], float] = {}
    for design, doses, shift in (("origin", (100, 400), 0.3), ("coca", (100, 400), 0.1), ("alibi", (400,), 0.0)):
        for seed in (1, 2, 3):
            for steps in doses:
                ratios = {}
                for scaling in ("none", "dynamic:8"):
                    v = 1.0 + shift * (steps / 400) + 0.05 * float(rng.standard_normal())
                    ratios[(scaling, 4096)] = v
                    ratios[(scaling, 1024)] = 1.0 + (v - 1.0) / 3
                    values[(design, steps, seed, scaling)] = v
                _run(root, design, steps, seed, ratios)
    family = root / "dose.yaml"
    family.write_text("""metric: ppl_ratio
doses: [100, 400]
alpha: 0.05
adjust: holm
bootstrap_resamples: 2000
family:
  - {test: difference, a: coca, b: origin, length: 4096, scaling: none}
  - {test: difference, a: coca, b: origin, length: 4096, scaling: "dynamic:8"}
  - {test: trend, a: coca, b: origin, length: 4096, scaling: none}
  - {test: growth, design: origin, length: 4096, scaling: none}
""")
    return root, family, values


def _exact_two_sample(a: list[float], b: list[float]) -> float:
    pooled, n_a, hits, total = a + b, len(a), 0, 0
    observed = abs(sum(a) / len(a) - sum(b) / len(b))
    for chosen in combinations(range(len(pooled)), n_a):
        x = [pooled[i] for i in chosen]
        y = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        total += 1
        hits += abs(sum(x) / len(x) - sum(y) / len(y)) >= observed - 1e-12
    return hits / total


def _exact_sign_flip(g: list[float]) -> float:
    observed, hits, total = abs(sum(g) / len(g)), 0, 0
    for signs in product((1, -1), repeat=len(g)):
        total += 1
        hits += abs(sum(s * v for s, v in zip(signs, g)) / len(g)) >= observed - 1e-12
    return hits / total


def _holm(ps: list[float]) -> list[float]:
    order, adjusted, running = sorted(range(len(ps)), key=lambda i: ps[i]), [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def test_family_tests_are_the_definitions(study):
    root, family_path, v = study
    runs = [dose.load_run(p) for p in sorted(root.glob("*_d*_s*"))]
    rows = dose.family_tests(runs, dose.load_family(family_path))
    assert [r["test"] for r in rows] == ["difference"] * 4 + ["trend", "growth"]
    seeds = (1, 2, 3)

    def at(design, steps, scaling):
        return [v[(design, steps, s, scaling)] for s in seeds]

    want_p = []
    for row, (steps, scaling) in zip(rows[:4], [(100, "none"), (400, "none"), (100, "dynamic:8"), (400, "dynamic:8")]):
        a, b = at("coca", steps, scaling), at("origin", steps, scaling)
        assert row["dose"] == steps and row["scaling"] == scaling
        assert row["effect"] == pytest.approx(np.mean(a) - np.mean(b), abs=1e-12)
        assert row["p"] == pytest.approx(_exact_two_sample(a, b), abs=1e-12)
        want_p.append(row["p"])
    g = {d: [t - lo for t, lo in zip(at(d, 400, "none"), at(d, 100, "none"))] for d in ("coca", "origin")}
    trend, growth = rows[4], rows[5]
    effect_top = np.mean(at("coca", 400, "none")) - np.mean(at("origin", 400, "none"))
    effect_low = np.mean(at("coca", 100, "none")) - np.mean(at("origin", 100, "none"))
    assert trend["effect"] == pytest.approx(effect_top - effect_low, abs=1e-12)
    assert trend["p"] == pytest.approx(_exact_two_sample(g["coca"], g["origin"]), abs=1e-12)
    assert growth["effect"] == pytest.approx(np.mean(g["origin"]), abs=1e-12)
    assert growth["p"] == pytest.approx(_exact_sign_flip(g["origin"]), abs=1e-12)
    assert growth["smallest_p"] == 2 / 2 ** 3
    want_holm = _holm([r["p"] for r in rows])
    assert [r["p_holm"] for r in rows] == pytest.approx(want_holm, abs=1e-12)
    for r in rows:
        assert r["low"] <= r["effect"] <= r["high"]


def test_a_test_without_runs_keeps_the_family_size(study):
    root, family_path, _ = study
    runs = [dose.load_run(p) for p in sorted(root.glob("origin_d*_s*"))]  # no coca at all
    rows = dose.family_tests(runs, dose.load_family(family_path))
    assert [r["tested"] for r in rows] == [False] * 5 + [True]
    assert rows[-1]["p_holm"] == pytest.approx(min(1.0, 6 * rows[-1]["p"]))


def test_summary_counts_tokens_per_non_embedding_parameter(study):
    root, _, v = study
    run = dose.load_run(root / "origin_d400_s2")
    assert run.tokens == 400 * 16 * 256 and run.train_len == 256
    from model.config import count_parameters
    from train.config import to_train_config
    cfg = to_train_config(compose(["experiment=study_ppl"]))
    assert run.tokens_per_param == run.tokens / count_parameters(cfg.model)["non_embedding"]
    assert run.ratios[("none", 4096)] == pytest.approx(v[("origin", 400, 2, "none")], rel=1e-12)
    row = next(r for r in dose.summary([dose.load_run(p) for p in root.glob("origin_d400_s*")], 500)
               if r["scaling"] == "none" and r["length"] == 4096)
    values = [v[("origin", 400, s, "none")] for s in (1, 2, 3)]
    assert row["n"] == 3 and row["mean"] == pytest.approx(np.mean(values)) and row["sd"] == pytest.approx(
        np.std(values, ddof=1))


def test_report_regenerates_byte_for_byte_and_bad_input_is_one_line(study, tmp_path, capsys):
    root, family_path, _ = study
    runs = sorted(str(p) for p in root.glob("*_d*_s*"))
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        result = subprocess.run([sys.executable, "-m", "eval.dose", *runs, "--family", str(family_path),
                                 "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        outs.append(out)
    files = sorted(p.name for p in outs[0].iterdir() if p.suffix != ".png")
    assert files == ["dose_cost.csv", "dose_family.csv", "dose_report.md", "dose_summary.csv", "dose_values.csv"]
    for name in files:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    report = (outs[0] / "dose_report.md").read_text()
    assert report.index("pre-registered family") < report.index("exploratory")

    # Bad input, through `main` (the command's own exit code and stderr; the process is the one above).
    bad = tmp_path / "not_a_dose_run"
    bad.mkdir()
    assert dose.main([str(bad), "--out", str(tmp_path / "c")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {bad}: a dose run's folder is named <design>_d<steps>_s<seed>"]
    assert dose.main([*runs, "--length", "2048", "--out", str(tmp_path / "d")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --length 2048: no run was evaluated at it (their lengths: 256, 1024, 4096)"]


def test_sign_flip_p_counts_the_observed_assignment():
    assert dose.sign_flip_p([0.1, 0.2, 0.3]) == pytest.approx(2 / 8)
    assert dose.sign_flip_p([0.1, -0.1]) == 1.0
    assert math.isclose(dose.sign_flip_p([1.0] * 10), 2 / 1024)


def test_reference_runs_take_their_steps_from_their_config_and_pair_by_seed(study, tmp_path):
    """A cosine run `origin_s2` of 100 steps sits beside the WSD runs at dose 100: the difference
    of means and the paired difference (seed 2, the one both have) are the definitions."""
    root, _, v = study
    ref = _run(tmp_path, "origin", 100, 2, {("none", 4096): 1.5, ("none", 1024): 1.2})
    ref = ref.rename(tmp_path / "origin_s2")
    run = dose.load_run(ref, dose.REFERENCE_NAME)
    assert (run.design, run.dose, run.seed) == ("origin", 100, 2)
    runs = [dose.load_run(p) for p in sorted(root.glob("origin_d*_s*"))]
    rows = dose.reference_rows(runs, [run], [1024, 4096])
    row = next(r for r in rows if r["scaling"] == "none" and r["length"] == 4096)
    wsd = [v[("origin", 100, s, "none")] for s in (1, 2, 3)]
    assert row["n_wsd"] == 3 and row["n_reference"] == 1 and row["paired_seeds"] == 1
    assert row["difference"] == pytest.approx(np.mean(wsd) - 1.5, abs=1e-12)
    assert row["paired_difference"] == pytest.approx(v[("origin", 100, 2, "none")] - 1.5, abs=1e-12)


def _dose(capsys, *argv) -> tuple[int, list[str]]:
    """`python -m eval.dose` in this process: its exit status and its stderr lines."""
    code = dose.main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def three(study, tmp_path) -> list[Path]:
    """Copies of three of the study's runs (origin at 400 steps, seeds 1-3), free to spoil."""
    root, _, _ = study
    runs = []
    for seed in (1, 2, 3):
        run = tmp_path / f"origin_d400_s{seed}"
        run.mkdir()
        for file in (root / run.name).iterdir():
            (run / file.name).write_bytes(file.read_bytes())
        runs.append(run)
    return runs


def test_a_run_whose_config_is_not_yaml_is_one_line_naming_it(three, tmp_path, capsys):
    (three[1] / "config.yaml").write_text("model: {attention: origin\nseed: [1, 2\n")
    code, err = _dose(capsys, *three, "--out", tmp_path / "out")
    assert code == 1 and len(err) == 1
    assert err[0].startswith(f"error: {three[1] / 'config.yaml'} is not YAML: ")
    (three[1] / "config.yaml").write_text("- a list\n- not settings\n")
    code, err = _dose(capsys, *three, "--out", tmp_path / "out")
    assert code == 1 and err == [f"error: {three[1] / 'config.yaml'} is not a run's config: not a mapping of settings"]


def test_a_run_given_twice_is_refused_by_any_path(three, tmp_path, capsys):
    a, b, _ = three
    code, err = _dose(capsys, a, a, b, "--out", tmp_path / "out")
    assert code == 1 and err == [f"error: run {a} given twice: each run counts once"]
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / a.name).symlink_to(a)
    for alias in (a.parent / ".." / a.parent.name / a.name, other / a.name):  # another spelling, a link
        code, err = _dose(capsys, a, b, alias, "--out", tmp_path / "out")
        assert code == 1 and err == [f"error: run {alias} and {a} are the same run: each run counts once"]
    assert _dose(capsys, a, b, "--out", tmp_path / "out")[0] == 0


def test_a_truncated_result_names_its_file_and_exits_1(three, tmp_path, capsys):
    ppl = three[2] / "ppl.json"
    ppl.write_bytes(ppl.read_bytes()[:-40])
    code, err = _dose(capsys, *three, "--out", tmp_path / "out")
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: {ppl} is not valid JSON (")
    published = ppl.with_name("ppl.json.gz")  # the published form, cut short in a copy
    published.write_bytes(gzip.compress(b'{"meta": {"train_len": 256}, "rows": []}', mtime=0)[:-6])
    ppl.unlink()
    code, err = _dose(capsys, *three, "--out", tmp_path / "out")
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: {published} is not a complete gzip file (")


def test_a_published_run_loads_as_its_plain_copy(three, tmp_path):
    """`eval.publish` writes ppl.json as ppl.json.gz: the same run to the report; republishing gives
    the same bytes, and a folder holding both forms is refused (either could be stale)."""
    from eval import publish
    from eval.results import GZ

    plain = three[0]
    log = '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.5}\n'
    (plain / "metrics.jsonl").write_text(log)  # the training log, published with the results
    copies = []
    for name in ("a", "b"):
        dest = tmp_path / name / plain.name
        assert publish.main([str(dest), *(str(p) for p in sorted(plain.iterdir()))]) == 0
        copies.append(dest)
    assert sorted(p.name for p in copies[0].iterdir()) == ["config.yaml", "cost.json.gz", "machine.txt",
                                                          "metrics.jsonl.gz", "ppl.json.gz"]
    assert all((copies[0] / f).read_bytes() == (copies[1] / f).read_bytes()
               for f in ("ppl.json.gz", "cost.json.gz", "metrics.jsonl.gz"))
    assert gzip.decompress((copies[0] / "metrics.jsonl.gz").read_bytes()).decode() == log
    assert gzip.decompress((copies[0] / "ppl.json.gz").read_bytes()) == (plain / "ppl.json").read_bytes()
    assert dose.load_run(copies[0]) == dose.load_run(plain)
    (copies[0] / "ppl.json").write_bytes((plain / "ppl.json").read_bytes())
    with pytest.raises(DataError, match=f"holds both ppl.json and ppl.json{GZ}"):
        dose.load_run(copies[0])
