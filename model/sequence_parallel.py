"""Sequence parallelism (DeepSpeed-Ulysses): P consecutive ranks share every row, each holding a
contiguous 1/P of its tokens, and attention sees the whole row through two all-to-alls.

    rank r of P holds tokens [r T/P, (r+1) T/P) of every row, all heads
      position-wise work on the shard, at GLOBAL positions with RoPE tables for the GLOBAL length T
      (embeddings, norms, projections, MLP, the design's q/k transform `Design.qk`, the loss)
      all-to-all sequence -> heads:  q [B, H, T/P, D] -> [B, H/P, T, D]  (k, v: their kv heads)
      the unchanged kernel on this rank's head slice over the whole row: causal or document
        masking (the full row's document ids, gathered), a distance bias with this rank's slice
        of the slopes (`HeadSlopes`)
      all-to-all heads -> sequence:  y [B, H/P, T, D] -> [B, H, T/P, D], then the output projection

Heads never interact inside the kernel, so every design that is a position-wise q/k transform plus
a per-head bias is exact: only positions, the RoPE length, the slopes' heads and the document ids
must be the global ones. Anything a future design adds that needs the whole sequence (a window,
a cumulative sum over keys, a learned per-head bias) belongs after the first all-to-all, with its
per-head parameters sliced like the slopes; anything per token (a gate, a temperature at global
positions) before it.

Grouped-query attention: kv heads are split like query heads when P divides them; when they
divide P (MQA with P=2, say) each is replicated P / n_kv_head times first, so rank r gets the one
kv head its query heads use (DeepSpeed ALST's rule). The KV cache, `capture_qk` and
`logits_to_keep` are single-rank (evaluation and generation never shard a row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .documents import Documents


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


@dataclass(frozen=True)
class HeadSlopes:
    """A design's slopes as the kernel asks for them (`n -> [n]`) on a head slice: heads
    first..first+n-1 of n_head. The bias kernels call the slopes with the heads they are given
    (H/P here), so the slice keeps each head's own slope."""

    slopes_of: Callable[[int], torch.Tensor]
    n_head: int
    first: int

    def __call__(self, n: int) -> torch.Tensor:
        return self.slopes_of(self.n_head)[self.first : self.first + n]


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

    def attention_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         slopes: Optional[Callable[[int], torch.Tensor]], n_head: int):
        """q, k, v of this rank's tokens -> of this rank's heads over the whole row, and the slopes
        of those heads. kv heads fewer than P are replicated first (see the module's docstring)."""
        if k.shape[1] < self.size:
            k, v = (x.repeat_interleave(self.size // x.shape[1], dim=1) for x in (k, v))
        sliced = None if slopes is None else HeadSlopes(slopes, n_head, self.rank * n_head // self.size)
        return self.to_heads(q), self.to_heads(k), self.to_heads(v), sliced


def sequence_refusal(size: int, n_head: int, kv_heads: int, max_seq_len: int) -> Optional[str]:
    """Why a model cannot be split over `size` sequence ranks (None: it can)."""
    if n_head % size:
        return f"model.n_head={n_head} is not divisible by parallel.sequence={size}: use a P that divides {n_head}"
    if kv_heads % size and size % kv_heads:
        return (f"model.n_kv_head={kv_heads} neither divides nor is divisible by parallel.sequence={size} "
                f"(kv heads are split over the ranks, or replicated when fewer): use a P that divides {n_head} "
                f"and is a multiple or a divisor of {kv_heads}")
    if max_seq_len % size:
        return (f"model.max_seq_len={max_seq_len} is not divisible by parallel.sequence={size}: each rank holds "
                f"an equal share of every row; use a multiple of {size}")
    return None


def enable(model: torch.nn.Module, sp: Optional[SequenceParallel]) -> None:
    """Make `model` (a `GPT`) run its training forward on this rank's shard of every row."""
    model.sequence_parallel = sp
    for block in model.h:
        block.attn.sequence_parallel = sp


def gathered(sp: Optional[SequenceParallel], documents: Optional[torch.Tensor]) -> Optional[Documents]:
    """The `Documents` the kernel needs: the whole rows' under sequence parallelism."""
    if documents is None:
        return None
    return Documents(documents if sp is None else sp.documents(documents))
