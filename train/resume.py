"""What a resume may change: one rule per config key, checked before anything is written.

`resume=auto` / `resume=<path>` continues a run with the config given now. A setting either takes
effect from the resumed step on (HONOUR) or is refused with one line naming it (REFUSE), before the
tokenizer, data or engine are set up and before `config.yaml` / `deepspeed.json` are rewritten.
A key takes the rule of its longest listed prefix; docs/DESIGN.md mirrors this table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.tokenizer import TOKENIZER_FILES
from model.config import upgrade_saved
from train import checkpoint
from train.checkpoint import CheckpointError
from train.config import OptimConfig, TrainConfig
from train.schedule import first_difference, lr_at

HONOUR, REFUSE = "honour", "refuse"

_SCHEDULE = "the schedule is evaluated with the new value from the resumed step on"
_GROUPS = "set on the optimizer's param groups after the checkpoint is loaded"
_LOADER = "the data loader's saved position cannot follow it"
_FUNCTION = "it changes the function the saved weights were trained for"
_START = "it acts only at a run's start, so config.yaml would misreport the run"
_LAYOUT = ("DeepSpeed cannot load the saved optimizer state under it "
           "(a ZeRO-0 checkpoint loads under ZeRO-1 with fresh optimizer moments, silently)")

RULES: dict[str, tuple[str, str]] = {
    "optim.lr": (HONOUR, _SCHEDULE),
    "optim.min_lr": (HONOUR, _SCHEDULE),
    "optim.warmup_steps": (HONOUR, _SCHEDULE),
    "optim.warmup_init_lr": (HONOUR, _SCHEDULE),
    "optim.decay": (HONOUR, _SCHEDULE),
    "optim.decay_fraction": (HONOUR, _SCHEDULE),
    "max_steps": (HONOUR, _SCHEDULE + " (it must not be below the checkpoint's step)"),
    "optim.weight_decay": (HONOUR, _GROUPS),
    "optim.beta1": (HONOUR, _GROUPS),
    "optim.beta2": (HONOUR, _GROUPS),
    "optim.eps": (HONOUR, _GROUPS),
    "optim.grad_clip": (HONOUR, "DeepSpeed clips with the new config's value"),
    "optim.name": (REFUSE, "the saved optimizer state is another optimizer's"),
    "optim.muon_lr": (HONOUR, _GROUPS),
    "optim.muon_weight_decay": (HONOUR, _GROUPS),
    "optim.muon_momentum": (HONOUR, _GROUPS),
    "optim.muon_nesterov": (HONOUR, _GROUPS),
    "optim.muon_ns_steps": (HONOUR, _GROUPS),
    "optim.muon_adjust_lr": (HONOUR, _GROUPS),
    "optim.qk_clip": (HONOUR, "read after every step"),
    "batch_size": (HONOUR, "only the gradient accumulation changes: each rank's loader continues its micro-batches"),
    "eval_every": (HONOUR, "read every step"),
    "eval_batches": (HONOUR, "the validation set is rebuilt at start"),
    "ckpt_every": (HONOUR, "read every step"),
    "keep_last": (HONOUR, "applied at the next save"),
    "nonfinite": (HONOUR, "read every step"),
    "compile": (HONOUR, "same parameters, same math"),
    "logger": (HONOUR, "reporting only"),
    "debug": (HONOUR, "fault injection for tests"),
    "name": (HONOUR, "a label (W&B run name)"),
    "run_dir": (HONOUR, "where this run writes; resume=<path> may read another run's checkpoint"),
    "resume": (HONOUR, "how the checkpoint is found"),
    "branch_from": (HONOUR, "how the checkpoint is found (a branch's source schedule is checked apart)"),
    "init_from": (HONOUR, "exclusive with resume"),
    "continues": (HONOUR, "checked when a run starts"),
    "parallel.sequence": (HONOUR, "the data-parallel layout is re-planned, as for another world size"),
    "model": (REFUSE, _FUNCTION),
    "model.arch": (REFUSE, "it fixes the parameter shapes"),
    "model.vocab_size": (REFUSE, "it fixes the parameter shapes"),
    "model.n_layer": (REFUSE, "it fixes the parameter shapes"),
    "model.n_head": (REFUSE, "it fixes the parameter shapes"),
    "model.n_kv_head": (REFUSE, "it fixes the parameter shapes"),
    "model.n_embd": (REFUSE, "it fixes the parameter shapes"),
    "model.ffn_hidden": (REFUSE, "it fixes the parameter shapes"),
    "model.tie_embeddings": (REFUSE, "it fixes the parameter shapes"),
    "model.max_seq_len": (REFUSE, "the data loader's saved position is counted in blocks of this length"),
    "model.init_std": (REFUSE, _START),
    "model.activation_checkpointing": (HONOUR, "recomputation only, same math"),
    "model.design_params.coca.t_init": (HONOUR, "acts only when init_from starts a run"),
    "data": (REFUSE, _LOADER),
    "data.cache_dir": (HONOUR, "a location; the tokenizer found there must equal the checkpoint's"),
    "data.tokenizer.model_path": (HONOUR, "a location; the tokenizer found there must equal the checkpoint's"),
    "micro_batch_size": (REFUSE, _LOADER),
    "seed": (REFUSE, _START),
    "deepspeed": (REFUSE, _LAYOUT),
    "deepspeed.precision": (REFUSE, "the saved weights and optimizer state are laid out "
                                    "for the precision they were trained in"),
    "deepspeed.fp16_initial_scale_power": (REFUSE, _START + " (the loss scale is restored)"),
}


def rule(key: str) -> tuple[str, str]:
    """The rule of `key`: its own, or its longest listed prefix's; unlisted keys are refused."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        found = RULES.get(".".join(parts[:end]))
        if found is not None:
            return found
    return REFUSE, "no rule says a resume may change it"


