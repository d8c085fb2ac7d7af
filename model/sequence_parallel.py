"""Sequence parallelism (DeepSpeed-Ulysses): P consecutive ranks share every row, each holding a
contiguous 1/P of its tokens, and attention sees the whole row through two all-to-alls.

    rank r of P holds tokens [r T/P, (r+1) T/P) of every row, all heads
      position-wise work on the shard, at GLOBAL positions with RoPE tables for the GLOBAL length T
      (embeddings, norms, projections, MLP, the design's q/k transform `Design.qk`, the length
      temperature's scale of q, a gated bias's per-token terms (FoX's log forget gates), the loss;
      FoX Pro's k/v shift, with the previous rank's last token: `previous_token`)
      all-to-all sequence -> heads:  q [B, H, T/P, D] -> [B, H/P, T, D]  (k, v: their kv heads;
        the gated terms [B, H, T/P] -> [B, H/P, T])
      the unchanged kernel on this rank's head slice over the whole row: causal or document
        masking (the full row's document ids, gathered), a sliding window, a score bias
        (`LayerBias`) with this rank's heads of its per-head parameters and global positions
      all-to-all heads -> sequence:  y [B, H/P, T, D] -> [B, H, T/P, D], then the output projection

Heads never interact inside the kernel, so every design of the registry is exact: only positions,
the RoPE length, the bias's heads and the document ids must be the global ones. A new design puts
what needs the whole sequence (a window, a cumulative sum over keys) after the first all-to-all,
with its per-head parameters sliced by `heads`, and what is per token before it.

Grouped-query attention: kv heads are split like query heads when P divides them; when they
divide P (MQA with P=2, say) each is replicated P / n_kv_head times first, so rank r gets the one
kv head its query heads use (DeepSpeed ALST's rule). The KV cache, `capture_qk` and
`logits_to_keep` are single-rank (evaluation and generation never shard a row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


class _Exchange(torch.autograd.Function):
    """all_to_all over the group on dim 0 ([P, ...]: chunk j goes to rank j, chunk i of the result
    came from rank i). The exchange is its own adjoint, so the backward pass is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


@dataclass(frozen=True, eq=False)
class SequenceParallel:
    """This rank's place in its sequence-parallel group: `rank` of `size`, and the process group."""

    group: Any
    size: int
    rank: int

    def span(self, local: int) -> tuple[int, int]:
        """(the global position of this rank's first token, the row's global length)."""
        return self.rank * local, self.size * local

    def documents(self, ids: torch.Tensor) -> torch.Tensor:
        """The full rows' document ids [B, T] from every rank's shard [B, T/P] (ids count EOS over
        the whole row, so each shard's are already global)."""
        parts = [torch.empty_like(ids) for _ in range(self.size)]
        dist.all_gather(parts, ids.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, h, T/P, D] (all of its h heads, this rank's tokens) -> [B, h/P, T, D] (this rank's
        heads, every token)."""
        B, h, t, D = x.shape
        out = _Exchange.apply(x.view(B, self.size, h // self.size, t, D).transpose(0, 1), self.group)
        return out.permute(1, 2, 0, 3, 4).reshape(B, h // self.size, self.size * t, D)

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_heads`: [B, h/P, T, D] -> [B, h, T/P, D]."""
        B, h, T, D = y.shape
        out = _Exchange.apply(y.view(B, h, self.size, T // self.size, D).permute(2, 0, 1, 3, 4), self.group)
        return out.transpose(0, 1).reshape(B, h * self.size, T // self.size, D)

    def previous_token(self, x: torch.Tensor) -> torch.Tensor:
        """The previous rank's last token of x [..., T/P, D], as [..., 1, D] (zeros on rank 0):
        what a token shift (FoX Pro's) reads before this rank's first token. One all-to-all in
        which rank r sends its last token to rank r + 1 and zeros elsewhere (differentiable, as
        `to_heads`). What every rank sends and reads is a function of its x (rank 0 reads the zeros
        rank P - 1 sent it), so every rank's graph holds the exchange and joins its backward."""
        to_next = torch.zeros(self.size, dtype=x.dtype, device=x.device)
        if self.rank + 1 < self.size:
            to_next[self.rank + 1] = 1.0
        sent = to_next.view(-1, *[1] * x.dim()) * x[..., -1:, :]
        return _Exchange.apply(sent, self.group)[self.rank - 1]

    def attention_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, terms: Optional[torch.Tensor],
                         n_head: int):
        """q, k, v (and a gated bias's per-token terms [B, H, T/P]) of this rank's tokens -> of this
        rank's heads over the whole row, and the slice of query heads they are (a bias's per-head
        parameters are taken from it). kv heads fewer than P are replicated first (see the module's
        docstring)."""
        if k.shape[1] < self.size:
            k, v = (x.repeat_interleave(self.size // x.shape[1], dim=1) for x in (k, v))
        first = self.rank * n_head // self.size
        heads = slice(first, first + n_head // self.size)
        if terms is not None:
            terms = self.to_heads(terms[..., None])[..., 0]
        return self.to_heads(q), self.to_heads(k), self.to_heads(v), terms, heads


def sequence_refusal(size: int, n_head: int, kv_heads: int, max_seq_len: int) -> Optional[str]:
    """Why a model cannot be split over `size` sequence ranks, every reason in one line (None: it can)."""
    reasons = []
    if n_head % size:
        reasons.append(f"model.n_head={n_head} is not divisible by parallel.sequence={size}: use a P that divides "
                       f"{n_head}")
    if kv_heads % size and size % kv_heads:
        reasons.append(f"model.n_kv_head={kv_heads} neither divides nor is divisible by parallel.sequence={size} "
                       f"(kv heads are split over the ranks, or replicated when fewer): use a P that divides "
                       f"{n_head} and is a multiple or a divisor of {kv_heads}")
    if max_seq_len % size:
        reasons.append(f"model.max_seq_len={max_seq_len} is not divisible by parallel.sequence={size}: each rank "
                       f"holds an equal share of every row; use a multiple of {size}")
    return "; ".join(reasons) or None


def enable(model: torch.nn.Module, sp: Optional[SequenceParallel]) -> None:
    """Make `model` (a `GPT`) run its training forward on this rank's shard of every row."""
    model.sequence_parallel = sp
    for block in model.h:
        block.attn.sequence_parallel = sp
