"""Atomic DeepSpeed checkpoints with the client state needed for an exact resume.

Layout of `<run_dir>/checkpoints/step_NNNNNNNN/`: DeepSpeed's files (weights, optimizer and
scheduler state, per ZeRO rank), `client_rank<R>.pt` per rank (step, tokens, data-loader state,
python/numpy/torch RNG states), `config.yaml` (the resolved run config), `tokenizer.model` and
`COMPLETE`.
A checkpoint is written under `.tmp_step_NNNNNNNN/` and renamed once every rank has finished
and the `COMPLETE` marker is on disk, so a write killed half-way is never visible.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from train import distributed as dist

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# Fields that fix the parameter shapes and their meaning: a resume must not change them.
SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "ffn_hidden", "tie_embeddings", "attention")


class CheckpointError(Exception):
    """A missing, incomplete, corrupt or mismatched checkpoint (one-line message)."""


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (incomplete or temporary ones are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run directory (its newest complete one) or a checkpoint path."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    if _STEP_DIR.match(path.name) and path.is_dir():
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker): its write was interrupted")
    found = complete_checkpoints(path.parent if path.name == "checkpoints" else path)
    if not found:
        raise CheckpointError(f"no complete checkpoint found in {path}")
    return found[-1]


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, run_dir: str | Path, step: int, client_state: dict[str, Any], files: dict[str, bytes],
         keep_last: int, before_commit: Optional[Callable[[], None]] = None) -> Path:
    """Write checkpoint `step` on every rank, then make it visible atomically and prune old ones.

    `files` (name -> content: the resolved config, the tokenizer) are written by rank 0.
    `before_commit` runs on every rank after all files are written and before the marker
    (the tests use it to kill a process in the middle of a checkpoint).
    """
    final = step_dir(run_dir, step)
    tmp = final.with_name(f".tmp_{final.name}")
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(tmp.parent), tag=tmp.name, save_latest=False)
    torch.save({**client_state, "rng": rng_state()}, tmp / f"client_rank{dist.rank()}.pt")
    if before_commit is not None:
        before_commit()
    dist.barrier()
    if dist.is_main():
        for name, content in files.items():
            (tmp / name).write_bytes(content)
        _write_synced(tmp / MARKER, json.dumps({"step": step, "world_size": dist.world_size()}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        _prune(Path(run_dir), keep_last)
    dist.barrier()
    return final


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; drop leftovers of interrupted writes."""
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in (run_dir / "checkpoints").glob(".tmp_step_*"):
        shutil.rmtree(leftover, ignore_errors=True)


def saved_config(ckpt: Path):
    """The resolved run config stored in a checkpoint (an OmegaConf DictConfig)."""
    try:
        return OmegaConf.load(ckpt / "config.yaml")
    except Exception as error:  # noqa: BLE001 - any read/parse failure means the same thing here
        raise CheckpointError(f"checkpoint {ckpt}: config.yaml is unreadable ({error})") from None


def check_compatible(ckpt: Path, model_cfg, world_size: int, *, weights_only: bool) -> None:
    """Clear errors for a resume that cannot work: another model shape, another world size."""
    saved = saved_config(ckpt)
    for name in SHAPE_FIELDS:
        old, new = saved.model.get(name), getattr(model_cfg, name)
        if old != new:
            raise CheckpointError(
                f"checkpoint {ckpt} has model.{name}={old}, this run has model.{name}={new}: "
                "the model shape must match the checkpoint"
            )
    if weights_only:
        return
    marker = json.loads((ckpt / MARKER).read_text())
    if marker["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {ckpt} was written by {marker['world_size']} ranks, this run has {world_size}: "
            "resume with the same number of ranks, or start a new run from its weights with init_from="
        )


def load(engine, ckpt: Path) -> dict[str, Any]:
    """Restore engine (weights, optimizer, scheduler) and this rank's RNG; return its client state."""
    try:
        loaded, _ = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name)
    except Exception as error:  # noqa: BLE001 - DeepSpeed/torch raise many types for a bad file
        raise CheckpointError(f"checkpoint {ckpt} is corrupt or unreadable: {_first_line(error)}") from None
    if loaded is None:
        raise CheckpointError(f"checkpoint {ckpt} is missing DeepSpeed files")
    path = ckpt / f"client_rank{dist.rank()}.pt"
    try:
        client = torch.load(path, weights_only=False)
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(f"checkpoint file {path} is corrupt or unreadable: {_first_line(error)}") from None
    set_rng_state(client.pop("rng"))
    return client


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
