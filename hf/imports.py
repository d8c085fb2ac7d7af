"""Read a local Hugging Face model directory into our model: `import_hf(path) -> (ModelConfig, state)`.

A directory holds `config.json` and its weights as safetensors: `model.safetensors`, or shards
named by `model.safetensors.index.json`. Three kinds are read (nothing is downloaded, and no
transformers model is built: the config is read as JSON, the tensors with `safetensors`):

- `GPTNeoXForCausalLM` (`model_type: gpt_neox`, Pythia): arch=neox, Origin attention; partial
  rotary (`rotary_pct` / `partial_rotary_factor`), `use_parallel_residual`, LayerNorm eps.
- `LlamaForCausalLM` (`model_type: llama`): arch=llama, Origin attention, grouped-query attention
  (`num_key_value_heads`), RMSNorm eps.
- this project's exports (`hf.export`): Origin ones are one of the above; the other designs' are
  `model_type: coca_lm` with `arch`, `attention` and `design_params` (an export made before
  CoCA's form joined `design_params` says `coca_form`: read as `design_params.form`).

Read from config.json: the sizes, heads and kv heads, `vocab_size` (the embedding's rows, often
padded beyond the tokenizer), the RoPE base (`rope_theta` in `rope_parameters` as transformers 5
writes it, or at the top level, or GPT-NeoX's `rotary_emb_base`), the RoPE scaling (`default`,
`linear`, `dynamic`, `yarn` with the fields this project's export writes, Llama 3's `llama3`; YaRN's
and llama3's `original_max_position_embeddings` is `rope_scaling.original_max_seq_len`), tied embeddings, and
`max_position_embeddings` as the training length `max_seq_len` (a `coca_lm` export's length
temperature L0 where it has one). The conversion is `model.hf_layout.model_config`, which the
exported model runs too. A missing field takes the default
of transformers' config class for that model type.

Anything else stops with one line naming the field: another model type, a RoPE type this model
does not compute (longrope, ...), biases where Llama has none (`attention_bias`,
`mlp_bias`), GPT-NeoX without them, an activation other than the architecture's (`gelu`, exact,
for GPT-NeoX; `silu` for Llama), a `head_dim` other than hidden_size / heads, and missing,
misshapen or unexpected tensors (`HFImportError`, exit 1). Old checkpoints' non-parameter buffers
(`rotary_emb.inv_freq`, GPT-NeoX's `attention.bias` / `masked_bias` masks) are skipped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from errors import ConfigError, UserError
from model import GPT, ModelConfig
from model.convert import check_conversion
from model.hf_layout import hf_names
from model.hf_layout import model_config as layout_model_config

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_BUFFERS = re.compile(r"(rotary_emb\.inv_freq|attention\.bias|attention\.masked_bias)$")  # not parameters

# What of a run's model config a directory fixes (its weights mean nothing under another value),
# and what the run may set (the training length and the RoPE recipes of continued pretraining: a
# scaling, a larger base as in ABF; from the directory by default), as `init_from` a checkpoint.
FIXED = ("arch", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "attention",
         "rotary_pct", "parallel_residual", "layernorm_eps", "tie_embeddings")
DEFAULTED = ("max_seq_len", "rope_scaling", "rope_base", "design_params")
_MODEL_DEFAULTS = {f.name: getattr(ModelConfig(), f.name) for f in fields(ModelConfig)}


class HFImportError(UserError):
    """A Hugging Face directory this import cannot read as one of our models (exit 1, one line)."""


@dataclass(frozen=True)
class HFModel:
    """A checked directory: its config.json, our model config, and each tensor's file."""

    path: Path
    config: dict[str, Any]
    model: ModelConfig
    tensors: dict[str, Path]  # Hugging Face tensor name -> the safetensors file holding it
    notes: tuple[str, ...] = ()  # what a reader of the directory is told (a tied head's tensor not read)

    @property
    def names(self) -> dict[str, str]:
        """Our parameter name -> the tensor read for it."""
        return _our_names(self.model, set(self.tensors))


def is_hf_dir(path: str | Path) -> bool:
    """Whether `path` is meant as a Hugging Face directory (it holds a config.json; run and
    checkpoint directories hold a config.yaml)."""
    return (Path(path) / CONFIG).is_file()


