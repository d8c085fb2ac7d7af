"""NoPE (Kazemnejad et al. 2023, arXiv 2305.19466): no positional encoding at all. Scores are
q_i . k_j / sqrt(D) for j <= i; the causal mask alone tells a token where it is."""

from __future__ import annotations

from .base import Design, unchanged

NOPE = Design(
    key="nope", attention="nope", label="nope", name="NoPE", colour="#5254a3",
    summary="no positional encoding: q . k under the causal mask",
    qk=unchanged, rope=False, from_origin="keep",
)
