"""launch/reproduce_dose.sh runs its whole chain on CPU, shortened: chains of two doses per seed with
branches, a top-only design, the report testing the family, and a rerun from published results."""

from __future__ import annotations

import csv
import gzip
import json
import shutil
from pathlib import Path

import pytest
from reproduce_chain import SMALL, run_script

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
    env = dict(FAMILY=str(family), RESULTS=str(results), LENGTH="512", FIT_TO="165",
               TRAIN=" ".join(("optim.warmup_steps=2", "eval_every=10", *SMALL)),
               EVAL="ppl.lengths=[256,512] ppl.n_docs=1")
    out = run_script("reproduce_dose.sh", tmp_path, **env)
    assert "branches at 8" in out
    runs = ["origin_d10_s1", "origin_d20_s1", "origin_d10_s2", "origin_d20_s2", "alibi_d20_s1"]
    assert sorted(p.name for p in results.glob("*_d*_s*")) == sorted(runs)
    for run in runs:
        published = results / run
        assert {p.name for p in published.iterdir()} >= {"DONE", "config.yaml", "ppl.json.gz", "machine.txt",
                                                         "cost.json", "metrics.jsonl.gz"}
        assert gzip.decompress((published / "metrics.jsonl.gz").read_bytes()) == \
            (tmp_path / run / "metrics.jsonl").read_bytes()  # the training log
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
    assert "## Fit of log(ratio - 1) against log tokens per parameter (exploratory; at 165: extrapolated)" in report
    # origin's chain only (alibi trains one dose); its row needs a ratio above 1 at two doses after 10-20 steps
    assert {r["design"] for r in csv.DictReader((results / "dose_fit.csv").open())} <= {"origin"}
    for run in runs:
        shutil.rmtree(tmp_path / run)
    run_script("reproduce_dose.sh", tmp_path, **env)
    assert not any((tmp_path / run).exists() for run in runs)
    assert (results / "dose_report.md").read_text() == report
