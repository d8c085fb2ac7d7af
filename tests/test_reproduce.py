"""The reproduction scripts run their whole chain (train -> evaluate -> report) on CPU.

Each test runs the real script (real training processes, real evaluation), shortened: the paper's
in its DRY_RUN mode, the CPU study with a few steps, two seeds and two lengths per task.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TASK_FILES = ("ppl.json", "passkey.json", "attention.json", "report.md", "ppl.png", "passkey.png")
REPORT_FILES = ("compare_report.md", "compare_ppl.csv", "compare_ppl.png", "compare_passkey.csv",
                "compare_passkey.png", "compare_attention.csv")


def run_script(script: str, runs: Path, **env: str) -> str:
    result = subprocess.run(
        ["bash", f"launch/{script}"], cwd=ROOT, capture_output=True, text=True, timeout=1500,
        env={**os.environ, "RUNS": str(runs), "WANDB_MODE": "disabled", **env},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def check_chain(runs: Path, variants: list[str], lengths: list[int], scalings: dict[str, set[str]],
                labels: dict[str, str] | None = None, report_dir: Path | None = None) -> None:
    report_dir = report_dir or runs / "report"
    for v in variants:
        run = runs / v
        assert (run / "DONE").exists() and (run / "config.yaml").exists()
        assert list((run / "checkpoints").glob("*/COMPLETE")), f"{v}: no complete checkpoint"
        for name in TASK_FILES:
            assert (run / "eval" / name).stat().st_size > 0, f"{v}: eval/{name} missing or empty"
        for task, key in (("ppl", "rows"), ("passkey", "cases")):
            rows = json.loads((run / "eval" / f"{task}.json").read_text())[key]
            assert {r["scaling"] for r in rows} == scalings[v], (v, task)
        ppl_rows = json.loads((run / "eval" / "ppl.json").read_text())["rows"]
        assert sorted({r["length"] for r in ppl_rows}) == lengths
        assert all(r["ppl"] > 1 for r in ppl_rows)
    for name in REPORT_FILES:
        assert (report_dir / name).stat().st_size > 0, f"report/{name} missing or empty"
    report = (report_dir / "compare_report.md").read_text()
    for v in variants:
        assert f"| {(labels or LABELS)[v]}" in report, v


LABELS = {"origin": "origin", "alibi": "alibi", "coca": "coca-slack", "coca_strict": "coca-strict"}


ROPE_SWEEP = {"none", "dynamic:2", "dynamic:4", "dynamic:8"}


@pytest.mark.slow
def test_paper_reproduction_dry_run(tmp_path: Path) -> None:
    variants = ["origin", "alibi", "coca", "coca_strict"]
    run_script("reproduce_paper.sh", tmp_path, DRY_RUN="1")
    sweep = {v: ({"none"} if v == "alibi" else ROPE_SWEEP) for v in variants}
    check_chain(tmp_path, variants, [64, 128], sweep)
    # The dry run trains the paper's presets, shrunk: the attention is each preset's own.
    for v in variants:
        cfg = (tmp_path / v / "config.yaml").read_text()
        assert f"name: paper_350m_{v}" in cfg
        assert ("form: strict" in cfg) == (v == "coca_strict")


@pytest.mark.slow
def test_study_shortened(tmp_path: Path) -> None:
    """Two designs x two seeds, two runs at a time: per-run chains, then the seed-aggregated report;
    published results let the study continue without the runs (another machine)."""
    study = dict(DESIGNS="origin alibi", SEEDS="1 2", TEXT_ONLY="0", STEPS="3", RESULTS=str(tmp_path / "results"),
                 SCALINGS="[none,dynamic:2,dynamic:4,dynamic:8]",  # the pilot's sweep (the study's: none, dynamic:8)
                 EVAL="ppl.lengths=[256,512] ppl.n_docs=1 passkey.lengths=[256,512] passkey.n_cases=2 "
                 "recall.lengths=[256,512] recall.n_cases=2 attention.length=512 attention.head_lengths=[256,512]")
    run_script("reproduce_study.sh", tmp_path, **study)
    runs = {f"{v}_s{s}": v for v in ("origin", "alibi") for s in (1, 2)}
    for run, design in runs.items():
        cfg = (tmp_path / run / "config.yaml").read_text()
        assert f"seed: {run[-1]}" in cfg and f"name: study_{design}_s{run[-1]}" in cfg
        recall = json.loads((tmp_path / run / "eval" / "recall.json").read_text())["cases"]
        assert {r["length"] for r in recall} == {256, 512}
    check_chain(tmp_path, list(runs), [256, 512],
                {run: ({"none"} if v == "alibi" else ROPE_SWEEP) for run, v in runs.items()},
                labels={run: LABELS[v] for run, v in runs.items()}, report_dir=tmp_path / "results")
    summary = (tmp_path / "results" / "seeds_summary.csv").read_text()
    assert "origin + dynamic:4" in summary and ",alibi," in summary
    report = (tmp_path / "results" / "seeds_report.md").read_text()
    assert "Seed-aggregated comparison" in report and "| origin | 0 of 2 |" in report  # 3 steps: no bar
    assert not (tmp_path / "results" / "bar_only").exists()  # the post hoc subset is empty: nothing written
    for run in runs:
        progress = (tmp_path / "results" / run / "passkey_progress.md").read_text()
        assert f"| {run}/step_00000003 |" in progress
    summary = (tmp_path / "results" / "seeds_summary.csv").read_text()
    for run in runs:  # a new machine: no runs, only the published results; nothing is retrained
        shutil.rmtree(tmp_path / run)
    run_script("reproduce_study.sh", tmp_path, **study)
    assert not any((tmp_path / run).exists() for run in runs)
    assert (tmp_path / "results" / "seeds_summary.csv").read_text() == summary


HEAD = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                      capture_output=True, text=True, check=True).stdout.strip()

# the statistics of a tiny study family (few resamples)
TINY_TESTS = """alpha: 0.05
adjust: holm
interval: cluster_bootstrap
bootstrap_resamples: 200
test: exact_permutation_over_seeds
"""

TINY_PERPLEXITY = """metric: ppl_ratio
lengths: [512]
comparisons:
  - {a: nope, b: origin, scaling: none}
  - {a: coca_strict, b: origin, scaling: "dynamic:8"}
