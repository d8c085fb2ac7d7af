"""The typed schema of `conf/config.yaml`.

Hydra composes `conf/` onto these dataclasses, so an unknown key or a wrong type fails at
composition; allowed values are checked in `__post_init__` with messages naming the key.
Batch sizes, precision, clipping and ZeRO settings live only here: the DeepSpeed JSON is
generated from them (`train.engine.deepspeed_config`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from data.cli import booleans_only, compose_tree, validated
from data.config import DataConfig
from errors import ConfigError
from model.config import FLAVORS, ModelConfig, flavor, legacy_override, upgrade_saved
from model.sequence_parallel import sequence_refusal

__all__ = ["ConfigError", "TrainConfig", "compose", "register_configs", "to_train_config"]  # ConfigError: errors.py

DECAYS = ("cosine", "linear", "constant", "wsd")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
WANDB_MODES = ("auto", "online", "offline", "disabled")
NONFINITE = ("stop", "skip")
OPTIMIZERS = ("adamw", "muon")
MUON_ADJUST_LR = ("original", "match_rms_adamw")


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")


def _at_least(name: str, value: float, low: float) -> None:
    if not value >= low:
        raise ValueError(f"{name}={value!r} must be >= {low}")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up from `warmup_init_lr`, then `decay` to `min_lr` at `max_steps`.

    decay: cosine | linear (from the end of warm-up to max_steps) | constant (lr after warm-up) |
      wsd (warmup-stable-decay: lr after warm-up until the last `decay_fraction` of max_steps, then
      linear to min_lr; a run's stable phase is shared by every longer run, so a checkpoint of it
      starts a cooldown branch to a shorter dose: `branch_from`).
    decay_fraction: wsd only, the fraction of max_steps spent decaying (rounded to whole steps).
    grad_clip: global gradient-norm clipping (0 disables). Weight decay skips biases and norms.
    name: adamw | muon (Muon on the hidden matrices, AdamW with the settings above on the rest:
      `train.optim`); one schedule drives both, each group at its own peak (lr, muon_lr).
    muon_lr, muon_weight_decay, muon_momentum: the Muon group's peak lr, decoupled weight decay, momentum.
    muon_nesterov, muon_ns_steps: Nesterov momentum, Newton-Schulz iterations (ZeRO 1/2 run
      DeepSpeed's Muon, which has Nesterov with 5 steps only).
    muon_adjust_lr: original (lr x sqrt(max(1, fan_out/fan_in))) | match_rms_adamw (0.2 sqrt(max dim)).
    qk_clip: MuonClip's threshold on each head's largest q.k logit, checked after every step
      (`train.qk_clip`); null: off.
    """

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    warmup_init_lr: float = 0.0
    decay: str = "cosine"
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    name: str = "adamw"
    muon_lr: float = 0.02
    muon_weight_decay: float = 0.1
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "original"
    qk_clip: Optional[float] = None

    def __post_init__(self) -> None:
        _one_of("optim.decay", self.decay, DECAYS)
        _one_of("optim.name", self.name, OPTIMIZERS)
        _one_of("optim.muon_adjust_lr", self.muon_adjust_lr, MUON_ADJUST_LR)
        if not self.muon_lr > 0 or not 0.0 <= self.muon_momentum < 1.0 or self.muon_weight_decay < 0:
            raise ValueError(f"optim.muon_lr={self.muon_lr!r} must be > 0, optim.muon_momentum="
                             f"{self.muon_momentum!r} in [0, 1), optim.muon_weight_decay >= 0")
        if not 1 <= self.muon_ns_steps < 100:
            raise ValueError(f"optim.muon_ns_steps={self.muon_ns_steps!r} must be in [1, 99]")
        if self.qk_clip is not None and not self.qk_clip > 0:
            raise ValueError(f"optim.qk_clip={self.qk_clip!r} must be > 0 (null: off)")
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr!r} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr!r} must be in [0, optim.lr={self.lr}]")
        if not 0 <= self.warmup_init_lr <= self.lr:
            raise ValueError(f"optim.warmup_init_lr={self.warmup_init_lr!r} must be in [0, optim.lr]")
        _at_least("optim.warmup_steps", self.warmup_steps, 0)
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"optim.decay_fraction={self.decay_fraction!r} must be in (0, 1]")
        _at_least("optim.weight_decay", self.weight_decay, 0.0)
        _at_least("optim.grad_clip", self.grad_clip, 0.0)
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name}={getattr(self, name)!r} must be in [0, 1)")


