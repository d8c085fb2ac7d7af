"""Retrieval prompts, one implementation for training rows (`data.synthetic`) and evaluation
(`eval.passkey`, `eval.recall`), so the two can never drift apart.

- **passkey** (Mohtashami & Jaggi 2023, the paper's prompt): an instruction, filler sentences, a
  5-digit key at some depth, more filler, the question, and the key as the answer.
- **recall** (multi-query associative recall): `Remember:` then key/value pairs (a key is two
  word pieces, a value one), then `Recall:` and some of the keys again, each followed by its value.
  Pairs fill the length, so a longer prompt puts the answers further from their keys.

Keys are split in two by a hash: one in `HELD_OUT` keys is reserved for evaluation, the rest for
training. The split is structural (no digit or piece pattern tells them apart), so a trained
model is always evaluated on keys it has never seen.

Evaluation cases come from one of three streams (`CASE_STREAMS`), all of evaluation keys only:
`fixed` depends on (seed, length) alone (the evaluation's seed: every run saw the same prompts);
`eval` is a run's own final evaluation, seeded by the run's seed; `bar` feeds the training bar
(`bench.passkey_progress`) from other generators and from the half of the held-out passkeys that
`eval` never draws (`bar_key`), so the bar never shares a key with the final evaluation.
Training rows (`data.synthetic`) use none of these streams.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

HELD_OUT = 8  # one key in HELD_OUT belongs to evaluation

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
RECALL_HEADER, RECALL_QUERY, RECALL_EQ, RECALL_SEP = "Remember:", " Recall:", " =", ","


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


def held_out(key: str) -> bool:
    """Whether `key` belongs to the evaluation keys (a fixed 1/HELD_OUT of all keys)."""
    return hashlib.sha256(key.encode()).digest()[0] % HELD_OUT == 0


# ----------------------------------------------------------------------------- passkey


@dataclass(frozen=True)
class PasskeyCase:
    """One prompt. `tokens` = prompt followed by the key; the key's tokens start at `answer_start`."""

    length: int
    depth: float
    key: str
    tokens: list[int]
    answer_start: int
    key_line_start: int
    filler_tokens: tuple[int, int]  # filler tokens before and after the key line

    @property
    def answer(self) -> list[int]:
        return self.tokens[self.answer_start :]

    @property
    def answer_positions(self) -> list[int]:
        return list(range(self.answer_start, len(self.tokens)))


def filler_text(n: int) -> str:
    """The first n filler sentences, cycling through the paragraph."""
    return " ".join(FILLER[i % len(FILLER)] for i in range(n))


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _case_texts(n_filler: int, depth: float, key: str) -> tuple[str, str, str, str]:
    """(text before the key line, filler after it, prompt, prompt + answer) with n_filler sentences."""
    n_before = round(depth * n_filler)
    before = _join(INSTRUCTION, filler_text(n_before))
    after = " ".join(FILLER[i % len(FILLER)] for i in range(n_before, n_filler))
    prompt = _join(before, KEY_LINE.format(key=key), after, QUESTION)
    return before, after, prompt, f"{prompt} {key}"


def passkey_min_length(tokenizer: TextTokenizer, prefix: Sequence[int] = ()) -> int:
    """Tokens of the shortest passkey prompt (no filler) with its answer, for a typical key."""
    return len(prefix) + len(tokenizer.encode(_case_texts(0, 0.5, "50000")[3]))


