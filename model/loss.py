"""Cross entropy through the LM head, a chunk of tokens at a time, never holding [tokens, vocab].

Training uses `LinearCrossEntropy`: the gradient of a *summed* loss does not depend on anything
after it except one scalar, so each chunk's gradients (softmax - one-hot, then through the head)
are computed in the forward pass while its logits are at hand, and the backward pass only scales
them. That costs the same three matmuls as an unchunked head, where recomputing the logits in the
backward pass (activation checkpointing) would cost four, and keeps one chunk of logits alive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Logit elements per chunk (tokens per chunk = this // vocab_size): 64 MB of float32 logits, enough
# rows (333 at a 50K vocabulary) for efficient matmuls.
CHUNK_ELEMENTS = 2**24


def chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits in at least float32; the matmul runs in the autocast dtype when autocast is on."""
    return _widen(F.linear(h, weight))


def _widen(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))  # bf16/fp16 -> fp32


def token_losses(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy [N] in at least float32 (0 where the target is -100); no gradient."""
    with torch.no_grad():
        rows = chunk_rows(weight.shape[0])
        return torch.cat([
            F.cross_entropy(_logits(h[i : i + rows], weight), targets[i : i + rows], ignore_index=-100,
                            reduction="none")
            for i in range(0, h.shape[0], rows)
        ])


class LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(h_i @ weight.T, targets_i) over h [N, C], weight [V, C]; targets -100 are ignored."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = chunk_rows(weight.shape[0])
        device = h.device.type
        compute = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                   else torch.promote_types(h.dtype, weight.dtype))  # the dtype F.linear would use
        w = weight.to(compute)  # cast once, not per chunk
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=_widen(weight).dtype, device=weight.device)
        total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        for i in range(0, h.shape[0], rows):
            hc, tc = h[i : i + rows].to(compute), targets[i : i + rows]
            keep = (tc != -100)[:, None]
            safe = tc.masked_fill(tc == -100, 0)[:, None]
            log_probs = torch.log_softmax(_widen(F.linear(hc, w)), dim=-1)
            total -= (log_probs.gather(1, safe) * keep).sum()
            # d(sum CE)/d logits = softmax - one-hot; ignored rows are zeroed through the cheap
            # [tokens, C] factors below rather than the [tokens, V] one.
            grad_logits = log_probs.exp_().scatter_add_(1, safe, torch.full_like(safe, -1.0, dtype=log_probs.dtype))
            grad_logits = grad_logits.to(compute)
            grad_h[i : i + rows] = (grad_logits @ w) * keep
            kept_h = hc * keep
            if grad_w.dtype == compute:
                grad_w.addmm_(grad_logits.t(), kept_h)  # in place: no [V, C] temporary per chunk
            else:
                grad_w += grad_logits.t() @ kept_h  # a 16-bit product, summed in float32
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), (grad_w * grad_out).to(ctx.weight_dtype), None


def linear_cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of h [N, C] through weight [V, C] (a differentiable scalar, >= float32)."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(h, weight, targets)
    return token_losses(h, weight, targets).sum()
