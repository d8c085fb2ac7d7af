"""Attention sinks (gpt-oss; Xiao et al. 2023's "sink" made a parameter): a learned logit a_h per
head in each layer's softmax denominator, with no value,

    p_mn = exp(s_mn) / (exp(a_h) + sum_{n' allowed} exp(s_mn')),   out_m = sum_n p_mn v_n,

so a query may put mass 1 - sum_n p_mn = exp(a_h - lse'_m) on "nothing" (lse'_m = log(exp(a_h) +
sum exp(s_mn'))). As gpt-oss (transformers' `GptOssAttention.sinks`, `_init_weights`): one
parameter [H] per layer, drawn N(0, init_std). It is a modifier of the softmax, not of the
scores: every design takes it (`model.sinks`).

Two ways to compute it, both here because the exported remote-code model runs them too:
- `with_sinks`: from a kernel's output and log-sum-exp over the keys (out, lse), the sinked ones,
  out * exp(lse - lse') and lse' = logaddexp(lse, a_h); a flash kernel's backward given these two
  is the sinked attention's backward for q, k, v (it reads only P = exp(S - lse') and
  rowsum(dO * out)), and a_h's gradient is `sink_gradient` of the rows' `sink_mass`.
- `sink_attention_rows`: a block of query rows with explicit scores and the sink as one more
  column (any mask, bias or device; memory [B, H, rows, keys]).
"""

from __future__ import annotations

import torch


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, T, D], lse [B, H, T]) of softmax attention over the keys -> the same with the sink
    in the denominator: (out * exp(lse - lse'), lse'), out scaled in place (a kernel's own output:
    no second copy). sinks: a_h [H], or per row [.., H, T] in the kernel's units where its scores
    are shifted by a per-row constant (the fused key-bias kernel's)."""
    sinks = sinks[:, None] if sinks.dim() == 1 else sinks
    total = torch.logaddexp(lse, sinks.to(lse.dtype))
    return out.mul_((lse - total).exp().to(out.dtype)[..., None]), total


def sink_mass(total: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Each row's probability on the sink, exp(a_h - lse') [B, H, T] (sinks as `with_sinks` takes them)."""
    sinks = sinks[:, None] if sinks.dim() == 1 else sinks
    return (sinks.to(total.dtype) - total).exp()


def sink_row_gradient(grad: torch.Tensor, out: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """d loss / d (row m's sink logit) [B, H, T]: the sink's probability times its value's (zero)
    minus the row's expected value under dO, -mass_m (dO_m . out_m). Summed over batch and rows it
    is a_h's gradient; a kernel whose sink is a_h plus a per-row term passes it on to that term."""
    T = out.shape[-2]  # dO . out per row, in blocks of rows: no [B, H, T, D] temporary
    rows = torch.cat([(grad[..., a : a + 256, :] * out[..., a : a + 256, :]).sum(-1) for a in range(0, T, 256)], -1)
    return -mass * rows.to(mass.dtype)


def sink_gradient(grad: torch.Tensor, out: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """d loss / d a_h [H]: `sink_row_gradient` summed over batch and rows."""
    return sink_row_gradient(grad, out, mass).sum(dim=(0, 2))


def sink_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                        allowed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax([q k^T / sqrt(D) + bias, a_h]) without its last column, times v: query rows q [B, H,
    rows, D] over keys k, v [B, kv heads, keys, D] (GQA: query head h reads kv head h // group);
    `allowed` [.., rows, keys] bool, `bias` [.., H, rows, keys]. The softmax runs in float32 at
    least, the scores in q's dtype; a row with no allowed key puts all its mass on the sink."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.mT).to(wide) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias.to(wide)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(wide)[:, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v
