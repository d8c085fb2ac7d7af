"""Multi-query associative recall: accuracy of the queried values (prompts from `data.tasks`).

Scored like passkey's teacher-forced mode: one forward pass over the whole case, the argmax at
each queried value's position given the true prefix, so a case of `q` queries gives `q` answers.
Cases of equal token count (all of one length: pairs fill it) share a forward, unpadded, as in
`eval.passkey`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from data.tasks import RecallCase
from eval.passkey import equal_length_batches, tail_logits


def predict(model, cases: Sequence[RecallCase], batch_tokens: int, progress: bool = False) -> list[list[int]]:
    """Per case, the argmax token at each answer position (the LM head runs on the query section)."""
    out: list[list[int]] = [[] for _ in cases]
    batches = list(equal_length_batches([len(c.tokens) - 1 for c in cases], batch_tokens))
    desc = f"recall L={cases[0].length}" if cases else "recall"
    for batch in tqdm(batches, desc=desc, unit="batch", disable=not progress, leave=False):
        n = len(cases[batch[0]].tokens)
        keep = n - min(min(cases[i].answer_positions) for i in batch)
        logits = tail_logits(model, [cases[i].tokens[:-1] for i in batch], keep)
        # logits row r: input position n - 1 - keep + r, which predicts token p = n - keep + r
        for row, i in enumerate(batch):
            out[i] = [int(logits[row, p - n + keep].argmax()) for p in cases[i].answer_positions]
    return out


def score_recall(
    model, cases: Sequence[RecallCase], progress: bool = True, batch_tokens: int = 16384
) -> list[dict]:
    """Per-case records: pairs, queries, predicted values and how many were right."""
    records = []
    for case, predicted in zip(cases, predict(model, cases, batch_tokens, progress)):
        right = sum(p == a for p, a in zip(predicted, case.answer))
        records.append({"length": case.length, "tokens": len(case.tokens), "pairs": case.n_pairs,
                        "queries": len(case.answer), "correct": right, "pred": predicted})
    return records


def recall_accuracy(records: Sequence[dict]) -> float:
    """Right answers over all queries."""
    return sum(r["correct"] for r in records) / sum(r["queries"] for r in records)
