"""The parameter-name maps between our model and Hugging Face's layouts: GPT-NeoX's (arch=neox) and
Llama's (arch=llama, `LlamaForCausalLM`); the exported remote-code model (`hf/modeling_coca_lm.py`)
uses the same two."""

from __future__ import annotations

import torch

from model import GPT, ModelConfig

_LAYER = {  # ours (inside block i) -> theirs (inside gpt_neox.layers.i)
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.qkv": "attention.query_key_value",
    "attn.proj": "attention.dense",
    "mlp.fc": "mlp.dense_h_to_4h",
    "mlp.proj": "mlp.dense_4h_to_h",
}


def _score_bias(cfg: ModelConfig, attention: str) -> dict[str, str]:
    """A design's score-bias parameters (`attn.score_bias.*`: KERPLE's r1, r2, FIRE's MLP, FoX's
    gate), under the same names inside the HF layer's attention (`attention`, `self_attn`)."""
    if cfg.design.bias is None:
        return {}
    module = cfg.design.bias(cfg.n_head, cfg.n_embd)
    return {f"attn.score_bias.{name}": f"{attention}.score_bias.{name}" for name, _ in module.named_parameters()}


def _modifiers(cfg: ModelConfig, attention: str) -> dict[str, str]:
    """The softmax modifiers' per-head parameters (`attn.sinks`, `attn.ssmax`; gpt-oss's name for
    the sinks) and a design's q/k transform module's (`attn.qk_transform.*`: PoPE's phase bias),
    under the same names inside the HF layer's attention."""
    names = {f"attn.{name}": f"{attention}.{name}" for name in ("sinks", "ssmax") if getattr(cfg, name)}
    transform = cfg.design.transform and cfg.design.transform(cfg.params, cfg.n_head, cfg.rope_width())
    if transform is not None:
        names.update({f"attn.qk_transform.{name}": f"{attention}.qk_transform.{name}"
                      for name, _ in transform.named_parameters()})
    return names


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Our state-dict name -> GPT-NeoX's, for every parameter of a model of `cfg` (the LM head
    only when untied: tied, it is the embedding). Invert it to read a GPT-NeoX state dict."""
    names = {"wte.weight": "gpt_neox.embed_in.weight", "ln_f.weight": "gpt_neox.final_layer_norm.weight",
             "ln_f.bias": "gpt_neox.final_layer_norm.bias"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layer):
        for ours, theirs in _LAYER.items():
            for p in ("weight", "bias"):
                names[f"h.{i}.{ours}.{p}"] = f"gpt_neox.layers.{i}.{theirs}.{p}"
        for ours, theirs in {**_score_bias(cfg, "attention"), **_modifiers(cfg, "attention")}.items():
            names[f"h.{i}.{ours}"] = f"gpt_neox.layers.{i}.{theirs}"
    return names


_LLAMA_LAYER = {  # ours (inside block i) -> theirs (inside model.layers.i); weights only, no biases
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.proj": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}


def llama_hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Our state-dict name -> LlamaForCausalLM's, for every parameter of an arch=llama model of
    `cfg` (the LM head only when untied). Both use the rotate-half RoPE layout, so q and k map as
    they are (no permutation)."""
    names = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layer):
        for ours, theirs in _LLAMA_LAYER.items():
            names[f"h.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
        for ours, theirs in {**_score_bias(cfg, "self_attn"), **_modifiers(cfg, "self_attn")}.items():
            names[f"h.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


# GPTNeoXForCausalLM's checkpoints name its LM head so (Pythia's and transformers' own
# `save_pretrained`: transformers 5 calls the module `lm_head` and renames the tensor on load).
NEOX_CHECKPOINT_HEAD = "embed_out.weight"


def hf_state_dict(model: GPT, *, neox_checkpoint: bool = False) -> dict[str, torch.Tensor]:
    """Our parameters under their Hugging Face names (GPT-NeoX's for arch=neox, Llama's for
    arch=llama: the plain export's and the remote-code model's alike), as contiguous fp32 copies;
    with `neox_checkpoint` (a plain GPTNeoXForCausalLM export), the head under the name its
    checkpoints give it, `embed_out.weight`, so that every loader of them finds it."""
    names = llama_hf_names(model.cfg) if model.cfg.arch == "llama" else hf_names(model.cfg)
    if neox_checkpoint and model.cfg.arch == "neox" and "lm_head.weight" in names:
        names["lm_head.weight"] = NEOX_CHECKPOINT_HEAD
    ours = dict(model.named_parameters(remove_duplicate=False))
    return {theirs: ours[name].detach().to(torch.float32).contiguous().clone() for name, theirs in names.items()}
