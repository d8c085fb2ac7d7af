"""data/synthetic.py and data/tasks.py: retrieval rows for training, the same prompts as evaluation."""

from __future__ import annotations

import io
import re
from itertools import islice

import pytest
import torch

from data.config import DataConfig, SourceConfig, TokenizerConfig
from data.loader import build_loader
from data.sources import open_source, text_of
from data.synthetic import SyntheticCursor, document_ids, split_block
from data.tasks import (
    INSTRUCTION,
    KEY_LINE,
    QUESTION,
    build_case,
    held_out,
    make_cases,
    make_recall_cases,
    passkey_min_length,
    recall_vocab,
)
from data.tokenizer import Tokenizer, get_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")

SEQ = 255  # blocks of 256 tokens


@pytest.fixture(scope="session")
def tok(tmp_path_factory) -> Tokenizer:
    """The stdlib tokenizer at 1024 pieces: enough whole-word pieces for recall keys."""
    cache = tmp_path_factory.mktemp("synthetic_cache")
    return get_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=1024, sample_docs=60), cache_dir=str(cache)))


def _source(task: str, loss_on: str = "all", **kw) -> SourceConfig:
    return SourceConfig(kind="synthetic", task=task, loss_on=loss_on, **kw)


def _blocks(cursor: SyntheticCursor, n: int) -> list:
    return [cursor.next_block(SEQ + 1) for _ in range(n)]


def _tokens(block) -> list[int]:
    return [t if t >= 0 else -t - 1 for t in block.tolist()]


def _prompt_of(tok: Tokenizer, block) -> list[int]:
    """The row without its EOS padding (the row starts with EOS; padding is EOS marked untrained)."""
    ids = _tokens(block)
    end = len(ids)
    while end > 1 and ids[end - 1] == tok.eos_id and block[end - 1] < 0:
        end -= 1
    return ids[:end]


def test_config_checks_task_and_loss():
    with pytest.raises(ValueError, match="data.sources.task"):
        SourceConfig(kind="synthetic", task="copy")
    with pytest.raises(ValueError, match="data.sources.loss_on"):
        SourceConfig(kind="synthetic", loss_on="answers")


def test_rows_are_deterministic_per_seed_rank_worker(tok):
    src = _source("passkey")
    a = _blocks(SyntheticCursor(src, tok, seed=3, rank=0, worker=0), 5)
    b = _blocks(SyntheticCursor(src, tok, seed=3, rank=0, worker=0), 5)
    assert all((x == y).all() for x, y in zip(a, b))
    for other in (dict(seed=4, rank=0, worker=0), dict(seed=3, rank=1, worker=0), dict(seed=3, rank=0, worker=1)):
        c = _blocks(SyntheticCursor(src, tok, **other), 5)
        assert not any((x == y).all() for x, y in zip(a, c)), other


def test_passkey_rows_are_the_evaluation_prompt(tok):
    """Each row is exactly what the evaluation's builder makes for its key, depth and length."""
    cursor = SyntheticCursor(_source("passkey"), tok, seed=0, rank=0, worker=0)
    shortest = passkey_min_length(tok, [tok.eos_id])
    lengths = []
    for block in _blocks(cursor, 40):
        ids = _prompt_of(tok, block)
        text = tok.decode(ids)
        assert ids[0] == tok.eos_id and text.startswith(INSTRUCTION) and QUESTION in text
        key = re.search(r"The pass key is (\d{5})\. Remember it\.", text).group(1)
        assert KEY_LINE.format(key=key) in text and text.endswith(f"{QUESTION} {key}")
        n_filler = text.count(".") - INSTRUCTION.count(".") - KEY_LINE.count(".") - QUESTION.count(".")
        before = text[: text.index("The pass key is")].count(".") - INSTRUCTION.count(".")
        depth = before / n_filler if n_filler else 0.0
        # the eval builder, given this row's length, fills the same sentences around the same key
        case = build_case(tok, len(ids), depth, key, [tok.eos_id])
        assert case.tokens == ids
        lengths.append(len(ids))
    assert min(lengths) < shortest + 60 and max(lengths) > SEQ - 20  # lengths spread over [shortest, block]


