"""Continuing a run: which checkpoint, what is read before the engine exists, what is loaded after.

A resume is read in two phases because the engine and the loader depend on it: `plan_resume`
(before: the client state, and on another world size the ZeRO state converted once through
DeepSpeed's universal format and where the new ranks' data streams start), then `restore` (after:
the engine's state, this rank's RNG and data position).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.stream import continuation
from train import checkpoint, elastic
from train import distributed as dist
from train.checkpointer import Progress
from train.config import TrainConfig
from train.faults import FaultInjector


def checkpoint_to_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint this run continues from, if any: its own newest (resume=auto), the one named
    (resume=<path>), or, at a branch's first start, its source (`branch_from`); refuse to overwrite
    a run silently."""
    if cfg.resume == "auto":
        found = checkpoint.complete_checkpoints(cfg.run_dir)
        if found:
            return found[-1]
        return checkpoint.find_checkpoint(cfg.branch_from) if cfg.branch_from else None
    if cfg.resume:
        return checkpoint.find_checkpoint(cfg.resume)
    found = checkpoint.complete_checkpoints(cfg.run_dir)
    if found:
        raise checkpoint.CheckpointError(
            f"run_dir {cfg.run_dir} already holds checkpoints (newest {found[-1].name}): pass resume=auto "
            "to continue that run, or set name=<new name> for a new one"
        )
    return checkpoint.find_checkpoint(cfg.branch_from) if cfg.branch_from else None


def complete_checkpoint(cfg: TrainConfig) -> Path | None:
    """With `resume=auto`, the newest checkpoint of a run that already reached `max_steps`."""
    found = checkpoint.complete_checkpoints(cfg.run_dir) if cfg.resume == "auto" else []
    if found and checkpoint.marker(found[-1])["step"] == cfg.max_steps:
        return found[-1]
    return None


@dataclass
class ResumePlan:
    """A resume, read before the engine and the loader are built (both depend on it)."""

    ckpt: Path
    client: dict[str, Any]  # this rank's client state; rank 0's when the layout changed
    same_layout: bool  # the world size and parallel.sequence that wrote the checkpoint
    universal: bool  # ZeRO state re-sliced through DeepSpeed's universal format (`train.elastic`)
    layout_step: int  # the step the data layout began at (`data.stream.PackedStream`)
    carry: dict | None  # where the new ranks' data streams start, when the world size changed


def plan_resume(ckpt: Path, cfg: TrainConfig, tokenizer, faults: FaultInjector) -> ResumePlan:
    """Read the checkpoint's client state; on another world size or `parallel.sequence`, convert the
    ZeRO state once (another world size under ZeRO 1-3: DeepSpeed partitions over every rank) and
    work out where the new data-parallel ranks' streams start from every old one's loader state
    (the first rank of each old sequence group: its group shared its rows)."""
    rank, world = dist.rank(), dist.world_size()
    written = checkpoint.marker(ckpt)
    written_by, written_sequence = written["world_size"], written.get("sequence", 1)
    if (written_by, written_sequence) == (world, cfg.parallel.sequence):
        client = checkpoint.client_state(ckpt, rank)
        return ResumePlan(ckpt, client, True, False, client.get("layout_step", 0), None)
    universal = elastic.needs_universal(written_by, world, cfg.deepspeed.zero_stage)
    if universal:
        elastic.universal_checkpoint(ckpt, before_commit=faults.in_conversion())
    clients = [checkpoint.client_state(ckpt, r) for r in range(0, written_by, written_sequence)]
    carry = continuation(cfg.data, tokenizer, cfg.model.max_seq_len, [client["loader"] for client in clients])
    return ResumePlan(ckpt, clients[0], False, universal, clients[0]["step"], carry)


def restore(plan: ResumePlan, engine, loader, cfg: TrainConfig) -> Progress:
    """Load the engine, then this rank's RNG and data position (or, on another layout, reseed: the
    old ranks' RNG streams do not map onto the new ranks)."""
    checkpoint.load(engine, plan.ckpt, universal=plan.universal)
    client = plan.client
    if plan.same_layout:
        checkpoint.set_rng_state(client["rng"])
        loader.load_state_dict(client["loader"])
    else:
        checkpoint.seed_all(cfg.seed + 1 + dist.rank() + 1_000_003 * client["step"])
    return Progress.from_client(client)
