"""Sliding-window perplexity against independent float64 references, and the scaling sweep."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from eval.config import Scaling
from eval.perplexity import evaluate_perplexity
from eval.sweep import applicable, default_plot_layers, sweep_attention, sweep_ppl
from model import DESIGNS, GPT
from model.config import flavor

L0 = 32  # training length of the test models


def gpt(attention: str = "origin", **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(flavor("tiny", vocab_size=256, n_layer=2, n_embd=64, n_head=4, ffn_hidden=128,
                      max_seq_len=L0, attention=attention, **kw)).eval()


def doc(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def nll64(model: GPT, inputs: list[int], targets: list[int]) -> torch.Tensor:
    """Per-token NLL of one sequence from the plain logits, in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([inputs]))[0].double()
    return F.cross_entropy(logits, torch.tensor(targets), reduction="none")


def test_ppl_at_training_length_is_exp_mean_token_loss():
    model, docs = gpt(), [doc(L0 + 1, s) for s in range(3)]
    (r,) = evaluate_perplexity(model, docs, [L0], stride=L0, progress=False)
    want = torch.cat([nll64(model, d[:-1], d[1:]) for d in docs]).mean().exp().item()
    assert r.tokens == 3 * L0
    assert r.ppl == pytest.approx(want, rel=1e-5)


def test_stride_equal_to_window_is_non_overlapping_evaluation():
    model, d = gpt(), doc(4 * L0 + 1)
    # documents are cut to the longest length: evaluating 4 * L0 too makes L0 read all of d
    r, _ = evaluate_perplexity(model, [d], [L0, 4 * L0], stride=L0, progress=False)
    chunks = [nll64(model, d[i : i + L0], d[i + 1 : i + L0 + 1]) for i in range(0, 4 * L0, L0)]
    assert r.ppl == pytest.approx(torch.cat(chunks).mean().exp().item(), rel=1e-5)


@pytest.mark.parametrize("attention", ["origin", "alibi", "coca"])
def test_overlapping_windows_match_press_reference_loop(attention):
    """The Hugging Face / Press et al. loop (windows start every `stride` tokens, each counts the
    tokens after the previous window's end) on a length where its windows are all full."""
    model, length, stride = gpt(attention), 2 * L0, 12
    n = length + 5 * stride + 1
    d = doc(n, seed=7)
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, n - 1, stride):
        end = min(begin + length, n - 1)
        losses = nll64(model, d[begin:end], d[begin + 1 : end + 1])
        new = end - prev_end
        total, count, prev_end = total + losses[-new:].sum().item(), count + new, end
        if end == n - 1:
            break
    r, _ = evaluate_perplexity(model, [d], [length, n - 1], stride=stride, batch_tokens=1, progress=False)
    assert r.tokens == count == n - 1
    assert r.ppl == pytest.approx(math.exp(total / count), rel=1e-5)
    batched, _ = evaluate_perplexity(model, [d], [length, n - 1], stride=stride, batch_tokens=10**6, progress=False)
    assert batched.ppl == pytest.approx(r.ppl, rel=1e-5)


def test_lengths_share_documents_cut_to_the_longest_and_short_ones_fail():
    model = gpt()
    docs = [doc(4 * L0 + 50, s) for s in range(2)]
    rows = evaluate_perplexity(model, docs, [L0, 2 * L0, 4 * L0], stride=L0, progress=False)
    assert [r.tokens for r in rows] == [2 * 4 * L0] * 3
    with pytest.raises(ValueError, match="shorter than 257 tokens"):
        evaluate_perplexity(model, [doc(100)], [256], stride=L0, progress=False)


