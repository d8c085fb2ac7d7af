"""What the end-to-end tests share: the environment their commands run in, and what they read back
from a `python -m train` process and its run_dir."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

# A launcher's variables (and W&B's) in the test's own environment would leak into the runs it starts.
_LAUNCHER = ("WANDB_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a command a test starts: no launcher or W&B variables, one torch thread
    (the test machine's cores are shared), then `extra`."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER)}
    return {**kept, "OMP_NUM_THREADS": "1", **extra}


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one `error: ...` line a failed command must print (and no other)."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def val_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records(run_dir) if "val_loss" in r}
