"""The packed token stream of one data-parallel rank: a small, explicitly stateful IterableDataset.

    documents (datasets streaming, split by rank and worker)      one cursor per source
      -> tokenize, EOS after each document, cut into (seq_len + 1)-token blocks (no padding)
      -> mixture: each block drawn from one source, chosen by weight with a seeded generator
      -> window shuffle (train): blocks permuted within windows of `shuffle_buffer` blocks
      -> LongTensor[seq_len + 1], one at a time (the StatefulDataLoader batches them)

Why a hand-written stage on top of `datasets`: packing carries a partial document from one
block to the next, the mixture and the shuffle hold generator state, and the epoch loop lives
here; none of that is state the library knows. `datasets` still shards and records the
document position (`IterableDataset.state_dict`); this class adds the rest, kept small:

- a source cursor's state is (epoch, the `datasets` state *before* the current document, the
  token offset into that document): resuming re-reads and re-tokenizes one document;
- the shuffle is a seeded permutation of each window (not a reservoir), so its state is the
  snapshot at the window start plus a position; resuming rebuilds the window and skips.

The checkpoint therefore stays a few hundred bytes per worker whatever the buffer size, and
the stream after `load_state_dict` is exactly the stream that would have followed.

Sharding: documents are split by rank with `datasets.distributed.split_dataset_by_node`
(whole shards when their number divides world_size, else every world_size-th document) and
by dataloader worker by `datasets` itself (whole shards). Each (rank, worker) packs its own
documents, so blocks never overlap and together cover every document of the single-process
stream once per epoch. Pre-tokenized `tokens` sources shard whole blocks instead.
"""

from __future__ import annotations

from typing import Optional, Protocol

import numpy as np
import torch
from datasets.distributed import split_dataset_by_node

from data.config import DataConfig, SourceConfig
from data.prepare import TokenCursor
from data.sources import by_document, open_source, text_of
from data.synthetic import SyntheticCursor
from data.tokenizer import Tokenizer

STATE_VERSION = 1


class Cursor(Protocol):
    """One source's block stream for one (rank, worker)."""

    def reset(self, state: Optional[dict]) -> None: ...

    def state(self) -> dict: ...

    def next_block(self, n: int) -> Optional[np.ndarray]: ...


class TextCursor:
    """Packs one text source's documents into blocks; epochs repeat for the train split."""

    def __init__(self, src: SourceConfig, cfg: DataConfig, tokenizer: Tokenizer, *, split: str,
                 rank: int, world_size: int, infinite: bool):
        self.src, self.cfg, self.tokenizer, self.split = src, cfg, tokenizer, split
        self.rank, self.world_size, self.infinite = rank, world_size, infinite

    def _open(self, hf_state: Optional[dict]) -> None:
        ds = open_source(self.src, self.split, self.cfg, seed=self.cfg.seed, epoch=self.epoch)
        if self.world_size > 1:
            ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world_size)
        if hf_state is not None:
            ds.load_state_dict(hf_state)
        self._ds, self._it = ds, iter(ds)
        self._hf_before = self._hf_after = hf_state
        self._fresh_epoch = hf_state is None
        self._docs_read = 0

    def reset(self, state: Optional[dict]) -> None:
        self.epoch = state["epoch"] if state else 0
        self._doc: Optional[np.ndarray] = None
        self._offset = 0
        self._skip = state["offset"] if state else 0
        self._open(state["hf"] if state else None)

    def state(self) -> dict:
        """Valid at block boundaries; the partially read document is re-read on resume."""
        if self._doc is None:  # nothing read since reset: still the loaded position
            return {"epoch": self.epoch, "hf": self._hf_after, "offset": self._skip}
        if self._offset < len(self._doc):
            return {"epoch": self.epoch, "hf": self._hf_before, "offset": self._offset}
        return {"epoch": self.epoch, "hf": self._hf_after, "offset": 0}

    def _next_doc(self) -> bool:
        while True:
            example = next(self._it, None)
            if example is None:
                if not self.infinite:
                    return False
                if self._fresh_epoch and self._docs_read == 0:
                    raise RuntimeError(
                        f"source {self.src.describe()}: no documents for rank {self.rank} in split "
                        f"{self.split!r} (too few shards for the ranks and dataloader workers?)"
                    )
                self.epoch += 1
                self._open(None)
                continue
            self._hf_before, self._hf_after = self._hf_after, self._ds.state_dict()
            self._docs_read += 1
            text = text_of(example, self.src)
            if not text:
                continue
            ids = self.tokenizer.encode(text)
            ids.append(self.tokenizer.eos_id)
            self._doc = np.asarray(ids, dtype=np.int64)
            self._offset, self._skip = min(self._skip, len(ids)), 0
            return True

    def next_block(self, n: int) -> Optional[np.ndarray]:
        parts, need = [], n
        while need:
            if self._doc is None or self._offset >= len(self._doc):
                if not self._next_doc():
                    return None  # end of a one-pass split: the partial block is dropped
            take = min(need, len(self._doc) - self._offset)
            parts.append(self._doc[self._offset : self._offset + take])
            self._offset += take
            need -= take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def stream_sources(cfg: DataConfig, split: str) -> list[SourceConfig]:
    """The sources of a split's stream: synthetic rows are trained on, never validated or tested
    (val/test losses stay comparable with a text-only run)."""
    sources = [s for s in cfg.sources if split == "train" or s.kind != "synthetic"]
    if not sources:
        raise ValueError(f"split {split!r} has no source: synthetic rows are for training; add a text source")
    return sources


