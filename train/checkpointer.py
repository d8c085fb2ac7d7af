"""The trainer's checkpointer: what a checkpoint holds beside DeepSpeed's state, and when it is written.

The client state (one file per rank) is the run's position: `Progress` (step, tokens seen, batches
skipped), the data loader's state, the step the data layout began at, and the RNG states (added
by `train.checkpoint.save`). Writing, atomic commit and pruning are `train.checkpoint`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train import checkpoint
from train.faults import FaultInjector


@dataclass
class Progress:
    """Where a run stands; saved in every checkpoint and restored on resume."""

    step: int = 0
    tokens: int = 0
    skipped: int = 0

    @classmethod
    def from_client(cls, client: dict[str, Any]) -> Progress:
        return cls(client["step"], client["tokens"], client["skipped"])


class Checkpointer:
    """Saves every `ckpt_every` steps, at the last step, and on a stop request."""

    def __init__(self, engine, loader, run_dir: Path, files: dict[str, bytes], *, every: int, last: int,
                 keep_last: int, layout_step: int, faults: FaultInjector, say: Callable[[str], None],
                 sequence: int = 1):
        self.engine, self.loader, self.run_dir, self.files = engine, loader, run_dir, files
        self.every, self.last, self.keep_last = every, last, keep_last
        self.layout_step = layout_step  # where the data layout began (`data.stream.PackedStream`)
        self.faults, self.say = faults, say
        self.sequence = sequence  # parallel.sequence, recorded in the marker (`train.restore`)
        self.last_saved: Path | None = None

    def client_state(self, progress: Progress) -> dict[str, Any]:
        return {"step": progress.step, "tokens": progress.tokens, "skipped": progress.skipped,
                "loader": self.loader.state_dict(), "layout_step": self.layout_step}

    def save(self, progress: Progress) -> Path:
        path = checkpoint.save(self.engine, self.run_dir, progress.step, self.client_state(progress),
                               self.files, self.keep_last, before_commit=self.faults.in_checkpoint(progress.step),
                               in_prune=self.faults.in_prune(progress.step), sequence=self.sequence)
        self.say(f"saved {path}")
        self.last_saved = path
        return path

    def maybe_save(self, progress: Progress) -> None:
        if progress.step % self.every == 0 or progress.step == self.last:
            self.save(progress)