@dataclass
class DeepSpeedConfig:
    """ZeRO stage, offload and precision (the rest of the DeepSpeed JSON derives from the run).

    precision: auto (bf16 on a GPU that supports it, else fp32) | fp32 | bf16 | fp16 (loss scaling).
    offload_optimizer: optimizer states and step on the CPU (DeepSpeedCPUAdam); ZeRO >= 1.
    offload_param: parameters on the CPU; ZeRO 3 only.
    """

    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    precision: str = "auto"
    fp16_initial_scale_power: int = 16

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"deepspeed.zero_stage={self.zero_stage!r} is not one of 0, 1, 2, 3")
        _one_of("deepspeed.precision", self.precision, PRECISIONS)
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("deepspeed.offload_optimizer=true needs deepspeed.zero_stage >= 1")
        if self.offload_param and self.zero_stage != 3:
            raise ValueError("deepspeed.offload_param=true needs deepspeed.zero_stage=3")


@dataclass
class LoggerConfig:
    """Console, `metrics.jsonl` and W&B.

    wandb: auto (online with credentials, else offline) | online | offline | disabled.
    peak_flops: peak FLOP/s of one device for MFU; null looks the device up in a table.
    """

    wandb: str = "auto"
    project: str = "coca-longctx"
    entity: Optional[str] = None
    log_every: int = 10
    progress: bool = True
    peak_flops: Optional[float] = None

    def __post_init__(self) -> None:
        _one_of("logger.wandb", self.wandb, WANDB_MODES)
        _at_least("logger.log_every", self.log_every, 1)


@dataclass
class DebugConfig:
    """Fault injection for tests of the failure paths (all off by default).

    nan_at_step: make rank 0's loss of this (1-based) step NaN (every rank must stop or skip).
    kill_in_checkpoint_at_step: SIGKILL this process half-way through writing that checkpoint.
    kill_in_prune_at_step: SIGKILL rank 0 while the save of that step deletes an old checkpoint
      (after its atomic rename, before its files are removed).
    kill_in_conversion: SIGKILL rank 0 after it converted a checkpoint for another world size,
      before the conversion is renamed into place (`train.elastic`).
    step_sleep_s: sleep after each step (lets a test kill a run at a known point).
    log_blocks: write every training block (fingerprint and tokens) to `blocks_rank<R>.jsonl`.
    """

    nan_at_step: int = -1
    kill_in_checkpoint_at_step: int = -1
    kill_in_prune_at_step: int = -1
    kill_in_conversion: bool = False
    step_sleep_s: float = 0.0
    log_blocks: bool = False


@dataclass
class ParallelConfig:
    """How the ranks share the work.

    sequence: P consecutive ranks share every row, each holding a contiguous 1/P of its tokens
      (DeepSpeed-Ulysses: `model.sequence_parallel`); data parallelism runs over world size / P
      groups. 1: every rank holds whole rows (plain data parallelism).
    """

    sequence: int = 1

    def __post_init__(self) -> None:
        _at_least("parallel.sequence", self.sequence, 1)


