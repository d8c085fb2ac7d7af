"""Evaluation pieces that need no trained model: windows, attention statistics, reports."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from eval import report, tables
from eval import results as result_files
from eval.attention_stats import attention_statistics, last_query_scores, layer_statistics
from eval.perplexity import safe_exp, sliding_windows
from model.designs.stick_breaking import STICK_BREAKING

# ----------------------------------------------------------------------------- windows


@pytest.mark.parametrize("n,length,stride", [(64, 16, 16), (64, 16, 5), (50, 16, 7), (16, 16, 4), (40, 8, 1)])
def test_windows_count_every_prediction_once_with_full_windows(n, length, stride):
    windows = sliding_windows(n, length, stride)
    counted = []
    for w in windows:
        assert w.end - w.start == length
        counted += list(range(w.end - w.counted, w.end))
    assert counted == list(range(n))
    for w in windows[1:]:
        assert w.counted <= stride
        # every counted position after the first window sees at least length - stride earlier tokens
        assert (w.end - w.counted) - w.start >= length - stride


def test_stride_equal_to_length_gives_disjoint_windows():
    windows = sliding_windows(48, 16, 16)
    assert [(w.start, w.end, w.counted) for w in windows] == [(0, 16, 16), (16, 32, 16), (32, 48, 16)]


def test_window_errors():
    with pytest.raises(ValueError, match="too short"):
        sliding_windows(10, 16, 16)
    with pytest.raises(ValueError, match="skip tokens"):
        sliding_windows(64, 16, 17)


def test_safe_exp_overflows_to_inf():
    assert safe_exp(1.0) == pytest.approx(math.e)
    assert safe_exp(1000.0) == math.inf


# ----------------------------------------------------------------------------- attention statistics


@dataclass
class Layer:
    q_eff: torch.Tensor
    k_eff: torch.Tensor
    slopes: torch.Tensor | None
    window: int = 0
    sinks: torch.Tensor | None = None  # attention sinks' logits a_h
    weights: object = None  # a design's weights from its scores (stick-breaking's); None: softmax

    @property
    def bias(self):
        """ALiBi's bias -slope_h (m - n) in `LayerBias.scores`'s form, or None."""
        if self.slopes is None:
            return None
        slopes = self.slopes

        class Bias:
            def scores(self, start, end, device):
                m, n = torch.arange(start, end)[:, None], torch.arange(end)[None, :]
                return -slopes[:, None, None] * (m - n)

        return Bias()


def stick_breaking_row(row: torch.Tensor) -> torch.Tensor:
    """A_n = sigmoid(s_n) prod_{n<k<m} (1 - sigmoid(s_k)) over a query's earlier keys s_0..s_{m-1}:
    the product of the paper's definition, key by key."""
    beta = torch.sigmoid(row)
    return torch.stack([beta[n] * torch.prod(1 - beta[n + 1 :]) for n in range(len(row))])


def reference_stats(layer: Layer, sigma: float, window: int) -> dict:
    """The definitions on the full float64 score matrix; stick-breaking's over the keys n < m."""
    q, k = layer.q_eff[0].double(), layer.k_eff[0].double()
    h, t, d = q.shape
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    m = torch.arange(t)[:, None]
    n = torch.arange(t)[None, :]
    if layer.slopes is not None:
        s = s - layer.slopes.double()[:, None, None] * (m - n)
    strict = layer.weights is not None  # stick-breaking: a query does not see its own key
    valid = ((n < m) if strict else (n <= m)).expand(h, t, t)
    vals = s[valid]
    outliers, local, max_z = 0, 0.0, 0.0
    for hi in range(h):
        for mi in range(t):
            row = s[hi, mi, : mi + (0 if strict else 1)]
            if not len(row):
                continue
            mean, std = row.mean(), row.std(unbiased=False)
            outliers += int((row > mean + sigma * std).sum())
            if std > 0:
                max_z = max(max_z, ((row - mean) / std).max().item())
            if strict:
                p = stick_breaking_row(row)
            else:  # exp(s) / (sum exp(s) [+ exp(a_h)]): a sink takes its share of every row
                denominator = row.exp().sum() + (layer.sinks[hi].double().exp() if layer.sinks is not None else 0.0)
                p = row.exp() / denominator
            local += p[max(0, len(row) - window) :].sum().item()
    return {
        "max_score": vals.max().item(),
        "min_score": vals.min().item(),
        "mean_score": vals.mean().item(),
        "std_score": vals.std(unbiased=False).item(),
        "outlier_count": outliers,
        "outlier_ratio": outliers / vals.numel(),
        "max_zscore": max_z,
        "local_mass": local / (h * t),
        "n_scores": vals.numel(),
    }


