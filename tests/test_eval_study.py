"""Recall scoring, and the seed aggregation of `eval.report` (mean, 95% CI, Welch's test) by hand."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from data.config import DataConfig, TokenizerConfig
from data.tasks import make_recall_cases
from data.tokenizer import get_tokenizer
from eval import aggregate, report
from eval.recall import recall_accuracy, score_recall

VOCAB = 1024


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    cache = tmp_path_factory.mktemp("study_cache")
    return get_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=VOCAB, sample_docs=60), cache_dir=str(cache)))


class Oracle(torch.nn.Module):
    """Knows every case: its logits put the true next token first (or always `always`, if set)."""

    def __init__(self, cases, always: int | None = None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.next = {tuple(c.tokens[:-1]): c.tokens[1:] for c in cases}
        self.always = always

    def forward(self, idx: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        nxt = self.next[tuple(idx[0].tolist())]
        target = [self.always] * len(nxt) if self.always is not None else nxt
        logits = torch.nn.functional.one_hot(torch.tensor(target), VOCAB).float()[None]
        return logits[:, -logits_to_keep:] if logits_to_keep else logits


def test_recall_oracle_scores_one_and_a_silent_model_zero(tok):
    cases = make_recall_cases(tok, 300, 4, 5, seed=0, prefix=[tok.eos_id]) + make_recall_cases(tok, 500, 3, 5, seed=0)
    assert all(c.n_pairs >= 5 and len(c.tokens) <= c.length for c in cases)
    perfect = score_recall(Oracle(cases), cases, progress=False)
    assert recall_accuracy(perfect) == 1.0 and all(r["correct"] == r["queries"] == 5 for r in perfect)
    silent = score_recall(Oracle(cases, always=tok.eos_id), cases, progress=False)
    assert recall_accuracy(silent) == 0.0


def test_recall_cases_depend_on_seed_and_length_only(tok):
    a = make_recall_cases(tok, 400, 3, 4, seed=1)
    assert [c.tokens for c in a] == [c.tokens for c in make_recall_cases(tok, 400, 3, 4, seed=1)]
    assert [c.tokens for c in a] != [c.tokens for c in make_recall_cases(tok, 400, 3, 4, seed=2)]
    with pytest.raises(ValueError, match="shorter than 4 pairs and queries"):
        make_recall_cases(tok, 30, 1, 4, seed=1)


# ----------------------------------------------------------------------------- statistics by hand

T_975_DF2 = 4.302652729749464  # Student t quantile, 0.975, 2 degrees of freedom (tables)


def test_mean_and_confidence_interval_by_hand():
    mean, ci = aggregate.mean_ci([0.5, 0.7, 0.9])
    # mean 0.7; sample sd sqrt((0.04 + 0 + 0.04) / 2) = 0.2; half-width t * 0.2 / sqrt(3)
    assert mean == pytest.approx(0.7, abs=1e-12)
    assert ci == pytest.approx(T_975_DF2 * 0.2 / math.sqrt(3), rel=1e-9)
    assert math.isnan(aggregate.mean_ci([0.4])[1])


def test_welch_p_value_by_hand():
    # a = 1, 2, 3; b = 4, 5, 6: variances 1, t = -3 / sqrt(2/3) = -3.6742; Welch df = 4.
    # Two-sided p for |t| = 3.6742 at 4 df: 0.021312 (t-distribution tables / integration).
    assert aggregate.welch_p([1, 2, 3], [4, 5, 6]) == pytest.approx(0.021312, abs=2e-6)
    assert aggregate.welch_p([1, 1, 1], [1, 1, 1]) == 1.0  # no spread, same: not significant
    assert aggregate.welch_p([0, 0, 0], [1, 1, 1]) == 0.0  # no spread, different


def _seed_run(root: Path, name: str, label: str, config_id: str, seed: int, ppl_2x: float, passkey_hits: int,
              recall_right: int) -> Path:
    """A run's eval folder: ppl at 64 (10) and 128, 4 passkey cases at 64, recall 10 queries at 64."""
    meta = {"run": str(root / name), "label": label, "train_len": 64, "step": 10, "source": "stdlib",
            "seed": seed, "config_id": config_id}
    out = root / name / "eval"
    ppl = [{"scaling": "none", "length": n, "stride": 64, "nll": 1.0, "tokens": 1, "documents": 1, "loss": 1.0, "ppl": p}
           for n, p in [(64, 10.0), (128, ppl_2x)]]
    report.save_json(out / "ppl.json", {"meta": meta, "rows": ppl, "notes": []})
    cases = [{"scaling": "none", "length": 64, "tokens": 64, "depth": 0.5, "key": "1", "teacher_correct": i < passkey_hits,
              "teacher_pred": [1]} for i in range(4)]
    report.save_json(out / "passkey.json", {"meta": meta, "cases": cases, "modes": ["teacher"]})
    recall = [{"scaling": "none", "length": 64, "tokens": 64, "pairs": 9, "queries": 5, "correct": c, "pred": []}
              for c in (min(5, recall_right), max(0, recall_right - 5))]
    report.save_json(out / "recall.json", {"meta": meta, "cases": recall, "queries": 5})
    return root / name


