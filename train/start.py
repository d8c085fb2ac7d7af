"""What a run's start is, decided once: `plan_start(cfg) -> Start`, the one object the trainer reads.

    fresh      nothing to continue: the weights are drawn from the seed
    resume     the run's own newest checkpoint (resume=auto) or the one named (resume=<path>): its
               whole training state; written by another world size or parallel.sequence, an elastic
               resume (`Start.elastic`: the state re-sliced, `train.restore`, `train.elastic`)
    branch     at a cooldown branch's first start, `branch_from`'s checkpoint: its whole training
               state (once the branch's own run_dir holds checkpoints, resume=auto continues those)
    init_from  a run's checkpoint or a Hugging Face directory: its weights only (converted where the
               attention differs: `model.convert`), step 0, a new optimizer
    finished   resume=auto on a run already at max_steps: nothing to train

A run whose model comes from a `ModelSource` (a Hugging Face directory, or a checkpoint of a run
started from one) trains `Start.cfg`: the given config with the source's model (`hf.imports.combine`),
a new object; the config given is not changed. Planning reads small files only (markers, configs,
config.json): `train.preflight` plans before the process group and DeepSpeed start, and the run is
built from what it returned. Every rank plans alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from errors import first_line
from hf.imports import HFModel, combine, is_hf_dir, missing_config
from hf.imports import read as read_hf
from model.config import ModelConfig, upgrade_saved
from train import checkpoint
from train.checkpoint import ORIGIN, CheckpointError, older_hint, saved_config
from train.config import ConfigError, TrainConfig
from train.modifiers import check_kept

KINDS = ("fresh", "resume", "branch", "init_from", "finished")


@dataclass(frozen=True)
class ModelSource:
    """Where a run's model config and tokenizer come from instead of the command line: a Hugging
    Face directory (`init_from=<dir>`: its config.json, tokenizer and tensors), or a checkpoint of a
    run that started from one (resumed, or named by `init_from`: its saved model config and stored
    tokenizer), which `ORIGIN` marks. `origin` is that file's content (the directory and its
    config.json), carried into every checkpoint of the run."""

    path: Path
    model: ModelConfig
    origin: dict[str, Any]
    hf: Optional[HFModel]  # the directory, whose tensors are the weights; None: a checkpoint

    @property
    def where(self) -> str:
        return f"{self.path / 'config.json'}" if self.hf is not None else f"checkpoint {self.path}"


@dataclass(frozen=True)
class Start:
    """A run's start (`plan_start`): its kind (`KINDS`), the config it trains under, the checkpoint
    whose whole state it continues (resume, branch; finished: the run's last), the `init_from`
    checkpoint or directory whose weights it starts from, the model source, and the (world size,
    parallel.sequence) that wrote the checkpoint."""

    kind: str
    cfg: TrainConfig
    checkpoint: Optional[Path] = None
    init_from: Optional[Path] = None
    source: Optional[ModelSource] = None
    written: Optional[tuple[int, int]] = None

    def elastic(self, world_size: int) -> bool:
        """Whether the checkpoint continues on another layout (world size or parallel.sequence)."""
        return self.written is not None and self.written != (world_size, self.cfg.parallel.sequence)


def named_model_fields(overrides: Sequence[str]) -> frozenset[str]:
    """The model fields a command line sets (`model.arch=neox` -> arch): an override equal to the
    default is still an override of a model source's value (`hf.imports.combine`)."""
    keys = (override.split("=", 1)[0].lstrip("+~") for override in overrides)
    return frozenset(key.split(".")[1] for key in keys if key.startswith("model.") and key.count(".") >= 1)


def plan_start(cfg: TrainConfig, overrides: Sequence[str] = ()) -> Start:
    """The one decision of what a run's start is; refuses (one line) a start that cannot be: a run
    that would be overwritten, an `init_from` that is neither a checkpoint nor a Hugging Face
    directory, a model that disagrees with its source (`hf.imports.combine`, exit 2) or with the
    checkpoint it takes weights from (`checkpoint.check_compatible`). `overrides`, the command line's,
    tell a model field set to its default from one left alone."""
    resumed = checkpoint_to_resume(cfg)
    init_from = find_init(cfg.init_from) if cfg.init_from else None
    origin = resumed or init_from
    source = model_source(origin) if origin is not None else None
    model = cfg.model
    if source is not None:
        model = combine(source.model, cfg.model, source.where, named_model_fields(overrides))
    elif init_from is not None:
        saved = checkpoint.saved_model(init_from)
        check_kept(saved, cfg.model, f"init_from={init_from}")  # a modifier it learned (exit 2)
        if saved.attention == cfg.model.attention:
            checkpoint.check_compatible(init_from, cfg.model)  # a conversion checks its own shapes (exit 2 too)
    planned = cfg if model is cfg.model else replace(cfg, model=model)
    written = None
    if resumed is not None:
        marker = checkpoint.marker(resumed)
        written = (marker["world_size"], marker.get("sequence", 1))
    if _finished(cfg, resumed):
        kind = "finished"
    elif resumed is not None:
        own = checkpoint.complete_checkpoints(cfg.run_dir)
        kind = "branch" if cfg.branch_from and not own else "resume"
        _check_steps_left(cfg, resumed, kind)
    else:
        kind = "init_from" if init_from is not None else "fresh"
    return Start(kind, planned, resumed, init_from, source, written)


def _check_steps_left(cfg: TrainConfig, ckpt: Path, kind: str) -> None:
    """A resume or branch with nothing to train (its checkpoint at max_steps, not the run's own
    finished one) would end at once with no checkpoint of its own: refused (exit 2). Past max_steps,
    `train.resume.check` refuses it."""
    step = checkpoint.marker(ckpt)["step"]
    if step != cfg.max_steps:
        return
    given = f"branch_from={cfg.branch_from}" if kind == "branch" else f"resume={cfg.resume}"
    raise ConfigError(f"{given} is at step {step} and this run has max_steps={cfg.max_steps}: nothing to train; "
                      f"set max_steps > {step}")


def checkpoint_to_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint this run continues from, if any: its own newest (resume=auto), the one named
    (resume=<path>), or, at a branch's first start, its source (`branch_from`); refuse to overwrite
    a run silently."""
    if cfg.resume == "auto":
        found = checkpoint.complete_checkpoints(cfg.run_dir)
        if found:
            return found[-1]
        return branch_source(cfg.branch_from) if cfg.branch_from else None
    if cfg.resume:
        return checkpoint.find_checkpoint(cfg.resume)
    found = checkpoint.complete_checkpoints(cfg.run_dir)
    if found:
        raise CheckpointError(
            f"run_dir {cfg.run_dir} already holds checkpoints (newest {found[-1].name}): pass resume=auto "
            "to continue that run, or set name=<new name> for a new one"
        )
    return branch_source(cfg.branch_from) if cfg.branch_from else None


def branch_source(path: str) -> Path:
    """The checkpoint `branch_from` names, checked whole (every file at its written size); a
    damaged or incomplete one is refused naming the newest sound one before it as `branch_from=`
    (a branch takes no `resume=<path>`)."""
    ckpt = Path(path)
    try:
        ckpt = checkpoint.find_checkpoint(path)
        checkpoint.verify(ckpt)
    except CheckpointError as error:
        message = str(error).removesuffix(checkpoint.older_hint(ckpt))
        older = _sound_before(ckpt)
        hint = (f"; branch_from={older} branches from step {checkpoint.marker(older)['step']}, the newest sound "
                "checkpoint before it" if older is not None else "")
        raise CheckpointError(message + hint) from None
    return ckpt


def _sound_before(ckpt: Path) -> Optional[Path]:
    """The newest complete checkpoint of `ckpt`'s run before it whose files are all sound, if any."""
    if ckpt.parent.name != "checkpoints":
        return None
    for older in reversed([p for p in checkpoint.complete_checkpoints(ckpt.parent.parent) if p.name < ckpt.name]):
        try:
            checkpoint.verify(older)
        except CheckpointError:
            continue
        return older
    return None


def _finished(cfg: TrainConfig, resumed: Path | None) -> bool:
    """With `resume=auto`, whether the run's own newest checkpoint is already at `max_steps`."""
    own = checkpoint.complete_checkpoints(cfg.run_dir) if cfg.resume == "auto" else []
    return bool(own) and resumed == own[-1] and checkpoint.marker(own[-1])["step"] == cfg.max_steps


def find_init(path: str | Path) -> Path:
    """What `init_from` names: a Hugging Face model directory (one holding config.json:
    `hf.imports`) as it is, else a checkpoint (`find_checkpoint`: a run's newest, or the one named)."""
    if is_hf_dir(path):
        return Path(path)
    unreadable = missing_config(path)
    if unreadable:
        raise CheckpointError(f"init_from={path}: {unreadable}")
    try:
        return checkpoint.find_checkpoint(path)
    except CheckpointError as error:
        if str(error).startswith("no complete checkpoint"):
            raise CheckpointError(f"init_from={path}: no complete checkpoint found there, and it is not a Hugging "
                                  "Face model directory either (no config.json)") from None
        raise


def model_source(path: Path) -> Optional[ModelSource]:
    """The `ModelSource` at `path` (a Hugging Face directory, or a checkpoint holding `ORIGIN`), or
    None for a checkpoint of a run configured on its command line."""
    if is_hf_dir(path):
        hf = read_hf(path)
        return ModelSource(path, hf.model, {"hf_dir": str(Path(path).absolute()), "config": hf.config}, hf)
    if not (path / ORIGIN).is_file():
        return None
    try:
        origin = json.loads((path / ORIGIN).read_text())
        saved = upgrade_saved(OmegaConf.to_container(saved_config(path).model), model_only=True)
        model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved))
    except (OSError, ValueError, TypeError, OmegaConfBaseException) as error:
        raise CheckpointError(f"checkpoint {path}: {ORIGIN} or its model config is unreadable "
                              f"({first_line(error)}){older_hint(path)}") from None
    return ModelSource(path, model, origin, None)