@pytest.mark.parametrize("alibi, sinks, weights", [(False, False, False), (True, False, False), (False, True, False),
                                                   (True, True, False), (False, False, True)],
                         ids=["softmax", "alibi", "sinks", "alibi, sinks", "stick-breaking"])
def test_chunked_attention_statistics_match_float64_definition(alibi, sinks, weights):
    g = torch.Generator().manual_seed(0)
    h, t, d = 3, 37, 8
    q = torch.randn(1, h, t, d, generator=g)
    k = torch.randn(1, h, t, d, generator=g)
    k[0, 1, 5] *= 8.0  # a key that stands out, so that outliers exist
    slopes = torch.tensor([0.5, 0.25, 0.125]) if alibi else None
    layer = Layer(q, k, slopes, sinks=torch.tensor([2.0, -1.0, 0.5]) if sinks else None,
                  weights=STICK_BREAKING.weights if weights else None)
    got = layer_statistics(layer, sigma=2.0, window=4, chunk=7)
    want = reference_stats(layer, sigma=2.0, window=4)
    assert want["outlier_count"] > 0
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_last_query_scores_is_last_row_of_score_matrix():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 9, 4, generator=g), torch.randn(1, 2, 9, 4, generator=g)
    slopes = torch.tensor([1.0, 0.5])
    got = last_query_scores(Layer(q, k, slopes))
    want = q[0, :, -1:] @ k[0].transpose(-1, -2) / 2.0 - slopes[:, None, None] * (8 - torch.arange(9))
    torch.testing.assert_close(got, want[:, 0])


def test_attention_statistics_numbers_layers_from_one():
    q = torch.randn(1, 1, 5, 2)
    stats = attention_statistics([Layer(q, q, None), Layer(q, q, None)], chunk=2)
    assert [s["layer"] for s in stats] == [1, 2]


# ----------------------------------------------------------------------------- reports


def _fake_run(eval_dir: Path, label: str, ppl_at_2x: float, train_len: int = 64) -> None:
    meta = {"run": str(eval_dir.parent), "label": label, "train_len": train_len, "step": 10, "source": "stdlib"}
    ppl_rows = [
        {"scaling": s, "length": L, "stride": 64, "nll": 1.0, "tokens": 1, "documents": 1, "loss": 1.0, "ppl": p}
        for s, f in [("none", 1.0), ("dynamic:4", 0.5)]
        for L, p in [(64, 10.0), (128, ppl_at_2x * f), (256, math.inf)]
    ]
    result_files.save_json(eval_dir / "ppl.json", {"meta": meta, "rows": ppl_rows, "notes": []})
    cases = [
        {"scaling": "none", "length": L, "tokens": L, "depth": dep, "key": "12345",
         "teacher_correct": ok, "teacher_pred": [1], "generate_correct": ok, "generate_pred": [1]}
        for L in (64, 128) for dep, ok in [(0.1, True), (0.9, L == 64)]
    ]
    result_files.save_json(eval_dir / "passkey.json", {"meta": meta, "cases": cases, "modes": ["teacher", "generate"]})
    rows = [{"scaling": "none", "layer": 1, "max_score": 3.0, "min_score": -1.0, "mean_score": 0.0, "std_score": 1.0,
             "outlier_count": 2, "outlier_ratio": 0.01, "max_zscore": 4.0, "local_mass": 0.5, "n_scores": 200}]
    result_files.save_json(eval_dir / "attention.json",
                     {"meta": meta, "rows": rows, "length": 256, "sigma": 6.0, "window": 16})
    result_files.save_profiles(eval_dir / result_files.PROFILES_FILE, {"none": {1: np.random.randn(2, 256)}})


