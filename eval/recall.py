"""Multi-query associative recall: accuracy of the queried values (prompts from `data.tasks`).

Scored like passkey's teacher-forced mode: one forward pass over the whole case, the argmax at
each queried value's position given the true prefix, so a case of `q` queries gives `q` answers.
"""

from __future__ import annotations

from typing import Sequence

import torch
from tqdm import tqdm

from data.tasks import RecallCase


@torch.inference_mode()
def predict(model, case: RecallCase) -> list[int]:
    """The argmax token at each answer position (the LM head runs on the query section only)."""
    tokens, first = case.tokens, min(case.answer_positions)
    keep = len(tokens) - first
    idx = torch.tensor([tokens[:-1]], device=next(model.parameters()).device)
    logits = model(idx, logits_to_keep=keep)[0]
    return [int(logits[p - len(tokens) + keep].argmax()) for p in case.answer_positions]


def score_recall(model, cases: Sequence[RecallCase], progress: bool = True) -> list[dict]:
    """Per-case records: pairs, queries, predicted values and how many were right."""
    records = []
    for case in tqdm(cases, desc=f"recall L={cases[0].length}" if cases else "recall", disable=not progress, leave=False):
        predicted = predict(model, case)
        right = sum(p == a for p, a in zip(predicted, case.answer))
        records.append({"length": case.length, "tokens": len(case.tokens), "pairs": case.n_pairs,
                        "queries": len(case.answer), "correct": right, "pred": predicted})
    return records


def recall_accuracy(records: Sequence[dict]) -> float:
    """Right answers over all queries."""
    return sum(r["correct"] for r in records) / sum(r["queries"] for r in records)