def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of a nested config (lists, such as data.sources, are one value)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _show(value: Any) -> str:
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def _saved(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's config, with keys it predates at their schema defaults (keys this version
    no longer has are left out: nothing could honour them)."""
    saved = OmegaConf.create(upgrade_saved(OmegaConf.to_container(checkpoint.saved_config(ckpt))))
    schema = OmegaConf.structured(TrainConfig)
    try:
        return leaves(OmegaConf.to_container(OmegaConf.merge(schema, saved), resolve=True))
    except (OmegaConfBaseException, ValueError, TypeError):
        return {**leaves(OmegaConf.to_container(schema)), **leaves(OmegaConf.to_container(saved, resolve=True))}


def check(ckpt: Path, cfg: TrainConfig) -> list[str]:
    """Refuse a resume that cannot continue as configured (one line naming every refused key);
    return the honoured changes as `key old -> new` for the log."""
    from train.engine import resolve_precision  # imports DeepSpeed

    checkpoint.verify(ckpt)
    marker = checkpoint.marker(ckpt)
    old, new = _saved(ckpt), leaves(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    for config in (old, new):  # null and n_head are one shape: compare the heads actually used
        if config.get("model.n_kv_head") is None:
            config["model.n_kv_head"] = config.get("model.n_head")
    old["deepspeed.precision"] = marker.get("precision") or resolve_precision(old["deepspeed.precision"])
    new["deepspeed.precision"] = resolve_precision(new["deepspeed.precision"])
    refused, reasons, honoured = [], [], []
    for key in sorted(new):
        before, after = old.get(key), new[key]
        if before == after or key in ("resume", "init_from", "branch_from"):
            continue
        verdict, why = rule(key)
        if verdict == HONOUR:
            honoured.append(f"{key} {_show(before)} -> {_show(after)}")
        else:
            refused.append(key)
            reasons.append(f"{key}: {why}")
    if refused:
        has = ", ".join(f"{key}={_show(old.get(key))}" for key in refused)
        wants = ", ".join(f"{key}={_show(new[key])}" for key in refused)
        raise CheckpointError(
            f"checkpoint {ckpt} has {has}, this run has {wants} ({'; '.join(reasons)}): resume with the "
            f"checkpoint's values, or start a new run from its weights with init_from={ckpt} name=<new name>"
        )
    if cfg.max_steps < marker["step"]:
        raise CheckpointError(
            f"max_steps={cfg.max_steps} is below the step of checkpoint {ckpt} ({marker['step']}): "
            f"set max_steps >= {marker['step']}"
        )
    checkpoint.check_compatible(ckpt, cfg.model)
    if cfg.branch_from and not Path(ckpt).resolve().is_relative_to(Path(cfg.run_dir).resolve()):
        _check_branch(ckpt, marker["step"], old, cfg)
    return honoured


def _check_branch(ckpt: Path, step: int, old: dict[str, Any], cfg: TrainConfig) -> None:
    """A branch is the run its own schedule would have trained only if its source trained the steps
    before the branch point at this schedule's learning rates (a WSD source: in its stable phase)."""
    source = OptimConfig(**{key.split(".", 1)[1]: value for key, value in old.items() if key.startswith("optim.")})
    differs = first_difference(source, old["max_steps"], cfg.optim, cfg.max_steps, step)
    if differs is not None:
        raise CheckpointError(
            f"branch_from={cfg.branch_from}: its run trained step {differs} at learning rate "
            f"{lr_at(differs, source, old['max_steps']):.6g}, this run's schedule gives "
            f"{lr_at(differs, cfg.optim, cfg.max_steps):.6g} (a branch must share its source's schedule up to "
            f"step {step}: branch from a checkpoint of a WSD run's stable phase, with its optim settings)"
        )


def check_tokenizer(ckpt: Path, tokenizer) -> None:
    """The tokenizer this run loaded must be the one the checkpoint was trained with: each of its
    files (`tokenizer.files()`: tokenizer.model, or tokenizer.json + tokenizer_config.json) equal,
    byte for byte, to the checkpoint's. A checkpoint from before tokenizers were stored passes."""
    stored = [name for name in TOKENIZER_FILES if (ckpt / name).is_file()]
    if not stored:
        return
    same = all((ckpt / name).is_file() and (ckpt / name).read_bytes() == content
               for name, content in tokenizer.files().items())
    if not same:
        raise CheckpointError(
            f"the tokenizer {tokenizer.path} differs from the one checkpoint {ckpt} was trained with: "
            f"set data.tokenizer.model_path={ckpt / stored[0]}"
        )
