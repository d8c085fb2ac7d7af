"""The mechanism measures of the attention statistics (`eval.attention_stats.head_statistics`): sink
share, entropy and the largest logit by distance, per head, against float64 definitions computed
query by query on the whole score matrix, for hand-built attention and every design's capture."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from test_eval_pure import Layer, stick_breaking_row
from test_model_gpt import IDS, VARIANTS, small

from eval import report
from eval import results as result_files
from eval.__main__ import main
from eval.attention_stats import distance_bins, head_statistics, layer_head_statistics
from model.designs.stick_breaking import STICK_BREAKING
from train.checkpoint import find_checkpoint
from train.load import model_config_of

pytestmark = pytest.mark.usefixtures("single_thread")


def reference_heads(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, window: int,
                    sinks: torch.Tensor | None, stick: bool, train_len: int) -> list[dict]:
    """Per head, from the definitions: each query's weights over the keys it sees (softmax with the
    sink's logit in its denominator, or stick-breaking's product), its weight on key 0, its entropy
    with the weight left to no key as one more outcome; the largest score per distance bin
    (bin = d.bit_length(): 0, 1, 2-3, 4-7, ...)."""
    q, k = q[0].double(), k[0].double()
    h, t, d = q.shape
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if bias is not None:
        s = s + bias.double()
    out = []
    for hi in range(h):
        sink, entropy, count = [0.0, 0.0], [0.0, 0.0], [0, 0]
        best: dict[int, float] = {}
        for m in range(t):
            first = max(0, m - window + 1) if window else 0
            keys = list(range(first, m if stick else m + 1))
            if not keys:
                continue
            row = s[hi, m, keys]
            if stick:
                a = stick_breaking_row(row)
                rest = 1 - a.sum()
            else:
                extra = sinks[hi].double().exp() if sinks is not None else torch.tensor(0.0, dtype=torch.float64)
                a = row.exp() / (row.exp().sum() + extra)
                rest = extra / (row.exp().sum() + extra)
            h_m = -sum(x * math.log(x) for x in a.tolist() if x > 0) - (rest * rest.log() if rest > 0 else 0.0)
            on_first = a[0].item() if keys[0] == 0 else 0.0
            for i in (0, 1) if m >= train_len else (0,):
                sink[i] += on_first
                entropy[i] += float(h_m)
                count[i] += 1
            for n, score in zip(keys, row.tolist()):
                b = (m - n).bit_length()
                best[b] = max(best.get(b, -math.inf), score)
        n_bins = len(distance_bins(t))
        out.append({
            "head": hi + 1,
            "sink_share": sink[0] / count[0], "entropy": entropy[0] / count[0],
            "sink_share_beyond": sink[1] / count[1] if count[1] else None,
            "entropy_beyond": entropy[1] / count[1] if count[1] else None,
            "max_logit": [best.get(b) for b in range(n_bins)],
        })
    return out


def assert_rows_match(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and g["head"] == w["head"]
        for key in ("sink_share", "entropy", "sink_share_beyond", "entropy_beyond"):
            assert (g[key] is None) == (w[key] is None), key
            if w[key] is not None:
                assert g[key] == pytest.approx(w[key], rel=1e-9, abs=1e-12), key
        assert [x is None for x in g["max_logit"]] == [x is None for x in w["max_logit"]]
        assert [x for x in g["max_logit"] if x is not None] == pytest.approx(
            [x for x in w["max_logit"] if x is not None], rel=1e-9, abs=1e-12)


def test_distance_bins_are_powers_of_two_ending_at_the_longest_distance():
    assert distance_bins(1) == [(0, 0)]
    assert distance_bins(2) == [(0, 0), (1, 1)]
    assert distance_bins(8) == [(0, 0), (1, 1), (2, 3), (4, 7)]
    assert distance_bins(11) == [(0, 0), (1, 1), (2, 3), (4, 7), (8, 10)]
    for length in range(1, 70):  # every distance in exactly one bin: its bit length's
        bins = distance_bins(length)
        assert [b for b, (lo, hi) in enumerate(bins) for _ in range(lo, hi + 1)] == [
            d.bit_length() for d in range(length)]


def test_uniform_attention_gives_the_harmonic_sink_share_and_log_entropy():
    """q = 0: every query m spreads 1/(m+1) over its keys, so the sink share is mean 1/(m+1) and
    the entropy mean log(m+1) (beyond: over m >= train_len), and every logit is 0."""
    t, train_len = 13, 5
    q = torch.zeros(1, 2, t, 4, dtype=torch.float64)
    k = torch.randn(1, 2, t, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rows = layer_head_statistics(Layer(q, k, None), train_len, chunk=4)
    for row in rows:
        assert row["sink_share"] == pytest.approx(sum(1 / (m + 1) for m in range(t)) / t, rel=1e-12)
        assert row["entropy"] == pytest.approx(sum(math.log(m + 1) for m in range(t)) / t, rel=1e-12)
        beyond = range(train_len, t)
        assert row["sink_share_beyond"] == pytest.approx(sum(1 / (m + 1) for m in beyond) / len(beyond), rel=1e-12)
        assert row["entropy_beyond"] == pytest.approx(sum(math.log(m + 1) for m in beyond) / len(beyond), rel=1e-12)
        assert row["max_logit"] == [0.0] * len(distance_bins(t))


@pytest.mark.parametrize("alibi, sinks, window, stick", [
    (False, False, 0, False), (True, False, 0, False), (False, True, 0, False), (False, False, 5, False),
    (False, False, 0, True)], ids=["softmax", "alibi", "sinks", "window", "stick-breaking"])
def test_head_statistics_match_float64_definitions_on_hand_built_attention(alibi, sinks, window, stick):
    g = torch.Generator().manual_seed(2)
    h, t, d, train_len = 3, 29, 8, 9
    q = torch.randn(1, h, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, h, t, d, generator=g, dtype=torch.float64)
    k[0, :, 0] *= 4.0  # a first key that stands out: a sink in some rows
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64) if alibi else None
    layer = Layer(q, k, slopes, window=window, sinks=torch.tensor([2.0, -1.0, 0.5]) if sinks else None,
                  weights=STICK_BREAKING.weights if stick else None)
    m, n = torch.arange(t)[:, None], torch.arange(t)[None, :]
    bias = -slopes[:, None, None] * (m - n) if alibi else None
    got = layer_head_statistics(layer, train_len, chunk=7)  # chunks that straddle the training length
    want = reference_heads(q, k, bias, window, layer.sinks, stick, train_len)
    assert_rows_match(got, want)
    if stick:  # no query sees its own key, and query 0 sees none
        assert got[0]["max_logit"][0] is None
    if window:  # key 0 is out of every window past the training length
        assert all(r["sink_share_beyond"] == 0.0 for r in got)
    elif not stick:  # stick-breaking reaches key 0 last: little of its stick is left there
        assert any(w["sink_share"] > 0.2 for w in want)  # the hand-built sink shows


def test_a_segment_within_the_training_length_has_nothing_beyond():
    q = torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(4))
    rows = head_statistics([Layer(q, q, None), Layer(q, q, None)], train_len=6, chunk=4)
    assert [(r["layer"], r["head"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["sink_share_beyond"] is None and r["entropy_beyond"] is None for r in rows)


@pytest.mark.parametrize("attention, form", VARIANTS + [("origin", "slack")], ids=IDS + ["origin with sinks"])
def test_every_designs_capture_gives_the_definitions_measures(attention, form, request):
    """Through `GPT.capture_qk` of a small float64 model past its training length (8 tokens, 20
    read): each layer's measures equal the definitions on its captured q, k, bias, window, sinks,
    and stick-breaking's weights."""
    sinks = request.node.callspec.id == "origin with sinks"
    model = small(attention, form, **({"sinks": True} if sinks else {}))
    idx = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(5))
    layers = model.capture_qk(idx)
    got = head_statistics(layers, train_len=8, chunk=6)
    for i, layer in enumerate(layers):
        assert (layer.sinks is not None) == sinks
        bias = None if layer.bias is None else layer.bias.scores(0, 20, layer.q_eff.device)
        want = reference_heads(layer.q_eff, layer.k_eff, bias, layer.window, layer.sinks, layer.weights is not None, 8)
        assert_rows_match([{k: v for k, v in r.items() if k != "layer"} for r in got if r["layer"] == i + 1], want)


