"""FoX, the Forgetting Transformer (Lin et al. 2025, arXiv 2503.02130), in two forms
(`model.design_params.fox.form`): `basic`, the paper's basic layer, and `pro`, its "Pro" block
(`ProParts` below). Both: no positional encoding; a data-dependent forget gate per head and token from the layer's
input x_t (after the block's norm),

    f_t = sigmoid(w_h . x_t + b_h),   b_h(m, n) = sum_{l = n+1}^{m} log f_l = F_m - F_n

with F the running sum of log f: the kernels' `gap` (within a document; KV cache: the gates of
the cached tokens are kept). ALiBi is the special case of a constant gate. As the paper's code, the gate is a
linear layer with a bias (`gate`), initialised as the model's other linears (normal weights, zero
bias), and log f = logsigmoid computed in float32; the gap sums are exact at any length (float64
prefix sums on CPU, float32 hi/lo pairs in FlexAttention: `model.bias_attention`, `model.flex`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Design, ScoreBias
from .learned import wide

FORMS = ("basic", "pro")


@dataclass
class FoxParams:
    """FoX's parameters, `model.design_params.fox.<name>`:

    form: basic (the forget gate alone: the paper's basic layer, what the published FoX runs are) |
      pro (the paper's "Pro" block, which its headline numbers use: the forget gate and `ProParts`);
      it selects the registry record (`fox` or `fox_pro`).
    """

    form: str = "basic"

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"model.design_params.fox.form={self.form!r} is not one of {', '.join(FORMS)}")


class ForgetBias(ScoreBias):
    """b_h(m, n) = F_m - F_n, F the prefix sums of log sigmoid(gate(x))_h."""

    gated = True
    separable = True  # F_m - F_n

    def __init__(self, n_head: int, n_embd: int):
        super().__init__()
        self.n_head = n_head
        self.gate = nn.Linear(n_embd, n_head)

    def terms(self, x: torch.Tensor) -> torch.Tensor:
        return F.logsigmoid(wide(self.gate(x))).transpose(1, 2)

    @staticmethod
    def element(t, h, m, n, gap=None) -> torch.Tensor:
        return gap

    def key_values(self, heads, n, prefix) -> torch.Tensor:
        return -prefix


class HeadNorm(nn.Module):
    """RMSNorm of each head's D channels, with a scale per channel of every head (`weight` [heads * D],
    1 at the start): the paper code's GroupNorm(num_groups=heads, is_rms_norm=True)."""

    def __init__(self, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.head_dim, self.eps = head_dim, eps
        self.weight = nn.Parameter(torch.ones(heads * head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, D], all of the layer's heads -> the same dtype (autocast computes the norm wider)."""
        normed = F.rms_norm(x, (self.head_dim,), eps=self.eps) * self.weight.view(x.shape[1], 1, self.head_dim)
        return normed.to(x.dtype)


class ProParts(nn.Module):
    """The Pro block's parts around the kernel (as the paper's released code builds them with
    `use_k_shift`, `use_v_shift`, `qk_norm`, `use_output_norm`, `use_output_gate`), for token t
    with layer input x_t (after the block's norm) and projections q_t, k_t, v_t:

        k_t <- a_t k_{t-1} + (1 - a_t) k_t,   a_t = sigmoid(w^k_g . x_t)  per kv head g (no bias)
        v_t <- b_t v_{t-1} + (1 - b_t) v_t,   b_t = sigmoid(w^v_g . x_t)
        q_t, k_t <- RMSNorm per head (scale per channel of every head), after the shift
        o_t <- RMSNorm per head (o_t) * sigmoid(W_o x_t),   then the output projection

    k_{t-1} is the predecessor's projection before its own shift (0 before a row's or a document's
    first token; the KV cache keeps the last token's). The shifts' linears and the gate's W_o are
    drawn as the model's other linears, the norms' scales start at 1 (the paper's code).
    """

    def __init__(self, n_head: int, kv_heads: int, head_dim: int, n_embd: int, eps: float):
        super().__init__()
        self.k_shift = nn.Linear(n_embd, kv_heads, bias=False)
        self.v_shift = nn.Linear(n_embd, kv_heads, bias=False)
        self.q_norm = HeadNorm(n_head, head_dim, eps)
        self.k_norm = HeadNorm(kv_heads, head_dim, eps)
        self.out_norm = HeadNorm(n_head, head_dim, eps)
        self.out_gate = nn.Linear(n_embd, n_head * head_dim, bias=False)

    def inputs(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               previous: tuple[torch.Tensor, torch.Tensor] | None,
               starts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, D], k and v [B, kv heads, T, D] -> Pro's. previous: the unshifted k and v
        [B, kv heads, 1, D] of the token before the first (None: there is none); starts [B, T]: the
        tokens that begin a document (their predecessor is another document's), or None."""
        before_k, before_v = (None, None) if previous is None else previous
        k = self._shift(self.k_shift, x, k, before_k, starts)
        v = self._shift(self.v_shift, x, v, before_v, starts)
        return self.q_norm(q), self.k_norm(k), v

    @staticmethod
    def _shift(proj: nn.Linear, x: torch.Tensor, y: torch.Tensor, before: torch.Tensor | None,
               starts: torch.Tensor | None) -> torch.Tensor:
        weight = torch.sigmoid(wide(proj(x))).transpose(1, 2)[..., None]  # [B, kv heads, T, 1]
        first = torch.zeros_like(y[..., :1, :]) if before is None else before
        prior = torch.cat((first, y[..., :-1, :]), dim=-2)
        if starts is not None:
            prior = prior.masked_fill(starts[:, None, :, None], 0.0)
        return (weight * prior + (1 - weight) * y).to(y.dtype)

    def output(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The attention's output y [B, H, T, D] of the tokens x [B, T, C] -> normed and gated."""
        B, H, T, D = y.shape
        gate = torch.sigmoid(self.out_gate(x)).view(B, T, H, D).transpose(1, 2)
        return (self.out_norm(y) * gate).to(y.dtype)


FOX = Design(
    key="fox", attention="fox", form="basic", label="fox", name="FoX", colour="#17becf",
    summary="no rotation; a data-dependent forget gate per head: the bias sums log f over the gap",
    rope=False, bias=ForgetBias, params=FoxParams, from_origin="keep",
)

FOX_PRO = Design(
    key="fox_pro", attention="fox", form="pro", label="fox-pro", name="FoX Pro", colour="#0e7c86",
    summary="FoX's forget gate in the paper's Pro block: k/v shifts, per-head QK-norm, a gated output norm",
    rope=False, bias=ForgetBias, params=FoxParams, from_origin="keep", pro=ProParts,
)
