"""What an attention design is: one record that says what the design computes and how every part
of the framework (config, kernels, evaluation, plots, export, conversion, benchmarks) treats it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .rope import RopeTables

QKTransform = Callable[[torch.Tensor, torch.Tensor, Optional[RopeTables]], tuple[torch.Tensor, torch.Tensor]]


def unchanged(q: torch.Tensor, k: torch.Tensor, rope: RopeTables | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The q/k transform of a design that scores q . k as they are (no rotation)."""
    return q, k


def distance_bias(slopes: torch.Tensor, m: torch.Tensor, n: torch.Tensor, allowed: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """The additive bias -slope_h * (m - n) for query positions m [rows, 1] and key positions
    n [1, keys] (slopes [H, 1, 1], float64: exact), cast to `dtype`; where `allowed` is False, the
    dtype's most negative finite value (never -inf, which has produced NaN in CPU SDPA)."""
    return (-slopes * (m - n)).to(dtype).masked_fill(~allowed, torch.finfo(dtype).min)


@dataclass(frozen=True)
class Design:
    """One attention design of the registry (`model.designs.registry`).

    key: its name in run folders, figures and the study's comparisons (`coca_strict`).
    attention, coca_form: the config values that select it (`model.attention`; `model.coca_form`
      for CoCA's two forms, None where the design has no forms).
    label: its name in evaluation results (`coca-strict`); name: in sentences (`CoCA strict`).
    colour: its colour in every figure. summary: one line on what it is.
    qk: q [B, H, T, D], k [B, kv heads, T, D] (the layer's K projection: CoCA's T), RoPE tables of
      the T positions (None where `rope` is False) -> the kernel's q_eff, k_eff. Scores are
      q_eff . k_eff / sqrt(D), plus the bias below; the KV cache holds k_eff.
    rope: whether the design rotates with RoPE: the model builds tables and RoPE scalings apply.
    slopes: n_head -> per-head slopes s_h [H] (float64) of a bias -s_h (m - n) added to the scores
      of query position m and key position n, run on the bias kernel; None: no bias (fused SDPA).
    native_hf: exported as the architecture's own Hugging Face class (GPTNeoXForCausalLM,
      LlamaForCausalLM); otherwise as the remote-code model shipped with the export.
    from_origin: how an Origin model's weights become this design's (`model.convert`): "keep"
      (every tensor as it is), "k_to_t" (K's rows become T, as they are or drawn afresh: `t_init`),
      None (refused).
    window: a sliding window of this many keys (the query's own included; 0: every earlier key).
    rotating_pairs: (params, rotary pairs) -> how many pairs rotate, the highest frequencies first
      (the rest get frequency 0: `Rope(pairs=...)`); None: all of them.
    params: the dataclass of the design's parameters, with their defaults and checks (the config's
      `model.design_params.<key>.<name>`, the export's `design_params`); None: it has none.
    for_layer: (params, layer index, n_layer) -> the Design layer `index` runs (a parametrised
      transform, another design in some layers, a window); None: this record in every layer.
    """

    key: str
    attention: str
    label: str
    name: str
    colour: str
    summary: str
    qk: QKTransform = unchanged
    rope: bool = True
    slopes: Optional[Callable[[int], torch.Tensor]] = None
    coca_form: Optional[str] = None
    native_hf: bool = False
    from_origin: Optional[str] = None
    window: int = 0
    rotating_pairs: Optional[Callable[[Any, int], int]] = None
    params: Optional[type] = None
    for_layer: Optional[Callable[[Any, int, int], Design]] = None

    def settings(self) -> dict[str, str]:
        """The model-config fields that select this design, e.g. {"attention": "coca", "coca_form": "strict"}."""
        return {"attention": self.attention, **({"coca_form": self.coca_form} if self.coca_form else {})}

    def layer(self, params: Any, index: int, n_layer: int) -> Design:
        """The design layer `index` of `n_layer` runs, under this design's `params`."""
        return self if self.for_layer is None else self.for_layer(params, index, n_layer)
