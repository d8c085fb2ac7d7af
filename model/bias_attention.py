"""Attention with a score bias b_h(m, n) (ALiBi, KERPLE, FIRE, FoX): the kernels of a layer's bias
bound to one forward (`LayerBias`, `model.layer_bias`). `bias_attention` picks one: FlexAttention with a score
modification on the GPU path (`model.flex`); on the CPU path the fused flash kernel with the bias
as one more q/k dimension for a separable bias (`_KeyBiasAttention`), its tiled additive mask for
one without per-token terms (`_AdditiveBiasAttention`), else SDPA over chunks of query rows with
the bias computed per chunk (`_chunked_bias`, also the KV-cache steps' kernel on the GPU path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .designs import sink_gradient, sink_mass, sink_row_gradient, with_sinks
from .flex import _flex_bias
from .kernel_path import _FLASH, _FLASH_BACKWARD, _gqa, gpu_sdpa, takes_gpu_path
from .layer_bias import LayerBias

# Query rows per chunk of the bias and window paths: the additive bias is [H, rows, keys]; the fused
# path's float32 error is proportional to it (`_KeyBiasAttention`).
BIAS_CHUNK = 128
# The additive-mask kernel's tile (`_AdditiveBiasAttention`, KERPLE and FIRE): query rows per chunk of
# its backward and keys per tile of both passes, so that its [H, rows, keys] tensors (bias,
# probabilities, score gradient) stay a few MiB at any length and its matmuls are 128 rows deep.
# Chosen with `python -m bench.attention` (README, Benchmarks): whole rows in smaller chunks took
# clearly more time, 1024-key tiles the same time with higher peaks at 2K.
SCORE_ROWS = 128
SCORE_KEYS = 512
# Keys per block in the fused bias kernel's backward (`_KeyBiasAttention`, ALiBi and FoX): a block's
# extended k and v and its key gradients per call are [B, H, keys, D + 1]. Chosen with
# `python -m bench.attention`: blocks of 1024 keys, with the extended copies made per block, gave a
# lower 8K peak than one call over all earlier keys or blocks of 2048, in no more time.
BACKWARD_KEYS = 1024


def _needs_backward(bias: LayerBias, *xs: torch.Tensor) -> bool:
    tensors = [*xs, *bias.module.parameters(), *([bias.terms] if bias.terms is not None else [])]
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def bias_attention(q, k, v, bias: LayerBias, kernel: str = "auto") -> torch.Tensor:
    """Attention with a score bias on the fastest correct kernel available. GPU path: FlexAttention
    with a score modification (O(N) memory) where queries and keys are the same positions; with
    fewer queries than keys (a KV-cache step, the last rows of `logits_to_keep`) SDPA over chunks
    with the bias computed per chunk (`_chunked_bias`: any device, and no compile per cache
    length). CPU path, training and evaluation alike: the fused kernels of `_cpu_bias` (CPU
    FlexAttention has no backward, and in forward it is about half as fast as they are and needs
    a compile per shape)."""
    if not takes_gpu_path(q, kernel):
        return _cpu_bias(q, k, v, bias)
    if q.shape[-2] == k.shape[-2]:
        return _flex_bias(q, k, v, bias)
    return _chunked_bias(q, k, v, bias, gpu=True)


def _cpu_bias(q, k, v, bias: LayerBias) -> torch.Tensor:
    """The CPU kernel of a bias, in float32 or float64: a separable one (ALiBi, FoX) rides the fused
    flash kernel as one more q/k dimension (`_KeyBiasAttention`), one without per-token terms
    (KERPLE, FIRE) as its additive mask (`_AdditiveBiasAttention`); bf16 / fp16 inputs (whose
    rounding of the extra dimension would be too coarse) and any other bias, the exact additive path."""
    if q.dtype in (torch.float32, torch.float64):
        if bias.module.separable:
            values = bias.key_values(k.shape[-2], bias.prefix(), q.device)
            return _KeyBiasAttention.apply(q, k, v, values)
        if bias.terms is None:
            return _AdditiveBiasAttention.apply(q, k, v, bias, None, *bias.module.tensors(bias.heads, q.device))
    return _chunked_bias(q, k, v, bias)


def _extended(x: torch.Tensor, heads: int) -> torch.Tensor:
    """x [B, h, T, D] as [B, heads, T, D + 1] (kv heads repeated for their query heads under GQA)
    with a zero last column: the buffer the extra dimension is written into."""
    B, h, T, D = x.shape
    out = x.new_zeros(B, heads, T, D + 1)
    out.view(B, h, heads // h, T, D + 1)[..., :D].copy_(x[:, :, None])
    return out


def _narrowed(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of `_extended`'s input from its output's: the first D columns, summed over the
    query heads that share a kv head."""
    return _grouped(grad[..., :-1], heads)


