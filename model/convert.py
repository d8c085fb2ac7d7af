"""Carry a trained Origin model's weights into another design: the CoCA drop-in, Origin to ALiBi, and
whatever a design's registry record allows (`Design.from_origin`).

The attentions share every parameter shape: CoCA's T projection takes K's place (the same rows
of NeoX's fused `qkv`, the same `attn.k` of Llama), and ALiBi uses K as it is. So a conversion
keeps every tensor and decides only what T starts from:

    origin -> coca (slack | strict)   embeddings, norms, Q, V, output projection, MLP, LM head kept;
                                      T = K (`design_params.coca.t_init: from_k`) or drawn afresh
                                      as the model's initialisation draws K (`t_init: fresh`, what
                                      the released code gets through `ignore_mismatched_sizes`)
    origin -> alibi                   everything kept; the rotary embedding is simply not applied
    origin -> kerple | fire | fox     everything kept, the rotary embedding not applied, and the
                                      design's bias parameters (KERPLE's r1, r2, FIRE's MLP, c, L,
                                      FoX's gate) drawn afresh as a new model draws them: Origin has
                                      nothing they could start from

Why T = K is a sensible start: CoCA scores q_m . (q_m * t_n) rotated, with t tied per rotary pair
and non-negative, so K's weights give T the keys' scale and the same per-head input features;
`fresh` tests whether that matters. A source without RoPE (ALiBi) has no rotary features for
CoCA to build on, and CoCA's T is not a key: those conversions are refused, as is any change of
shape (they must be equal apart from the attention).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from errors import ConfigError

from .config import ModelConfig
from .designs import DESIGNS

# the modifiers' config fields: the softmax's (one parameter [H] per layer) and q/k's RMSNorm (two
# norms per layer, `attn.q_norm`, `attn.k_norm`, starting as a new model's: scale 1)
MODIFIERS = ("sinks", "ssmax", "qk_norm")


class ConversionError(ConfigError):
    """A conversion that cannot make sense; one line that says why (a usage error: exit 2)."""


@dataclass
class Conversion:
    """What a conversion did: tensor names carried bitwise, and those (or slices) drawn afresh."""

    carried: list[str]
    fresh: list[str]

    def describe(self) -> str:
        fresh = f"; drawn afresh: {', '.join(self.fresh)}" if self.fresh else ""
        return f"{len(self.carried)} tensors carried{fresh}"


def check_conversion(source: ModelConfig, target: ModelConfig) -> None:
    """Refuse, in one line, a conversion that cannot make sense."""
    for name in MODIFIERS:
        if getattr(source, name) and not getattr(target, name):
            raise ConversionError(f"the source has model.{name}=true and the target not: a conversion does not "
                                  f"drop learned parameters")
    if source.design.pro and not target.design.pro:
        raise ConversionError(f"the source is {source.design.name} and the target {target.design.name}: a conversion "
                              f"does not drop learned parameters (the Pro block's)")
    if source.attention == target.attention:
        return
    if source.design is not DESIGNS["origin"] or target.design.from_origin is None:
        into = ", ".join(sorted({d.attention for d in DESIGNS.values() if d.from_origin}))
        raise ConversionError(
            f"cannot convert attention={source.attention} into attention={target.attention}: only Origin (RoPE) "
            f"models convert, into {into} (coca: its T starts from K; the others keep K)")
    unchanged = replace(target, attention=source.attention, design_params=source.design_params)
    for name in ("arch", "vocab_size", "n_layer", "n_head", "n_embd", "ffn_hidden", "kv_heads", "tie_embeddings",
                 "parallel_residual", "rotary_pct"):
        if getattr(unchanged, name) != getattr(source, name):
            raise ConversionError(f"a conversion keeps the shape: the source has model.{name}="
                                  f"{getattr(source, name)}, the target {getattr(unchanged, name)}")


def t_init(cfg: ModelConfig) -> str | None:
    """Where the design's K rows start in a conversion (its params' `t_init`: CoCA's T), or None for
    a design without that choice (K kept)."""
    return getattr(cfg.params, "t_init", None)


def convert(state: dict[str, torch.Tensor], source: ModelConfig, target: ModelConfig,
            seed: int = 0) -> tuple[dict[str, torch.Tensor], Conversion]:
    """`state` (the source model's) as the target attention's state dict, and what was carried;
    modifiers the target adds (`model.sinks`, `model.ssmax`, `model.qk_norm`) start as a new model's
    (QK-norm's scales at 1: q and k only normalised, as DroPE's recalibration starts)."""
    check_conversion(source, target)
    out, done = _convert_design(state, source, target, seed)
    added = _fresh_layer_parameters(out, target, seed)
    return {**out, **added}, Conversion(carried=done.carried, fresh=[*done.fresh, *sorted(added)])


def _fresh_layer_parameters(state: dict[str, torch.Tensor], target: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Each attention layer's parameters the target has and `state` lacks (a modifier's,
    a q/k transform's: PoPE's phase bias; a design's own attention's: stick-breaking's head bias;
    FoX Pro's block parts),
    as a new attention layer of `target` initialises them,
    drawn from `seed`."""
    from .attention import CausalSelfAttention

    fresh = {}
    if not (target.sinks or target.ssmax or target.qk_norm or target.design.transform or target.design.attend
            or target.design.pro):
        return fresh
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in range(target.n_layer):
            names = {f"h.{layer}.attn.{name}": p for name, p in CausalSelfAttention(target, layer).named_parameters()}
            fresh.update({name: p.detach() for name, p in names.items() if name not in state})
    return fresh


def _convert_design(state: dict[str, torch.Tensor], source: ModelConfig, target: ModelConfig,
                    seed: int) -> tuple[dict[str, torch.Tensor], Conversion]:
    """The attention's part of `convert`."""
    out = {name: tensor.clone() for name, tensor in state.items()}
    if source.attention == target.attention:
        return out, Conversion(carried=sorted(out), fresh=[])
    if target.design.bias is not None:
        fresh = _fresh_bias(target, seed)
        return {**out, **fresh}, Conversion(carried=sorted(out), fresh=sorted(fresh))
    if t_init(target) != "fresh":
        return out, Conversion(carried=sorted(out), fresh=[])
    generator = torch.Generator().manual_seed(seed)
    fresh = []
    for layer in range(target.n_layer):
        prefix = f"h.{layer}.attn"
        if target.arch == "neox":  # the K rows of each head's [q, k, v] block of the fused projection
            weight = out[f"{prefix}.qkv.weight"].view(target.n_head, 3, target.head_dim, -1)
            weight[:, 1] = _normal(weight[:, 1], target.init_std, generator)
            out[f"{prefix}.qkv.bias"].view(target.n_head, 3, target.head_dim)[:, 1] = 0.0
            fresh.append(f"{prefix}.qkv (K rows)")
        else:
            out[f"{prefix}.k.weight"] = _normal(out[f"{prefix}.k.weight"], target.init_std, generator)
            fresh.append(f"{prefix}.k.weight")
    carried = [name for name in sorted(out) if not any(name.startswith(f.split(" ")[0]) for f in fresh)]
    return out, Conversion(carried=carried, fresh=fresh)


def _fresh_bias(target: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Each layer's score-bias parameters as a new model of `target` initialises them (its linears as
    the model's, then the design's own `reset_parameters`), drawn from `seed`."""
    from .gpt import init_weights

    state = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in range(target.n_layer):
            module = target.design.bias(target.n_head, target.n_embd)
            module.apply(lambda m: init_weights(m, target.init_std))
            state.update({f"h.{layer}.attn.score_bias.{name}": p.detach() for name, p in module.named_parameters()})
    return state


def _normal(like: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(like.shape, generator=generator, dtype=torch.float32) * std).to(like.dtype)
