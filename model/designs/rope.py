"""RoPE and its scalings: the rotation every RoPE-based design (`rope=True` in the registry) applies.

GPT-NeoX rotate-half layout: dimension j of the rotated part pairs with j + r/2 (r = rotary dims);
pair j at position m turns by m * theta_j, theta_j = base^(-2j/r). Dimensions beyond r pass through
unrotated (rotary_pct < 1). Angles are computed in float64 for the positions and length actually
processed, then cast, so long positions keep their precision and dynamic NTK never reuses a base
computed for another length.

Like every module of `model.designs`, it imports only the standard library, torch and (with one
dot) its siblings: the Hugging Face export ships the package's files beside its remote-code model.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

RopeTables = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [..., T, r]


class Scaling(Protocol):
    """A RoPE scaling (`model.config.RopeScaling`; the exported model builds its own from
    `rope_parameters`): type none | linear | ntk | dynamic | yarn | llama3, its factor, YaRN's betas
    and Llama 3's frequency bounds."""

    type: str
    factor: float
    beta_fast: float
    beta_slow: float
    low_freq_factor: float
    high_freq_factor: float


# ---- RoPE ------------------------------------------------------------------------------------------


class Rope:
    """Computes cos/sin tables for given positions under a scaling (none|linear|ntk|dynamic|yarn|llama3).

    pairs: how many pairs rotate, the highest frequencies (j = 0, 1, ...) first; the others get
    frequency 0, so they pass through (p-RoPE). None: every pair rotates.
    """

    def __init__(self, rotary_dims: int, base: float, train_len: int, scaling: Scaling, pairs: int | None = None):
        self.rotary_dims = rotary_dims
        self.base = base
        self.train_len = train_len
        self.scaling = scaling
        self.pairs = pairs

    def base_at(self, seq_len: int) -> float:
        """The RoPE base used when `seq_len` tokens are processed (only dynamic NTK varies)."""
        r, s = self.rotary_dims, self.scaling
        if s.type == "ntk":
            return self.base * s.factor ** (r / (r - 2))
        if s.type == "dynamic" and seq_len > self.train_len:
            return self.base * (s.factor * seq_len / self.train_len - (s.factor - 1)) ** (r / (r - 2))
        return self.base

    def inv_freq(self, seq_len: int) -> tuple[torch.Tensor, float]:
        """Per-pair angular frequencies [r/2] (float64) and the factor cos/sin are scaled by."""
        inv, scale = self._scaled_inv_freq(seq_len)
        if self.pairs is not None:
            inv[self.pairs:] = 0.0
        return inv, scale

    def _scaled_inv_freq(self, seq_len: int) -> tuple[torch.Tensor, float]:
        r, s = self.rotary_dims, self.scaling
        inv = self.base_at(seq_len) ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
        if s.type == "linear":
            return inv / s.factor, 1.0
        if s.type == "yarn":
            return self._yarn(inv), (0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0)
        if s.type == "llama3":
            return self._llama3(inv), 1.0
        return inv, 1.0

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        """Llama 3.1's scaling (transformers' `_compute_llama3_parameters`): a pair whose wavelength
        exceeds L0 / low_freq_factor turns `factor` times slower, one under L0 / high_freq_factor is
        kept, and between them the frequency ramps linearly in L0 / wavelength."""
        s, l0 = self.scaling, self.train_len
        wavelength = 2 * math.pi / inv
        smooth = (l0 / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        ramped = (1.0 - smooth) * inv / s.factor + smooth * inv
        slow = torch.where(wavelength > l0 / s.low_freq_factor, inv / s.factor, inv)
        medium = (wavelength >= l0 / s.high_freq_factor) & (wavelength <= l0 / s.low_freq_factor)
        return torch.where(medium, ramped, slow)

    def _yarn(self, inv: torch.Tensor) -> torch.Tensor:
        """YaRN (Peng et al. 2023): interpolate slow pairs, keep fast ones, ramp in between."""
        r, s = self.rotary_dims, self.scaling

        def pair_at(rotations: float) -> float:  # pair index that turns `rotations` times in L0
            return r * math.log(self.train_len / (rotations * 2 * math.pi)) / (2 * math.log(self.base))

        low = max(math.floor(pair_at(s.beta_fast)), 0)
        high = min(math.ceil(pair_at(s.beta_slow)), r - 1)
        ramp = (torch.arange(r // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
        keep = 1.0 - ramp.clamp(0.0, 1.0)  # 1: extrapolate (unchanged), 0: interpolate (/factor)
        return inv / s.factor * (1.0 - keep) + inv * keep

    def tables(self, positions: torch.Tensor, seq_len: int, dtype: torch.dtype) -> RopeTables:
        """cos/sin [..., T, r] for `positions` [..., T] when `seq_len` tokens are processed."""
        inv, scale = self.inv_freq(seq_len)
        angles = positions.to(torch.float64)[..., None] * inv.to(positions.device)
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """Rotate the leading r dims of x [..., T, D] (rotate-half pairing); the rest pass through."""
    cos, sin = tables
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
