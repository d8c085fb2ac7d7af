"""Rank-0 reporting: console progress bar, `metrics.jsonl`, W&B, and model FLOPs utilisation.

MFU = achieved model FLOP/s / the device's peak (`train.flops`).

`metrics.jsonl` is the run's complete record (flushed per line, truncated to the resumed step on a
resume). W&B may lose its tail on a hard kill (it writes its records in batches), so a resumed run
continues the same W&B run id and first logs every `metrics.jsonl` record the W&B run does not hold:
those at or after its `starting_step` (online: the step after the last one the server received;
offline: 0, so the newest `wandb/offline-run-*` directory holds the whole history).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from train.checkpoint import CheckpointError
from train.config import LoggerConfig


def peak_memory_gb() -> float:
    """Peak accelerator memory allocated, or the process's peak resident set on the CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def wandb_mode(mode: str) -> str:
    """`auto`: WANDB_MODE if the user set it, online with credentials, offline without."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    has_login = netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
    return "online" if os.environ.get("WANDB_API_KEY") or has_login else "offline"


class Reporter:
    """Writes metrics from rank 0; on other ranks every method is a no-op."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, run_name: str, config: dict[str, Any],
                 *, enabled: bool, resumed_step: int, kept_records: list[str], max_steps: int):
        """`kept_records`: the lines of `metrics.jsonl` this run keeps (`records_up_to`)."""
        self.enabled = enabled
        self.wandb_run = None
        self.bar = None
        if not enabled:
            return
        self.path = run_dir / "metrics.jsonl"
        self.path.write_text("".join(line + "\n" for line in kept_records))
        self.file = open(self.path, "a")
        mode = wandb_mode(cfg.wandb)
        if mode == "offline" and cfg.wandb == "auto" and not os.environ.get("WANDB_MODE"):
            self.message(f"W&B offline (no WANDB_API_KEY or `wandb login` here): the run is kept in "
                         f"{run_dir / 'wandb'}; upload it later with `wandb sync`")
        if mode != "disabled":
            self.wandb_run = _init_wandb(cfg, run_dir, run_name, config, mode, resumed=resumed_step > 0)
            self._backfill()
        if cfg.progress:
            self.bar = tqdm(total=max_steps, initial=resumed_step, desc="train", dynamic_ncols=True,
                            file=sys.stderr, mininterval=1.0)

    def log(self, record: dict[str, Any]) -> None:
        """One JSON line, and the same values to W&B at the record's step."""
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self._to_wandb(record)

    def _to_wandb(self, record: dict[str, Any]) -> None:
        self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def _backfill(self) -> None:
        """Log the `metrics.jsonl` records the W&B run lacks (see the module docstring)."""
        first = self.wandb_run.starting_step
        for line in self.path.read_text().splitlines():
            record = json.loads(line)
            if record["step"] >= first:
                self._to_wandb(record)

    def progress(self, step: int, **values: str) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(values, refresh=False)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self, exit_code: int = 0) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)


def records_up_to(path: Path, step: int) -> tuple[list[str], Optional[str]]:
    """The lines of a run's `metrics.jsonl` at or before `step` (the rows after the checkpoint a
    run resumes from are written again), and a warning if the last line was torn.

    A last line that does not parse (a power loss or a full disk mid-write) is dropped with that
    warning: the checkpoint is the truth. Any other line that does not parse is an error naming it.
    """
    if not path.is_file():
        return [], None
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept, warning = [], None
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number < len(lines):
                raise CheckpointError(f"{path} line {number} does not parse ({error}): "
                                      "repair or delete that line, then resume again") from None
            warning = f"warning: dropped the torn last line {number} of {path} ({error})"
            continue
        if record["step"] <= step:
            kept.append(line)
    return kept, warning


class Throughput:
    """Training tokens per second over the logging window (validation and saves are paused out),
    and model FLOPs utilisation where the device's peak is known."""

    def __init__(self, tokens: int, flops_per_token: float, peak_flops: Optional[float], world: int):
        self.flops_per_token, self.peak, self.world = flops_per_token, peak_flops, world
        self.start, self.tokens = time.perf_counter(), tokens

    def measure(self, tokens: int) -> tuple[float, Optional[float]]:
        """tokens/s and MFU since the last measurement; starts the next window."""
        now = time.perf_counter()
        rate = (tokens - self.tokens) / max(now - self.start, 1e-9)
        self.start, self.tokens = now, tokens
        mfu = self.flops_per_token * rate / (self.peak * self.world) if self.peak else None
        return rate, mfu

    @contextmanager
    def paused(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - began


def _init_wandb(cfg: LoggerConfig, run_dir: Path, run_name: str, config: dict[str, Any], mode: str,
                *, resumed: bool):
    """The run's W&B run: the same id when resuming from a checkpoint; a new one when the run starts
    at step 0 (W&B cannot rewind a run's history to an earlier step)."""
    import wandb

    id_file = run_dir / "wandb_id.txt"
    if not resumed or not id_file.is_file():
        id_file.write_text(uuid.uuid4().hex[:8])
    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=run_name,
        id=id_file.read_text().strip(),
        resume="allow",
        dir=str(run_dir),
        mode=mode,
        config=config,
        settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
    )
