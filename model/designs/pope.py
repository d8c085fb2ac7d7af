"""PoPE, polar coordinate position embeddings (Gopalakrishnan et al. 2025, arXiv 2509.10534): RoPE's
rotation applied to non-negative magnitudes, so that a score's phase depends on position alone.

Each of the r rotary components c of q and k (r = rotary dims, all of a head by default) becomes a
complex number with magnitude softplus(x_c) and phase (position x theta_c), one frequency per
component, theta_c = base^(-c / r), c = 0..r-1 (twice RoPE's r/2 frequencies):

    a(m, n) = sum_c softplus(q_mc) softplus(k_nc) cos((m - n) theta_c)   (= Re[q~_m^H k~_n])

scored as a / sqrt(D), D the head dimension, like every design's dot product. As one real dot
product: q_eff = [mu_q cos(m theta), mu_q sin(m theta)] (2r wide), k_eff likewise, i.e. RoPE's
rotate-half rotation of [mu, 0] with 2r-wide tables, whose frequencies base^(-2j/2r) are exactly
theta_c (`Design.rope_width`). Components beyond r (rotary_pct < 1) pass unchanged, as RoPE's do.
q_eff is scaled by sqrt(width / D) so that the kernels' 1 / sqrt(q_eff width) is 1 / sqrt(D).
The kernels get v zero-padded to q_eff's width (the fused CPU kernel wants one head size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Design
from .rope import RopeTables


@dataclass
class PopeParams:
    """phase_bias: the paper's optional learned phase offset delta_{h,c} of every key component,
    a(m, n) = sum_c mu_q mu_k cos((m - n) theta_c - delta_{h,c}) (`PhaseBias`)."""

    phase_bias: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.phase_bias, bool):
            raise ValueError(f"model.design_params.pope.phase_bias={self.phase_bias!r} must be true or false")


def polar(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[softplus(x_c) cos(phase_c), softplus(x_c) sin(phase_c)] for the leading r components of x
    (r = the tables' half width), the rest after them unchanged: [..., 2r + D - r]."""
    r = cos.shape[-1] // 2
    magnitude = F.softplus(x[..., :r])
    return torch.cat((magnitude * cos[..., :r], magnitude * sin[..., :r], x[..., r:]), dim=-1)


def pope_qk(q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
    """q_eff, k_eff of PoPE (module docstring); q_eff carries sqrt(width / D)."""
    cos, sin = rope
    q_eff, k_eff = polar(q, cos, sin), polar(k, cos, sin)
    return q_eff * math.sqrt(q_eff.shape[-1] / q.shape[-1]), k_eff


class PhaseBias(nn.Module):
    """PoPE with the learned phase offset: the keys' phases n theta_c + delta_{h,c}, delta [H, r]
    per query head and component, initialised 0 and kept in [-2 pi, 0] by a clamp (x-transformers'
    `PolarEmbedding`: zero init, `clamp(-2 pi, 0)`). Applied as -delta on the queries' phases
    (the same score, cos(n theta + delta - m theta)), so that under GQA a kv head's keys stay
    shared by its query heads."""

    def __init__(self, n_head: int, rope_width: int):
        super().__init__()
        self.delta = nn.Parameter(torch.zeros(n_head, rope_width // 2))

    def forward(self, q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        r = cos.shape[-1] // 2
        delta = self.delta.clamp(-2 * math.pi, 0.0).to(cos.dtype)[:, None, :]  # [H, 1, r]
        c, s = cos[..., :r], sin[..., :r]  # [T, r] or [B, 1, T, r]: with delta [H, T, r] or [B, H, T, r]
        shifted_cos = c * delta.cos() + s * delta.sin()  # cos(m theta - delta)
        shifted_sin = s * delta.cos() - c * delta.sin()  # sin(m theta - delta)
        q_eff = polar(q, torch.cat((shifted_cos, shifted_cos), -1), torch.cat((shifted_sin, shifted_sin), -1))
        k_eff = polar(k, cos, sin)
        return q_eff * math.sqrt(q_eff.shape[-1] / q.shape[-1]), k_eff


def phase_bias(params: PopeParams, n_head: int, rope_width: int) -> nn.Module | None:
    """The layer's q/k transform module: `PhaseBias` where the phase bias is on, else none."""
    return PhaseBias(n_head, rope_width) if params.phase_bias else None


def twice(rotary_dims: int) -> int:
    """PoPE's tables: one frequency per rotary component, theta_c = base^(-c / r)."""
    return 2 * rotary_dims


POPE = Design(
    key="pope", attention="pope", label="pope", name="PoPE", colour="#9467bd",
    summary="RoPE's rotation of softplus magnitudes: the phase is the position's alone",
    qk=pope_qk, rope_width=twice, params=PopeParams, transform=phase_bias, from_origin="keep",
)
