"""CoCA, Collinear Constrained Attention (Zhu et al. 2023), in two forms.

The T projection replaces K. Each rotary pair (j, j + r/2) of t is tied by averaging and made
non-negative, t_j = relu((t_j + t_{j+r/2}) / 2), so k = q_m * t_n is collinear with q_m in every
rotated pair. With rotary_pct < 1 the non-rotary dims d >= r are not rotated, so k_d = q_d * t_d is
collinear with q_d for any t_d >= 0: they get t_d = relu(t_d) each, and both forms score them as
sum_d q_d^2 t_d (a position-free term). With rotary_pct = 1 this is exactly the released code.

    slack    q_eff = q * rope(q, m)              k_eff = rope(t, n)       (the released code)
    strict   q_eff = rope([|q_j|^2, 0], m)       k_eff = rope([t_j, 0], n)  (the paper's Eq. 9)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Design
from .rope import RopeTables, apply_rope

FORMS = ("slack", "strict")
T_INITS = ("from_k", "fresh")


@dataclass
class CocaParams:
    """CoCA's parameters, `model.design_params.coca.<name>`:

    form: slack (the released code) | strict (Eq. 9); it selects the registry record (`coca` or
      `coca_strict`), as `model.attention` selects the others.
    t_init: where T starts when `init_from` converts an Origin model (`model.convert`): from_k
      (T = K, kept) | fresh (drawn as the model initialises K, what the released code does).
    """

    form: str = "slack"
    t_init: str = "from_k"

    def __post_init__(self) -> None:
        for name, allowed in (("form", FORMS), ("t_init", T_INITS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"model.design_params.coca.{name}={getattr(self, name)!r} is not one of "
                                 f"{', '.join(allowed)}")


def coca_tie(t: torch.Tensor, rotary_dims: int) -> torch.Tensor:
    """CoCA's t: each rotary pair averaged and ReLU'd (duplicated back), other dims ReLU'd."""
    half = rotary_dims // 2
    tied = torch.relu((t[..., :half] + t[..., half:rotary_dims]) / 2)
    return torch.cat((tied, tied, torch.relu(t[..., rotary_dims:])), dim=-1)


def coca_slack_qk(q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
    """The released code's a(m,n) = sum_d q[d] rope(q,m)[d] rope(t,n)[d], as one dot product."""
    t = coca_tie(k, rope[0].shape[-1])
    return q * apply_rope(q, rope), apply_rope(t, rope)


def coca_strict_qk(q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 9, a(m,n) = sum_j t_{n,j} |q_{m,j}|^2 cos((m-n) theta_j), as one dot product.

    Pair j of q_eff holds (|q_j|^2, 0) rotated by m and pair j of k_eff holds (t_j, 0) rotated by n,
    so their dot product is |q_j|^2 t_j cos((m - n) theta_j): purely relative.
    """
    cos, sin = rope
    half = cos.shape[-1] // 2
    r = 2 * half
    t = coca_tie(k, r)
    cos, sin = cos[..., :half], sin[..., :half]  # rope([x, 0]) = [x cos, x sin]
    sq = q[..., :half] ** 2 + q[..., half:r] ** 2
    th = t[..., :half]
    q_eff = torch.cat((sq * cos, sq * sin, q[..., r:] ** 2), dim=-1)
    k_eff = torch.cat((th * cos, th * sin, t[..., r:]), dim=-1)
    return q_eff, k_eff


COCA_SLACK = Design(
    key="coca", attention="coca", form="slack", label="coca-slack", name="CoCA slack", colour="#ff7f0e",
    summary="CoCA as released: k collinear with q per rotary pair (T replaces K)",
    qk=coca_slack_qk, params=CocaParams, from_origin="keep",
)
COCA_STRICT = Design(
    key="coca_strict", attention="coca", form="strict", label="coca-strict", name="CoCA strict",
    colour="#d62728", summary="CoCA as the paper's Eq. 9: purely relative, |q_j|^2 t_j cos((m - n) theta_j)",
    qk=coca_strict_qk, params=CocaParams, from_origin="keep",
)
