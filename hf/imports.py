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
`max_position_embeddings` as the training length `max_seq_len`. A missing field takes the default
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
from hf.names import hf_names, llama_hf_names
from model import DESIGNS, GPT, ModelConfig
from model.config import RopeScaling
from model.convert import check_conversion

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MODEL_TYPES = {"gpt_neox": "GPTNeoXForCausalLM, Pythia", "llama": "LlamaForCausalLM",
               "coca_lm": "this project's export of a design other than Origin"}
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# The RoPE fields each type may carry (the ones our RoPE computes, as hf.export writes them).
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings"}
_TYPE_KEYS = {"yarn": {"beta_fast", "beta_slow"}, "llama3": {"low_freq_factor", "high_freq_factor"}}
# What a type cannot do without, as transformers' validation of `rope_parameters` requires it.
_TYPE_REQUIRED = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
_BUFFERS = re.compile(r"(rotary_emb\.inv_freq|attention\.bias|attention\.masked_bias)$")  # not parameters
# transformers' defaults for fields a config.json may leave out (GPTNeoXConfig, LlamaConfig).
_DEFAULTS = {
    "neox": {"hidden_act": "gelu", "layer_norm_eps": 1e-5, "rotary_pct": 0.25, "use_parallel_residual": True,
             "attention_bias": True},
    "llama": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rotary_pct": 1.0, "attention_bias": False,
              "mlp_bias": False},
}
_ACTIVATION = {"neox": "gelu", "llama": "silu"}

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

    @property
    def names(self) -> dict[str, str]:
        """Our parameter name -> the tensor read for it."""
        return _our_names(self.model, set(self.tensors))


def is_hf_dir(path: str | Path) -> bool:
    """Whether `path` is meant as a Hugging Face directory (it holds a config.json; run and
    checkpoint directories hold a config.yaml)."""
    return (Path(path) / CONFIG).is_file()


