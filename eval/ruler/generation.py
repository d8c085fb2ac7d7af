"""Greedy answers to RULER cases, scored as RULER scores them.

Every case of one task and length has the same token count (`data.ruler` fills prompts exactly),
so they share a forward and a KV cache unpadded: each row is computed as it is alone (causal
attention; dynamic NTK follows the tokens processed, the same in a batch). Generation stops at the
answer budget or once every row of the batch has produced EOS; a row's answer is its text up to
its first EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from tqdm import tqdm

from data.ruler.tasks import TASKS, RulerCase
from eval.passkey import equal_length_batches
from eval.ruler.score import postprocess, string_match


class Decoder(Protocol):
    """What turns ids back into text: the run's tokenizer."""

    eos_id: int

    def decode(self, ids: list[int]) -> str: ...


@torch.inference_mode()
def generate_answers(model, cases: Sequence[RulerCase], tokenizer: Decoder, batch_tokens: int,
                     bar: tqdm | None = None) -> list[str]:
    """Each case's greedy continuation of at most its budget, as text (up to its first EOS)."""
    device = next(model.parameters()).device
    out: list[str] = [""] * len(cases)
    for batch in equal_length_batches([c.length for c in cases], batch_tokens):
        prompt = torch.tensor([cases[i].tokens for i in batch], device=device)
        budget = max(cases[i].budget for i in batch)
        generated = model.generate(prompt, max_new_tokens=budget, greedy=True, stop=(tokenizer.eos_id,))
        for row, i in enumerate(batch):
            ids = generated[row, prompt.shape[1] :].tolist()[: cases[i].budget]
            if tokenizer.eos_id in ids:
                ids = ids[: ids.index(tokenizer.eos_id)]
            out[i] = tokenizer.decode(ids)
        if bar is not None:
            bar.update(len(batch))
    return out


def score_cases(model, cases: Sequence[RulerCase], tokenizer: Decoder, batch_tokens: int,
                bar: tqdm | None = None) -> list[dict]:
    """Per-case records: task, length, prompt tokens, haystack units, needle depths (NIAH), expected
    answers, prediction and score."""
    predictions = generate_answers(model, cases, tokenizer, batch_tokens, bar)
    records = []
    for case, text in zip(cases, predictions):
        prediction = postprocess(text)
        records.append({"task": case.task, "length": case.length, "tokens": len(case.tokens),
                        "haystack": case.haystack, "depth": list(case.depths), "answers": list(case.answers),
                        "prediction": prediction,
                        "score": string_match(prediction, case.answers, TASKS[case.task].rule)})
    return records
