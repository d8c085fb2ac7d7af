"""What the end-to-end training tests read back from a `python -m train` process and its run_dir."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


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
