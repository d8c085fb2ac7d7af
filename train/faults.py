"""Fault injection for the tests of the failure paths: every `debug.*` hook in one place.

With the defaults (`DebugConfig()`) every method is inert, so the trainer calls them unconditionally
and no `if cfg.debug...` appears anywhere else.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from train import distributed as dist
from train.config import DebugConfig

Hook = Optional[Callable[[], None]]


def kill_now() -> None:
    """Die here as a hard kill would (power loss, OOM killer)."""
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjector:
    """NaN losses, SIGKILLs at chosen points of a save, a prune or a conversion, slow steps, and the
    block log that proves no training block is repeated or skipped on resume."""

    def __init__(self, cfg: DebugConfig):
        self.cfg = cfg
        self._nan_pending = cfg.nan_at_step  # injected once, into the first micro-batch of that step
        self._blocks = None

    def open_block_log(self, run_dir: Path, resumed_step: int) -> None:
        if self.cfg.log_blocks:
            self._blocks = _BlockLog(run_dir, resumed_step)

    def on_batch(self, step: int, batch: torch.Tensor) -> None:
        if self._blocks is not None:
            self._blocks.write(step, batch)

    def poison(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Rank 0's loss of `debug.nan_at_step` becomes NaN (the other ranks must follow it)."""
        if dist.is_main() and step == self._nan_pending:
            self._nan_pending = -1
            return loss * float("nan")
        return loss

    def in_checkpoint(self, step: int) -> Hook:
        return kill_now if step == self.cfg.kill_in_checkpoint_at_step else None

    def in_prune(self, step: int) -> Hook:
        return kill_now if step == self.cfg.kill_in_prune_at_step else None

    def in_conversion(self) -> Hook:
        return kill_now if self.cfg.kill_in_conversion else None

    def after_step(self) -> None:
        if self.cfg.step_sleep_s:
            time.sleep(self.cfg.step_sleep_s)


class _BlockLog:
    """Every training block (a fingerprint and its tokens) to `blocks_rank<R>.jsonl`, to prove none
    is repeated or skipped on resume, and to replay the run's global batches in a test."""

    def __init__(self, run_dir: Path, resumed_step: int):
        self.path = run_dir / f"blocks_rank{dist.rank()}.jsonl"
        if self.path.is_file():
            lines = self.path.read_text().splitlines()
            kept = [line for line in lines if json.loads(line)["step"] <= resumed_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = open(self.path, "a")

    def write(self, step: int, batch: torch.Tensor) -> None:
        hashes = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in batch.cpu()]
        self.file.write(json.dumps({"step": step, "blocks": hashes, "tokens": batch.tolist()}) + "\n")
        self.file.flush()
