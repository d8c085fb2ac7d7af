"""launch/reproduce_study.sh and launch/reproduce_designs.sh run their whole chains on CPU, shortened: a
few steps, two seeds and two lengths per task."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from reproduce_chain import LABELS, ROOT, ROPE_SWEEP, SMALL, check_chain, run_script


@pytest.mark.slow
def test_study_shortened(tmp_path: Path) -> None:
    """Two designs x two seeds, two runs at a time: per-run chains, then the seed-aggregated report;
    published results let the study continue without the runs (another machine)."""
    study = dict(DESIGNS="origin alibi", SEEDS="1 2", TEXT_ONLY="0", STEPS="3", RESULTS=str(tmp_path / "results"),
                 SCALINGS="[none,dynamic:2,dynamic:4,dynamic:8]",  # the pilot's sweep (the study's: none, dynamic:8)
                 EVAL="ppl.lengths=[256,512] ppl.n_docs=1 passkey.lengths=[256,512] passkey.n_cases=2 "
                 "recall.lengths=[256,512] recall.n_cases=2 attention.length=512 attention.head_lengths=[256,512]")
    run_script("reproduce_study.sh", tmp_path, *SMALL, **study)
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
    for run in runs:  # each run's training log is published with its results
        log = tmp_path / "results" / run / "metrics.jsonl.gz"
        assert gzip.decompress(log.read_bytes()) == (tmp_path / run / "metrics.jsonl").read_bytes()
    summary = (tmp_path / "results" / "seeds_summary.csv").read_text()
    for run in runs:  # a new machine: no runs, only the published results; nothing is retrained
        shutil.rmtree(tmp_path / run)
    run_script("reproduce_study.sh", tmp_path, *SMALL, **study)
    assert not any((tmp_path / run).exists() for run in runs)
    assert (tmp_path / "results" / "seeds_summary.csv").read_text() == summary


@pytest.mark.slow
def test_new_designs_compared_with_published_origin_runs(tmp_path: Path) -> None:
    """With PUBLISHED set, the retrieval arm for new designs trains only them (the study's preset with
    the design's attention) and reports them beside the Origin runs published there, not retrained."""
    published = tmp_path / "study"
    shutil.copytree(ROOT / "docs" / "results" / "study" / "origin_s1", published / "origin_s1")
    results = tmp_path / "results"
    run_script("reproduce_designs.sh", tmp_path, *SMALL, DESIGNS="origin kerple", SEEDS="1", STEPS="3",
               PUBLISHED=str(published), RESULTS=str(results),
               EVAL="ppl.lengths=[256,512] ppl.n_docs=1 passkey.lengths=[256,512] passkey.n_cases=2 "
               "recall.lengths=[256] recall.n_cases=1 attention.length=256 attention.head_lengths=[256]")
    assert not (tmp_path / "origin_s1").exists() and not (results / "origin_s1").exists()
    cfg = (tmp_path / "kerple_s1" / "config.yaml").read_text()
    assert "attention: kerple" in cfg and "name: study_kerple_s1" in cfg and "kind: synthetic" in cfg
    assert (results / "kerple_s1" / "passkey_progress.md").exists()
    ppl = (results / "compare_ppl.csv").read_text()  # one seed each: the per-run comparison, no seed report
    assert "\norigin,none,256," in ppl and "\nkerple,none,256," in ppl
