"""The interleaved NoPE/RoPE hybrid of long-context production models (Llama 4's iRoPE; Cohere's
RNoPE-SWA, arXiv 2501.18795): every k-th layer is NoPE with global causal attention, the others
RoPE with a causal sliding window of W tokens (a token sees the W most recent tokens, itself
included; W = 0: global). Layers are counted from the last, so the last layer is always a global
layer (with n_layer a multiple of k, exactly layers k, 2k, ... counted from the first).

The global layers may instead be RoPE at a base of their own (`global_layers: origin`,
`global_rope_base`): Gemma 3's layout, 5 local RoPE layers (base 10K, window 1024) to 1 global
RoPE layer (base 1M), is `nope_every=6 window=1024 global_layers=origin global_rope_base=1e6`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .base import Design, unchanged
from .origin import origin_qk

GLOBAL_LAYERS = ("nope", "origin")  # what the hybrid's global layers run


@dataclass
class HybridParams:
    """nope_every: k, one global layer in every k; window: W of the local RoPE layers (0: global);
    global_layers: nope (no position) | origin (RoPE, at global_rope_base where it is > 0, else at
    model.rope_base)."""

    nope_every: int = 4
    window: int = 128
    global_layers: str = "nope"
    global_rope_base: float = 0.0

    def __post_init__(self) -> None:
        for name, low in (("nope_every", 1), ("window", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"model.design_params.hybrid.{name}={value!r} must be an integer >= {low}")
        if self.global_layers not in GLOBAL_LAYERS:
            raise ValueError(f"model.design_params.hybrid.global_layers={self.global_layers!r} is not one of "
                             f"{', '.join(GLOBAL_LAYERS)}")
        base = self.global_rope_base
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not (base == 0 or base > 1):
            raise ValueError(f"model.design_params.hybrid.global_rope_base={base!r} must be > 1 (or 0: "
                             "model.rope_base)")
        if base and self.global_layers != "origin":
            raise ValueError(f"model.design_params.hybrid.global_rope_base={base!r} needs global_layers=origin "
                             "(NoPE global layers have no RoPE)")


def hybrid_layer(params: HybridParams, index: int, n_layer: int) -> Design:
    """Layer `index`: global (NoPE, or RoPE at its own base) where (n_layer - 1 - index) is a
    multiple of k, else windowed RoPE."""
    if (n_layer - 1 - index) % params.nope_every:
        return replace(HYBRID, qk=origin_qk, window=params.window, for_layer=None)
    if params.global_layers == "origin":
        return replace(HYBRID, qk=origin_qk, window=0, for_layer=None, rope_base=params.global_rope_base or None)
    return replace(HYBRID, qk=unchanged, window=0, for_layer=None)


HYBRID = Design(
    key="hybrid", attention="hybrid", label="hybrid", name="NoPE/RoPE hybrid", colour="#000000",
    summary="every k-th layer global (NoPE, or RoPE at its own base), the others RoPE in a window of W tokens",
    qk=origin_qk, params=HybridParams, for_layer=hybrid_layer, from_origin="keep",
)
