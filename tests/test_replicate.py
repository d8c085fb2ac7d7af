"""`python -m eval.replicate`: two evaluations of one run compared case for case; a published run
(its results gzip-compressed) against a plain copy, as a retraining's `eval/` holds them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from eval import replicate

PUBLISHED = Path(__file__).resolve().parents[1] / "docs" / "results" / "study" / "origin_s1"


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("passkey.json", "ppl.json"):
        (copy / name).write_bytes(gzip.decompress((PUBLISHED / f"{name}.gz").read_bytes()))
    return copy


def test_a_run_agrees_with_itself(tmp_path, capsys):
    assert replicate.main([str(PUBLISHED), str(_copy(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "1200 of 1200 cases predict the same tokens" in out and "difference +0.00e+00" in out


def test_a_changed_prediction_and_perplexity_are_reported(tmp_path, capsys):
    copy = _copy(tmp_path)
    passkey = json.loads((copy / "passkey.json").read_text())
    passkey["cases"][7]["teacher_pred"] = [1, 2, 3]
    (copy / "passkey.json").write_text(json.dumps(passkey))
    ppl = json.loads((copy / "ppl.json").read_text())
    ppl["rows"][3]["ppl"] *= 1.5
    (copy / "ppl.json").write_text(json.dumps(ppl))
    assert replicate.main([str(PUBLISHED), str(copy)]) == 1
    out = capsys.readouterr().out
    case = passkey["cases"][7]
    assert "1199 of 1200" in out and f"case 7 ({case['scaling']}, {case['length']} tokens" in out
    assert f"+5.00e-01 ({ppl['rows'][3]['scaling']}, {ppl['rows'][3]['length']} tokens)" in out


def test_other_prompts_are_an_error_not_a_comparison(tmp_path, capsys):
    other = PUBLISHED.with_name("origin_s2")
    assert replicate.main([str(PUBLISHED), str(other)]) == 2
    assert "case 0: different prompts" in capsys.readouterr().err


PERPLEXITY = PUBLISHED.parents[1] / "perplexity" / "origin_s1"


def test_perplexity_alone_is_compared_row_by_row(tmp_path, capsys):
    """The perplexity study's runs have no passkey.json: their rows decide, to PPL_AGREEMENT."""
    copy = tmp_path / "copy"
    copy.mkdir()
    ppl = json.loads(gzip.decompress((PERPLEXITY / "ppl.json.gz").read_bytes()))
    (copy / "ppl.json").write_text(json.dumps(ppl))
    assert replicate.main([str(PERPLEXITY), str(copy)]) == 0
    assert f"{len(ppl['rows'])} of {len(ppl['rows'])} rows agree" in capsys.readouterr().out
    ppl["rows"][2]["ppl"] *= 1 + 2 * replicate.PPL_AGREEMENT
    (copy / "ppl.json").write_text(json.dumps(ppl))
    assert replicate.main([str(PERPLEXITY), str(copy)]) == 1
    assert f"{len(ppl['rows']) - 1} of {len(ppl['rows'])} rows agree" in capsys.readouterr().out


def test_evaluations_of_different_kinds_are_an_error(tmp_path, capsys):
    assert replicate.main([str(PERPLEXITY), str(tmp_path)]) == 2
    assert "no evaluation of the same kind" in capsys.readouterr().err