def test_answer_only_rows_train_the_key_alone(tok):
    cursor = SyntheticCursor(_source("passkey", loss_on="answer"), tok, seed=0, rank=0, worker=0)
    batch = torch.stack([torch.from_numpy(b) for b in _blocks(cursor, 8)])
    inputs, targets = split_block(batch)
    assert (inputs >= 0).all()
    for row in range(8):
        text = tok.decode(inputs[row].tolist())
        key = re.search(r"The pass key is (\d{5})", text).group(1)
        trained = targets[row][targets[row] != -100].tolist()
        assert tok.decode(trained).strip() == key


def test_all_tokens_rows_train_the_prompt_but_not_the_padding(tok):
    cursor = SyntheticCursor(_source("passkey"), tok, seed=1, rank=0, worker=0)
    block = cursor.next_block(SEQ + 1)
    inputs, targets = split_block(torch.from_numpy(block)[None])
    n = len(_prompt_of(tok, block))
    assert (targets[0, : n - 1] != -100).all() and (targets[0, n - 1 :] == -100).all()


def test_recall_rows_query_stored_pairs(tok):
    vocab = recall_vocab(tok)
    cursor = SyntheticCursor(_source("recall", loss_on="answer", queries=4), tok, seed=0, rank=0, worker=0)
    for block in _blocks(cursor, 10):
        ids = _tokens(block)
        query_at = next(i for i in range(len(ids)) if ids[i : i + len(vocab.query)] == list(vocab.query))
        pairs, step = {}, vocab.pair_tokens
        start = 1 + len(vocab.header)
        for i in range(start, query_at, step):
            pairs[tuple(ids[i : i + 2])] = ids[i + 2 + len(vocab.eq)]
        answers = [i for i in range(len(block)) if block[i] >= 0]
        assert len(answers) == 4
        for a in answers:  # each trained token is the value stored for the key just before it
            key = tuple(ids[a - len(vocab.eq) - 2 : a - len(vocab.eq)])
            assert a > query_at and pairs[key] == ids[a]


def test_training_and_evaluation_keys_are_disjoint(tok):
    train_keys = set()
    for worker in range(2):
        cursor = SyntheticCursor(_source("passkey"), tok, seed=0, rank=0, worker=worker)
        for block in _blocks(cursor, 300):
            train_keys.add(re.search(r"The pass key is (\d{5})", tok.decode(_tokens(block))).group(1))
    eval_keys = {c.key for length in (256, 512) for seed in range(3) for c in make_cases(tok, length, 100, seed)}
    assert len(train_keys) > 500 and len(eval_keys) > 400
    assert not train_keys & eval_keys
    assert all(held_out(k) for k in eval_keys) and not any(held_out(k) for k in train_keys)
    # recall: evaluation keys (two pieces) never appear among training rows' keys either
    vocab = recall_vocab(tok)
    cursor = SyntheticCursor(_source("recall"), tok, seed=0, rank=0, worker=0)
    for block in _blocks(cursor, 20):
        ids = _tokens(block)
        query_at = next(i for i in range(len(ids)) if ids[i : i + len(vocab.query)] == list(vocab.query))
        keys = [f"{ids[i]} {ids[i + 1]}" for i in range(1 + len(vocab.header), query_at, vocab.pair_tokens)]
        assert keys and not any(held_out(k) for k in keys)
    for case in make_recall_cases(tok, 512, 5, 4, seed=0):
        ids = case.tokens[len(vocab.header):]
        assert all(held_out(f"{ids[i]} {ids[i + 1]}") for i in range(0, 5 * vocab.pair_tokens, vocab.pair_tokens))


