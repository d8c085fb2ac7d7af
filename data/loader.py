"""`build_loader`: the resumable dataloader of packed token blocks for one data-parallel rank."""

from __future__ import annotations

import atexit
import multiprocessing
import signal
from typing import Optional

import torch
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader

from data.config import DataConfig, check_split
from data.prepare import TokenCursor
from data.sources import check_source, open_source
from data.stream import PackedStream, stream_sources
from data.synthetic import SyntheticCursor
from data.tokenizer import Tokenizer


def ignore_stop_signals(_worker_id: int) -> None:
    """DataLoader `worker_init_fn`: workers ignore SIGTERM and SIGINT.

    Schedulers signal the whole process group; a worker that died of it would crash its rank
    before the rank could save. The rank stops at a step boundary and shuts its workers down
    (they also exit on their own if the rank is killed: torch's parent-process watchdog).
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _kill_workers_at_exit() -> None:
    """At interpreter exit, multiprocessing terminates daemonic children with SIGTERM and joins
    them. Our workers ignore SIGTERM, so a worker whose iterator is still alive at exit (one that
    raised while starting, held by a traceback) would block the exit forever: kill them first.
    Registered after multiprocessing's own exit handler, so it runs before it. torch's SIGCHLD
    handler, which reports a killed worker as an error, is put back to the default first."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


atexit.register(_kill_workers_at_exit)


def _check_shards(cfg: DataConfig, split: str, rank: int, world_size: int) -> None:
    """Every dataloader worker of the train split needs documents of every source."""
    if split != "train" or cfg.num_workers < 2:
        return
    for src in cfg.sources:
        if not src.is_text:
            continue
        ds = open_source(src, split, cfg, seed=cfg.seed)
        if world_size > 1:
            ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
        if ds.num_shards < cfg.num_workers:
            raise ValueError(
                f"source {src.describe()}: split {split!r} has {ds.num_shards} shard(s) for rank {rank}, "
                f"fewer than data.num_workers={cfg.num_workers}; lower num_workers or use more files"
            )


def build_loader(cfg: DataConfig, tokenizer: Tokenizer, *, split: str, seq_len: int, batch_size: int,
                 rank: int = 0, world_size: int = 1, layout_step: int = 0,
                 carry: Optional[dict] = None) -> StatefulDataLoader:
    """Batches `LongTensor[batch_size, seq_len + 1]`; `data.synthetic.split_block` gives inputs and
    targets (negative entries of synthetic rows are inputs that are not trained on).

    `train` is infinite (epochs repeat, documents reordered per epoch, blocks shuffled within
    `cfg.shuffle_buffer`); `val`/`test` are one deterministic pass (last batch may be smaller).
    `loader.state_dict()` after k batches, given to `load_state_dict` of a loader built with the
    same arguments, continues with batch k + 1 exactly (on every rank, with any num_workers).
    `layout_step` and `carry` continue a run on another world size (`data.stream.continuation`).
    """
    check_split(split)
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    for src in stream_sources(cfg, split):  # clear errors here, in the main process, rather than in a worker
        if src.kind == "tokens":
            TokenCursor(src, tokenizer, split=split, seed=cfg.seed, index=0, consumers=1, infinite=False)
        elif src.kind == "synthetic":
            SyntheticCursor(src, tokenizer, seed=cfg.seed, rank=rank, worker=0).row(0, seq_len + 1)
        else:
            check_source(src, split, cfg)
    _check_shards(cfg, split, rank, world_size)
    stream = PackedStream(cfg, tokenizer, split=split, seq_len=seq_len, rank=rank, world_size=world_size,
                          layout_step=layout_step, carry=carry)
    return StatefulDataLoader(
        stream,
        batch_size=batch_size,
        num_workers=cfg.num_workers,
        drop_last=split == "train",
        pin_memory=torch.cuda.is_available(),
        worker_init_fn=ignore_stop_signals if cfg.num_workers > 0 else None,
    )
