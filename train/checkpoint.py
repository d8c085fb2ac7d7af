"""Atomic DeepSpeed checkpoints with the client state needed for an exact resume.

Layout of `<run_dir>/checkpoints/step_NNNNNNNN/`: DeepSpeed's files (weights, optimizer and
scheduler state, per ZeRO rank), `client_rank<R>.pt` per rank (step, tokens, data-loader state,
python/numpy/torch RNG states), `config.yaml` (the resolved run config), the tokenizer's files
(`tokenizer.model`, or a Hugging Face `tokenizer.json` + `tokenizer_config.json`), for a run started
from a Hugging Face directory `hf_origin.json` (`train.start.ModelSource`), and `COMPLETE` (JSON: step, world
size, precision, ZeRO stage and the size of every file).
The client state is the run's position: `Progress` (step, tokens seen, batches skipped), the data
loader's state, the step the data layout began at, and the RNG states; `Checkpointer` writes it
every `ckpt_every` steps, at the last and on a stop request.
A checkpoint is written under `.tmp_step_NNNNNNNN/` and renamed once every rank has finished
and the `COMPLETE` marker is on disk, so a write killed half-way is never visible.
A checkpoint is deleted by first renaming it to `.trash_step_NNNNNNNN/` (atomic), then removing
the files, so a kill during pruning never leaves a directory that looks like a checkpoint; the
next save removes `.trash_*`, `.tmp_*` and marker-less `step_*` leftovers.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from errors import EXIT_USAGE, UserError, first_line
from model.config import ModelConfig, upgrade_saved
from train import distributed as dist
from train.faults import FaultInjector

MARKER = "COMPLETE"
ORIGIN = "hf_origin.json"  # in every checkpoint of a run started from a Hugging Face directory
UNIVERSAL = "universal"  # a checkpoint's ZeRO state re-sliceable for any world size (`train.elastic`)
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_LEFTOVER = re.compile(r"^\.(tmp|trash)_step_\d{8}(_\d+)?$")
# Fields that fix the parameter shapes and their meaning: a resume must not change them.
SHAPE_FIELDS = ("arch", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "tie_embeddings",
                "attention")
_MODEL_DEFAULTS = {f.name: f.default for f in fields(ModelConfig)}


class CheckpointError(UserError):
    """A missing, incomplete, corrupt or mismatched checkpoint (one-line message)."""


class ShapeError(CheckpointError):
    """The run's model shape is not the checkpoint's: the shape given is wrong (exit 2, as a shape
    override that disagrees with a Hugging Face directory or a conversion's source)."""

    exit_code = EXIT_USAGE


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (incomplete or temporary ones are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=_step_of)


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


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (the states `rng_state` saves)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
         keep_last: int, before_commit: Optional[Callable[[], None]] = None,
         in_prune: Optional[Callable[[], None]] = None, sequence: int = 1) -> Path:
    """Write checkpoint `step` on every rank, then make it visible atomically and prune old ones.
    The marker records `sequence` (parallel.sequence) beside the world size: together they say
    which ranks' loader states are the data-parallel ones (`train.restore.plan_resume`).

    `files` (name -> content: the resolved config, the tokenizer) are written by rank 0.
    `before_commit` runs on every rank after all files are written and before the marker;
    `in_prune` runs on rank 0 after an old checkpoint is renamed for deletion and before its
    files are removed (the tests use them to kill a process at those moments).
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
        marker = {"step": step, "world_size": dist.world_size(), "sequence": sequence, "precision": _precision(engine),
                  "zero_stage": int(engine.zero_optimization_stage()), "files": _file_sizes(tmp)}
        _write_synced(tmp / MARKER, json.dumps(marker))
        if final.exists():  # the same step saved again (a resume from an older checkpoint)
            _discard(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        _prune(Path(run_dir), keep_last, step, in_prune)
    dist.barrier()
    return final


def _precision(engine) -> str:
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


def _file_sizes(root: Path) -> dict[str, int]:
    return {str(path.relative_to(root)): path.stat().st_size for path in sorted(root.rglob("*")) if path.is_file()}


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


def _discard(path: Path, before_delete: Optional[Callable[[], None]] = None) -> None:
    """Delete a checkpoint directory so that no crash leaves it looking like one: rename it to
    `.trash_<name>` (atomic, and invisible to `complete_checkpoints`), then remove its files."""
    trash = path.with_name(f".trash_{path.name}")
    if trash.exists():
        trash = path.with_name(f".trash_{path.name}_{os.getpid()}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    _fsync_dir(path.parent)
    if before_delete is not None:
        before_delete()
    shutil.rmtree(trash, ignore_errors=True)


def _prune(run_dir: Path, keep_last: int, step: int, in_prune: Optional[Callable[[], None]] = None) -> None:
    """After checkpoint `step` is committed: keep the newest `keep_last` complete checkpoints up to
    `step`, and discard the rest and every leftover.

    Complete checkpoints beyond `step` belong to a history this run abandoned when it resumed from
    an older checkpoint (metrics.jsonl was truncated the same way): they go too. Leftovers are
    `.tmp_*` (an interrupted write), `.trash_*` (an interrupted prune) and `step_*` without a
    marker (left by an interrupted prune of earlier versions).
    """
    root = run_dir / "checkpoints"
    complete = complete_checkpoints(run_dir)
    kept = [p for p in complete if _step_of(p) <= step][-keep_last:]
    for old in complete:
        if old not in kept:
            _discard(old, in_prune)
            in_prune = None
    for leftover in root.iterdir():
        if _LEFTOVER.match(leftover.name) or (_STEP_DIR.match(leftover.name) and not (leftover / MARKER).exists()):
            shutil.rmtree(leftover, ignore_errors=True)


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def saved_config(ckpt: Path):
    """The resolved run config stored in a checkpoint (an OmegaConf DictConfig)."""
    try:
        return OmegaConf.load(ckpt / "config.yaml")
    except Exception as error:  # noqa: BLE001 - any read/parse failure means the same thing here
        raise CheckpointError(
            f"checkpoint {ckpt}: config.yaml is unreadable ({first_line(error)}){older_hint(ckpt)}"
        ) from None


def saved_model(ckpt: Path) -> ModelConfig:
    """The model config stored in a checkpoint, as a `ModelConfig` (fields it predates defaulted)."""
    try:
        saved = upgrade_saved(OmegaConf.to_container(saved_config(ckpt).model), model_only=True)
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved))
    except (ValueError, TypeError, OmegaConfBaseException) as error:
        raise CheckpointError(f"checkpoint {ckpt}: its model config is unreadable ({first_line(error)})"
                              f"{older_hint(ckpt)}") from None


def marker(ckpt: Path) -> dict[str, Any]:
    """The `COMPLETE` marker's fields (older checkpoints hold only step and world_size)."""
    try:
        return json.loads((ckpt / MARKER).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint {ckpt}: its {MARKER} marker is unreadable ({error}){older_hint(ckpt)}"
        ) from None


