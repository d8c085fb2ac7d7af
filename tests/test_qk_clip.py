"""QK-clip (`train.qk_clip`): the per-head max logit against an explicit float64 computation, the
clip's exact effect on NeoX's fused qkv, Llama's grouped-query heads and CoCA's quadratic q, the
designs it refuses, and the per-layer record of a real run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from errors import ConfigError
from model import GPT, ModelConfig
from run_checks import clean_env, ok
from train import qk_clip

REPO = Path(__file__).resolve().parents[1]


def _reference(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """The definition, pair by pair in float64."""
    B, H, Tq, D = q.shape
    offset = k.shape[-2] - Tq
    best = [-math.inf] * H
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                m = offset + i
                for n in range(m + 1):
                    if window and m - n >= window:
                        continue
                    value = float((q[b, h, i].double() * k[b, h, n].double()).sum()) / math.sqrt(D)
                    best[h] = max(best[h], value)
    return torch.tensor(best, dtype=torch.float64)


@pytest.mark.parametrize("tq, tk, window, rows", [(9, 9, 0, 4), (5, 12, 0, 2), (11, 11, 3, 4)])
def test_qk_clip_max_logit_equals_float64_reference(tq, tk, window, rows):
    """Chunked by query rows (rows smaller than T), with a KV offset and a window: equal to the
    pair-by-pair float64 maximum, the far-away large scores masked out."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 3, tq, 8, generator=gen), torch.randn(2, 3, tk, 8, generator=gen)
    k[:, :, 0] *= 25.0  # the first key dominates where visible (not within a window of 3 beyond row 2)
    got = qk_clip.max_logits(q, k, window, rows=rows)
    assert torch.allclose(got.double(), _reference(q, k, window), rtol=1e-6, atol=1e-6)


def _model(**overrides) -> GPT:
    cfg = dict(n_layer=2, n_head=4, n_embd=64, ffn_hidden=128, vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**cfg, **overrides}))
    with torch.no_grad():  # large logits: q and k projections x 6
        for block in model.h:
            for name in ("qkv", "q", "k"):
                if hasattr(block.attn, name):
                    getattr(block.attn, name).weight.mul_(6.0)
    return model


LLAMA = dict(arch="llama", parallel_residual=False)


@pytest.mark.parametrize("overrides, expected_degree", [({}, (1, 1)), ({**LLAMA, "n_kv_head": 2}, (1, 1)),
                                                        ({**LLAMA}, (1, 1)), ({"attention": "coca"}, (2, 1)),
                                                        ({"attention": "alibi"}, (1, 1))])
def test_qk_clip_brings_clipped_heads_to_the_threshold_and_leaves_the_others(overrides, expected_degree):
    model = _model(**overrides)
    idx = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    degree = qk_clip.degrees(model)
    assert degree == expected_degree
    before = torch.stack([torch.stack(layer) for layer in zip(*(qk_clip._layer_logits(model, i) for i in idx))])
    before = before.amax(dim=1)  # [layers, H]
    threshold = float(before.median())
    record = qk_clip.clip(model, idx, threshold, degree)
    # layer 0's inputs are unchanged by the clip, so its remeasured maxima are exact; later layers'
    # inputs moved with layer 0's outputs
    after = torch.stack([qk_clip._layer_logits(model, i)[0] for i in idx]).amax(dim=0)
    over = before[0] > threshold
    assert over.any() and (~over).any()
    assert torch.allclose(after[over], torch.full_like(after[over], threshold), rtol=1e-4)
    assert torch.equal(after[~over], before[0][~over])  # a head's rows only: the others bitwise (GQA too)
    assert record["qk_clipped/0"] == int(over.sum())
    assert record["qk_max_logit/0"] == pytest.approx(float(before[0].max()))


@pytest.mark.parametrize("overrides", [{"attention": "pope"}, {"qk_norm": True}])
def test_qk_clip_refuses_designs_whose_logits_do_not_scale(overrides):
    with pytest.raises(ConfigError, match="nothing to clip") as error:
        qk_clip.degrees(_model(**overrides))
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_qk_clip_run_logs_clipped_heads_per_layer(tmp_path):
    """A real run under Muon with a low threshold: every step's record names each layer's max logit,
    and heads are clipped at every step."""
    run_dir = tmp_path / "run"
    ok(subprocess.run([sys.executable, "-m", "train", "experiment=micro", "optim=muon", "optim.qk_clip=0.02",
                       "logger.wandb=disabled", "logger.progress=false", "max_steps=4", "eval_every=4",
                       "ckpt_every=4", f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"],
                      cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    clips = [r for r in rows if "qk_max_logit/0" in r]
    assert [r["step"] for r in clips] == [1, 2, 3, 4]
    assert all(r["qk_clipped/0"] >= 1 and r["qk_max_logit/0"] > 0.02 for r in clips)


def test_the_clip_log_counts_each_layers_clipped_steps(tmp_path, capsys):
    """`python -m eval.qk_clip_log`: a hand-written log of 10 steps (records at the log interval, 5, and
    wherever a head was clipped), plain and in its published gzip form, gives the counts written here;
    a run without a log, or a log without QK-clip records, is one line, exit 1."""
    import gzip

    from eval import qk_clip_log

    log = [{"step": 1, "loss": 5.0},
           {"step": 2, "qk_max_logit/0": 14.0, "qk_clipped/0": 2, "qk_max_logit/1": 9.0, "qk_clipped/1": 0},
           {"step": 5, "qk_max_logit/0": 12.5, "qk_clipped/0": 0, "qk_max_logit/1": 8.0, "qk_clipped/1": 0},
           {"step": 7, "qk_max_logit/0": 13.5, "qk_clipped/0": 1, "qk_max_logit/1": 13.2, "qk_clipped/1": 1},
           {"step": 10, "loss": 4.0},
           {"step": 10, "qk_max_logit/0": 12.0, "qk_clipped/0": 0, "qk_max_logit/1": 7.0, "qk_clipped/1": 0}]
    text = "".join(json.dumps(r) + "\n" for r in log)
    plain, published = tmp_path / "plain", tmp_path / "published"
    plain.mkdir(), published.mkdir()
    (plain / "metrics.jsonl").write_text(text)
    (published / "metrics.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    want = [{"layer": 0, "steps": 10, "steps_clipped": 2, "heads_per_step": 0.3, "first_clipped": 2,
             "last_clipped": 7, "max_logit": 14.0},
            {"layer": 1, "steps": 10, "steps_clipped": 1, "heads_per_step": 0.1, "first_clipped": 7,
             "last_clipped": 7, "max_logit": 13.2}]
    for run in (plain, published):
        assert [{k: v for k, v in row.items() if k != "run"} for row in qk_clip_log.summary(run)] == want
    assert qk_clip_log.main([str(plain), "--out", str(tmp_path / "log.csv")]) == 0
    assert "| plain | 0 | 10 | 2 | 0.300 | 2 | 7 | 14.00 |" in capsys.readouterr().out
    assert (tmp_path / "log.csv").read_text().splitlines()[0].startswith("run,layer,steps,steps_clipped")
    (tmp_path / "none").mkdir()
    (tmp_path / "adamw").mkdir()
    (tmp_path / "adamw" / "metrics.jsonl").write_text(json.dumps(log[0]) + "\n")
    for run, line in ((tmp_path / "none", "no training log (metrics.jsonl or metrics.jsonl.gz)"),
                      (tmp_path / "adamw", "its training log has no QK-clip records")):
        assert qk_clip_log.main([str(run)]) == 1
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {run}: {line}" + (
            " (trained without optim.qk_clip?)" if "records" in line else "")]
