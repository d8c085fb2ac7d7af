"""`train.start.plan_start`: the one decision of what a run's start is, on checkpoint directories
made here (their `COMPLETE` markers; nothing trains) and a Hugging Face directory saved by
transformers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from train.checkpoint import MARKER
from train.config import compose, to_train_config
from train.start import plan_start


def _cfg(*overrides: str):
    return to_train_config(compose(list(overrides)))


def _checkpoint(run_dir: Path, step: int, world_size: int = 1, sequence: int = 1) -> Path:
    ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / MARKER).write_text(json.dumps({"step": step, "world_size": world_size, "sequence": sequence}))
    return ckpt


def test_fresh_resume_elastic_and_finished(tmp_path):
    run = tmp_path / "run"
    fresh = plan_start(cfg := _cfg(f"run_dir={run}", "resume=auto", "max_steps=8"))
    assert (fresh.kind, fresh.checkpoint, fresh.init_from, fresh.written) == ("fresh", None, None, None)
    assert fresh.cfg is cfg and not fresh.elastic(2)
    ckpt = _checkpoint(run, 4, world_size=2, sequence=2)
    resumed = plan_start(_cfg(f"run_dir={run}", "resume=auto", "max_steps=8", "parallel.sequence=2",
                              "model.n_head=4"))
    assert (resumed.kind, resumed.checkpoint, resumed.written) == ("resume", ckpt, (2, 2))
    assert not resumed.elastic(2) and resumed.elastic(4)  # another world size re-plans the layout
    assert plan_start(_cfg(f"run_dir={run}", "resume=auto", "max_steps=8")).elastic(2)  # another P
    done = _checkpoint(run, 8)
    finished = plan_start(_cfg(f"run_dir={run}", "resume=auto", "max_steps=8"))
    assert (finished.kind, finished.checkpoint) == ("finished", done)


def test_a_branch_starts_from_its_source_then_resumes_its_own(tmp_path):
    source = _checkpoint(tmp_path / "source", 6)
    branch = tmp_path / "branch"
    first = plan_start(_cfg(f"run_dir={branch}", f"branch_from={source}", "resume=auto", "max_steps=8"))
    assert (first.kind, first.checkpoint) == ("branch", source)
    own = _checkpoint(branch, 7)
    again = plan_start(_cfg(f"run_dir={branch}", f"branch_from={source}", "resume=auto", "max_steps=8"))
    assert (again.kind, again.checkpoint) == ("resume", own)


def test_init_from_a_hugging_face_directory_plans_its_model_without_changing_the_config(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64,
                                 tie_word_embeddings=True)).save_pretrained(hf)
    cfg = _cfg(f"run_dir={tmp_path / 'run'}", f"init_from={hf}")
    given = dataclasses.replace(cfg.model)
    start = plan_start(cfg)
    assert (start.kind, start.init_from, start.checkpoint) == ("init_from", hf, None)
    assert start.source is not None and start.source.hf is not None
    m = start.cfg.model
    assert (m.arch, m.n_layer, m.n_embd, m.kv_heads, m.vocab_size, m.max_seq_len) == ("llama", 2, 32, 2, 300, 64)
    assert cfg.model == given and start.cfg is not cfg  # a new config: the given one is unchanged


def test_a_run_that_would_be_overwritten_is_refused(tmp_path):
    from train.checkpoint import CheckpointError

    _checkpoint(tmp_path / "run", 2)
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        plan_start(_cfg(f"run_dir={tmp_path / 'run'}"))