def _damage(ckpt: Path, written: dict[str, Any]) -> Optional[str]:
    """What is wrong with the files the marker `written` lists (missing, or not at the size written), if anything."""
    for name, size in written.get("files", {}).items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
    return None


def verify(ckpt: Path) -> None:
    """A cheap integrity check before any expensive setup: every file of the checkpoint, at its size."""
    damage = _damage(ckpt, marker(ckpt))
    if damage:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {damage}{older_hint(ckpt)}")


def older_hint(ckpt: Path) -> str:
    """'; resume=<path> continues from step N' naming the newest sound checkpoint older than `ckpt`.

    Not an automatic fall-back: the user decides to drop the newer history (docs/DESIGN.md)."""
    if not _STEP_DIR.match(ckpt.name):
        return ""
    for older in reversed(complete_checkpoints(ckpt.parent.parent)):
        try:
            sound = (_step_of(older) < _step_of(ckpt)
                     and _damage(older, json.loads((older / MARKER).read_text())) is None)
        except (OSError, ValueError):
            sound = False
        if sound:
            return f"; resume={older} continues from step {_step_of(older)} (newer checkpoints are then replaced)"
    return "; there is no older complete checkpoint: start a new run with name=<new name>"


def check_compatible(ckpt: Path, model_cfg) -> None:
    """A clear error for a checkpoint of another model shape (any world size can resume: `train.elastic`)."""
    saved = saved_config(ckpt)
    for name in SHAPE_FIELDS:  # a field the checkpoint predates (arch, n_kv_head) has its default
        old, new = saved.model.get(name, _MODEL_DEFAULTS.get(name)), getattr(model_cfg, name)
        if name == "n_kv_head":  # null means n_head: compare the heads actually used
            old = saved.model.get("n_head") if old is None else old
            new = model_cfg.kv_heads
        if old != new:
            raise ShapeError(
                f"checkpoint {ckpt} has model.{name}={old}, this run has model.{name}={new}: "
                "the model shape must match the checkpoint"
            )


def load(engine, ckpt: Path, *, universal: bool = False) -> None:
    """Restore the engine (weights, optimizer, scheduler) from `ckpt`, or with `universal` from its
    conversion for another world size (`train.elastic.universal_checkpoint`, made beforehand).

    The optimizer's hyperparameters then follow the current config (`train.schedule.Schedule.apply`):
    DeepSpeed restores the saved param groups, which hold the values of the run that wrote them.
    """
    load_dir, tag = (ckpt, UNIVERSAL) if universal else (ckpt.parent, ckpt.name)
    try:
        loaded, _ = engine.load_checkpoint(str(load_dir), tag=tag)
    except Exception as error:  # noqa: BLE001 - DeepSpeed/torch raise many types for a bad file
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupt or unreadable: {first_line(error)}{older_hint(ckpt)}"
        ) from None
    if loaded is None:
        raise CheckpointError(f"checkpoint {ckpt} is missing DeepSpeed files{older_hint(ckpt)}")
    if universal:
        _unshare_adam_steps(engine)
    engine.lr_scheduler.apply()


def _unshare_adam_steps(engine) -> None:
    """Give every parameter group its own Adam step counter.

    DeepSpeed's ZeRO-3 universal loader (0.19.8) assigns one step tensor to every sub-group; torch's
    AdamW increments it in place once per sub-group, so from the second sub-group on the bias
    correction ran a step ahead (measured: the second loss after a 2 -> 1 rank resume off by 4e-4).
    """
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def client_state(ckpt: Path, rank: int) -> dict[str, Any]:
    """The client state rank `rank` saved: step, tokens, data-loader state, RNG states (`rng`)."""
    path = ckpt / f"client_rank{rank}.pt"
    try:
        return torch.load(path, weights_only=False)
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(
            f"checkpoint file {path} is corrupt or unreadable: {first_line(error)}{older_hint(ckpt)}"
        ) from None


# ---- the trainer's checkpointer: what a checkpoint holds beside DeepSpeed's state, and when ----


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
        path = save(self.engine, self.run_dir, progress.step, self.client_state(progress),
                               self.files, self.keep_last, before_commit=self.faults.in_checkpoint(progress.step),
                               in_prune=self.faults.in_prune(progress.step), sequence=self.sequence)
        self.say(f"saved {path}")
        self.last_saved = path
        return path

    def maybe_save(self, progress: Progress) -> None:
        if progress.step % self.every == 0 or progress.step == self.last:
            self.save(progress)
