"""What the reproduction scripts' tests share: running a launcher, and checking a run's chain
(train -> evaluate -> report). The tests are one file per launcher (tests/test_reproduce_*.py), so
pytest-xdist's workers, which take whole files, share them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK_FILES = ("ppl.json", "passkey.json", "attention.json", "report.md", "ppl.png", "passkey.png")
REPORT_FILES = ("compare_report.md", "compare_ppl.csv", "compare_ppl.png", "compare_passkey.csv",
                "compare_passkey.png", "compare_attention.csv")


# Training overrides that keep a shortened study's chain and shrink its cost: the study presets' batch
# of 16 x 256 tokens and 20 validation batches made each run's few steps and one validation take
# most of a launcher test's time; the chain (train -> evaluate -> publish -> report) is the same.
SMALL = ("batch_size=4", "micro_batch_size=4", "eval_batches=2")


def run_script(script: str, runs: Path, *args: str, **env: str) -> str:
    """Run launch/<script> with `args` (Hydra overrides where the launcher passes them to training)."""
    result = subprocess.run(
        ["bash", f"launch/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=1500,
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


HEAD = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                      capture_output=True, text=True, check=True).stdout.strip()

# the statistics of a tiny study family (few resamples)
TINY_TESTS = """alpha: 0.05
adjust: holm
interval: cluster_bootstrap
bootstrap_resamples: 200
test: exact_permutation_over_seeds
"""