@dataclass
class TrainConfig:
    """One training run. The training length is `model.max_seq_len`.

    batch_size: global sequences per optimizer step; micro_batch_size: per data-parallel rank per
    forward. Gradient accumulation is batch_size / (micro_batch_size * data-parallel size), the
    data-parallel size being world size / parallel.sequence.
    resume: null (fresh run), auto (newest complete checkpoint in run_dir, if any) or a path.
    branch_from: a checkpoint of another run this run starts from with its whole training state
        (weights, optimizer, schedule step, data position, RNG), at its first start only: once its
        own run_dir holds checkpoints, resume=auto continues those. With `optim.decay=wsd` and a
        checkpoint of the source's stable phase it is a cooldown branch: the run that a shorter WSD
        schedule would have trained (the source's learning rates before the branch point must be
        this run's, or it is refused).
    init_from: a run or checkpoint directory, or a Hugging Face directory, whose weights (only)
        start this run; with another `model.attention` they are converted (`model.convert`).
    nonfinite: stop (exit with an error) or skip (drop the batch) on a non-finite loss.
    compile: torch.compile each transformer block (fuses its element-wise work; the first steps
        take longer while it compiles). Parameter names and checkpoints are unchanged.
    continues: set by the presets that continue a trained model (extend_*, dropin_coca,
        continue_origin): without init_from or resume such a run would train a new model from
        scratch, so it is refused.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    name: str = "tiny"
    run_dir: str = "runs/${name}"
    seed: int = 42
    batch_size: int = 16
    micro_batch_size: int = 16
    max_steps: int = 300
    eval_every: int = 50
    eval_batches: int = 10
    ckpt_every: int = 100
    keep_last: int = 2
    resume: Optional[str] = None
    branch_from: Optional[str] = None
    init_from: Optional[str] = None
    nonfinite: str = "stop"
    compile: bool = False
    continues: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "micro_batch_size", "max_steps", "eval_every", "eval_batches",
                     "ckpt_every", "keep_last"):
            _at_least(name, getattr(self, name), 1)
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size={self.batch_size} must be a multiple of micro_batch_size={self.micro_batch_size}"
            )
        _one_of("nonfinite", self.nonfinite, NONFINITE)
        if self.resume is not None and self.init_from is not None:
            raise ValueError("resume and init_from are exclusive: resume continues a run, init_from starts one")
        if self.branch_from is not None and (self.init_from is not None or self.resume not in (None, "auto")):
            raise ValueError("branch_from starts a run from a checkpoint's whole state: give it alone (resume=auto "
                             "continues the branch), not with init_from or resume=<path>")
        if self.optim.decay == "wsd" and wsd_decay_start(self.optim, self.max_steps) < self.optim.warmup_steps:
            raise ValueError(f"optim.decay=wsd: the decay ({self.optim.decay_fraction:g} of "
                             f"max_steps={self.max_steps}) would start inside the "
                             f"{self.optim.warmup_steps}-step warm-up: lower optim.decay_fraction "
                             "or optim.warmup_steps")
        if self.optim.decay == "wsd" and wsd_decay_start(self.optim, self.max_steps) == self.max_steps:
            raise ValueError(f"optim.decay=wsd: the decay ({self.optim.decay_fraction:g} of "
                             f"max_steps={self.max_steps}) rounds to 0 steps, a constant learning rate: set "
                             "optim.decay_fraction >= "
                             f"{1 / self.max_steps:g} (one step)")
        if self.continues and self.resume is None and self.init_from is None:
            raise ValueError(f"{self.name} continues a trained model: give init_from=<run, checkpoint or Hugging "
                             "Face directory> (or resume=auto to continue this run)")
        refusal = sequence_refusal(self.parallel.sequence, self.model.n_head, self.model.kv_heads,
                                   self.model.max_seq_len) or muon_refusal(self) or qk_clip_refusal(self)
        if refusal:
            raise ValueError(refusal)

    def grad_accum(self, data_parallel: int) -> int:
        """Micro-batches per optimizer step on each rank, for this data-parallel size (the world
        size / parallel.sequence)."""
        per_step = self.micro_batch_size * data_parallel
        if self.batch_size % per_step:
            sp = self.parallel.sequence
            ranks = (f"world size {data_parallel}: run on a number of ranks" if sp == 1 else
                     f"data-parallel size {data_parallel} (world size {data_parallel * sp} / parallel.sequence={sp}): "
                     f"run on parallel.sequence x a number")
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by micro_batch_size={self.micro_batch_size} "
                f"x {ranks} that divides {self.batch_size // self.micro_batch_size}, or change batch_size"
            )
        return self.batch_size // per_step


def muon_refusal(cfg: TrainConfig) -> str | None:
    """The one-line refusal of `optim.name=muon` settings this run's ZeRO stage cannot train, or None."""
    o, ds = cfg.optim, cfg.deepspeed
    if o.name != "muon":
        return None
    if ds.offload_optimizer:
        return "optim.name=muon with deepspeed.offload_optimizer=true: the CPU optimizer is Adam only; drop the offload"
    if ds.zero_stage == 3:
        return ("optim.name=muon with deepspeed.zero_stage=3 is not supported here (DeepSpeed's ZeRO-3 Muon is "
                "untested in this framework); use deepspeed=zero1 or zero2")
    if ds.zero_stage > 0 and (not o.muon_nesterov or o.muon_ns_steps != 5 or o.muon_adjust_lr != "original"):
        return (f"optim.name=muon under deepspeed.zero_stage={ds.zero_stage} runs DeepSpeed's Muon, which has "
                "Nesterov, 5 Newton-Schulz steps and the original lr adjustment only: set optim.muon_nesterov=true, "
                "optim.muon_ns_steps=5, optim.muon_adjust_lr=original, or train under deepspeed=zero0")
    return None


