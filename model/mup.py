"""muP (maximal update parametrization, Yang et al. 2022, "Tensor Programs V"), relative to a base width.

A parameter's kind follows from which of its dimensions grow with the width, found as the `mup`
package finds them: the model is built (on the meta device, no memory) at the base width and at
twice it, and the dimensions that differ are the "infinite" ones. So every design's own parameters
are classified by their shapes, with no list of names:

    kind     infinite dims                       init std        Adam lr    forward
    hidden   two (fan-in and fan-out)            x 1/sqrt(m)     x 1/m
    output   a linear's weight, fan-in only       x 1/m           x 1/m      (Table 3's form)
    readout  the LM head                         unchanged       x 1        logits x 1/m (Table 8's form)
    vector   at most one, not fan-in: embedding, unchanged       x 1
             biases, norms, per-head parameters

m = n_embd / mup_base_width (the width multiplier; at m = 1 the model is the standard one). The LM
head takes Table 8's form (an output multiplier 1/m in the forward, `GPT.lm_head.multiplier`, so a
tied embedding is input and readout at once, both at lr x 1 and a constant init); a design's
internal output-like matrix (FoX's forget gate, n_embd -> heads) takes Table 3's equivalent form,
init and lr x 1/m, so its module needs no multiplier. Attention scores are q.k x sqrt(d_base)/d
instead of q.k / sqrt(d) (muP's 1/d, equal at the base head dimension d_base).

Muon's hidden matrices get the spectral form of muP instead of Adam's 1/m: an orthogonalised
update has spectral norm lr x adjust(shape), and muP asks for it to stay fixed as the width grows,
so the factor is adjust(base shape) / adjust(shape): 1 under `original` (sqrt(max(1, fan_out /
fan_in)) keeps its value when both dims scale), sqrt(1/m) under `match_rms_adamw`.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import replace

import torch
from torch import nn

from .config import ModelConfig

_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def width_mult(cfg: ModelConfig) -> float:
    """m: the width relative to the base width (1 without muP)."""
    return cfg.n_embd / cfg.mup_base_width if cfg.mup else 1.0


def at_width(cfg: ModelConfig, width: int) -> ModelConfig:
    """`cfg` at another width: n_embd = width, ffn_hidden in proportion, the same heads; standard (no muP)."""
    return replace(cfg, n_embd=width, ffn_hidden=cfg.ffn_hidden * width // cfg.n_embd, mup=False)


def attention_multiplier(cfg: ModelConfig) -> float:
    """The factor on q.k / sqrt(d) that makes it q.k x sqrt(d_base) / d (1 without muP)."""
    return math.sqrt(cfg.mup_base_width / cfg.n_embd) if cfg.mup else 1.0


def output_multiplier(cfg: ModelConfig) -> float:
    """The LM head's logit multiplier, 1/m (1 without muP)."""
    return 1.0 / width_mult(cfg)


def _shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    from .gpt import GPT

    with torch.device("meta"):
        return {name: p.shape for name, p in GPT(cfg).named_parameters()}


def kinds(model: nn.Module) -> dict[str, str]:
    """Each parameter's muP kind by name (see the module's table), computed once per model."""
    if model in _KINDS:
        return _KINDS[model]
    cfg = model.cfg
    base, wide = _shapes(at_width(cfg, cfg.mup_base_width)), _shapes(at_width(cfg, 2 * cfg.mup_base_width))
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    out: dict[str, str] = {}
    for name, p in model.named_parameters():
        infinite = [i for i, (a, b) in enumerate(zip(base[name], wide[name], strict=True)) if a != b]
        if p is model.lm_head.weight and id(p) not in embeddings:
            out[name] = "readout"
        elif len(infinite) == 2:
            out[name] = "hidden"
        elif id(p) in linears and infinite == [1]:
            out[name] = "output"
        else:
            out[name] = "vector"
    _KINDS[model] = out
    return out


@torch.no_grad()
def rescale_init(model: nn.Module) -> None:
    """muP's initialisation from the standard one (normal(0, init_std) at every width): hidden
    matrices x 1/sqrt(m) (variance 1/fan_in, equal at the base width), output-like ones x 1/m."""
    m = width_mult(model.cfg)
    params = dict(model.named_parameters())
    for name, kind in kinds(model).items():
        if kind == "hidden":
            params[name].mul_(1.0 / math.sqrt(m))
        elif kind == "output":
            params[name].mul_(1.0 / m)


def _adjust(adjust_lr: str, shape: tuple[int, ...]) -> float:
    """torch's Muon lr adjustment for a matrix of `shape` (`torch.optim._muon._adjust_lr`)."""
    fan_out, fan_in = shape[:2]
    return math.sqrt(max(1.0, fan_out / fan_in)) if adjust_lr == "original" else 0.2 * math.sqrt(max(shape[:2]))


def lr_multiplier(model: nn.Module, adjust_lr: str, p: nn.Parameter, use_muon: bool) -> float:
    """Parameter p's muP lr factor: Adam's per kind, or Muon's spectral one (see the module's doc)."""
    name = next(n for n, q in model.named_parameters() if q is p)
    kind, m = kinds(model)[name], width_mult(model.cfg)
    if use_muon:
        base = [round(d / m) if i in (0, 1) else d for i, d in enumerate(p.shape)]
        return _adjust(adjust_lr, tuple(base)) / _adjust(adjust_lr, tuple(p.shape))
    return 1.0 / m if kind in ("hidden", "output") else 1.0