def build_case(
    tokenizer: TextTokenizer, length: int, depth: float, key: str, prefix: Sequence[int] = ()
) -> PasskeyCase:
    """The case with the most filler whose `prefix` + prompt + key fits in `length` tokens.

    Adding a filler sentence never shortens the encoding, so the result is within one filler
    sentence of `length`. `prefix` (e.g. the EOS that precedes every document in training) is
    prepended to the ids. The whole text is encoded at once (a tokenizer may merge across the
    prompt/answer boundary); the answer is the tail after the prefix it shares with the prompt.
    """
    prefix = list(prefix)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth must be in [0, 1], got {depth}")

    def n_tokens(n: int) -> int:
        return len(prefix) + len(tokenizer.encode(_case_texts(n, depth, key)[3]))

    if n_tokens(0) > length:
        raise ValueError(f"passkey length {length} is shorter than the prompt without filler ({n_tokens(0)} tokens)")
    lo, hi = 0, 1
    while n_tokens(hi) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if n_tokens(mid) <= length else (lo, mid)
    before, after, prompt, full = _case_texts(lo, depth, key)
    tokens = prefix + tokenizer.encode(full)
    prompt_tokens = prefix + tokenizer.encode(prompt)
    shared = 0
    while shared < min(len(tokens), len(prompt_tokens)) and tokens[shared] == prompt_tokens[shared]:
        shared += 1
    if shared == len(tokens):
        raise ValueError(f"key {key} produced no tokens of its own after the prompt")
    n_before = len(tokenizer.encode(before)) - len(tokenizer.encode(INSTRUCTION))
    n_after = len(tokenizer.encode(" " + after)) if after else 0
    return PasskeyCase(
        length=length,
        depth=depth,
        key=key,
        tokens=tokens,
        answer_start=shared,
        key_line_start=len(prefix) + len(tokenizer.encode(before)),
        filler_tokens=(n_before, n_after),
    )


def draw_passkey(rng: random.Random, evaluation: bool) -> str:
    """A 5-digit key from the evaluation keys or from the training keys."""
    while True:
        key = str(rng.randint(10000, 99999))
        if held_out(key) == evaluation:
            return key


# ----------------------------------------------------------------------------- evaluation streams

CASE_STREAMS = ("fixed", "eval", "bar")
_FIXED_OFFSET = {"passkey": 0, "recall": 7_777_777}  # the `fixed` stream's generators, as first published


def bar_key(key: str) -> bool:
    """Whether a held-out passkey belongs to the training bar's stream (one held-out key in two, by a
    second hash byte): `eval` cases never use these keys, `bar` cases use only these."""
    digest = hashlib.sha256(key.encode()).digest()
    return digest[0] % HELD_OUT == 0 and digest[1] % 2 == 1


def case_rng(task: str, stream: str, seed: int, length: int) -> random.Random:
    """The generator of one evaluation stream at one length (independent across lengths, so adding
    lengths leaves the other cases alone)."""
    if stream not in CASE_STREAMS:
        raise ValueError(f"case stream {stream!r} is not one of {', '.join(CASE_STREAMS)}")
    if stream == "fixed":
        return random.Random(seed * 1_000_003 + length + _FIXED_OFFSET[task])
    return random.Random(f"{task}/{stream}/{seed}/{length}")  # str seeds hash with SHA-512: stable


def draw_stream_passkey(rng: random.Random, stream: str) -> str:
    """A key for an evaluation stream: any held-out key (`fixed`), or the stream's half of them."""
    if stream == "fixed":
        return draw_passkey(rng, evaluation=True)
    while True:
        key = str(rng.randint(10000, 99999))
        if held_out(key) and bar_key(key) == (stream == "bar"):
            return key


def make_cases(
    tokenizer: TextTokenizer,
    length: int,
    n_cases: int,
    seed: int,
    depths: Sequence[float] = (),
    prefix: Sequence[int] = (),
    stream: str = "fixed",
) -> list[PasskeyCase]:
    """`n_cases` seeded evaluation cases at `length`: random depths, or `n_cases` per depth of a sweep.

    The cases depend only on (stream, seed, length); keys are evaluation keys (`held_out`), never
    seen in training.
    """
    rng = case_rng("passkey", stream, seed, length)
    plan = [d for d in depths for _ in range(n_cases)] if depths else [None] * n_cases
    cases = []
    for d in plan:
        key = draw_stream_passkey(rng, stream)
        depth = rng.random() if d is None else float(d)
        cases.append(build_case(tokenizer, length, depth, key, prefix))
    return cases


# ----------------------------------------------------------------------------- recall


@dataclass(frozen=True)
class RecallCase:
    """One prompt: `tokens`, and the positions of the queried values (the answers) in it."""

    length: int
    n_pairs: int
    tokens: list[int]
    answer_positions: list[int]

    @property
    def answer(self) -> list[int]:
        return [self.tokens[p] for p in self.answer_positions]


@dataclass(frozen=True)
class RecallVocab:
    """The word pieces keys and values are drawn from, and the fixed pieces of the format."""

    keys: tuple[int, ...]
    values: tuple[int, ...]
    header: tuple[int, ...]
    query: tuple[int, ...]
    eq: tuple[int, ...]
    sep: tuple[int, ...]

    @property
    def pair_tokens(self) -> int:
        return 2 + len(self.eq) + 1 + len(self.sep)


