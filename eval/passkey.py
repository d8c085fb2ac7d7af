"""Passkey retrieval (Mohtashami & Jaggi 2023) with the paper's prompt.

A case is an instruction, filler sentences, the key line at a chosen depth, more filler, the
question, and the key as the answer. The whole text is encoded at once (a tokenizer may merge
across the prompt/answer boundary), and the answer span is the tail of that encoding after the
longest prefix it shares with the encoded prompt alone.

Two scorers: `teacher_forced` takes the argmax at every answer position in one forward pass, which
equals greedy decoding (greedy never leaves the key while it is right, and is wrong from the first
miss on either way); `generated` really decodes greedily with the model's KV cache, to cross-check.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from tqdm import tqdm

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


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class PasskeyModel(Protocol):
    """What the scorers need: logits of the last positions of a batch of ids, and greedy decoding."""

    def __call__(self, idx: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor: ...

    def generate(self, idx: torch.Tensor, max_new_tokens: int, greedy: bool = ...) -> torch.Tensor: ...

    def parameters(self): ...


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


def build_case(
    tokenizer: TextTokenizer, length: int, depth: float, key: str, prefix: Sequence[int] = ()
) -> PasskeyCase:
    """The case with the most filler whose `prefix` + prompt + key fits in `length` tokens.

    Adding a filler sentence never shortens the encoding, so the result is within one filler
    sentence of `length`. `prefix` (e.g. the EOS that precedes every document in training) is
    prepended to the ids.
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


def make_cases(
    tokenizer: TextTokenizer,
    length: int,
    n_cases: int,
    seed: int,
    depths: Sequence[float] = (),
    prefix: Sequence[int] = (),
) -> list[PasskeyCase]:
    """`n_cases` seeded cases at `length`: random depths, or `n_cases` per depth of a sweep.

    The random stream depends only on (seed, length), so adding lengths leaves other cases alone.
    """
    rng = random.Random(seed * 1_000_003 + length)
    plan = [d for d in depths for _ in range(n_cases)] if depths else [None] * n_cases
    cases = []
    for d in plan:
        key = str(rng.randint(10000, 99999))
        depth = rng.random() if d is None else float(d)
        cases.append(build_case(tokenizer, length, depth, key, prefix))
    return cases


def _device(model: PasskeyModel) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def teacher_forced(model: PasskeyModel, case: PasskeyCase) -> list[int]:
    """Argmax at each answer position given the true prefix (one forward pass; the LM head runs
    on the answer positions only, so no [T, V] logits)."""
    idx = torch.tensor([case.tokens[:-1]], device=_device(model))
    logits = model(idx, logits_to_keep=len(case.answer))
    return logits[0].argmax(dim=-1).tolist()


@torch.inference_mode()
def generated(model: PasskeyModel, case: PasskeyCase) -> list[int]:
    """Greedy decoding of as many tokens as the answer has, from the prompt."""
    n = len(case.answer)
    idx = torch.tensor([case.tokens[: case.answer_start]], device=_device(model))
    out = model.generate(idx, max_new_tokens=n, greedy=True)
    return out[0, -n:].tolist()


SCORERS = {"teacher": teacher_forced, "generate": generated}


def score_cases(
    model: PasskeyModel, cases: Sequence[PasskeyCase], modes: Sequence[str] = ("teacher",), progress: bool = True
) -> list[dict]:
    """Per-case records: the key, depth, and for each mode the predicted tokens and correctness."""
    unknown = [m for m in modes if m not in SCORERS]
    if unknown:
        raise ValueError(f"passkey mode {unknown[0]!r} is not one of {', '.join(SCORERS)}")
    records = []
    for case in tqdm(cases, desc=f"passkey L={cases[0].length}" if cases else "passkey", disable=not progress, leave=False):
        record = {"length": case.length, "tokens": len(case.tokens), "depth": case.depth, "key": case.key}
        for mode in modes:
            predicted = SCORERS[mode](model, case)
            record[f"{mode}_pred"] = predicted
            record[f"{mode}_correct"] = predicted == case.answer
        records.append(record)
    return records


def accuracy(records: Sequence[dict], mode: str = "teacher") -> float:
    return sum(r[f"{mode}_correct"] for r in records) / len(records)
