"""launch/reproduce_extension.sh runs its whole chain (pilot -> the family's runs -> report) on CPU,
shortened: a few steps, two seeds, three arms (its own file, so pytest-xdist runs it beside
the other launchers' tests)."""

from __future__ import annotations

import csv
import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from reproduce_chain import ROOT, SMALL, run_script

TINY_EXTENSION = """metric: passkey
lengths: [1024]
comparisons:
  - {a: dropin_coca, b: coca, scaling: none}
  - {a: extend_yarn, b: continue_origin, scaling_a: none, scaling_b: "dynamic:8"}
alpha: 0.05
adjust: holm
interval: cluster_bootstrap
bootstrap_resamples: 200
test: exact_permutation_over_seeds
budget_rule: {pilot_steps: 4, every: 2, window: 2, min_gain: 0.01}
"""


def train_study_origin(study: Path, seeds: tuple[int, ...]) -> None:
    """The study's Origin runs the extension starts from, 3 steps each, two at once (as the study trains
    them: launch/reproduce_study.sh, tested above with its evaluation)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(["python", "-m", "train", "experiment=study_origin", f"run_dir={study}/origin_s{s}",
                               f"seed={s}", f"data.seed={s}", "max_steps=3", "logger.progress=false", *SMALL],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for s in seeds]
    for s, proc in zip(seeds, procs):
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:]
        (study / f"origin_s{s}" / "DONE").touch()


@pytest.mark.slow
def test_extension_shortened(tmp_path: Path) -> None:
    """Two Origin study seeds (3 steps), then the extension experiment on them with three of its arms:
    the pilot picks the budget and t_init, each arm continues its seed's Origin model, and the report
    tests the family, one comparison across scalings, beside the study's published Origin and CoCA."""
    study = tmp_path / "study"
    train_study_origin(study, (1, 2))
    for run in ("origin_s1", "origin_s2", "coca_s1", "coca_s2"):
        shutil.copytree(ROOT / "docs" / "results" / "study" / run, study / "published" / run)
    family = tmp_path / "family.yaml"
    family.write_text(TINY_EXTENSION)
    results = tmp_path / "results"
    ext = tmp_path / "extension"
    out = run_script("reproduce_extension.sh", ext, *SMALL, SOURCES=str(study), STUDY_RESULTS=str(study / "published"),
                     ARMS="extend_yarn dropin_coca continue_origin", SEEDS="1 2", FAMILY=str(family),
                     RESULTS=str(results), EVAL="ppl.n_docs=1 passkey.n_cases=2", SHORT="[256,1024]", LONG="[1024]")
    assert "FAILED" not in out
    choice = json.loads((results / "pilot.json").read_text())
    assert choice["budget"] in (2, 4) and choice["t_init"] in ("from_k", "fresh")
    assert set(choice["curves"]) == {"extend_yarn", "dropin_from_k", "dropin_fresh", "continue_origin"}
    for arm, scalings, train_len in (("extend_yarn", {"none"}, 1024), ("dropin_coca", {"none", "dynamic:8"}, 256),
                                     ("continue_origin", {"none", "dynamic:8"}, 256)):
        for seed in (1, 2):
            cfg = (results / f"{arm}_s{seed}" / "config.yaml").read_text()
            assert f"init_from: {study}/origin_s{seed}" in cfg and f"max_steps: {choice['budget']}" in cfg
            assert f"max_seq_len: {train_len}" in cfg and f"seed: {100 + seed}" in cfg
            assert "batch_size: 4" in cfg  # the launcher's own arguments reach every training
            assert ("attention: coca" in cfg) == (arm == "dropin_coca")
            passkey = json.loads(gzip.decompress((results / f"{arm}_s{seed}" / "passkey.json.gz").read_bytes()))
            assert {c["scaling"] for c in passkey["cases"]} == scalings and passkey["meta"]["seed"] == seed
            log = gzip.decompress((results / f"{arm}_s{seed}" / "metrics.jsonl.gz").read_bytes()).decode()
            assert f'"step": {choice["budget"]}' in log  # its training log, to the last step
    assert f"t_init: {choice['t_init']}" in (results / "dropin_coca_s1" / "config.yaml").read_text()
    family_rows = {(r["a"], r["b"]): r for r in csv.DictReader((results / "seeds_family.csv").open())}
    assert family_rows[("extend_yarn", "continue_origin")]["scaling_b"] == "dynamic:8"
    assert all(r["tested"] == "True" for r in family_rows.values())
    assert "| extend_yarn | continue_origin | none vs dynamic:8 | 1K | 2 | 2 |" in (
        results / "seeds_report.md").read_text()
