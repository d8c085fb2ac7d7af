"""launch/reproduce_paper.sh runs its whole chain (train -> evaluate -> report) on CPU in its DRY_RUN
mode: the paper's presets, shrunk, real training processes and real evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest
from reproduce_chain import ROPE_SWEEP, check_chain, run_script


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