def read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as error:
        raise HFImportError(f"{path / CONFIG} is not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise HFImportError(f"{path / CONFIG} is not a JSON object")
    return config


def _get(config: dict, key: str, kind: type, where: str, default: Any = None) -> Any:
    """config[key] as a `kind` (an int reads as a float), else `default`; missing without a default,
    or of another type: refused."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise HFImportError(f"{where} has no {key}")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise HFImportError(f"{where}: {key}={json.dumps(value)} is not a {kind.__name__}")
    return value


def _refuse(where: str, field: str, value: Any, why: str) -> HFImportError:
    return HFImportError(f"{where}: {field}={json.dumps(value)} is not supported: {why}")


def _rope(config: dict, arch: str, where: str, max_positions: int) -> tuple[float, float, RopeScaling]:
    """(base, rotary_pct, scaling) from `rope_parameters` (transformers 5) or the older top-level
    fields (`rope_theta` / `rotary_emb_base`, `rotary_pct`, `rope_scaling`). YaRN's and llama3's
    `original_max_position_embeddings` is the length they stretch from (`original_max_seq_len`);
    dynamic NTK scales from `max_position_embeddings` (as transformers does), linear from nothing."""
    params, legacy = config.get("rope_parameters"), config.get("rope_scaling")
    scaling, field = (params, "rope_parameters") if params else (legacy or {}, "rope_scaling")
    if not isinstance(scaling, dict):
        raise HFImportError(f"{where}: {field}={json.dumps(scaling)} is not a JSON object")
    params = params or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise _refuse(where, f"{field}.rope_type", kind, f"this model computes RoPE as {', '.join(ROPE_TYPES)}")
    allowed = _ROPE_KEYS | _TYPE_KEYS.get(kind, set())
    if kind == "yarn" and scaling.get("truncate", True) is True:
        allowed = allowed | {"truncate"}
    extra = sorted(k for k, v in scaling.items() if k not in allowed and v is not None)
    if extra:
        raise _refuse(where, f"{field}.{extra[0]}", scaling[extra[0]], f"RoPE type {kind} here takes only "
                      f"{', '.join(sorted(allowed - {'type'}))}")
    base = params.get("rope_theta", config.get("rope_theta", config.get("rotary_emb_base", 10000.0)))
    pct = params.get("partial_rotary_factor", config.get("rotary_pct", config.get("partial_rotary_factor",
                                                                                 _DEFAULTS[arch]["rotary_pct"])))
    for name, value in (("rope_theta", base), ("partial_rotary_factor", pct)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise HFImportError(f"{where}: {name}={json.dumps(value)} is not a number")
    if kind == "default":
        return float(base), float(pct), RopeScaling()
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor >= 1.0:
        raise HFImportError(f"{where}: {field}.factor={json.dumps(factor)} must be a number >= 1 for RoPE type {kind}")
    missing = [key for key in _TYPE_REQUIRED.get(kind, ()) if scaling.get(key) is None]
    if missing:
        raise HFImportError(f"{where}: {field} of RoPE type {kind} lacks {', '.join(missing)} (transformers "
                            "refuses it too): give them, e.g. Llama 3.1's low_freq_factor 1.0, high_freq_factor 4.0 "
                            "and the length it was pretrained at")
    extras: dict[str, Any] = {}
    if kind in _TYPE_KEYS:
        extras = {k: float(scaling[k]) for k in _TYPE_KEYS[kind] if scaling.get(k) is not None}
        original = scaling.get("original_max_position_embeddings")
        if original is not None and original != max_positions:
            extras["original_max_seq_len"] = original
    try:
        return float(base), float(pct), RopeScaling(kind, float(factor), **extras)
    except (ValueError, TypeError) as error:
        raise HFImportError(f"{where}: {field}: {error}") from None


def model_config(config: dict[str, Any], where: str = CONFIG) -> ModelConfig:
    """Our `ModelConfig` for a config.json (see the module docstring for what is read and refused)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        known = "; ".join(f"{k} ({v})" for k, v in MODEL_TYPES.items())
        raise HFImportError(f"{where}: model_type={json.dumps(model_type)} is not supported: one of {known}")
    arch = {"gpt_neox": "neox", "llama": "llama"}.get(model_type) or config.get("arch", "neox")
    if arch not in _DEFAULTS:
        raise _refuse(where, "arch", arch, "one of neox, llama")
    defaults = _DEFAULTS[arch]
    attention, design = "origin", {}
    if model_type == "coca_lm":  # an export from before CoCA's form joined design_params says coca_form
        attention = config.get("attention", "origin")
        params = {**({"form": config["coca_form"]} if "coca_form" in config else {}),
                  **(config.get("design_params") or {})}
        design = dict(design_params={attention: params} if params else {},
                      length_temperature=bool(config.get("length_temperature")), sinks=bool(config.get("sinks")),
                      ssmax=bool(config.get("ssmax")))
    activation = config.get("hidden_act", defaults["hidden_act"])
    if activation != _ACTIVATION[arch]:
        raise _refuse(where, "hidden_act", activation, f"this {arch} model uses {_ACTIVATION[arch]} "
                      f"({'exact GELU' if arch == 'neox' else 'SwiGLU'})")
    for key in ("attention_bias", "mlp_bias"):
        value = config.get(key, defaults.get(key))
        wanted = arch == "neox" if key == "attention_bias" else False
        if key in defaults and value is not None and bool(value) != wanted:
            why = ("GPT-NeoX's attention here has biases" if arch == "neox"
                   else "Llama's attention and MLP here have no biases")
            raise _refuse(where, key, value, why)
    hidden = _get(config, "hidden_size", int, where)
    heads = _get(config, "num_attention_heads", int, where)
    if arch == "llama" and config.get("head_dim") not in (None, hidden // max(heads, 1)):
        raise _refuse(where, "head_dim", config["head_dim"],
                      f"a head here has hidden_size / num_attention_heads = {hidden}/{heads} dimensions")
    max_positions = _get(config, "max_position_embeddings", int, where)
    base, pct, scaling = _rope(config, arch, where, max_positions)
    if attention in {d.attention for d in DESIGNS.values() if not d.rope}:
        pct, scaling = 1.0, RopeScaling()  # no RoPE (ALiBi): our default, whatever the config says
    kv = _get(config, "num_key_value_heads", int, where, heads) if arch == "llama" else heads
    eps_key = "rms_norm_eps" if arch == "llama" and model_type == "llama" else "layer_norm_eps"
    eps = _get(config, eps_key, float, where, defaults.get(eps_key, 1e-5))
    parallel = _get(config, "use_parallel_residual", bool, where, defaults.get("use_parallel_residual", False))
    sizes = {"vocab_size": _get(config, "vocab_size", int, where),
             "n_layer": _get(config, "num_hidden_layers", int, where),
             "ffn_hidden": _get(config, "intermediate_size", int, where)}
    try:
        return ModelConfig(
            arch=arch, **sizes, n_head=heads, n_kv_head=None if kv == heads else kv, n_embd=hidden,
            max_seq_len=max_positions, attention=attention, **design, rotary_pct=pct,
            rope_base=base,
            rope_scaling=scaling, parallel_residual=parallel if arch == "neox" else False, layernorm_eps=eps,
            tie_embeddings=_get(config, "tie_word_embeddings", bool, where, False),
        )
    except ValueError as error:
        raise HFImportError(f"{where}: {error}") from None


def _our_names(cfg: ModelConfig, present: set[str]) -> dict[str, str]:
    """Our parameter name -> its tensor's name in the directory. GPT-NeoX checkpoints call the LM
    head `embed_out` (transformers renames it on load), as our plain GPT-NeoX exports do; our
    remote-code exports call it `lm_head`."""
    names = llama_hf_names(cfg) if cfg.arch == "llama" else hf_names(cfg)
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


def check_tensors(path: Path, cfg: ModelConfig, files: dict[str, Path]) -> None:
    """Every parameter of a model of `cfg` present at its shape, and nothing else that is a
    parameter (the headers only: no tensor is read)."""
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


def read(path: str | Path) -> HFModel:
    """A directory checked for import: config.json read and mapped, every tensor's header checked."""
    path = Path(path)
    if not is_hf_dir(path):
        raise HFImportError(f"{path} is not a Hugging Face model directory (no {CONFIG})")
    config = read_config(path)
    cfg = model_config(config, str(path / CONFIG))
    files = tensor_files(path)
    check_tensors(path, cfg, files)
    return HFModel(path, config, cfg, files)


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


def combine(source: ModelConfig, requested: ModelConfig, where: str) -> ModelConfig:
    """The model config of a run whose weights come from `source` (a directory's, `where`), given
    the composed `requested` one. The fields in `FIXED` are the source's, and a requested value
    that is not the schema's default and disagrees is refused (`ConfigError`, exit 2: the weights
    fix it), but for `attention`: another attention converts the weights (`model.convert`: from
    Origin into a design whose record allows it; any other is refused there). `max_seq_len`,
    `rope_scaling`, `rope_base` and `design_params` (CoCA's form among them) are the requested ones
    where set (not the default), else the source's; every other field (activation checkpointing,
    document masking, init_std) is the
    requested one. A value equal to the default cannot be told from no override: it reads as none
    (the composed config keeps no trace of the command line)."""
    attention = requested.attention if requested.attention != _MODEL_DEFAULTS["attention"] else source.attention
    chosen = {"attention": attention}  # another attention converts the weights
    for name in FIXED:
        if name in chosen:
            continue
        theirs, ours = getattr(source, name), getattr(requested, name)
        if name == "n_kv_head":
            theirs, ours = source.kv_heads, requested.n_kv_head
        if ours == _MODEL_DEFAULTS[name] or ours == theirs:
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