@lru_cache(maxsize=8)
def recall_vocab(tokenizer) -> RecallVocab:
    """Whole-word lowercase pieces of the tokenizer (`▁word`), alternately keys and values.

    Keys are pairs of pieces (enough distinct keys for thousands of pairs), values single pieces.
    """
    words = []
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.piece(i)
        word = piece[1:]
        if piece.startswith("\u2581") and len(word) >= 2 and word.isascii() and word.isalpha() and word.islower():
            words.append(i)
    if len(words) < 64:
        raise ValueError(f"the tokenizer has {len(words)} whole-word pieces (a leading space, then two or more "
                         "lowercase ASCII letters: `▁word` as its `piece` writes it); recall needs at least 64: "
                         "with this tokenizer, use the passkey task")
    return RecallVocab(
        keys=tuple(words[0::2]), values=tuple(words[1::2]),
        header=tuple(tokenizer.encode(RECALL_HEADER)), query=tuple(tokenizer.encode(RECALL_QUERY)),
        eq=tuple(tokenizer.encode(RECALL_EQ)), sep=tuple(tokenizer.encode(RECALL_SEP)),
    )


def recall_min_length(vocab: RecallVocab, n_queries: int, prefix: Sequence[int] = ()) -> int:
    """Tokens of a recall prompt with `n_queries` pairs, each queried once."""
    return len(prefix) + len(vocab.header) + len(vocab.query) + 2 * n_queries * vocab.pair_tokens


def build_recall(
    vocab: RecallVocab, length: int, n_queries: int, rng: random.Random, evaluation: bool,
    prefix: Sequence[int] = (),
) -> RecallCase:
    """As many pairs as fit in `length` tokens with `n_queries` queries of distinct pairs.

    Keys are distinct within a case and drawn from the evaluation or the training keys.
    """
    if n_queries < 1:
        raise ValueError(f"recall needs at least one query, got {n_queries}")
    fixed = len(prefix) + len(vocab.header) + len(vocab.query)
    n_pairs = (length - fixed) // vocab.pair_tokens - n_queries
    if n_pairs < n_queries:
        need = recall_min_length(vocab, n_queries, prefix)
        raise ValueError(f"recall length {length} is shorter than {n_queries} pairs and queries ({need} tokens)")
    if n_pairs > len(vocab.keys) ** 2 // (2 * HELD_OUT):
        raise ValueError(f"recall length {length} needs more distinct keys than the tokenizer offers")
    keys: dict[tuple[int, int], int] = {}
    while len(keys) < n_pairs:
        key = (rng.choice(vocab.keys), rng.choice(vocab.keys))
        if key not in keys and held_out(f"{key[0]} {key[1]}") == evaluation:
            keys[key] = rng.choice(vocab.values)
    pairs = list(keys.items())
    tokens = list(prefix) + list(vocab.header)

    def add_pair(key: tuple[int, int], value: int) -> int:
        tokens.extend(key)
        tokens.extend(vocab.eq)
        tokens.append(value)
        tokens.extend(vocab.sep)
        return len(tokens) - len(vocab.sep) - 1

    for key, value in pairs:
        add_pair(key, value)
    tokens.extend(vocab.query)
    answers = [add_pair(*pairs[i]) for i in rng.sample(range(n_pairs), n_queries)]
    return RecallCase(length=length, n_pairs=n_pairs, tokens=tokens, answer_positions=answers)


def make_recall_cases(
    tokenizer: TextTokenizer,
    length: int,
    n_cases: int,
    n_queries: int,
    seed: int,
    prefix: Sequence[int] = (),
    stream: str = "fixed",
) -> list[RecallCase]:
    """`n_cases` seeded evaluation cases at `length` (evaluation keys only); depends on (stream, seed,
    length). Recall has no training bar: `bar` is not one of its streams."""
    if stream == "bar":
        raise ValueError("recall cases have streams fixed and eval (the training bar is passkey only)")
    vocab = recall_vocab(tokenizer)
    rng = case_rng("recall", stream, seed, length)
    return [build_recall(vocab, length, n_queries, rng, evaluation=True, prefix=prefix) for _ in range(n_cases)]
