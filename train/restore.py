"""Continuing from a checkpoint's whole state (a resume or a branch: `train.start.Start`): what is
read before the engine exists, what is loaded after.

It is read in two phases because the engine and the loader depend on it: `plan_resume`
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
from train.checkpoint import CheckpointError, Progress
from train.config import TrainConfig
from train.faults import FaultInjector
from train.start import Start


@dataclass
class ResumePlan:
    """A resume, read before the engine and the loader are built (both depend on it)."""

    ckpt: Path
    client: dict[str, Any]  # this rank's client state; rank 0's when the layout changed
    same_layout: bool  # the world size and parallel.sequence that wrote the checkpoint
    universal: bool  # ZeRO state re-sliced through DeepSpeed's universal format (`train.elastic`)
    layout_step: int  # the step the data layout began at (`data.stream.PackedStream`)
    carry: dict | None  # where the new ranks' data streams start, when the world size changed


def plan_resume(start: Start, tokenizer, faults: FaultInjector) -> ResumePlan:
    """Read the start's checkpoint's client state; on another layout (`Start.elastic`: world size
    or `parallel.sequence`), convert the ZeRO state once (another world size under ZeRO 1-3:
    DeepSpeed partitions over every rank) and work out where the new data-parallel ranks' streams
    start from every old one's loader state (the first rank of each old sequence group: its group
    shared its rows)."""
    ckpt, cfg, world = start.checkpoint, start.cfg, dist.world_size()
    if not start.elastic(world):
        client = checkpoint.client_state(ckpt, dist.rank())
        return ResumePlan(ckpt, client, True, False, client.get("layout_step", 0), None)
    written_by, written_sequence = start.written
    universal = elastic.needs_universal(written_by, world, cfg.deepspeed.zero_stage)
    if universal and cfg.optim.name == "muon":
        raise CheckpointError(
            f"checkpoint {ckpt}: written by {written_by} ranks under ZeRO {cfg.deepspeed.zero_stage} with Muon, "
            "and DeepSpeed's universal-checkpoint conversion keeps Adam's moments but not Muon's momentum "
            f"buffers: resume it with {written_by} ranks")
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
