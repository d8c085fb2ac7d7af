"""data.stream.continuation: the data stream of a run resumed on another number of ranks.

A `tokens` source must continue exactly: the blocks the old ranks gave out plus the blocks the new
ranks give out until the epoch ends are every block of the epoch once. Text sources begin a new
epoch; synthetic rows, mixture and shuffle draw from seeds of the new layout.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from data.config import DataConfig, SourceConfig, TokenizerConfig
from data.loader import build_loader
from data.prepare import prepare
from data.stream import continuation
from data.tokenizer import Tokenizer, get_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")

SEQ = 15  # blocks of 16 tokens
BATCH = 2


def _write(root: Path, prefix: str, files: int, docs: int, seed: int) -> None:
    rng = random.Random(seed)
    words = [f"{prefix}{i}" for i in range(40)]
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
        for f in range(files):
            lines = [json.dumps({"text": f"<{prefix}-{f}-{k}> "
                                 + " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))})
                     for k in range(docs)]
            (root / split / f"part-{f:02d}.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Tokenizer, DataConfig, list[tuple[int, ...]]]:
    """A tokenizer, a mixture of a prepared `tokens` source (weight 2) and another text corpus
    (weight 1) with a shuffle window, and every block of the tokens source's train split."""
    root = tmp_path_factory.mktemp("elastic")
    _write(root / "tok", "a", files=4, docs=12, seed=0)
    _write(root / "text", "b", files=4, docs=12, seed=1)
    tok = get_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=400, sample_docs=30),
                                   cache_dir=str(root / "cache")))
    text_cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(root / "tok" / "{split}" / "*.jsonl"))],
                          tokenizer=TokenizerConfig(model_path=tok.path))
    prepare(text_cfg, root / "bin", splits=("train", "val"))
    meta = json.loads((root / "bin" / "meta.json").read_text())
    tokens = np.concatenate([np.fromfile(root / "bin" / s["file"], dtype=meta["dtype"])
                             for s in meta["splits"]["train"]["shards"]])
    blocks = [tuple(int(t) for t in tokens[b * (SEQ + 1) : (b + 1) * (SEQ + 1)])
              for b in range(len(tokens) // (SEQ + 1))]
    cfg = DataConfig(sources=[SourceConfig(kind="tokens", path=str(root / "bin"), weight=2.0),
                              SourceConfig(kind="files", path=str(root / "text" / "{split}" / "*.jsonl"))],
                     shuffle_buffer=4, num_workers=2)
    return tok, cfg, blocks


def _loader(setup, world: int, rank: int, workers: int, window: int = 4, **kw):
    tok, cfg, _ = setup
    cfg = dataclasses.replace(cfg, num_workers=workers, shuffle_buffer=window)
    return build_loader(cfg, tok, split="train", seq_len=SEQ, batch_size=BATCH, rank=rank, world_size=world, **kw)


def _old_ranks(setup, world: int, batches: int) -> tuple[list[dict], list[tuple[int, ...]]]:
    """`world` ranks with two workers each take `batches` batches (as trainer ranks do); their
    loader states and every block they gave out."""
    states, given = [], []
    for rank in range(world):
        loader = _loader(setup, world, rank, workers=2)
        it = iter(loader)
        for _ in range(batches):
            given += [tuple(row) for row in next(it).tolist()]
        states.append(loader.state_dict())
    return states, given


def _share(carry_source: dict, consumer: int, consumers: int, n_blocks: int) -> int:
    """Blocks of the carried epoch that a new consumer gives out (its pending share, then its stride)."""
    pending = len(carry_source["pending"][consumer::consumers])
    return pending + len(range(carry_source["start"] + consumer, n_blocks, consumers))


@pytest.mark.parametrize("new_world, new_workers", [(1, 2), (3, 0)])
def test_tokens_source_continues_exactly_on_another_world_size(setup, new_world, new_workers):
    """2 ranks x 2 workers read part of the epoch; the new ranks then read until the epoch ends:
    the tokens source's blocks together are the epoch's blocks, each once (nothing lost, nothing
    repeated), though the shuffle window and the mixture had drawn blocks not yet given out.
    (The new ranks read without a shuffle window, so that each consumer's blocks of the epoch are
    simply its first ones: a window would mix the next epoch's first blocks in.)"""
    tok, cfg, all_blocks = setup
    known = set(all_blocks)
    states, given = _old_ranks(setup, world=2, batches=5)
    old_tokens = [b for b in given if b in known]
    carry = continuation(cfg, tok, SEQ, states)
    source = carry["sources"][0]
    assert source["epoch"] == 0 and source["pending"], source  # the window and mixture left blocks behind
    new_tokens = []
    for rank in range(new_world):
        loader = _loader(setup, new_world, rank, new_workers, window=0, layout_step=5, carry=carry)
        workers = max(new_workers, 1)
        want = [_share(source, rank * workers + w, new_world * workers, len(all_blocks)) for w in range(workers)]
        got = [0] * workers
        for j, batch in enumerate(loader):  # batches come from the workers in turn
            worker = j % workers
            for row in map(tuple, batch.tolist()):
                if row in known and got[worker] < want[worker]:
                    new_tokens.append(row)
                    got[worker] += 1
            if got == want:
                break
    assert Counter(old_tokens) + Counter(new_tokens) == Counter(all_blocks)


def test_the_new_layout_resumes_exactly_and_continues_again(setup):
    """After a resume on another world size the new layout is part of the run: a resume on the
    same (new) world size continues it batch for batch, and a second change carries on from it."""
    tok, cfg, _ = setup
    states, _ = _old_ranks(setup, world=2, batches=3)
    carry = continuation(cfg, tok, SEQ, states)
    def make():
        return _loader(setup, 1, 0, workers=2, layout_step=3, carry=carry)

    reference = [b for _, b in zip(range(12), make())]
    loader = make()
    it = iter(loader)
    first = [next(it) for _ in range(5)]
    state = loader.state_dict()
    resumed = _loader(setup, 1, 0, workers=2, layout_step=3)
    resumed.load_state_dict(state)
    again = first + [b for _, b in zip(range(7), resumed)]
    assert all(torch.equal(a, b) for a, b in zip(again, reference))
    with pytest.raises(ValueError, match="layout_step"):  # a state of one layout is not read as another
        other = _loader(setup, 1, 0, workers=2)
        other.load_state_dict(state)
        next(iter(other))
    third = continuation(cfg, tok, SEQ, [state])
    assert third["sources"][0]["epoch"] == 0 and third["sources"][0]["start"] >= carry["sources"][0]["start"]


def test_text_sources_begin_a_new_epoch_and_synthetic_rows_new_seeds(setup):
    tok, cfg, _ = setup
    states, _ = _old_ranks(setup, world=2, batches=3)
    assert continuation(cfg, tok, SEQ, states)["sources"][1] == {"epoch": 1, "hf": None, "offset": 0}
    fresh = [_loader(setup, 2, r, workers=2).state_dict() for r in range(2)]  # nothing read yet
    nothing_read = continuation(cfg, tok, SEQ, fresh)["sources"]  # the epoch's first blocks, then the rest
    assert nothing_read == [{"epoch": 0, "k": 0, "start": 3, "pending": [[0, 0], [0, 1], [0, 2]]},
                            {"epoch": 0, "hf": None, "offset": 0}]
    first = next(iter(_loader(setup, 1, 0, workers=0)))
    carried = next(iter(_loader(setup, 1, 0, workers=0, layout_step=3, carry=continuation(cfg, tok, SEQ, fresh))))
    assert not torch.equal(first, carried)  # same start, but the mixture draws from the new layout's seeds