""" + TINY_TESTS + "seeds: {origin: 2, nope: 2, coca_strict: 1}\n"


@pytest.mark.slow
def test_perplexity_study_shortened(tmp_path: Path) -> None:
    """The text-only preset with each design by one override (the registry's settings, CoCA strict's
    form included), the file's seeds per design, perplexity only (RoPE designs also with dynamic
    NTK 8), and the report testing the file's family."""
    family = tmp_path / "family.yaml"
    family.write_text(TINY_PERPLEXITY)
    results = tmp_path / "results"
    run_script("reproduce_perplexity.sh", tmp_path, DESIGNS="origin nope coca_strict", STEPS="3",
               FAMILY=str(family), RESULTS=str(results), EVAL="ppl.lengths=[256,512] ppl.n_docs=1")
    runs = {"origin_s1": "origin", "origin_s2": "origin", "nope_s1": "nope", "nope_s2": "nope",
            "coca_strict_s1": "coca"}
    assert sorted(p.name for p in tmp_path.glob("*_s*")) == sorted(runs)
    for run, attention in runs.items():
        cfg = (tmp_path / run / "config.yaml").read_text()
        design = run.rsplit("_s", 1)[0]
        assert f"attention: {attention}" in cfg and f"name: study_ppl_{run}" in cfg and "max_steps: 3" in cfg
        assert "kind: synthetic" not in cfg  # text only
        assert ("form: strict" in cfg) == (design == "coca_strict")
        assert sorted(p.name for p in (results / run).iterdir()) == [
            "DONE", "config.yaml", "machine.txt", "ppl.json.gz"]
        machine = (results / run / "machine.txt").read_text().splitlines()  # one line per start
        assert len(machine) == 1 and f"torch {torch.__version__}" in machine[0]
        assert f", code {HEAD}" in machine[0]  # the commit the run's code came from
        rows = json.loads(gzip.decompress((results / run / "ppl.json.gz").read_bytes()))["rows"]
        assert {r["scaling"] for r in rows} == ({"none"} if design == "nope" else {"none", "dynamic:8"})
    with open(results / "seeds_family.csv") as f:
        family_rows = list(csv.DictReader(f))
    assert [(r["a"], r["b"], r["scaling"], r["tested"]) for r in family_rows] == [
        ("nope", "origin", "none", "True"), ("coca_strict", "origin", "dynamic:8", "True")]
    assert not (results / "bar_only").exists()