def qk_clip_refusal(cfg: TrainConfig) -> str | None:
    """The one-line refusal of `optim.qk_clip` where it cannot rescale the weights it measures, or None:
    under ZeRO >= 1 the optimizer's partitions, not the module's weights, are the master copy; under
    sequence parallelism no rank holds whole rows to measure."""
    if cfg.optim.qk_clip is None:
        return None
    if cfg.deepspeed.zero_stage > 0:
        return ("optim.qk_clip rescales the module's q and k weights, which under deepspeed.zero_stage="
                f"{cfg.deepspeed.zero_stage} are not the optimizer's master copy: use deepspeed=zero0")
    if cfg.parallel.sequence > 1:
        return "optim.qk_clip measures whole rows: it needs parallel.sequence=1"
    return None


def wsd_decay_start(optim: OptimConfig, max_steps: int) -> int:
    """The first step of a WSD schedule's decay: the last `decay_fraction` of `max_steps` decays."""
    return max_steps - round(optim.decay_fraction * max_steps)


def setup_id(cfg: TrainConfig) -> str:
    """Identifies a training setup up to its seeds and names: runs with equal ids are replicates
    (`eval.report` aggregates them). Only settings that differ from the schema's defaults enter it,
    so a field added to the schema later, at a default that keeps the old behaviour, leaves the ids
    of earlier runs as they were. A continued run differs from one from scratch, and by CoCA's
    `t_init`, but not by which run it started from (its seed's). CoCA's parameters enter under the
    names they had before they joined `model.design_params` (`model.config.MOVED`), so the ids of
    runs trained before are unchanged."""
    def spec(c: TrainConfig) -> dict[str, Any]:
        model = dataclasses.asdict(c.model)
        coca = model["design_params"].pop("coca")
        return _flat({"model": {**model, "coca_form": coca["form"]},
                      "data": {**dataclasses.asdict(c.data), "seed": None},
                      "optim": dataclasses.asdict(c.optim), "deepspeed": dataclasses.asdict(c.deepspeed),
                      "batch_size": c.batch_size, "max_steps": c.max_steps,
                      "init_from": c.init_from is not None, "t_init": coca["t_init"]})
    default = spec(TrainConfig())
    changed = {k: v for k, v in spec(cfg).items() if k not in default or default[k] != v}
    return hashlib.sha256(json.dumps(changed, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict of dotted keys (lists and other values kept whole)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def register_configs() -> None:
    """Register the schema and the model flavors (from `model.config.FLAVORS`, the one table)."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for name in FLAVORS:
        store.store(group="model", name=name, node=flavor(name))


def compose(overrides: list[str]) -> DictConfig:
    """Compose `conf/config.yaml` with command-line overrides, type-checked against the schema
    (a boolean takes only true or false: `data.cli.booleans_only`)."""
    moved = legacy_override(overrides)
    if moved:
        raise ConfigError(moved)
    booleans_only(TrainConfig, overrides)
    return compose_tree("config", overrides, register_configs, job_name="train")


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The checked `TrainConfig` of a composed config, or of a saved one (a run's or a checkpoint's
    config.yaml: keys that moved since it was written are read where they went, `upgrade_saved`)."""
    tree = OmegaConf.to_container(cfg)
    upgraded = upgrade_saved(tree)
    return validated(TrainConfig, cfg if upgraded == tree else OmegaConf.create(upgraded))
