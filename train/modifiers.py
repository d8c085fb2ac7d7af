"""The softmax and q/k modifiers (`model.sinks`, `model.ssmax`, `model.qk_norm`) when `init_from`
starts a run whose model differs from its source only by them.

Adding one to a trained model is a recipe (DroPE adds QK-norm): where the attention is kept, the
added parameters start where the model computes what the source computed, as far as a constant can:

    sinks     logit SINK_START per head: a sink's share of a softmax is below e^-20 of the row's
              best key's weight, under fp32 rounding wherever that key scores above -3 (exactly
              neutral in practice), and still trainable (AdamW's steps do not shrink with the gradient)
    ssmax     s = 1 / log(L0), a new model's: a query that sees L0 keys (or one key) scores as in the
              source; the others' scores are scaled by log n / log L0 (no constant s is neutral)
    qk_norm   scales at 1, a new model's and DroPE's: q and k are normalised, which changes the
              scores (no constant scale is neutral)

A conversion to another attention (`model.convert`) changes the function anyway: it draws them as a
new model does. Dropping a modifier the source learned is refused (`check_kept`), as a conversion
refuses it.
"""

from __future__ import annotations

import torch

from errors import ConfigError
from model import GPT, ModelConfig
from model.convert import MODIFIERS

SINK_START = -20.0

# each modifier's parameters in an attention layer, and how its start relates to the source
_PARAMETERS = {"sinks": ("attn.sinks",), "ssmax": ("attn.ssmax",),
               "qk_norm": ("attn.q_norm.weight", "attn.k_norm.weight")}
_START = {"sinks": f"sinks at logit {SINK_START:g} (neutral to fp32 rounding)",
          "ssmax": "ssmax's s at 1/log(max_seq_len) (neutral for a query that sees max_seq_len keys only)",
          "qk_norm": "qk_norm's scales at 1 (q and k normalised: not neutral)"}


def added(source: ModelConfig, target: ModelConfig) -> list[str]:
    """The modifiers the target has and the source has not."""
    return [name for name in MODIFIERS if getattr(target, name) and not getattr(source, name)]


def check_kept(source: ModelConfig, target: ModelConfig, where: str) -> None:
    """Refuse (one line, exit 2) a start that would drop modifiers the source learned, naming them
    and their parameters."""
    dropped = [name for name in MODIFIERS if getattr(source, name) and not getattr(target, name)]
    if dropped:
        keys = ", ".join(f"model.{name}=true" for name in dropped)
        params = ", ".join(f"h.*.{param}" for name in dropped for param in _PARAMETERS[name])
        raise ConfigError(f"{where} has {keys} (learned parameters {params}) and this run not: init_from does not "
                          f"drop learned parameters; set {' '.join(f'model.{name}=true' for name in dropped)}")


def neutral_start(model: GPT, state: dict[str, torch.Tensor],
                  source: ModelConfig) -> tuple[dict[str, torch.Tensor], str]:
    """`state` (the source's, same attention) with the parameters of the modifiers `model` adds at
    their neutral start (module docstring), and one line saying how each starts ("" if none)."""
    names = added(source, model.cfg)
    if not names:
        return state, ""
    filled = dict(state)
    for key, value in model.state_dict().items():
        if key in state or not any(part in key for name in names for part in _PARAMETERS[name]):
            continue
        filled[key] = torch.full_like(value, SINK_START) if key.endswith("attn.sinks") else value.detach().clone()
    starts = "; ".join(_START[name] for name in names)
    return filled, f"{', '.join(f'model.{name}' for name in names)} added to the source's model: {starts}"
