"""Passkey retrieval (Mohtashami & Jaggi 2023) with the paper's prompt: the scorers.

The prompts are built by `data.tasks` (shared with the training rows of `data.synthetic`).
Two scorers: `teacher_forced` takes the argmax at every answer position in one forward pass, which
equals greedy decoding (greedy never leaves the key while it is right, and is wrong from the first
miss on either way); `generated` really decodes greedily with the model's KV cache, to cross-check.
"""

from __future__ import annotations

from typing import Protocol, Sequence

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
