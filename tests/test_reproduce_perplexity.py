"""launch/reproduce_perplexity.sh runs its whole chain on CPU, shortened: a family file's designs and
variants, a few steps, perplexity only, the report testing the family."""

from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from reproduce_chain import HEAD, ROOT, SMALL, TINY_TESTS, run_script

TINY_PERPLEXITY = """metric: ppl_ratio
lengths: [512]
variants:
  origin_sinks: {design: origin, overrides: [model.sinks=true]}
  drope: {design: nope, preset: drope_ppl, continues: origin}
comparisons:
  - {a: nope, b: origin, scaling: none}
  - {a: coca_strict, b: origin, scaling: "dynamic:8"}
  - {a: origin_sinks, b: origin, scaling: none}
  - {a: drope, b: origin, scaling: none}
""" + TINY_TESTS + "seeds: {origin: 2, nope: 2, coca_strict: 1, origin_sinks: 1, drope: 2}\n"


@pytest.mark.slow
def test_perplexity_study_shortened(tmp_path: Path) -> None:
    """One shortened launch (its runs are shared by what it checks): the text-only preset with each
    registry design by one override (the registry's settings, CoCA strict's form included), the
    file's seeds per design, perplexity only (RoPE designs also with dynamic NTK 8); the file's
    variants: a registry design with overrides of its own, and a continuation that starts from the
    Origin run of its seed (waiting for it: the runs go two at a time) with another preset; and the
    report testing the file's family under the designs' and variants' names."""
    family = tmp_path / "family.yaml"
    family.write_text(TINY_PERPLEXITY)
    results = tmp_path / "results"
    run_script("reproduce_perplexity.sh", tmp_path, *SMALL, DESIGNS="origin nope coca_strict origin_sinks drope",
               STEPS="3", FAMILY=str(family), RESULTS=str(results), EVAL="ppl.lengths=[256,512] ppl.n_docs=1")
    runs = {"origin_s1": "origin", "origin_s2": "origin", "nope_s1": "nope", "nope_s2": "nope",
            "coca_strict_s1": "coca", "origin_sinks_s1": "origin", "drope_s1": "nope", "drope_s2": "nope"}
    assert sorted(p.name for p in tmp_path.glob("*_s[0-9]")) == sorted(runs)
    for run, attention in runs.items():
        cfg = (tmp_path / run / "config.yaml").read_text()
        design = run.rsplit("_s", 1)[0]
        assert f"attention: {attention}" in cfg and f"name: study_ppl_{run}" in cfg and "max_steps: 3" in cfg
        assert "kind: synthetic" not in cfg  # text only
        assert ("form: strict" in cfg) == (design == "coca_strict")
        assert ("sinks: true" in cfg) == (design == "origin_sinks")
        assert ("qk_norm: true" in cfg) == (design == "drope")
        assert (f"init_from: {tmp_path}/origin_s{run[-1]}" in cfg) == (design == "drope")
        assert sorted(p.name for p in (results / run).iterdir()) == [
            "DONE", "config.yaml", "machine.txt", "metrics.jsonl.gz", "ppl.json.gz"]
        machine = (results / run / "machine.txt").read_text().splitlines()  # one line per start
        assert len(machine) == 1 and f"torch {torch.__version__}" in machine[0]
        assert f", code {HEAD}" in machine[0]  # the commit the run's code came from
        rows = json.loads(gzip.decompress((results / run / "ppl.json.gz").read_bytes()))["rows"]
        assert {r["scaling"] for r in rows} == ({"none"} if attention == "nope" else {"none", "dynamic:8"})
    with open(results / "seeds_family.csv") as f:
        family_rows = list(csv.DictReader(f))
    assert [(r["a"], r["b"], r["scaling"], r["tested"]) for r in family_rows] == [
        ("nope", "origin", "none", "True"), ("coca_strict", "origin", "dynamic:8", "True"),
        ("origin_sinks", "origin", "none", "True"), ("drope", "origin", "none", "True")]
    assert not (results / "bar_only").exists()


def test_unknown_study_design_is_named(tmp_path: Path) -> None:
    """A design that is neither a registry key nor one of the family's variants stops the launcher
    before anything trains, naming the designs it knows."""
    family = tmp_path / "family.yaml"
    family.write_text(TINY_PERPLEXITY)
    result = subprocess.run(["bash", "launch/reproduce_perplexity.sh"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "RUNS": str(tmp_path), "FAMILY": str(family), "DESIGNS": "origin_sink",
                                 "SEEDS": "1", "WANDB_MODE": "disabled"}, timeout=120)
    assert "unknown design origin_sink" in result.stdout + result.stderr and "origin_sinks" in result.stderr
    assert not list(tmp_path.glob("*/config.yaml"))
