"""Passkey retrieval: prompt construction with the real tokenizer, and the two scorers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from data.config import DataConfig, TokenizerConfig
from data.tasks import FILLER, INSTRUCTION, QUESTION, PasskeyCase, build_case, make_cases
from data.tokenizer import get_tokenizer
from eval.passkey import accuracy, score_cases, teacher_forced
from model import GPT
from model.config import flavor


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    cfg = DataConfig(
        cache_dir=str(tmp_path_factory.getbasetemp() / "eval_tokenizer"),
        tokenizer=TokenizerConfig(vocab_size=512, sample_docs=60),  # as experiment=micro: one cached tokenizer
    )
    return get_tokenizer(cfg)


def sentence_tokens(tok) -> int:
    return max(len(tok.encode(" " + s)) for s in FILLER)


@pytest.mark.parametrize("length", [200, 257, 1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_prompt_length_within_one_filler_sentence(tok, length, depth):
    case = build_case(tok, length, depth, "48213", prefix=[tok.eos_id])
    assert length - sentence_tokens(tok) < len(case.tokens) <= length
    assert case.tokens[0] == tok.eos_id


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_key_line_at_requested_depth(tok, depth):
    case = build_case(tok, 2000, depth, "70531")
    before, after = case.filler_tokens
    assert before + after > 1500
    assert abs(before / (before + after) - depth) <= sentence_tokens(tok) / (before + after)
    text = tok.decode(case.tokens[case.key_line_start :])
    assert text.lstrip().startswith("The pass key is 70531. Remember it. 70531 is the pass key.")
    assert tok.decode(case.tokens[: case.key_line_start]).startswith(INSTRUCTION)


def test_answer_span_is_the_key_after_the_question(tok):
    case = build_case(tok, 500, 0.5, "10000")
    assert tok.decode(case.tokens[: case.answer_start]).endswith(QUESTION)
    assert tok.decode(case.answer).strip() == "10000"
    # the joint encoding splits at the boundary exactly like the prompt alone
    assert case.tokens[: case.answer_start] == tok.encode(tok.decode(case.tokens[: case.answer_start]))


def test_cases_are_seeded_five_digit_keys_and_depth_sweep(tok):
    a = make_cases(tok, 300, 6, seed=3)
    assert [c.key for c in a] == [c.key for c in make_cases(tok, 300, 6, seed=3)]
    assert [c.key for c in a] != [c.key for c in make_cases(tok, 300, 6, seed=4)]
    assert all(10000 <= int(c.key) <= 99999 for c in a)
    assert len({c.depth for c in a}) == 6 and all(0 <= c.depth <= 1 for c in a)
    sweep = make_cases(tok, 300, 2, seed=3, depths=[0.0, 0.5, 1.0])
    assert [c.depth for c in sweep] == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]


def test_prompt_errors(tok):
    with pytest.raises(ValueError, match="shorter than the prompt"):
        build_case(tok, 100, 0.5, "12345")
    with pytest.raises(ValueError, match="depth"):
        build_case(tok, 500, 1.5, "12345")


# ----------------------------------------------------------------------------- scorers


class ScriptedLM(nn.Module):
    """Knows each case's full token sequence (picks the one sharing the longest prefix with its
    input) and predicts the token `shift` positions ahead of each input position.

    shift=1 predicts the true next token (always emits the key); shift=0 echoes its input token,
    which is never the key's next token (and would look right to a scorer off by one).
    """

    def __init__(self, cases: list[PasskeyCase], vocab: int, shift: int):
        super().__init__()
        self.seqs = [c.tokens for c in cases]
        self.vocab, self.shift = vocab, shift
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, idx: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        logits = torch.zeros(*idx.shape, self.vocab)
        for b, row in enumerate(idx.tolist()):
            seq = max(self.seqs, key=lambda s: _shared_prefix(s, row))
            for p in range(len(row)):
                logits[b, p, seq[min(p + self.shift, len(seq) - 1)]] = 1.0
        return logits[:, -logits_to_keep:] if logits_to_keep > 0 else logits

    def generate(self, idx: torch.Tensor, max_new_tokens: int, greedy: bool = True) -> torch.Tensor:
        for _ in range(max_new_tokens):
            idx = torch.cat([idx, self(idx)[:, -1:].argmax(-1)], dim=1)
        return idx


def _shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_scorer_one_for_key_emitter_zero_for_echo(tok):
    cases = make_cases(tok, 200, 5, seed=0)
    modes = ["teacher", "generate"]
    right = score_cases(ScriptedLM(cases, tok.vocab_size, shift=1), cases, modes, progress=False)
    wrong = score_cases(ScriptedLM(cases, tok.vocab_size, shift=0), cases, modes, progress=False)
    assert accuracy(right, "teacher") == accuracy(right, "generate") == 1.0
    assert accuracy(wrong, "teacher") == accuracy(wrong, "generate") == 0.0


def test_unknown_mode_is_an_error(tok):
    cases = make_cases(tok, 200, 1, seed=0)
    with pytest.raises(ValueError, match="not one of teacher, generate"):
        score_cases(ScriptedLM(cases, tok.vocab_size, 1), cases, ["beam"], progress=False)


@pytest.mark.parametrize("attention", ["origin", "alibi", "coca"])
def test_teacher_forced_agrees_with_greedy_decoding_of_real_gpt(tok, attention):
    """One forward's argmax and the KV-cache greedy decode agree, on the key and on the model's own
    continuation (which a random model gets right by construction, so every position is checked)."""
    torch.manual_seed(0)
    model = GPT(flavor("tiny", vocab_size=tok.vocab_size, n_layer=2, attention=attention)).eval()
    cases = make_cases(tok, 300, 3, seed=1) + make_cases(tok, 700, 3, seed=1)
    records = score_cases(model, cases, ["teacher", "generate"], progress=False)
    for case, r in zip(cases, records):
        t, g, answer = r["teacher_pred"], r["generate_pred"], case.answer
        first_miss = _shared_prefix(t, answer)
        assert t[: first_miss + 1] == g[: first_miss + 1]
        assert r["teacher_correct"] == r["generate_correct"]
        own = dataclasses.replace(case, tokens=case.tokens[: case.answer_start] + g)
        assert teacher_forced(model, own) == g
