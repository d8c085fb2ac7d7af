"""FoX, the Forgetting Transformer (Lin et al. 2025, arXiv 2503.02130), its basic layer (not "FoX
Pro"): no positional encoding; a data-dependent forget gate per head and token from the layer's
input x_t (after the block's norm),

    f_t = sigmoid(w_h . x_t + b_h),   b_h(m, n) = sum_{l = n+1}^{m} log f_l = F_m - F_n

with F the running sum of log f: the kernels' `gap` (within a document; KV cache: the gates of
the cached tokens are kept). ALiBi is the special case of a constant gate. As the paper's code, the gate is a
linear layer with a bias (`gate`), initialised as the model's other linears (normal weights, zero
bias), and log f = logsigmoid computed in float32; the gap sums are exact at any length (float64
prefix sums on CPU, float32 hi/lo pairs in FlexAttention: `model.bias_attention`, `model.flex`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Design, ScoreBias
from .learned import wide


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


FOX = Design(
    key="fox", attention="fox", label="fox", name="FoX", colour="#17becf",
    summary="no rotation; a data-dependent forget gate per head: the bias sums log f over the gap",
    rope=False, bias=ForgetBias, from_origin="keep",
)
