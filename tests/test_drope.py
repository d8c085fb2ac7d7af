"""DroPE end to end (`experiment=drope`, docs/DESIGN.md "DroPE"): a tiny Origin run of the study's
preset (shrunk: width 32, 2 steps; its 256 tokens) -> `experiment=drope init_from=<it>` with the same
shrinking (2 steps) -> `python -m eval task=ppl` at the training length and twice it. The DroPE
run's model is NoPE with QK-norm at the source's length, and its checkpoint holds the norms'
scales, which training moved from the conversion's 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from run_checks import clean_env, ok
from train.load import load_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

REPO = Path(__file__).resolve().parents[1]
SHRINK = ["model.n_embd=32", "model.ffn_hidden=64", "batch_size=2", "micro_batch_size=2",
          "max_steps=2", "eval_every=2", "eval_batches=1", "ckpt_every=2", "optim.warmup_steps=1",
          "data.tokenizer.vocab_size=2048", "data.tokenizer.sample_docs=30", "data.num_workers=0",
          "data.shuffle_buffer=16", "logger=none", "logger.progress=false"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return ok(subprocess.run([sys.executable, *args], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                             timeout=600))


def test_drope_recalibrates_an_origin_run_and_evaluates_beyond_its_length(tmp_path):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    source, run = tmp_path / "origin", tmp_path / "drope"
    _run("-m", "train", "experiment=study_origin", *SHRINK, cache, f"run_dir={source}")
    _run("-m", "train", "experiment=drope", *SHRINK, cache, f"init_from={source}", f"run_dir={run}")
    before, _, _ = load_model(str(source))
    model, _, _ = load_model(str(run))
    assert model.cfg.attention == "nope" and model.cfg.qk_norm and model.cfg.max_seq_len == before.cfg.max_seq_len
    assert before.cfg.attention == "origin" and not before.cfg.qk_norm
    state = model.state_dict()
    for layer in range(model.cfg.n_layer):
        q, k = state[f"h.{layer}.attn.q_norm.weight"], state[f"h.{layer}.attn.k_norm.weight"]
        assert q.shape == k.shape == (32,) and not torch.equal(q, torch.ones_like(q))
    assert set(state) - set(before.state_dict()) == {f"h.{i}.attn.{n}_norm.weight" for i in range(2) for n in "qk"}
    _run("-m", "eval", f"run={run}", f"out_dir={tmp_path / 'eval'}", "task=ppl", "ppl.lengths=[256,512]",
         "ppl.n_docs=1", "progress=false", "wandb.mode=disabled")
    assert json.loads((tmp_path / "eval" / "ppl.json").read_text())