TINY_VARIANTS = """metric: ppl_ratio
lengths: [512]
variants:
  origin_sinks: {design: origin, overrides: [model.sinks=true]}
  drope: {design: nope, preset: drope_ppl, continues: origin}
comparisons:
  - {a: origin_sinks, b: origin, scaling: none}
  - {a: drope, b: origin, scaling: none}
""" + TINY_TESTS + "seeds: {origin: 2, origin_sinks: 1, drope: 2}\n"


@pytest.mark.slow
def test_study_variants_and_continuations(tmp_path: Path) -> None:
    """A family file's variants: a registry design with overrides of its own, and a continuation that
    starts from the Origin run of its seed (waiting for it: the two run two at a time) with another
    preset; the report tests the family under the variants' names."""
    family = tmp_path / "family.yaml"
    family.write_text(TINY_VARIANTS)
    results = tmp_path / "results"
    run_script("reproduce_perplexity.sh", tmp_path, DESIGNS="origin origin_sinks drope", STEPS="3",
               FAMILY=str(family), RESULTS=str(results), EVAL="ppl.lengths=[256,512] ppl.n_docs=1")
    assert sorted(p.name for p in tmp_path.glob("*_s[0-9]")) == [
        "drope_s1", "drope_s2", "origin_s1", "origin_s2", "origin_sinks_s1"]
    sinks = (tmp_path / "origin_sinks_s1" / "config.yaml").read_text()
    assert "attention: origin" in sinks and "sinks: true" in sinks and "name: study_ppl_origin_sinks_s1" in sinks
    for seed in (1, 2):
        cfg = (tmp_path / f"drope_s{seed}" / "config.yaml").read_text()
        assert "attention: nope" in cfg and "qk_norm: true" in cfg and "kind: synthetic" not in cfg
        assert f"init_from: {tmp_path}/origin_s{seed}" in cfg
        rows = json.loads(gzip.decompress((results / f"drope_s{seed}" / "ppl.json.gz").read_bytes()))["rows"]
        assert {r["scaling"] for r in rows} == {"none"}
    with open(results / "seeds_family.csv") as f:
        family_rows = list(csv.DictReader(f))
    assert [(r["a"], r["b"], r["tested"]) for r in family_rows] == [
        ("origin_sinks", "origin", "True"), ("drope", "origin", "True")]


def test_unknown_study_design_is_named(tmp_path: Path) -> None:
    """A design that is neither a registry key nor one of the family's variants stops the launcher
    before anything trains, naming the designs it knows."""
    family = tmp_path / "family.yaml"
    family.write_text(TINY_VARIANTS)
    result = subprocess.run(["bash", "launch/reproduce_perplexity.sh"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "RUNS": str(tmp_path), "FAMILY": str(family), "DESIGNS": "origin_sink",
                                 "SEEDS": "1", "WANDB_MODE": "disabled"}, timeout=120)
    assert "unknown design origin_sink" in result.stdout + result.stderr and "origin_sinks" in result.stderr
    assert not list(tmp_path.glob("*/config.yaml"))


