"""Batched passkey and recall scoring equals one case at a time, for every attention and with
dynamic NTK (whose RoPE base follows the number of tokens processed)."""

from __future__ import annotations

import pytest
import torch

from data.config import DataConfig, TokenizerConfig
from data.tasks import make_cases, make_recall_cases
from data.tokenizer import get_tokenizer
from eval.passkey import answer_logits, equal_length_batches, score_cases
from eval.recall import score_recall
from model import GPT
from model.config import flavor

ATTENTIONS = {"origin": {}, "alibi": {"attention": "alibi"}, "coca-slack": {"attention": "coca"},
              "coca-strict": {"attention": "coca", "design_params": {"coca": {"form": "strict"}}}}
TRAIN_LEN = 128  # the tiny flavor's: cases at 300 and 700 tokens are 2.3x and 5.5x it
SETTINGS = [(v, s) for v in ATTENTIONS for s in ("none", "dynamic:8") if v != "alibi" or s == "none"]  # no RoPE


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "batched_tokenizer"
    return get_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=1024, sample_docs=60), cache_dir=str(cache)))


def tiny(tok, variant: str, scaling: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(flavor("tiny", vocab_size=tok.vocab_size, n_layer=2, max_seq_len=TRAIN_LEN,
                       **ATTENTIONS[variant])).eval()
    if scaling != "none":
        model.set_rope_scaling("dynamic", 8.0)
    return model


class Forwards:
    """Counts a model's forward calls and the rows they carry."""

    def __init__(self, model: torch.nn.Module):
        self.calls, self.rows = 0, 0
        model.register_forward_hook(self)

    def __call__(self, module, args, output) -> None:
        self.calls += 1
        self.rows += args[0].shape[0]


def test_batches_group_equal_lengths_within_the_token_bound():
    lengths = [100, 120, 100, 100, 120, 100, 30]
    batches = list(equal_length_batches(lengths, batch_tokens=250))
    assert batches == [[0, 2], [3, 5], [1, 4], [6]]
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert list(equal_length_batches(lengths, batch_tokens=1)) == [[i] for i in (0, 2, 3, 5, 1, 4, 6)]


@pytest.mark.parametrize("variant, scaling", SETTINGS)
def test_batched_passkey_equals_one_case_at_a_time(tok, variant, scaling):
    model = tiny(tok, variant, scaling)
    cases = make_cases(tok, 300, 6, seed=1, prefix=[tok.eos_id]) + make_cases(tok, 700, 5, seed=1, stream="eval")
    lengths = {len(c.tokens) for c in cases}
    counter = Forwards(model)
    batched = answer_logits(model, cases, batch_tokens=1 << 20)
    assert counter.calls == len(lengths) < len(cases) and counter.rows == len(cases)  # really batched
    alone = [answer_logits(model, [c], batch_tokens=1)[0] for c in cases]
    for b, a, case in zip(batched, alone, cases):
        assert b.shape == (len(case.answer), tok.vocab_size)
        torch.testing.assert_close(b, a)  # float32 tolerance
    together = score_cases(model, cases, progress=False, batch_tokens=1 << 20)
    one_by_one = score_cases(model, cases, progress=False, batch_tokens=1)
    assert together == one_by_one
    assert [r["teacher_pred"] for r in together] == [x.argmax(-1).tolist() for x in alone]


def test_batched_passkey_scores_a_model_that_knows_the_key(tok):
    """A model that copies the key gets every batched case right: the rows are read at their own
    answer positions, whatever the batch."""
    cases = make_cases(tok, 300, 6, seed=2, prefix=[tok.eos_id])

    class KeyCopier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(1))
            self.answers = {tuple(c.tokens[:-1]): c.tokens[1:] for c in cases}

        def forward(self, idx, logits_to_keep=0):
            out = torch.zeros(*idx.shape, tok.vocab_size)
            for b, row in enumerate(idx.tolist()):
                out[b, torch.arange(idx.shape[1]), torch.tensor(self.answers[tuple(row)])] = 1.0
            return out[:, -logits_to_keep:]

    records = score_cases(KeyCopier(), cases, progress=False, batch_tokens=1 << 20)
    assert all(r["teacher_correct"] for r in records)
    assert [r["teacher_pred"] for r in records] == [c.answer for c in cases]


@pytest.mark.parametrize("variant, scaling", SETTINGS)
def test_batched_recall_equals_one_case_at_a_time(tok, variant, scaling):
    model = tiny(tok, variant, scaling)
    cases = make_recall_cases(tok, 300, 4, 4, seed=1, prefix=[tok.eos_id], stream="eval")
    counter = Forwards(model)
    together = score_recall(model, cases, progress=False, batch_tokens=1 << 20)
    assert counter.calls == len({len(c.tokens) for c in cases}) < len(cases)
    assert together == score_recall(model, cases, progress=False, batch_tokens=1)


@pytest.mark.slow
def test_batched_alibi_on_flex_attention_equals_one_case_at_a_time(tok):
    """From 1024 tokens CPU ALiBi runs on FlexAttention, whose block mask is built per length."""
    model = tiny(tok, "alibi", "none")
    cases = make_cases(tok, 1100, 4, seed=3, prefix=[tok.eos_id], stream="eval")
    batched = answer_logits(model, cases, batch_tokens=1 << 20)
    for case, b in zip(cases, batched):
        torch.testing.assert_close(b, answer_logits(model, [case], batch_tokens=1)[0])
