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
import uuid
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

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
                 *, enabled: bool, resumed_step: int, max_steps: int):
        self.enabled = enabled
        self.wandb_run = None
        self.bar = None
        if not enabled:
            return
        self.path = run_dir / "metrics.jsonl"
        _truncate_after(self.path, resumed_step)
        self.file = open(self.path, "a")
        mode = wandb_mode(cfg.wandb)
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


def _truncate_after(path: Path, step: int) -> None:
    """Drop records beyond `step` (written after the checkpoint a run resumes from)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


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