def _csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_report_aggregates_runs_differing_only_in_seed(tmp_path):
    runs = [_seed_run(tmp_path, f"o{s}", "origin", "A", s, ppl, hits, right)
            for s, ppl, hits, right in [(1, 11.0, 4, 10), (2, 12.0, 3, 9), (3, 13.0, 4, 8)]]
    runs += [_seed_run(tmp_path, f"c{s}", "coca-slack", "B", s, ppl, hits, right)
             for s, ppl, hits, right in [(1, 15.0, 1, 2), (2, 16.0, 0, 3), (3, 17.0, 1, 1)]]
    out = tmp_path / "report"
    assert report.main([str(r) for r in runs] + ["--out", str(out)]) == 0

    summary = {(r["metric"], r["label"], int(r["length"])): r for r in _csv(out / "seeds_summary.csv")}
    # origin ppl ratio at 2x: 1.1, 1.2, 1.3 -> mean 1.2, sd 0.1
    cell = summary[("ppl_ratio", "origin", 128)]
    assert float(cell["mean"]) == pytest.approx(1.2) and int(cell["n"]) == 3
    assert float(cell["ci95"]) == pytest.approx(T_975_DF2 * 0.1 / math.sqrt(3), rel=1e-9)
    # passkey: 4/4, 3/4, 4/4 -> mean 11/12; recall: 10/10, 9/10, 8/10 -> 0.9, sd 0.1
    assert float(summary[("passkey", "origin", 64)]["mean"]) == pytest.approx(11 / 12)
    assert float(summary[("recall", "origin", 64)]["mean"]) == pytest.approx(0.9)
    assert float(summary[("recall", "origin", 64)]["ci95"]) == pytest.approx(T_975_DF2 * 0.1 / math.sqrt(3), rel=1e-9)
    assert float(summary[("ppl_ratio", "origin", 64)]["mean"]) == 1.0

    tests = {(r["metric"], int(r["length"])): r for r in _csv(out / "seeds_significance.csv")}
    # 1.1, 1.2, 1.3 vs 1.5, 1.6, 1.7: t = -0.4 / sqrt(2 * 0.01 / 3) = -4.899 at 4 df: two-sided p 0.0080499
    ppl_test = tests[("ppl_ratio", 128)]
    assert {ppl_test["a"], ppl_test["b"]} == {"origin", "coca-slack"}
    assert float(ppl_test["p"]) == pytest.approx(0.0080499, abs=2e-6) and ppl_test["significant"] == "True"
    assert tests[("recall", 64)]["significant"] == "True"

    values = _csv(out / "seeds_values.csv")
    assert {v["seed"] for v in values} == {"1", "2", "3"} and len({v["run"] for v in values}) == 6
    md = (out / "seeds_report.md").read_text()
    assert "| origin | 1 ± 0 | 1.2 ± 0.25 |" in md  # ppl ratio table: 1x, 2x
    assert "- 128: origin beats coca-slack (p=0.008)" in md  # lower perplexity ratio is better
    assert "- 64: origin beats coca-slack (p=0.0031)" in md  # passkey: higher accuracy is better
    assert "coca-slack beats" not in md
    for metric in aggregate.METRICS:
        assert (out / f"seeds_{metric}.png").stat().st_size > 0


def test_report_without_replicates_writes_no_seed_tables(tmp_path):
    a = _seed_run(tmp_path, "o1", "origin", "A", 1, 11.0, 4, 10)
    b = _seed_run(tmp_path, "c1", "coca-slack", "B", 1, 15.0, 1, 2)
    assert report.main([str(a), str(b), "--out", str(tmp_path / "r")]) == 0
    assert not (tmp_path / "r" / "seeds_summary.csv").exists()
    assert (tmp_path / "r" / "compare_recall.csv").exists()


def test_significance_compares_a_scaling_with_every_setup_as_trained():
    """Same-scaling pairs as before, plus each setup with a scaling against every setup as trained
    (here Origin + dynamic:8 vs CoCA as trained and vs Origin itself); never two different scalings."""
    rows = [{"group": g, "seed": s, "run": f"{g}{s}", "metric": "passkey", "scaling": sc, "length": 512, "value": v}
            for g, sc, values in [("origin", "none", [0.0, 0.1, 0.2]), ("origin", "dynamic:8", [1.0, 0.9, 0.8]),
                                  ("coca", "none", [0.5, 0.6, 0.7]), ("coca", "dynamic:4", [0.9, 1.0, 1.0])]
            for s, v in enumerate(values, 1)]
    pairs = {(t["a"], t["scaling"], t["b"], t["scaling_b"]): t for t in aggregate.significance(rows)}
    assert set(pairs) == {("origin", "none", "coca", "none"), ("origin", "dynamic:8", "origin", "none"),
                          ("origin", "dynamic:8", "coca", "none"), ("coca", "dynamic:4", "origin", "none"),
                          ("coca", "dynamic:4", "coca", "none")}
    # 1.0, 0.9, 0.8 vs 0.5, 0.6, 0.7: the Welch test of the two cells (checked by hand above)
    cross = pairs[("origin", "dynamic:8", "coca", "none")]
    assert cross["p"] == pytest.approx(aggregate.welch_p([1.0, 0.9, 0.8], [0.5, 0.6, 0.7]))
    assert cross["diff"] == pytest.approx(0.3) and cross["significant"]
    assert "- 512: origin + dynamic:8 beats coca as trained" in "\n".join(
        report._orderings([cross], [512], lower_is_better=False))