def _grouped(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """A gradient [B, H, T, D] per query head summed over the query heads of each of `heads` kv heads."""
    B, H, T, D = grad.shape
    return grad if H == heads else grad.reshape(B, heads, H // heads, T, D).sum(2)


def _chunks(tq: int, offset: int):
    """Per chunk of query rows: (rows, their key positions, the chunk's middle row's position) and
    its two kernel calls, (keys, causal): its own square block under the kernel's (top-left)
    causal mask, then every earlier key unmasked."""
    for start in range(0, tq, BIAS_CHUNK):
        end = min(tq, start + BIAS_CHUNK)
        first, last = offset + start, offset + end
        parts = [(slice(first, last), True)] + ([(slice(0, first), False)] if first else [])
        yield slice(start, end), last, offset + (start + end - 1) // 2, parts


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, part: torch.Tensor,
           part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over some keys (out, lse; None: none yet) and over others (part, part_lse) as
    attention over both: each weighted by its share of the combined log-sum-exp."""
    if out is None:
        return part, part_lse
    both = torch.logaddexp(lse, part_lse)
    return out * (lse - both).exp()[..., None] + part * (part_lse - both).exp()[..., None], both


def _key_blocks(keys: int):
    """The keys in blocks of at most BACKWARD_KEYS, the fused kernel's backward's unit: one block's
    extended k and v and its key gradients per call, [B, H, <= BACKWARD_KEYS, D + 1], not the row's."""
    for start in range(0, keys, BACKWARD_KEYS):
        yield slice(start, min(keys, start + BACKWARD_KEYS))


class _KeyBiasAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(D) + c_h(n) - c_h(m)) v (causal, query i at key position Tk - Tq + i)
    on the fused CPU flash kernel: softmax drops -c_h(m), so q gets a column of ones and k the
    column (c_h(n) - c_h(centre)) sqrt(D) (v a zero one, the kernel wants one head size).

    The centre is the middle row of each chunk of query rows: float32 rounds the column to about
    |c_h(n) - c_h(centre)| 2^-24, which near a row's diagonal, where its probability mass is, is
    at most half a chunk's span of the bias, at any length (far keys carry large values but
    exp(-large) weight). Each chunk is two kernel calls merged by their log-sum-exps; backward
    calls the kernel's backward on the same keys with the merged output and log-sum-exp, block of
    earlier keys by block (`_key_blocks`: the extended copies are a block's, not the whole k and v),
    so nothing is recomputed and only q, k, v (views of the
    projection), c, the output and the log-sum-exps are kept, as for Origin. c's gradient is the
    column's (FoX's gates); the centre is a constant, as the output does not depend on it."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, values: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        B, H, tq, D = q.shape
        scale = D**-0.5
        k_ext, v_ext = _extended(k, H), _extended(v, H)
        out, lse = q.new_empty(B, H, tq, D + 1), q.new_empty(B, H, tq)
        for rows, keys, centre, parts in _chunks(tq, k.shape[-2] - tq):
            q_c = F.pad(q[..., rows, :], (0, 1), value=1.0)
            _write_column(k_ext[..., :keys, :], values, slice(0, keys), centre, scale)
            merged = total = None
            for part, causal in parts:
                o, lse_part = _FLASH(q_c, k_ext[..., part, :], v_ext[..., part, :], 0.0, causal, scale=scale)
                merged, total = _merge(merged, total, o, lse_part)
            out[..., rows, :], lse[..., rows] = merged, total
        mass = None
        if sinks is not None:  # the sink a_h in the kernel's units, a_h + c_h(m) - c_h(centre), per chunk
            first, shifted = k.shape[-2] - tq, torch.empty_like(lse, dtype=values.dtype)
            for rows, _, centre, _ in _chunks(tq, first):
                own = values[..., first + rows.start : first + rows.stop]
                shifted[..., rows] = own - values[..., centre : centre + 1]
            shifted += sinks.to(values.dtype)[:, None]
            out, lse = with_sinks(out, lse, shifted)
            mass = sink_mass(lse, shifted)
        ctx.save_for_backward(q, k, v, values, out, lse, sinks, mass)
        return out[..., :D]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, values, out, lse, sinks, mass = ctx.saved_tensors
        B, H, tq, D = q.shape
        scale, offset = D**-0.5, k.shape[-2] - tq
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        column = q.new_zeros(B, H, k.shape[-2]) if ctx.needs_input_grad[3] else None

        def call(rows: slice, part: slice, centre: int, causal: bool, k_ext: torch.Tensor, v_ext: torch.Tensor):
            """The kernel's backward for query rows `rows` over keys `part` (k_ext, v_ext: their extension)."""
            _write_column(k_ext, values, part, centre, scale)
            q_c, grad_c = F.pad(q[..., rows, :], (0, 1), value=1.0), F.pad(grad[..., rows, :], (0, 1))
            dq, dk, dv = _FLASH_BACKWARD(grad_c, q_c, k_ext, v_ext, out[..., rows, :], lse[..., rows], 0.0, causal,
                                         scale=scale)
            grad_q[..., rows, :] += dq[..., :D]
            grad_k[..., part, :] += _narrowed(dk, k.shape[1])
            grad_v[..., part, :] += _narrowed(dv, v.shape[1])
            if column is not None:
                column[..., part] += dk[..., -1]

        # each block of earlier keys extended once, then every chunk of rows after it
        for block in _key_blocks(k.shape[-2]):
            k_ext, v_ext = _extended(k[..., block, :], H), _extended(v[..., block, :], H)
            for rows, _, centre, parts in _chunks(tq, offset):
                own = parts[0][0]  # the chunk's square block; its earlier keys are those before it
                n = min(block.stop, own.start) - block.start
                if n > 0:
                    call(rows, slice(block.start, block.start + n), centre, False, k_ext[..., :n, :], v_ext[..., :n, :])
        for rows, _, centre, parts in _chunks(tq, offset):  # each chunk's own square block
            part = parts[0][0]
            call(rows, part, centre, True, _extended(k[..., part, :], H), _extended(v[..., part, :], H))
        grad_values = row_sink = None
        if sinks is not None:  # each row's sink logit in the kernel's units, a_h + c_h(m) - c_h(centre)
            row_sink = sink_row_gradient(grad, out[..., :D], mass)
        if column is not None:  # the column is c_h(n) / scale
            grad_values = column.to(torch.float64) / scale
            if row_sink is not None:  # c_h(m) in its row's sink (the centre cancels, as without a sink)
                grad_values[..., offset:] += row_sink.to(torch.float64)
            if values.shape[0] != B:
                grad_values = grad_values.sum(0, keepdim=True)
        if sinks is None:
            return grad_q, grad_k, grad_v, grad_values
        grad_sinks = row_sink.sum(dim=(0, 2)).to(sinks.dtype) if ctx.needs_input_grad[4] else None
        return grad_q, grad_k, grad_v, grad_values, grad_sinks