def continuation(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, loader_states: list[dict]) -> dict:
    """Where every consumer of a new world size starts, from the loader states of all the old ranks
    (a resume on another number of ranks; the semantics are in docs/DESIGN.md):

    - a `tokens` source continues exactly: the blocks the old consumers had not read, and only
      those, are shared out among the new ones (`TokenCursor`'s `start` and `pending`);
    - a text source begins a new epoch, as if the current one had ended at the resume: nothing is
      read twice within an epoch; what the old ranks had not reached of it is skipped;
    - synthetic rows, the mixture and the shuffle draw from seeds of the new layout.
    """
    olds = _dataset_states(loader_states)
    if not olds:  # no loader had started: nothing was read
        return {"sources": None, "rng": None, "alive": None}
    sources = stream_sources(cfg, "train")
    weights = _weights(sources)
    starts: list[dict] = []
    for i, src in enumerate(sources):
        if src.kind == "synthetic":
            starts.append({"rows": 0})
        elif src.kind == "tokens":
            starts.append(_tokens_carry(cfg, tokenizer, src, i, olds, seq_len + 1, weights))
        else:
            read = [s["start"]["sources"][i]["epoch"] for s in olds if s.get("start") and s["start"]["rng"] is not None]
            carried = [s["start"]["sources"][i]["epoch"] for s in olds if s.get("start") and s["start"]["sources"]]
            epoch = max(read) + 1 if read else max(carried, default=0)
            starts.append({"epoch": epoch, "hf": None, "offset": 0})
    return {"sources": starts, "rng": None, "alive": None}


def _tokens_carry(cfg: DataConfig, tokenizer: Tokenizer, src: SourceConfig, i: int, olds: list[dict], n: int,
                  weights: np.ndarray) -> dict:
    """The new consumers' common start of `tokens` source i. Each old consumer gave out its blocks
    up to its snapshot, then some of the blocks its shuffle window drew after it (replayed); the
    first block no window drew is its head. The newest head is the frontier; every block before
    it that was not given out is pending."""
    heads, left = [], []
    cursors = []
    for state in olds:
        workers = max(state["num_workers"], 1)
        cursor = TokenCursor(src, tokenizer, split="train", seed=cfg.seed,
                             index=state["rank"] * workers + state["worker"],
                             consumers=state["world_size"] * workers, infinite=True)
        start = state.get("start")
        cursor.reset(start["sources"][i] if start and start["sources"] else None)
        for given in _window_draws(cfg, state, i, weights):
            position = cursor.next_position(n)
            if not given:
                left.append(position)
        heads.append(cursor.next_position(n))
        cursors.append(cursor)
    frontier = max(heads)
    for cursor, position in zip(cursors, heads):
        while position < frontier:
            left.append(position)
            position = cursor.next_position(n)
    return {"epoch": frontier[0], "k": 0, "start": frontier[1], "pending": sorted(list(p) for p in left)}


