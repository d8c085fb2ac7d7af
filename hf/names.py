"""Our parameters under their Hugging Face names, for the exporter. The layout itself (which of our
modules sits where in GPT-NeoX's and Llama's trees) is `model.hf_layout`, shipped with every
remote-code export, whose modelling file places our modules by it: one map for both."""

from __future__ import annotations

import torch

from model import GPT, ModelConfig
from model.hf_layout import hf_names

__all__ = ["NEOX_CHECKPOINT_HEAD", "hf_names", "hf_state_dict", "llama_hf_names"]


def llama_hf_names(cfg: ModelConfig) -> dict[str, str]:
    """`hf_names` of an arch=llama config (LlamaForCausalLM's names)."""
    if cfg.arch != "llama":
        raise ValueError(f"llama_hf_names of an arch={cfg.arch} config")
    return hf_names(cfg)


# GPTNeoXForCausalLM's checkpoints name its LM head so (Pythia's and transformers' own
# `save_pretrained`: transformers 5 calls the module `lm_head` and renames the tensor on load).
NEOX_CHECKPOINT_HEAD = "embed_out.weight"


def hf_state_dict(model: GPT, *, neox_checkpoint: bool = False) -> dict[str, torch.Tensor]:
    """Our parameters under their Hugging Face names (GPT-NeoX's for arch=neox, Llama's for
    arch=llama: the plain export's and the remote-code model's alike), as contiguous fp32 copies;
    with `neox_checkpoint` (a plain GPTNeoXForCausalLM export), the head under the name its
    checkpoints give it, `embed_out.weight`, so that every loader of them finds it."""
    names = hf_names(model.cfg)
    if neox_checkpoint and model.cfg.arch == "neox" and "lm_head.weight" in names:
        names["lm_head.weight"] = NEOX_CHECKPOINT_HEAD
    ours = dict(model.named_parameters(remove_duplicate=False))
    return {theirs: ours[name].detach().to(torch.float32).contiguous().clone() for name, theirs in names.items()}