def _per_query_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v [B, h, T, D] with each kv head repeated for the query heads it serves (GQA)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


class _AdditiveBiasAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(D) + b_h(m, n)) v for a bias that reads no per-token terms (KERPLE, FIRE)
    in fp32 / fp64 on CPU, tile by tile: per chunk of BIAS_CHUNK query rows and tile of about
    SCORE_KEYS keys (`_score_tiles`), the bias (`ScoreBias.causal_block`, from the module's `tensors`,
    inputs here so that their gradients flow to the parameters, `prepared` once per call) and the
    fused flash kernel with it as an additive mask, the tiles merged by log-sum-exp. Only q, k, v,
    the output and the log-sum-exps are kept (as for Origin); backward, per chunk of SCORE_ROWS
    rows and tile, recomputes the bias and runs the softmax backward itself (the kernel's backward
    gives no score gradient, which the bias's tensors need): P = exp(S + b - lse),
    dS = P (dO v^T - rowsum(dO O))."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: LayerBias, sinks: torch.Tensor | None,
                *tensors: torch.Tensor) -> torch.Tensor:
        B, H, tq, D = q.shape
        offset = k.shape[-2] - tq
        ctx.bias = bias
        given = (q, k, v, *tensors)
        k, v = _per_query_head(k, H), _per_query_head(v, H)
        prepared = bias.module.prepared(tensors)
        out, lse = torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(B, H, tq)
        for start in range(0, tq, BIAS_CHUNK):
            end = min(tq, start + BIAS_CHUNK)
            rows, first = slice(start, end), offset + start
            merged = total = None
            for keys in _score_tiles(first, offset + end):
                mask = bias.module.causal_block(bias.heads, first, end - start, keys, bias.start, prepared, q.device,
                                                q.dtype)[None]
                o, lse_tile = _FLASH(q[..., rows, :], k[..., keys, :], v[..., keys, :], 0.0, False, attn_mask=mask,
                                     scale=D**-0.5)
                merged, total = _merge(merged, total, o, lse_tile)
            out[..., rows, :], lse[..., rows] = merged, total
        mass = None
        if sinks is not None:  # attention sinks (`model.sink_attention`): a_h in every row's denominator
            out, lse = with_sinks(out, lse, sinks)
            mass = sink_mass(lse, sinks)
        ctx.save_for_backward(out, lse, sinks, mass, *given)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, lse, sinks, mass, q, k, v, *tensors = ctx.saved_tensors
        kv_heads, module, heads, start = k.shape[1], ctx.bias.module, ctx.bias.heads, ctx.bias.start
        B, H, tq, D = q.shape
        offset, scale = k.shape[-2] - tq, D**-0.5
        k, v = _per_query_head(k, H), _per_query_head(v, H)
        wanted = [t.detach().requires_grad_(need) for t, need in zip(tensors, ctx.needs_input_grad[5:])]
        needed = [t for t in wanted if t.requires_grad]
        with torch.enable_grad():
            prepared = module.prepared(wanted)
        inner = [t for t in prepared if t.requires_grad]  # the tiles' gradients go to these, then to `needed`
        grad_q = torch.empty_like(q)
        grad_k, grad_v = (q.new_zeros(B * H, k.shape[-2], D) for _ in range(2))  # accumulated in place
        grad_inner = [torch.zeros_like(t) for t in inner]
        for begin in range(0, tq, SCORE_ROWS):
            end = min(tq, begin + SCORE_ROWS)
            rows, n, first = slice(begin, end), end - begin, offset + begin
            q_c = q[..., rows, :].reshape(B * H, n, D)
            g_c = grad[..., rows, :].reshape(B * H, n, D)
            q_scaled = q_c * scale
            minus_lse = lse[..., rows, None].neg()
            delta = (grad[..., rows, :] * out[..., rows, :]).sum(-1).view(B * H, n, 1)
            grad_q_c = q.new_zeros(B * H, n, D)
            for keys in _score_tiles(first, offset + end):
                w = keys.stop - keys.start
                with torch.enable_grad():  # at B = 1 the tile comes as b - lse (a design adds it in its pass)
                    values = module.causal_block(heads, first, n, keys, start, prepared, q.device, q.dtype,
                                                 shift=minus_lse[0] if B == 1 else None)
                k_t, v_t = k[..., keys, :].reshape(B * H, w, D), v[..., keys, :].reshape(B * H, w, D)
                # P = exp(b - lse + (q scale) k^T): the scores accumulated onto b - lse, in the tile's
                # own storage (no op of its graph keeps its output)
                p = values.detach() if B == 1 else values.detach() + minus_lse
                p = p.view(B * H, n, w).baddbmm_(q_scaled, k_t.mT).exp_()
                ds = (g_c @ v_t.mT).sub_(delta).mul_(p)  # masked pairs: exp(lowest) = 0
                grad_v[:, keys].baddbmm_(p.mT, g_c)
                del p
                grad_q_c.baddbmm_(ds, k_t)
                grad_k[:, keys].baddbmm_(ds.mT, q_c, alpha=scale)
                if inner:
                    ds = ds.view(B, H, n, w)
                    ds = ds[0] if B == 1 else ds.sum(0)  # the bias is the same in every row of the batch
                    for total, g in zip(grad_inner, torch.autograd.grad(values, inner, ds, materialize_grads=True)):
                        total += g
            grad_q[..., rows, :] = grad_q_c.view(B, H, n, D).mul_(scale)
        grads = iter(torch.autograd.grad(inner, needed, grad_inner, materialize_grads=True) if inner else ())
        grad_k, grad_v = (g.view(B, H, -1, D) for g in (grad_k, grad_v))
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            grad_sinks = sink_gradient(grad, out, mass).to(sinks.dtype)
        return (grad_q, _grouped(grad_k, kv_heads), _grouped(grad_v, kv_heads), None, grad_sinks,
                *(next(grads) if t.requires_grad else None for t in wanted))