def _window_draws(cfg: DataConfig, state: dict, i: int, weights: np.ndarray) -> list[bool]:
    """For each block of source i that the consumer's current shuffle window drew (in draw order),
    whether it was given out: the draws and their order are replayed from their seeds (no data is
    read). Empty when the consumer is at a window boundary or never started."""
    start, pos = state.get("start"), state.get("pos", 0)
    if not start or start["rng"] is None or pos == 0:
        return []
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = start["rng"]
    picks = [_pick(rng, weights, start["alive"]) for _ in range(state["shuffle_buffer"])]
    order = np.arange(len(picks))
    if state["shuffle_buffer"] > 1:
        layout = [state["layout_step"]] if state.get("layout_step") else []
        order = _window_order(cfg.seed, state["rank"], state["worker"], state["window"], layout, len(picks))
    given = set(int(k) for k in order[:pos])
    return [draw in given for draw, source in enumerate(picks) if source == i]


def _weights(sources: list[SourceConfig]) -> np.ndarray:
    weights = np.array([s.weight for s in sources], dtype=np.float64)
    return weights / weights.sum()


def _pick(rng: np.random.Generator, weights: np.ndarray, alive: list[bool]) -> int:
    """The source of the next block: drawn by weight among the live ones."""
    live = np.flatnonzero(alive)
    return int(live[0]) if len(live) == 1 else int(rng.choice(live, p=weights[live] / weights[live].sum()))


def _window_order(seed: int, rank: int, worker: int, window: int, layout: list[int], size: int) -> np.ndarray:
    """The order a shuffle window's blocks are given out in."""
    return np.random.default_rng([seed, rank, worker, window, *layout]).permutation(size)


def _dataset_states(loader_states: list[dict]) -> list[dict]:
    """The `PackedStream` states inside `StatefulDataLoader.state_dict()`s (one per worker)."""
    found = []
    for state in loader_states:
        if "dataset_state" in state:  # num_workers=0
            found.append(state["dataset_state"])
        else:
            found.extend(w["dataset_state"] for w in state["_snapshot"]["_worker_snapshots"].values())
    return [s for s in found if s is not None]


