"""The interleaved NoPE/RoPE hybrid of long-context production models (Llama 4's iRoPE; Cohere's
RNoPE-SWA, arXiv 2501.18795): every k-th layer is NoPE with global causal attention, the others
RoPE with a causal sliding window of W tokens (a token sees the W most recent tokens, itself
included; W = 0: global). Layers are counted from the last, so the last layer is always a global
NoPE layer (with n_layer a multiple of k, exactly layers k, 2k, ... counted from the first)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .base import Design, unchanged
from .origin import origin_qk


@dataclass
class HybridParams:
    """nope_every: k, one global NoPE layer in every k; window: W of the RoPE layers (0: global)."""

    nope_every: int = 4
    window: int = 128

    def __post_init__(self) -> None:
        for name, low in (("nope_every", 1), ("window", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"model.design_params.hybrid.{name}={value!r} must be an integer >= {low}")


def hybrid_layer(params: HybridParams, index: int, n_layer: int) -> Design:
    """Layer `index`: global NoPE where (n_layer - 1 - index) is a multiple of k, else windowed RoPE."""
    if (n_layer - 1 - index) % params.nope_every == 0:
        return replace(HYBRID, qk=unchanged, window=0, for_layer=None)
    return replace(HYBRID, qk=origin_qk, window=params.window, for_layer=None)


HYBRID = Design(
    key="hybrid", attention="hybrid", label="hybrid", name="NoPE/RoPE hybrid", colour="#000000",
    summary="every k-th layer global NoPE, the others RoPE in a sliding window of W tokens",
    qk=origin_qk, params=HybridParams, for_layer=hybrid_layer, from_origin="keep",
)