def _score_tiles(first: int, keys: int):
    """The keys 0..keys-1 of query rows at first.. in tiles of about SCORE_KEYS (the additive
    kernel's unit in both passes, [B, H, rows, tile] tensors): the earlier keys in blocks, the last
    one running on to the end, so that every row has a key in every tile."""
    starts = range(0, max(first, 1), SCORE_KEYS)
    for a, b in zip(starts, [*starts[1:], keys]):
        yield slice(a, b)


def _write_column(k_ext: torch.Tensor, values: torch.Tensor, part: slice, centre: int, scale: float) -> None:
    """The extra column of k_ext, k extended over the keys `part`: (c_h(n) - c_h(centre)) / scale,
    rounded once from float64."""
    k_ext[..., -1] = (values[..., part] - values[..., centre : centre + 1]) / scale


def _chunked_bias(q, k, v, bias: LayerBias, gpu: bool = False) -> torch.Tensor:
    """SDPA over chunks of query rows with an additive bias [B or 1, H, rows, keys], computed per
    chunk from the bias's parameters (and prefix sums); gpu: the GPU path's SDPA (`gpu_sdpa`).

    With gradients, each chunk is recomputed in the backward pass (activation checkpointing), so
    autograd keeps no per-chunk bias or probabilities: memory stays O(chunk x N), not O(N^2), and
    the bias's parameters get their gradients from the recomputed chunks.
    """
    tq, tk = q.shape[-2], k.shape[-2]
    offset = tk - tq
    grad = _needs_backward(bias, q, k, v)
    prefix = bias.prefix()
    out = []
    for start in range(0, tq, BIAS_CHUNK):
        end = min(tq, start + BIAS_CHUNK)
        keys = offset + end
        f = None if prefix is None else prefix[..., :keys]
        args = (q[..., start:end, :], k[..., :keys, :], v[..., :keys, :], bias, offset + start, f, gpu)
        out.append(checkpoint(_bias_rows, *args, use_reentrant=False) if grad else _bias_rows(*args))
    return torch.cat(out, dim=-2)


def _bias_rows(q, k, v, bias: LayerBias, first: int, prefix: torch.Tensor | None, gpu: bool) -> torch.Tensor:
    """Attention of query rows first.. over keys 0..first+rows-1 (later keys are masked)."""
    rows, keys = q.shape[-2], k.shape[-2]
    m = torch.arange(first, first + rows, device=q.device)[:, None]
    n = torch.arange(keys, device=q.device)[None, :]
    values = bias.rows(first, rows, keys, prefix, q.device)
    mask = values.to(q.dtype).masked_fill(~(n <= m), torch.finfo(q.dtype).min)
    if gpu:
        return gpu_sdpa(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=_gqa(q, k))