def test_too_short_blocks_fail_at_loader_build_with_one_line(tok):
    cfg = DataConfig(sources=[_source("passkey")], num_workers=0,
                     tokenizer=TokenizerConfig(vocab_size=1024, sample_docs=60))
    with pytest.raises(ValueError, match="raise model.max_seq_len"):
        build_loader(cfg, tok, split="train", seq_len=64, batch_size=2)


def test_validation_streams_leave_synthetic_rows_out(tok):
    only = DataConfig(sources=[_source("passkey")], num_workers=0)
    with pytest.raises(ValueError, match="synthetic rows are for training"):
        build_loader(only, tok, split="val", seq_len=SEQ, batch_size=2)


def _roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("rank,world_size", [(0, 1), (1, 2)])
def test_mixture_with_text_resumes_exactly_after_three_resumes(tok, rank, world_size):
    """stdlib text + passkey + recall, two dataloader workers: resumed batches equal the unbroken ones."""
    cfg = DataConfig(sources=[SourceConfig(kind="stdlib", weight=0.2), _source("passkey", "answer", weight=0.5),
                              _source("recall", "answer", queries=4, weight=0.3)],
                     num_workers=2, shuffle_buffer=8, tokenizer=TokenizerConfig(vocab_size=1024, sample_docs=60))

    def make():
        return build_loader(cfg, tok, split="train", seq_len=SEQ, batch_size=4, rank=rank, world_size=world_size)

    it = iter(make())
    ref = [next(it) for _ in range(24)]
    got, state = [], None
    for a, b in zip([0, 5, 11, 17], [5, 11, 17, 24]):
        loader = make()
        if state is not None:
            loader.load_state_dict(_roundtrip(state))
        it = iter(loader)
        got += [next(it) for _ in range(b - a)]
        state = loader.state_dict()
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    kinds = {("text" if (b >= 0).all() else "synthetic") for batch in ref for b in batch}
    assert kinds == {"text", "synthetic"}


def test_document_ids_follow_the_documents_the_stream_packed(tok):
    """Each document of a text block is a piece of [EOS] + one source document: whole when it lies
    inside the block, its tail at the block's start, its head at the end; a passkey row is one
    document (its prompt, from its EOS) and then one per padding EOS."""
    cfg = DataConfig(sources=[SourceConfig(kind="stdlib", weight=0.7), _source("passkey", "answer", weight=0.3)],
                     shuffle_buffer=4, tokenizer=TokenizerConfig(vocab_size=1024, sample_docs=60))

    def text(ids) -> str:
        return "," + ",".join(map(str, ids)) + ","

    docs = [text([tok.eos_id, *tok.encode(text_of(example, cfg.sources[0]))])
            for example in open_source(cfg.sources[0], "train", cfg, seed=cfg.seed)]
    loader = build_loader(cfg, tok, split="train", seq_len=SEQ, batch_size=8)
    whole = synthetic = 0
    for batch in islice(loader, 6):
        inputs, _ = split_block(batch)
        ids = document_ids(inputs, tok.eos_id)
        assert (ids.diff(dim=-1) >= 0).all()
        for row, row_ids, raw in zip(inputs, ids, batch):
            pieces = [text(row[row_ids == d].tolist()) for d in row_ids.unique().tolist()]
            if (raw < 0).any():  # a passkey row
                assert pieces[0] == text(_prompt_of(tok, raw[:-1]))
                assert all(p == text([tok.eos_id]) for p in pieces[1:])
                synthetic += 1
                continue
            assert all(any(piece in doc for doc in docs) for piece in pieces)
            if len(pieces) > 1:
                assert any(doc.endswith(pieces[0]) for doc in docs)
                assert any(doc.startswith(pieces[-1]) for doc in docs)
            assert all(piece in docs for piece in pieces[1:-1])
            whole += max(0, len(pieces) - 2)
    assert whole > 0 and synthetic > 0