def test_run_report_tables_and_figures(tmp_path):
    eval_dir = tmp_path / "run" / "eval"
    _fake_run(eval_dir, "origin", 12.5)
    written = report.render(report.run_results(eval_dir), eval_dir)
    md = (eval_dir / "report.md").read_text()
    assert "| none | 10 | 12.5 | inf |" in md
    assert "| dynamic:4 | 10 | 6.25 | inf |" in md
    assert "| none | 1 | 0.5 |" in md  # passkey: both right at 64, one of two at 128
    summary = tables.passkey_summary(report.run_results(eval_dir)["passkey"]["cases"], ["teacher", "generate"])
    got = {(r["length"], r["teacher_accuracy"], r["modes_agree"]) for r in summary}
    assert got == {(64, 1.0, 1.0), (128, 0.5, 1.0)}
    for paths in written.values():
        for p in paths:
            assert p.exists() and p.stat().st_size > 0
    assert {p.name for p in written["passkey"]} >= {"passkey.png", "passkey_depth.png"}
    assert (eval_dir / "attention_scores.png").exists()


def test_depth_grid_bins_sweep_depths_exactly():
    cases = [{"length": 64, "depth": d, "t_correct": d < 0.5} for d in (0.0, 0.25, 0.5, 0.75, 1.0) for _ in range(2)]
    lengths, bins, acc = tables.depth_grid(cases, "t")
    assert lengths == [64] and bins == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert acc[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_compare_runs_one_line_per_run_and_scaling(tmp_path, capsys):
    _fake_run(tmp_path / "a" / "eval", "origin", 12.5)
    _fake_run(tmp_path / "b" / "eval", "coca-slack", 11.0)
    out = tmp_path / "cmp"
    assert report.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    md = (out / "compare_report.md").read_text()
    for line in ["| origin | 10 | 12.5 | inf |", "| origin + dynamic:4 | 10 | 6.25 | inf |",
                 "| coca-slack | 10 | 11 | inf |"]:
        assert line in md
    rows = list(csvrows(out / "compare_ppl.csv"))
    assert {r["label"] for r in rows} == {"origin", "origin + dynamic:4", "coca-slack", "coca-slack + dynamic:4"}
    for name in ["compare_ppl.png", "compare_passkey.png", "compare_attention_scores.png"]:
        assert (out / name).stat().st_size > 0
    assert "training length 64," in md


def test_compare_runs_of_different_training_lengths(tmp_path):
    _fake_run(tmp_path / "a" / "eval", "origin", 12.5, train_len=64)
    _fake_run(tmp_path / "b" / "eval", "origin", 11.0, train_len=128)
    assert report.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")]) == 0
    md = (tmp_path / "cmp" / "compare_report.md").read_text()
    assert "training length various," in md and "| a (origin) | 10 | 12.5 | inf |" in md


def test_compare_missing_results_is_a_clear_error(tmp_path, capsys):
    assert report.main([str(tmp_path / "nothing")]) == 1  # unusable input (errors.py)
    err = capsys.readouterr().err
    assert err.startswith("error: no evaluation results in") and len(err.strip().splitlines()) == 1


def csvrows(path: Path):
    import csv

    with path.open() as f:
        yield from csv.DictReader(f)


def test_saved_json_roundtrips_inf(tmp_path):
    result_files.save_json(tmp_path / "x.json", {"v": math.inf})
    assert json.loads((tmp_path / "x.json").read_text())["v"] == math.inf


# ----------------------------------------------------------------------------- config


def test_scaling_parse_and_default_lengths():
    from eval.config import Scaling, default_lengths

    assert Scaling.parse("dynamic:4") == Scaling("dynamic", 4.0) and Scaling.parse("dynamic:4").label == "dynamic:4"
    assert Scaling.parse("none") == Scaling("none", 1.0) and Scaling.parse("linear:2.5").label == "linear:2.5"
    for bad, msg in [("dyn:4", "not one of"), ("ntk", "type:factor"), ("yarn:0.5", ">= 1")]:
        with pytest.raises(ValueError, match=msg):
            Scaling.parse(bad)
    assert default_lengths(512) == [512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert default_lengths(128, 4) == [128, 256, 512]