def test_sweep_restores_trained_scaling_and_does_not_leak_lengths():
    model, d = gpt(), doc(8 * L0 + 1)
    none, dyn = Scaling("none"), Scaling("dynamic", 4.0)
    rows = sweep_ppl(model, [d], [L0, 8 * L0], L0, [none, dyn], none, batch_tokens=4096, progress=False)
    ppl = {(r["scaling"], r["length"]): r["ppl"] for r in rows}
    assert model.cfg.rope_scaling.type == "none"
    # dynamic NTK changes nothing at the training length, and something at 8x
    assert ppl[("dynamic:4", L0)] == pytest.approx(ppl[("none", L0)], rel=1e-6)
    assert ppl[("dynamic:4", 8 * L0)] != pytest.approx(ppl[("none", 8 * L0)], rel=1e-6)
    # evaluating at 8x first does not leak its base into a later evaluation at 1x
    again = sweep_ppl(model, [d], [8 * L0, L0], L0, [dyn], none, batch_tokens=4096, progress=False)
    assert again[1]["length"] == L0
    assert again[1]["ppl"] == pytest.approx(ppl[("dynamic:4", L0)], rel=1e-6)


def test_alibi_skips_rope_scalings_with_a_note():
    kept, notes = applicable([Scaling("none"), Scaling("dynamic", 4.0)], DESIGNS["alibi"])
    assert kept == [Scaling("none")] and "dynamic:4 skipped" in notes[0]
    kept, notes = applicable([Scaling("linear", 2.0)], DESIGNS["alibi"])
    assert kept == [Scaling("none")] and len(notes) == 2
    assert applicable([Scaling("yarn", 2.0)], DESIGNS["coca"]) == ([Scaling("yarn", 2.0)], [])


@pytest.mark.parametrize("attention", ["origin", "alibi", "coca"])
def test_attention_sweep_statistics_and_profiles(attention):
    model = gpt(attention)
    scalings, _ = applicable([Scaling("none"), Scaling("dynamic", 4.0)], model.cfg.design)
    rows, profiles = sweep_attention(model, doc(4 * L0), scalings, Scaling("none"), [1, 2], sigma=4.0, window=8,
                                     chunk=16)
    assert [(r["scaling"], r["layer"]) for r in rows] == [(s.label, i) for s in scalings for i in (1, 2)]
    for r in rows:
        assert r["n_scores"] == 4 * (4 * L0) * (4 * L0 + 1) // 2
        assert 0 < r["local_mass"] <= 1 and r["max_score"] >= r["mean_score"] >= r["min_score"]
    assert all(p.shape == (4, 4 * L0) and np.isfinite(p).all() for s in profiles.values() for p in s.values())
    if attention != "alibi":  # the scaling changes scores beyond the training length
        assert rows[1]["max_score"] != rows[3]["max_score"]


def test_default_plot_layers_are_the_papers():
    assert default_plot_layers(24) == [6, 12, 18, 24]
    assert default_plot_layers(4) == [1, 2, 3, 4]
    assert default_plot_layers(2) == [1, 2]


def test_the_length_temperature_is_an_axis_of_the_sweep():
    """`+temp` switches the temperature on for that scaling, also for a design without RoPE (whose
    other scalings are skipped), and the trained setting is restored after the sweep."""
    assert Scaling.parse("dynamic:8+temp") == Scaling("dynamic", 8.0, True)
    assert Scaling.parse("none+temp").label == "none+temp" and Scaling.parse("dynamic:8").label == "dynamic:8"
    scalings = [Scaling.parse(s) for s in ("none", "dynamic:4", "none+temp", "dynamic:4+temp")]
    assert applicable(scalings, DESIGNS["alibi"])[0] == [scalings[0], scalings[2]]
    model, d, none = gpt(), doc(4 * L0 + 1), Scaling("none")
    ppl = {(r["scaling"], r["length"]): r["ppl"]
           for r in sweep_ppl(model, [d], [L0, 4 * L0], L0, scalings, none, batch_tokens=4096, progress=False)}
    assert ppl[("none+temp", L0)] == ppl[("none", L0)]  # 1 up to the training length
    assert ppl[("none+temp", 4 * L0)] != ppl[("none", 4 * L0)]
    assert ppl[("dynamic:4+temp", 4 * L0)] not in (ppl[("dynamic:4", 4 * L0)], ppl[("none+temp", 4 * L0)])
    assert not model.cfg.length_temperature and model.cfg.rope_scaling.type == "none"
