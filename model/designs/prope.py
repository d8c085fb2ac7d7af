"""p-RoPE (Barbero et al. 2024, "Round and Round We Go", arXiv 2410.06205): RoPE with its lowest
frequencies removed. Of the r/2 rotary pairs, theta_k = base^(-2k/r), only the round(p * r/2) with
the largest theta_k (k = 0, 1, ...) rotate; the others have frequency 0 and pass through. p = 1 is
RoPE, p = 0 is NoPE. This is not `rotary_pct`, which re-spaces all frequencies over fewer
dimensions. RoPE scalings act on the rotating pairs (`Rope(pairs=...)`)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Design
from .origin import origin_qk


@dataclass
class PRopeParams:
    """p: the fraction of rotary pairs that rotate, the highest frequencies first (0 <= p <= 1)."""

    p: float = 0.25

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0.0 <= self.p <= 1.0:
            raise ValueError(f"model.design_params.prope.p={self.p!r} must be a number in [0, 1]")


def rotating_pairs(params: PRopeParams, pairs: int) -> int:
    """How many of `pairs` rotary pairs rotate: round(p * pairs) (Python's round: half to even)."""
    return round(params.p * pairs)


PROPE = Design(
    key="prope", attention="prope", label="p-rope", name="p-RoPE", colour="#8ca252",
    summary="RoPE on the highest-frequency fraction p of the pairs only; the rest unrotated",
    qk=origin_qk, params=PRopeParams, rotating_pairs=rotating_pairs, from_origin="keep",
)
