"""Synthetic retrieval rows (`kind: synthetic`) as a source of the packed stream.

Each block holds one row: a passkey or recall prompt (`data.tasks`, the evaluation's own builder)
or a RULER task's prompt and a right answer (`data.ruler`, the evaluation's builder too, filled
exactly to the row's length) of a random length between `min_len` and the block length, starting
with EOS like every document, then EOS padding. Row k of consumer (rank, worker) is a pure
function of (seed, rank, worker, k), so the cursor's state is the row count: infinite,
deterministic, and exactly resumable. Keys are always training keys (`data.tasks.held_out`
reserves the evaluation keys; RULER rows: the asked values).

Positions that are not trained on are stored as `-(id + 1)` (see `split_block`): padding always,
and everything but the answer tokens with `loss_on: answer`. That keeps a block one integer
tensor, so the loader, its resume state and the block logs need no second array.
"""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch

from data.config import RULER_DOWNLOAD_FREE, SourceConfig
from data.ruler.tasks import TASKS as RULER_TASKS
from data.ruler.tasks import Encoder, Settings, TooShort
from data.ruler.tasks import build_case as build_ruler_case
from data.tasks import (
    build_case,
    build_recall,
    draw_passkey,
    passkey_min_length,
    recall_min_length,
    recall_vocab,
)
from data.tokenizer import Tokenizer

_TRAIN_STREAM = 0x5EED  # mixed into every row's seed: evaluation uses other generators entirely


def split_block(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of `[B, T + 1]` blocks: negative entries are tokens `-(id + 1)` that are
    read as input but not trained on as targets (target -100)."""
    tokens = torch.where(batch < 0, -batch - 1, batch)
    targets = torch.where(batch[:, 1:] < 0, torch.full_like(batch[:, 1:], -100), batch[:, 1:])
    return tokens[:, :-1], targets


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, T] document id of each input token, for document masking (`model.doc_mask`).

    The stream writes one EOS at every document boundary and nowhere else (sentencepiece never
    encodes text to its EOS, a control symbol), and the EOS that starts a document belongs to it:
    ids are the running count of EOS. They follow from the tokens alone, so the loader's state and
    exact resume are unchanged. Tokens before a row's first EOS (the tail of a document begun in the
    previous row) are document 0 of the row; each EOS of a synthetic row's padding is its own.
    """
    return (tokens == eos_id).cumsum(dim=-1)


def untrained(ids: np.ndarray) -> np.ndarray:
    """Mark ids as input only (not targets)."""
    return -ids - 1


class SyntheticCursor:
    """Rows of one synthetic task for one (rank, worker); state = rows produced.

    `layout_step` > 0 (a run resumed on another world size at that step) gives the consumers of the
    new layout seeds of their own, so they do not replay the rows of the old one."""

    def __init__(self, src: SourceConfig, tokenizer: Tokenizer, *, seed: int, rank: int, worker: int,
                 layout_step: int = 0):
        self.src, self.tokenizer = src, tokenizer
        self.seed, self.rank, self.worker = seed, rank, worker
        self.layout = [layout_step] if layout_step else []
        self.prefix = [tokenizer.eos_id]
        if src.task in RULER_DOWNLOAD_FREE:
            self.encoder = Encoder(tokenizer)
            self.settings = Settings(hops=src.hops, chains=src.chains, fewshot=False)
            self.shortest = 1
            try:
                self._ruler_row(random.Random(0), 1)
            except TooShort as e:
                self.shortest = e.needed
        elif src.task == "passkey":
            self.shortest = passkey_min_length(tokenizer, self.prefix)
        else:
            self.vocab = recall_vocab(tokenizer)
            self.shortest = recall_min_length(self.vocab, src.queries, self.prefix)
        self.shortest = max(self.shortest, src.min_len)
        self.rows = 0

    def reset(self, state: Optional[dict]) -> None:
        self.rows = state["rows"] if state else 0

    def state(self) -> dict:
        return {"rows": self.rows}

    def _rng(self, row: int) -> random.Random:
        entropy = np.random.SeedSequence([self.seed, self.rank, self.worker, row, _TRAIN_STREAM, *self.layout])
        return random.Random(int(entropy.generate_state(2, dtype=np.uint64)[0]))

    def row(self, k: int, n: int) -> tuple[list[int], list[int]]:
        """Row k for blocks of n tokens: (tokens, positions of the answer tokens)."""
        if self.shortest > n:
            raise ValueError(
                f"source {self.src.describe()}: its shortest row has {self.shortest} tokens, longer than a "
                f"training block ({n}): raise model.max_seq_len"
            )
        rng = self._rng(k)
        length = rng.randint(self.shortest, n)
        if self.src.task in RULER_DOWNLOAD_FREE:
            try:
                return self._ruler_row(rng, length)
            except TooShort:  # these needles need more tokens than the first draw's
                try:
                    return self._ruler_row(self._rng(k), n)
                except TooShort as e:
                    raise ValueError(f"source {self.src.describe()}: a row needs {e.needed} tokens, more than a "
                                     f"training block ({n}): raise model.max_seq_len") from None
        if self.src.task == "passkey":
            key, depth = draw_passkey(rng, evaluation=False), rng.random()
            try:
                case = build_case(self.tokenizer, length, depth, key, self.prefix)
            except ValueError:  # this key needs a token more than the typical one
                case = build_case(self.tokenizer, n, depth, key, self.prefix)
            return case.tokens, case.answer_positions
        case = build_recall(self.vocab, length, self.src.queries, rng, evaluation=False, prefix=self.prefix)
        return case.tokens, case.answer_positions

    def _ruler_row(self, rng: random.Random, length: int) -> tuple[list[int], list[int]]:
        """A RULER prompt of `length` minus its answer's tokens, then the answer (training values)."""
        case = build_ruler_case(RULER_TASKS[self.src.task], self.encoder, length, rng, settings=self.settings,
                                evaluation=False, prefix=self.prefix, training_row=True)
        answer = list(self.encoder(case.continuation))
        return case.tokens + answer, list(range(len(case.tokens), len(case.tokens) + len(answer)))

    def next_block(self, n: int) -> np.ndarray:
        tokens, answers = self.row(self.rows, n)
        self.rows += 1
        block = np.full(n, self.tokenizer.eos_id, dtype=np.int64)
        block[: len(tokens)] = tokens
        trained = np.zeros(n, dtype=bool)
        if self.src.loss_on == "answer":
            trained[answers] = True
        else:
            trained[: len(tokens)] = True
        return np.where(trained, block, untrained(block))
