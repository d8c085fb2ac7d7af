"""`python -m eval.report` reads run folders as `eval.dose` does (`eval.results`): a run given twice,
by any path, is refused, and a damaged published result is one line naming its file, exit 1."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from eval import report

PUBLISHED = Path(__file__).resolve().parents[1] / "docs" / "results" / "study"


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    """Copies of two published study runs (their results gzip-compressed)."""
    return [Path(shutil.copytree(PUBLISHED / name, tmp_path / "runs" / name)) for name in ("origin_s1", "coca_s1")]


def _report(capsys, *argv) -> tuple[int, list[str]]:
    code = report.main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_run_given_twice_is_refused(runs, tmp_path, capsys):
    a, b = runs
    code, err = _report(capsys, a, b, a, "--out", tmp_path / "out")
    assert code == 1 and err == [f"error: run {a} given twice: each run counts once"]
    (a / "eval").mkdir()  # a run folder whose results are in its eval/, named both ways
    for name in ("ppl.json.gz", "passkey.json.gz"):
        (a / name).rename(a / "eval" / name)
    alias = b.parent / ".." / b.parent.name / a.name / "eval"
    code, err = _report(capsys, a, b, alias, "--out", tmp_path / "out")
    assert code == 1 and err == [f"error: run {alias} and {a} are the same run: each run counts once"]
    assert not (tmp_path / "out").exists()


def test_a_truncated_published_result_names_its_file(runs, tmp_path, capsys):
    passkey = runs[1] / "passkey.json.gz"
    passkey.write_bytes(passkey.read_bytes()[:-100])
    code, err = _report(capsys, *runs, "--out", tmp_path / "out")
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: {passkey} is not a complete gzip file (")
    passkey.write_bytes(gzip.compress(b'{"meta": {"label": "coca"}, "cases": [{"scaling": "none"', mtime=0))
    code, err = _report(capsys, *runs, "--out", tmp_path / "out")
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: {passkey} is not valid JSON (")
