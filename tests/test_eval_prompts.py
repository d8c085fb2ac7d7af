"""Evaluation prompt streams (data.tasks): per-run prompts, the fixed set as first published, the
training bar's cases disjoint from the final evaluation's, and training rows left untouched."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import data.synthetic as synthetic
from bench.passkey_progress import bar_cases
from data.config import DataConfig, SourceConfig, TokenizerConfig
from data.tasks import bar_key, held_out, make_cases, make_recall_cases
from data.tokenizer import get_tokenizer
from eval.config import EvalConfig

ROOT = Path(__file__).resolve().parents[1]
# The last commit before the evaluation streams: its data/tasks.py made today's fixed cases and the
# training rows the study's runs were trained on.
BEFORE_STREAMS = "9111230"
SEEDS = [1, 2, 3, 4, 5, 6]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The stdlib tokenizer at 1024 pieces: enough whole-word pieces for recall keys."""
    cache = tmp_path_factory.getbasetemp() / "prompts_tokenizer"
    return get_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=1024, sample_docs=60), cache_dir=str(cache)))


@pytest.fixture(scope="module")
def committed_tasks():
    """data/tasks.py as committed before the streams existed, imported as its own module."""
    done = subprocess.run(["git", "show", f"{BEFORE_STREAMS}:data/tasks.py"], cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"git history without commit {BEFORE_STREAMS}: {done.stderr.strip()[:80]}")
    spec = importlib.util.spec_from_loader("tasks_before_streams", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    exec(compile(done.stdout, f"{BEFORE_STREAMS}:data/tasks.py", "exec"), module.__dict__)
    yield module
    del sys.modules[spec.name]


def eval_cases(tok, run_seed: int, length: int, n: int, prompt_seed: str = "run"):
    """The passkey cases `python -m eval` scores for a run of this seed (its stream and seed)."""
    stream, seed = EvalConfig(run="r", prompt_seed=prompt_seed).prompt_stream(run_seed)
    return make_cases(tok, length, n, seed, prefix=[tok.eos_id], stream=stream)


def pairs(cases) -> set[tuple[str, float]]:
    return {(c.key, c.depth) for c in cases}


def test_prompt_seed_names_the_stream_and_its_seed():
    assert EvalConfig(run="r").prompt_stream(7) == ("eval", 7)
    assert EvalConfig(run="r", prompt_seed="3").prompt_stream(7) == ("eval", 3)
    assert EvalConfig(run="r", prompt_seed="fixed", seed=5).prompt_stream(7) == ("fixed", 5)
    for bad in ("runs", "-1", "2.5", ""):
        with pytest.raises(ValueError, match="prompt_seed"):
            EvalConfig(run="r", prompt_seed=bad)


def test_per_run_prompts_differ_across_seeds_and_repeat_for_one(tok):
    by_seed = {s: eval_cases(tok, s, 300, 20) for s in SEEDS}
    for s in SEEDS:
        again = eval_cases(tok, s, 300, 20)
        assert [c.tokens for c in again] == [c.tokens for c in by_seed[s]]
    for a in SEEDS:
        for b in SEEDS:
            if a < b:  # 20 keys of ~5600: two seeds sharing more than a few would be one stream
                assert len({c.key for c in by_seed[a]} & {c.key for c in by_seed[b]}) <= 2
    assert all(held_out(c.key) and not bar_key(c.key) for cases in by_seed.values() for c in cases)
    # another length is another draw of the same run's stream
    assert {c.key for c in eval_cases(tok, 1, 400, 20)} != {c.key for c in by_seed[1]}


def test_per_run_recall_prompts_differ_across_seeds_and_repeat_for_one(tok):
    def tokens(seed: int) -> list[list[int]]:
        return [c.tokens for c in make_recall_cases(tok, 300, 4, 4, seed, [tok.eos_id], stream="eval")]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    assert tokens(1) != [c.tokens for c in make_recall_cases(tok, 300, 4, 4, 1, [tok.eos_id])]  # not fixed
    with pytest.raises(ValueError, match="training bar is passkey only"):
        make_recall_cases(tok, 300, 1, 4, 1, stream="bar")


def test_fixed_flag_gives_the_cases_every_run_shared(tok, committed_tasks):
    for length in (256, 400):
        before = committed_tasks.make_cases(tok, length, 16, 0, prefix=[tok.eos_id])
        for run_seed in (1, 2):  # the same, whatever the run
            now = eval_cases(tok, run_seed, length, 16, prompt_seed="fixed")
            assert [(c.key, c.depth, c.tokens) for c in now] == [(c.key, c.depth, c.tokens) for c in before]
        recall_before = committed_tasks.make_recall_cases(tok, length, 3, 4, 0, [tok.eos_id])
        recall_now = make_recall_cases(tok, length, 3, 4, 0, [tok.eos_id], stream="fixed")
        assert [c.tokens for c in recall_now] == [c.tokens for c in recall_before]


@pytest.mark.parametrize("length", [256, 512])
def test_bar_cases_share_no_key_and_depth_with_the_evaluation(tok, length):
    for seed in SEEDS:
        final, bar = eval_cases(tok, seed, length, 100), bar_cases(tok, length, 60, seed)
        assert len(pairs(final)) == 100 and len(pairs(bar)) == 60
        assert not pairs(final) & pairs(bar)
        assert not {c.key for c in final} & {c.key for c in bar}  # not even a key
        assert all(held_out(c.key) for c in bar)  # never a training key either


def test_bar_keys_are_half_the_held_out_keys():
    keys = [str(k) for k in range(10000, 100000)]
    evaluation = [k for k in keys if held_out(k)]
    bar = [k for k in evaluation if bar_key(k)]
    assert not [k for k in keys if bar_key(k) and not held_out(k)]
    assert 0.45 < len(bar) / len(evaluation) < 0.55


@pytest.mark.parametrize("task", ["passkey", "recall"])
def test_training_rows_are_those_of_the_committed_builders(tok, committed_tasks, monkeypatch, task):
    """The rows the study trains on are bitwise those of data/tasks.py before the streams existed."""
    src = SourceConfig(kind="synthetic", task=task, loss_on="answer")

    def rows(seed: int) -> list[list[int]]:
        cursor = synthetic.SyntheticCursor(src, tok, seed=seed, rank=0, worker=0)
        return [cursor.next_block(256).tolist() for _ in range(40)]

    now = {seed: rows(seed) for seed in (1, 2, 3)}
    for name in ("build_case", "build_recall", "draw_passkey", "passkey_min_length", "recall_min_length",
                 "recall_vocab"):
        monkeypatch.setattr(synthetic, name, getattr(committed_tasks, name))
    assert {seed: rows(seed) for seed in (1, 2, 3)} == now
