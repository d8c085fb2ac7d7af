"""Passkey retrieval (Mohtashami & Jaggi 2023) with the paper's prompt: the scorers.

The prompts are built by `data.tasks` (shared with the training rows of `data.synthetic`).
Two scorers: `teacher_forced` takes the argmax at every answer position in one forward pass, which
equals greedy decoding (greedy never leaves the key while it is right, and is wrong from the first
miss on either way); `generated` really decodes greedily with the model's KV cache, to cross-check.

Teacher forcing is batched: cases of the same token count share a forward (`equal_length_batches`).
No row is padded, so each row is computed exactly as alone: causal attention, and dynamic NTK,
whose RoPE base follows the number of tokens processed, see the same length in a batch as alone.
(The prompts of one length have one token count when keys always tokenize alike, as with the
study's digit groups; otherwise a length gives a few batches.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from tqdm import tqdm

from data.tasks import PasskeyCase


class PasskeyModel(Protocol):
    """What the scorers need: logits of the last positions of a batch of ids, and greedy decoding."""

    def __call__(self, idx: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor: ...

    def generate(self, idx: torch.Tensor, max_new_tokens: int, greedy: bool = ...) -> torch.Tensor: ...

    def parameters(self): ...


def _device(model: PasskeyModel) -> torch.device:
    return next(model.parameters()).device


def equal_length_batches(lengths: Sequence[int], batch_tokens: int) -> Iterator[list[int]]:
    """Indices of rows grouped by length, each group at most max(1, batch_tokens // length) rows,
    in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    for n, members in groups.items():
        size = max(1, batch_tokens // n)
        for start in range(0, len(members), size):
            yield members[start : start + size]


@torch.inference_mode()
def tail_logits(model: PasskeyModel, rows: Sequence[Sequence[int]], keep: int) -> torch.Tensor:
    """Logits [B, keep, V] of the last `keep` positions of equal-length id rows, in one forward
    (the LM head runs on those positions only)."""
    return model(torch.tensor([list(r) for r in rows], device=_device(model)), logits_to_keep=keep)


def answer_logits(
    model: PasskeyModel, cases: Sequence[PasskeyCase], batch_tokens: int, progress: bool = False
) -> list[torch.Tensor]:
    """Per case, the logits [len(answer), V] at its answer positions given the true prefix."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(cases)
    batches = list(equal_length_batches([len(c.tokens) - 1 for c in cases], batch_tokens))
    desc = f"passkey L={cases[0].length}" if cases else "passkey"
    for batch in tqdm(batches, desc=desc, unit="batch", disable=not progress, leave=False):
        keep = max(len(cases[i].answer) for i in batch)
        logits = tail_logits(model, [cases[i].tokens[:-1] for i in batch], keep)
        for row, i in enumerate(batch):
            out[i] = logits[row, keep - len(cases[i].answer) :]
    return out


def teacher_forced(model: PasskeyModel, case: PasskeyCase) -> list[int]:
    """Argmax at each answer position given the true prefix (one forward pass)."""
    return answer_logits(model, [case], batch_tokens=1)[0].argmax(dim=-1).tolist()


@torch.inference_mode()
def generated(model: PasskeyModel, case: PasskeyCase) -> list[int]:
    """Greedy decoding of as many tokens as the answer has, from the prompt."""
    n = len(case.answer)
    idx = torch.tensor([case.tokens[: case.answer_start]], device=_device(model))
    out = model.generate(idx, max_new_tokens=n, greedy=True)
    return out[0, -n:].tolist()


MODES = ("teacher", "generate")


def score_cases(
    model: PasskeyModel, cases: Sequence[PasskeyCase], modes: Sequence[str] = ("teacher",),
    progress: bool = True, batch_tokens: int = 16384,
) -> list[dict]:
    """Per-case records: the key, depth, and for each mode the predicted tokens and correctness.
    Teacher forcing runs in batches of up to `batch_tokens` tokens; generation one case at a time."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"passkey mode {unknown[0]!r} is not one of {', '.join(MODES)}")
    desc = f"passkey L={cases[0].length}" if cases else "passkey"
    predicted: dict[str, list[list[int]]] = {}
    if "teacher" in modes:
        logits = answer_logits(model, cases, batch_tokens, progress)
        predicted["teacher"] = [x.argmax(dim=-1).tolist() for x in logits]
    if "generate" in modes:
        predicted["generate"] = [generated(model, c) for c in tqdm(cases, desc=desc, disable=not progress,
                                                                   leave=False)]
    records = []
    for i, case in enumerate(cases):
        record = {"length": case.length, "tokens": len(case.tokens), "depth": case.depth, "key": case.key}
        for mode in modes:
            record[f"{mode}_pred"] = predicted[mode][i]
            record[f"{mode}_correct"] = predicted[mode][i] == case.answer
        records.append(record)
    return records


def accuracy(records: Sequence[dict], mode: str = "teacher") -> float:
    return sum(r[f"{mode}_correct"] for r in records) / len(records)