def missing_config(path: str | Path) -> str | None:
    """One line for a directory that holds a Hugging Face model's files (weights or tokenizer) but
    no config.json, which a command would otherwise call a directory without checkpoints; None
    for anything else."""
    path = Path(path)
    if not path.is_dir() or is_hf_dir(path) or (path / "config.yaml").exists():
        return None
    found = sorted({p.name for pattern in ("*.safetensors", INDEX, "pytorch_model*.bin", "tokenizer.json")
                    for p in path.glob(pattern)})
    if not found:
        return None
    return (f"{path} holds {found[0]} but no {CONFIG}: a Hugging Face model directory needs its {CONFIG} "
            "(save the model with save_pretrained)")


def read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as error:
        raise HFImportError(f"{path / CONFIG} is not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise HFImportError(f"{path / CONFIG} is not a JSON object")
    return config


def model_config(config: dict[str, Any], where: str = CONFIG) -> ModelConfig:
    """Our `ModelConfig` for a config.json (see the module docstring for what is read and refused):
    `model.hf_layout.model_config`, the conversion the exported model runs too, its refusals as ours."""
    try:
        return layout_model_config(config, where)
    except ValueError as error:
        raise HFImportError(str(error)) from None


def _our_names(cfg: ModelConfig, present: set[str]) -> dict[str, str]:
    """Our parameter name -> its tensor's name in the directory. GPT-NeoX checkpoints call the LM
    head `embed_out` (transformers renames it on load), as our plain GPT-NeoX exports do; our
    remote-code exports call it `lm_head`."""
    names = hf_names(cfg)
    if cfg.arch == "neox" and "lm_head.weight" in names and "lm_head.weight" not in present:
        names["lm_head.weight"] = "embed_out.weight"
    return names


def tensor_files(path: Path) -> dict[str, Path]:
    """Each tensor's safetensors file: from `model.safetensors.index.json`, else `model.safetensors`."""
    from safetensors import safe_open

    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: path / file for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise HFImportError(f"{index} is not a safetensors index ({type(error).__name__}: {error})") from None
        missing = sorted({f.name for f in files.values() if not f.is_file()})
        if missing:
            raise HFImportError(f"{index} names {missing[0]}, which is missing from {path}"
                                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return files
    if not (path / SINGLE).is_file():
        other = "pytorch_model.bin" if any(path.glob("pytorch_model*.bin")) else None
        hint = f" ({other} is not read: save the model with safetensors)" if other else ""
        raise HFImportError(f"{path} holds {CONFIG} but no {SINGLE} or {INDEX}{hint}")
    try:
        with safe_open(str(path / SINGLE), framework="pt") as f:
            return {name: path / SINGLE for name in f.keys()}
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for a bad file
        raise HFImportError(f"{path / SINGLE} is not a safetensors file ({type(error).__name__}: {error})") from None


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for file in sorted(set(files.values())):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as error:  # noqa: BLE001
            raise HFImportError(f"{file} is not a safetensors file ({type(error).__name__}: {error})") from None
    return shapes


def check_tensors(path: Path, cfg: ModelConfig, files: dict[str, Path]) -> tuple[str, ...]:
    """Every parameter of a model of `cfg` present at its shape, and nothing else that is a
    parameter (the headers only: no tensor is read); returns what a reader is told (a tied model's
    separate head tensor, which is not read)."""
    with torch.device("meta"):
        wanted = {name: tuple(p.shape) for name, p in GPT(cfg).named_parameters()}
    shapes = _shapes(files)
    missing_from_index = sorted(set(files) - set(shapes))
    if missing_from_index:
        raise HFImportError(f"{path / INDEX} lists {missing_from_index[0]}, which its file "
                            f"{files[missing_from_index[0]].name} does not hold")
    names = _our_names(cfg, set(shapes))
    for ours, theirs in names.items():
        if theirs not in shapes:
            raise HFImportError(f"{path}: tensor {theirs} is missing (a {cfg.arch} model of {CONFIG}'s sizes has it)")
        if shapes[theirs] != wanted[ours]:
            raise HFImportError(f"{path}: tensor {theirs} has shape {list(shapes[theirs])}, {CONFIG} gives "
                                f"{list(wanted[ours])}")
    head = {"lm_head.weight", "embed_out.weight"} if cfg.tie_embeddings else set()  # tied: transformers ignores it
    extra = sorted(n for n in shapes if n not in names.values() and n not in head and not _BUFFERS.search(n))
    if extra:
        raise HFImportError(f"{path}: tensor {extra[0]} is not a parameter of a {cfg.arch} model of {CONFIG}'s "
                            f"settings" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    unread = sorted(head & set(shapes))
    if unread:
        return (f"{path / CONFIG} has tie_word_embeddings=true: the LM head is the input embedding "
                f"({names['wte.weight']}), and the directory's separate {unread[0]} is not read (as transformers "
                "ties it)",)
    return ()


def read(path: str | Path) -> HFModel:
    """A directory checked for import: config.json read and mapped, every tensor's header checked."""
    path = Path(path)
    if not is_hf_dir(path):
        raise HFImportError(missing_config(path) or f"{path} is not a Hugging Face model directory (no {CONFIG})")
    config = read_config(path)
    cfg = model_config(config, str(path / CONFIG))
    files = tensor_files(path)
    notes = check_tensors(path, cfg, files)
    return HFModel(path, config, cfg, files, notes)


def state_dict(hf: HFModel) -> dict[str, torch.Tensor]:
    """Our fp32 state dict of a checked directory (`read`); tied, the LM head is the embedding."""
    from safetensors import safe_open

    names = hf.names
    by_file: dict[Path, list[str]] = {}
    for ours, theirs in names.items():
        by_file.setdefault(hf.tensors[theirs], []).append(ours)
    state = {}
    for file, ours in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as f:
            for name in ours:
                state[name] = f.get_tensor(names[name]).to(torch.float32)
    if hf.model.tie_embeddings:
        state["lm_head.weight"] = state["wte.weight"]
    return state


def import_hf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A Hugging Face directory as (our ModelConfig, our fp32 state dict): `GPT(cfg).load_state_dict(state)`."""
    hf = read(path)
    return hf.model, state_dict(hf)


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


def combine(source: ModelConfig, requested: ModelConfig, where: str,
            named: frozenset[str] = frozenset()) -> ModelConfig:
    """The model config of a run whose weights come from `source` (a directory's, `where`), given
    the composed `requested` one. The fields in `FIXED` are the source's, and a requested value
    that is not the schema's default and disagrees is refused (`ConfigError`, exit 2: the weights
    fix it), but for `attention`: another attention converts the weights (`model.convert`: from
    Origin into a design whose record allows it; any other is refused there). `max_seq_len`,
    `rope_scaling`, `rope_base` and `design_params` (CoCA's form among them) are the requested ones
    where set (not the default), else the source's; every other field (activation checkpointing,
    document masking, init_std) is the
    requested one. A value equal to the default cannot be told from no override: it reads as none
    (the composed config keeps no trace of the command line), unless `named` (the model fields the
    command line sets: `model.arch=neox` on a Llama directory) says it was given."""
    attention = requested.attention if requested.attention != _MODEL_DEFAULTS["attention"] else source.attention
    chosen = {"attention": attention}  # another attention converts the weights
    for name in FIXED:
        if name in chosen:
            continue
        theirs, ours = getattr(source, name), getattr(requested, name)
        if name == "n_kv_head":
            theirs, ours = source.kv_heads, requested.n_kv_head
        if (ours == _MODEL_DEFAULTS[name] and name not in named) or ours == theirs:
            continue
        if isinstance(ours, float) and isinstance(theirs, float) and math.isclose(ours, theirs, rel_tol=1e-12):
            continue
        raise ConfigError(f"model.{name}={_show(ours)} disagrees with {where}, whose weights fix "
                          f"model.{name}={_show(theirs)}: drop the override")
    for name in DEFAULTED:
        ours = getattr(requested, name)
        chosen[name] = ours if ours != _MODEL_DEFAULTS[name] else getattr(source, name)
    try:
        combined = replace(requested, **{**{name: getattr(source, name) for name in FIXED}, **chosen})
    except ValueError as error:
        raise ConfigError(f"{error} (with the model of {where})") from None
    check_conversion(source, combined)  # only Origin converts, as the target's record allows (`model.convert`)
    return combined


if __name__ == "__main__":  # `python -m hf.imports`: this is the library; a run imports with init_from
    import sys

    from errors import UsageError, report_error

    sys.exit(report_error(UsageError("hf.imports is the importer's library: train from a Hugging Face "
                                     "directory with python -m train init_from=<dir> [model.attention=...]")))