class PackedStream(torch.utils.data.IterableDataset):
    """Blocks of `seq_len + 1` tokens for one rank; `state_dict()` per worker resumes exactly.

    `carry` (from `continuation`) and `layout_step` (the step it was made at) start a run resumed on
    another world size; the layout step stays part of every later state of the run.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, *, split: str, seq_len: int,
                 rank: int, world_size: int, layout_step: int = 0, carry: Optional[dict] = None):
        self.cfg, self.tokenizer, self.split = cfg, tokenizer, split
        self.seq_len, self.rank, self.world_size = seq_len, rank, world_size
        self.layout_step, self.carry = layout_step, carry
        self.layout = [layout_step] if layout_step else []
        self.infinite = split == "train"
        self.window = cfg.shuffle_buffer if self.infinite and cfg.shuffle_buffer > 1 else 1
        self.sources = stream_sources(cfg, split)
        self.weights = _weights(self.sources)
        self._state: Optional[dict] = None
        self._resume: Optional[dict] = None

    # -- identity of this consumer, stored in and checked against the state -----------------
    def _consumer(self) -> dict:
        info = torch.utils.data.get_worker_info()
        me = {
            "version": STATE_VERSION, "split": self.split, "seq_len": self.seq_len,
            "rank": self.rank, "world_size": self.world_size,
            "worker": info.id if info else 0, "num_workers": info.num_workers if info else 0,
            "sources": [s.describe() for s in self.sources], "seed": self.cfg.seed,
            "shuffle_buffer": self.window,
        }
        # A key only where it applies: states saved before files were split by document still load
        # for other sources, and such a state of a `files` source is refused rather than misread.
        if any(by_document(s) for s in self.sources):
            me["split_by_document"] = True
        me["layout_step"] = self.layout_step
        return me

    def state_dict(self) -> dict:
        if self._state is not None:
            return self._state
        return {**self._consumer(), "start": self.carry, "window": 0, "pos": 0}

    def load_state_dict(self, state: dict) -> None:
        self._state = self._resume = state

    def _check(self, state: dict, me: dict) -> None:
        saved = {k: state.get(k, 0 if k == "layout_step" else None) for k in me}  # older states: layout 0
        if saved != me:
            diff = ", ".join(f"{k}: saved {saved[k]!r}, now {me[k]!r}" for k in me if saved[k] != me[k])
            raise ValueError(f"data loader state does not match this loader ({diff}); resume needs the same data setup")

    # -- iteration ---------------------------------------------------------------------------
    def _cursors(self) -> list[Cursor]:
        cursors: list[Cursor] = []
        info = torch.utils.data.get_worker_info()
        for src in self.sources:
            if src.kind == "synthetic":
                cursors.append(SyntheticCursor(src, self.tokenizer, seed=self.cfg.seed, rank=self.rank,
                                               worker=info.id if info else 0, layout_step=self.layout_step))
            elif src.kind == "tokens":
                consumers = self.world_size * (info.num_workers if info else 1)
                index = self.rank * (info.num_workers if info else 1) + (info.id if info else 0)
                cursors.append(TokenCursor(src, self.tokenizer, split=self.split, seed=self.cfg.seed,
                                           index=index, consumers=consumers, infinite=self.infinite))
            else:
                cursors.append(TextCursor(src, self.cfg, self.tokenizer, split=self.split, rank=self.rank,
                                          world_size=self.world_size, infinite=self.infinite))
        return cursors

    def __iter__(self):
        me = self._consumer()
        resume, self._resume = self._resume, None
        if resume is not None:
            self._check(resume, me)
        start = resume.get("start") if resume else self.carry
        cursors = self._cursors()
        rng = np.random.Generator(np.random.PCG64([self.cfg.seed, self.rank, me["worker"], *self.layout]))
        alive = [True] * len(cursors)
        for i, c in enumerate(cursors):
            c.reset(start["sources"][i] if start and start["sources"] else None)
        if start and start["rng"] is not None:  # a snapshot of this consumer (not a carry)
            rng.bit_generator.state = start["rng"]
            alive = list(start["alive"])
        window, pos = (resume["window"], resume["pos"]) if resume and resume.get("start") else (0, 0)
        n = self.seq_len + 1
        while True:
            snap = {"sources": [c.state() for c in cursors], "rng": rng.bit_generator.state, "alive": list(alive)}
            blocks = []
            while len(blocks) < self.window and any(alive):
                i = _pick(rng, self.weights, alive)
                block = cursors[i].next_block(n)
                if block is None:
                    alive[i] = False
                else:
                    blocks.append(block)
            self._state = {**me, "start": snap, "window": window, "pos": 0}
            if not blocks:
                return
            order = np.arange(len(blocks))
            if self.window > 1:
                order = _window_order(self.cfg.seed, self.rank, me["worker"], window, self.layout, len(blocks))
            for k in range(pos, len(blocks)):
                self._state = {**me, "start": snap, "window": window, "pos": k + 1}
                yield torch.from_numpy(blocks[order[k]])
            window, pos = window + 1, 0
