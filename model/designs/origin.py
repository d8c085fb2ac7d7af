"""Origin: rotary position embedding (RoPE, Su et al. 2021), the design the others are measured
against. q_eff = rope(q, m), k_eff = rope(k, n), so the score depends on m - n only."""

from __future__ import annotations

import torch

from .base import Design
from .rope import RopeTables, apply_rope


def origin_qk(q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope(q, rope), apply_rope(k, rope)


ORIGIN = Design(
    key="origin", attention="origin", label="origin", name="Origin", colour="#1f77b4",
    summary="RoPE: q and k rotated by their positions (GPT-NeoX, Llama)",
    qk=origin_qk, native_hf=True,
)