@pytest.mark.slow
def test_new_designs_compared_with_published_origin_runs(tmp_path: Path) -> None:
    """With PUBLISHED set, the retrieval arm for new designs trains only them (the study's preset with
    the design's attention) and reports them beside the Origin runs published there, not retrained."""
    published = tmp_path / "study"
    shutil.copytree(ROOT / "docs" / "results" / "study" / "origin_s1", published / "origin_s1")
    results = tmp_path / "results"
    run_script("reproduce_designs.sh", tmp_path, DESIGNS="origin kerple", SEEDS="1", STEPS="3",
               PUBLISHED=str(published), RESULTS=str(results),
               EVAL="ppl.lengths=[256,512] ppl.n_docs=1 passkey.lengths=[256,512] passkey.n_cases=2 "
               "recall.lengths=[256] recall.n_cases=1 attention.length=256 attention.head_lengths=[256]")
    assert not (tmp_path / "origin_s1").exists() and not (results / "origin_s1").exists()
    cfg = (tmp_path / "kerple_s1" / "config.yaml").read_text()
    assert "attention: kerple" in cfg and "name: study_kerple_s1" in cfg and "kind: synthetic" in cfg
    assert (results / "kerple_s1" / "passkey_progress.md").exists()
    ppl = (results / "compare_ppl.csv").read_text()  # one seed each: the per-run comparison, no seed report
    assert "\norigin,none,256," in ppl and "\nkerple,none,256," in ppl


TINY_DOSE = """doses: [10, 20]
decay_fraction: 0.2
seeds: {origin: 2, alibi: 1}
top_only: [alibi]
metric: ppl_ratio
alpha: 0.05
adjust: holm
bootstrap_resamples: 200
family:
  - {test: difference, a: alibi, b: origin, length: 512, scaling: none}
  - {test: growth, design: origin, length: 512, scaling: none}
"""


@pytest.mark.slow
def test_dose_study_shortened(tmp_path: Path) -> None:
    """The dose launcher with a family file: per seed one chain (10 steps from scratch, 20 branched
    from its step 8 with its whole training state), a top-only design from scratch, each run
    published with its config, results, machine and cost, the report testing the family; then a
    machine with only the published results retrains nothing."""
    family = tmp_path / "family.yaml"
    family.write_text(TINY_DOSE)
    results = tmp_path / "results"
    env = dict(FAMILY=str(family), RESULTS=str(results), LENGTH="512", TRAIN="optim.warmup_steps=2 eval_every=10",
               EVAL="ppl.lengths=[256,512] ppl.n_docs=1")
    out = run_script("reproduce_dose.sh", tmp_path, **env)
    assert "branches at 8" in out
    runs = ["origin_d10_s1", "origin_d20_s1", "origin_d10_s2", "origin_d20_s2", "alibi_d20_s1"]
    assert sorted(p.name for p in results.glob("*_d*_s*")) == sorted(runs)
    for run in runs:
        published = results / run
        assert {p.name for p in published.iterdir()} >= {"DONE", "config.yaml", "ppl.json.gz", "machine.txt",
                                                         "cost.json"}
        cfg = (published / "config.yaml").read_text()
        assert "decay: wsd" in cfg and f"max_steps: {run.split('_d')[1].split('_')[0]}" in cfg
        cost = json.loads((published / "cost.json").read_text())
        assert set(cost) == {"train_s", "eval_s"} and cost["train_s"] >= 1
        assert len(list((tmp_path / run / "train_seconds.d").iterdir())) == 1  # one start, its wall seconds
    branch = (tmp_path / "origin_d20_s2" / "config.yaml").read_text()
    assert "origin_d10_s2/checkpoints/step_00000008" in branch  # branched, not trained from scratch
    assert "branch_from: null" in (tmp_path / "alibi_d20_s1" / "config.yaml").read_text()
    tests = list(csv.DictReader((results / "dose_family.csv").open()))
    assert [(t["test"], t["dose"]) for t in tests] == [("difference", "10"), ("difference", "20"), ("growth", "20-10")]
    assert [t["tested"] for t in tests] == ["False", "True", "True"]  # alibi trains the top dose only
    report = (results / "dose_report.md").read_text()
    for run in runs:
        shutil.rmtree(tmp_path / run)
    run_script("reproduce_dose.sh", tmp_path, **env)
    assert not any((tmp_path / run).exists() for run in runs)
    assert (results / "dose_report.md").read_text() == report