def test_report_writes_the_head_table_and_a_column_per_distance_bin(tmp_path):
    meta = {"run": "r", "label": "origin", "train_len": 2, "step": 1, "source": "stdlib"}
    row = {"scaling": "none", "layer": 1, "max_score": 1.0, "min_score": 0.0, "mean_score": 0.5, "std_score": 0.1,
           "outlier_count": 0, "outlier_ratio": 0.0, "max_zscore": 1.0, "local_mass": 1.0, "n_scores": 10}
    heads = [{"scaling": "none", "length": n, "layer": 1, "head": h, "sink_share": s, "entropy": e,
              "sink_share_beyond": b, "entropy_beyond": None if b is None else 2 * e,
              "max_logit": [1.0, 2.0, 3.0, 4.0][: len(distance_bins(n))]}
             for n, h, s, e, b in [(2, 1, 0.5, 1.0, None), (2, 2, 0.25, 0.5, None), (8, 1, 0.75, 1.5, 0.5),
                                   (8, 2, 0.25, 0.5, 0.25)]]
    eval_dir = tmp_path / "eval"
    result_files.save_json(eval_dir / "attention.json", {
        "meta": meta, "rows": [row], "length": 8, "sigma": 6.0, "window": 16, "heads": heads,
        "head_lengths": [2, 8], "distance_bins": distance_bins(8)})
    report.render(report.run_results(eval_dir), eval_dir)
    md = (eval_dir / "report.md").read_text()
    assert "| none | 2 | 1 | 0.375 | 0.5 |  | 0.75 |  |" in md  # means and largest over the two heads
    assert "| none | 8 | 1 | 0.5 | 0.75 | 0.375 | 1 | 2 |" in md
    with open(eval_dir / "attention_heads.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[-4:] == ["max_logit_d0-0", "max_logit_d1-1", "max_logit_d2-3", "max_logit_d4-7"]
    assert [(r["length"], r["head"], r["max_logit_d1-1"], r["max_logit_d4-7"]) for r in rows] == [
        ("2", "1", "2.0", ""), ("2", "2", "2.0", ""), ("8", "1", "2.0", "4.0"), ("8", "2", "2.0", "4.0")]


@pytest.mark.slow
def test_eval_attention_writes_the_head_measures_at_1x_4x_and_16x(micro_run, tmp_path):
    """`python -m eval task=attention` on the session's micro run (training length 32): every head of
    every layer at 32, 128 and 512 tokens under each scaling; as trained, the 32-token segment is the
    start of the 512-token one, so its largest logit per bin is at most the longer segment's."""
    out = tmp_path / "eval"
    assert main([f"run={micro_run}", f"out_dir={out}", "progress=false", "wandb.mode=disabled", "task=attention",
                 "attention.length=64", "attention.scalings=[none,dynamic:4]"]) == 0
    result = result_files.load_results(out)["attention"]
    meta, heads = result["meta"], result["heads"]
    n_head = model_config_of(find_checkpoint(micro_run)).n_head
    assert result["head_lengths"] == [32, 128, 512] and result["distance_bins"] == [list(b) for b in distance_bins(512)]
    assert sorted((r["scaling"], r["length"], r["layer"], r["head"]) for r in heads) == sorted(
        (s, n, layer, h) for s in ("none", "dynamic:4") for n in (32, 128, 512)
        for layer in range(1, meta["n_layer"] + 1) for h in range(1, n_head + 1))
    for r in heads:
        assert 0 <= r["sink_share"] <= 1 and r["entropy"] >= 0
        assert (r["sink_share_beyond"] is None) == (r["length"] == 32)
    at = {(r["scaling"], r["length"], r["layer"], r["head"]): r["max_logit"] for r in heads}
    for (scaling, length, layer, head), short in at.items():
        if scaling == "none" and length == 32:
            assert all(a <= b for a, b in zip(short, at[(scaling, 512, layer, head)]))
    assert (out / "attention_heads.csv").stat().st_size > 0 and "## Sink share" in (out / "report.md").read_text()
