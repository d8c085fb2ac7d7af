"""The one parameter-name map between our model and Hugging Face's GPT-NeoX layout, which the
exported remote-code model (`hf/modeling_coca_lm.py`) uses too."""

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
    return names


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our parameters under GPT-NeoX's names, as contiguous fp32 copies."""
    ours = dict(model.named_parameters(remove_duplicate=False))
    return {theirs: ours[name].detach().to(torch.float32).contiguous().clone()
            for name, theirs in hf_names(model.cfg).items()}
