"""Our decoder in Hugging Face's layouts: where GPT-NeoX (arch=neox) and Llama (arch=llama) keep each
of our modules (`slots`, hence every parameter's name, `hf_names`), and a Hugging Face config.json
as our `ModelConfig` (`model_config`: GPT-NeoX's, Llama's, and this project's `coca_lm` exports').

Torch and this package only: the export ships this file with the model's own (`hf.export`), and
its modelling file builds `model.gpt.GPT` from the config with `model_config` and places our
modules under these names; `hf.names` (the exporter's tensors) and `hf.imports` (reading a
directory) use the same two, so there is one layout and one conversion. A refusal is a
`ValueError` of one line naming the field (`hf.imports` reports it as its own error).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from .config import ModelConfig, RopeScaling
from .designs import DESIGNS
from .gpt import GPT

# arch -> ours -> theirs: the modules (or a bare parameter) outside the blocks, and inside block i
# (under `<layers>.<i>`). Our fused qkv is GPT-NeoX's layout ([H, 3, D] rows), and both use
# rotate-half RoPE: only the names differ. A design's score bias, q/k transform, attention in place
# of softmax (`attend`), the softmax modifiers' per-head parameters, QK-norm's two norms and FoX
# Pro's parts (`pro`) sit inside the layer's attention under our names (`self_attn.q_norm` as in
# Qwen 3's and OLMo 2's layouts).
OUTSIDE = {"neox": {"wte": "gpt_neox.embed_in", "ln_f": "gpt_neox.final_layer_norm", "lm_head": "lm_head"},
           "llama": {"wte": "model.embed_tokens", "ln_f": "model.norm", "lm_head": "lm_head"}}
LAYERS = {"neox": "gpt_neox.layers", "llama": "model.layers"}
_EXTRAS = ("score_bias", "qk_transform", "attend", "sinks", "ssmax", "q_norm", "k_norm", "pro")
INSIDE = {
    "neox": {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.qkv": "attention.query_key_value",
             "attn.proj": "attention.dense", "mlp.fc": "mlp.dense_h_to_4h", "mlp.proj": "mlp.dense_4h_to_h",
             **{f"attn.{name}": f"attention.{name}" for name in _EXTRAS}},
    "llama": {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.q": "self_attn.q_proj",
              "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj", "attn.proj": "self_attn.o_proj",
              "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj",
              **{f"attn.{name}": f"self_attn.{name}" for name in _EXTRAS}},
}


def _at(root: nn.Module, path: str) -> Any:
    """The module or parameter at a dotted path of `root`, or None where there is none."""
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def slots(model: GPT) -> dict[str, str]:
    """Ours -> theirs for every module (and bare parameter: the sinks, SSMax's s) of `model` that
    the architecture's Hugging Face layout names; the rest of our tree (blocks, attention layers,
    MLPs) are containers there."""
    arch = model.cfg.arch
    found = dict(OUTSIDE[arch])
    for i in range(model.cfg.n_layer):
        found.update({f"h.{i}.{ours}": f"{LAYERS[arch]}.{i}.{theirs}" for ours, theirs in INSIDE[arch].items()
                      if _at(model, f"h.{i}.{ours}") is not None})
    return found


def names_of(model: GPT) -> dict[str, str]:
    """Our state-dict name -> theirs, for every parameter of `model` (tied: the head is the
    embedding, named once, as `wte`)."""
    places = slots(model)
    names = {}
    for name, _ in model.named_parameters():
        owner = max((s for s in places if name == s or name.startswith(s + ".")), key=len, default=None)
        if owner is None:
            raise ValueError(f"parameter {name} has no place in the {model.cfg.arch} layout (model.hf_layout)")
        names[name] = places[owner] + name[len(owner):]
    return names


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Our state-dict name -> GPT-NeoX's (arch=neox) or LlamaForCausalLM's (arch=llama), for every
    parameter of a model of `cfg` (the LM head only when untied). Invert it to read theirs."""
    with torch.device("meta"):
        return names_of(GPT(cfg))


# ---- config.json -> ModelConfig ------------------------------------------------------------------

MODEL_TYPES = {"gpt_neox": "GPTNeoXForCausalLM, Pythia", "llama": "LlamaForCausalLM",
               "coca_lm": "this project's export of a design other than Origin"}
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# The RoPE fields each type may carry (the ones our RoPE computes, as hf.export writes them).
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings"}
_TYPE_KEYS = {"yarn": {"beta_fast", "beta_slow"}, "llama3": {"low_freq_factor", "high_freq_factor"}}
# What a type cannot do without, as transformers' validation of `rope_parameters` requires it.
_TYPE_REQUIRED = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
# transformers' defaults for fields a config.json may leave out (GPTNeoXConfig, LlamaConfig).
_DEFAULTS = {
    "neox": {"hidden_act": "gelu", "layer_norm_eps": 1e-5, "rotary_pct": 0.25, "use_parallel_residual": True,
             "attention_bias": True},
    "llama": {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rotary_pct": 1.0, "attention_bias": False,
              "mlp_bias": False},
}
_ACTIVATION = {"neox": "gelu", "llama": "silu"}


def _get(config: dict, key: str, kind: type, where: str, default: Any = None) -> Any:
    """config[key] as a `kind` (an int reads as a float), else `default`; missing without a default,
    or of another type: refused."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"{where} has no {key}")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"{where}: {key}={json.dumps(value)} is not a {kind.__name__}")
    return value


def _refuse(where: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{where}: {field}={json.dumps(value)} is not supported: {why}")


def _rope(config: dict, arch: str, where: str, max_positions: int,
          train_len: int) -> tuple[float, float, RopeScaling]:
    """(base, rotary_pct, scaling) from `rope_parameters` (transformers 5) or the older top-level
    fields (`rope_theta` / `rotary_emb_base`, `rotary_pct`, `rope_scaling`). YaRN's and llama3's
    `original_max_position_embeddings` is the length they stretch from (`original_max_seq_len`);
    dynamic NTK scales from `max_position_embeddings` (as transformers does), linear from nothing.
    Either is `original_max_seq_len` only where it is not the training length `train_len`."""
    params, legacy = config.get("rope_parameters"), config.get("rope_scaling")
    scaling, field = (params, "rope_parameters") if params else (legacy or {}, "rope_scaling")
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}: {field}={json.dumps(scaling)} is not a JSON object")
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
            raise ValueError(f"{where}: {name}={json.dumps(value)} is not a number")
    if kind == "default":
        return float(base), float(pct), RopeScaling()
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor >= 1.0:
        raise ValueError(f"{where}: {field}.factor={json.dumps(factor)} must be a number >= 1 for RoPE type {kind}")
    missing = [key for key in _TYPE_REQUIRED.get(kind, ()) if scaling.get(key) is None]
    if missing:
        raise ValueError(f"{where}: {field} of RoPE type {kind} lacks {', '.join(missing)} (transformers "
                         "refuses it too): give them, e.g. Llama 3.1's low_freq_factor 1.0, high_freq_factor 4.0 "
                         "and the length it was pretrained at")
    extras: dict[str, Any] = {}
    original = max_positions if kind == "dynamic" else scaling.get("original_max_position_embeddings")
    if kind in _TYPE_KEYS:
        extras = {k: float(scaling[k]) for k in _TYPE_KEYS[kind] if scaling.get(k) is not None}
    if kind != "linear" and original is not None and original != train_len:
        extras["original_max_seq_len"] = original
    try:
        return float(base), float(pct), RopeScaling(kind, float(factor), **extras)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where}: {field}: {error}") from None


def _design(config: dict, model_type: str) -> tuple[str, dict[str, Any], int]:
    """(attention, ModelConfig's design fields, the length temperature's L0 or 0) of a config: Origin
    for GPT-NeoX and Llama; a `coca_lm` export's own (one made before CoCA's form joined
    design_params says `coca_form`: read as `design_params.form`)."""
    if model_type != "coca_lm":
        return "origin", {}, 0
    attention = config.get("attention", "origin")
    params = {**({"form": config["coca_form"]} if "coca_form" in config else {}),
              **(config.get("design_params") or {})}
    l0 = config.get("length_temperature") or 0  # L0 (a bool in no export; true reads as max_position_embeddings)
    fields = dict(design_params={attention: params} if params else {}, length_temperature=bool(l0),
                  sinks=bool(config.get("sinks")), ssmax=bool(config.get("ssmax")),
                  qk_norm=bool(config.get("qk_norm")),
                  **({"mup": True, "mup_base_width": config["mup_base_width"]} if config.get("mup_base_width") else {}))
    return attention, fields, l0 if isinstance(l0, int) and not isinstance(l0, bool) else 0


def model_config(config: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Our `ModelConfig` for a config.json (`hf.imports` says what is read and refused). A `coca_lm`
    export's length temperature L0 is the training length; under dynamic NTK
    `max_position_embeddings` is the length it scales from (`hf.export`), which is then
    `rope_scaling.original_max_seq_len` where it differs."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        known = "; ".join(f"{k} ({v})" for k, v in MODEL_TYPES.items())
        raise ValueError(f"{where}: model_type={json.dumps(model_type)} is not supported: one of {known}")
    arch = {"gpt_neox": "neox", "llama": "llama"}.get(model_type) or config.get("arch", "neox")
    if arch not in _DEFAULTS:
        raise _refuse(where, "arch", arch, "one of neox, llama")
    defaults = _DEFAULTS[arch]
    attention, design, l0 = _design(config, model_type)
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
    train_len = l0 or max_positions
    base, pct, scaling = _rope(config, arch, where, max_positions, train_len)
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
            max_seq_len=train_len, attention=attention, **design, rotary_pct=pct, rope_base=base,
            rope_scaling=scaling, parallel_residual=parallel if arch == "neox" else False, layernorm_eps=eps,
            tie_embeddings=_get(config, "tie_word_embeddings", bool, where, False),
        )
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
