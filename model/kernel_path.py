"""Which kernels attention runs, decided in one place (`takes_gpu_path`), and each path's raw call:
the CPU flash kernel's ops (`_FLASH`, called directly by the CPU path's fused kernels), the GPU
path's compiled FlexAttention (`run_flex`) and its SDPA (`gpu_sdpa`). Forcing the GPU path on a CPU
(`model.kernel=flex`) is how its code is tested without a GPU (docs/GPU.md)."""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether k/v have fewer heads than q (grouped-query attention): the kernels' `enable_gqa`."""
    return k.shape[1] != q.shape[1]


def takes_gpu_path(x: torch.Tensor, kernel: str = "auto") -> bool:
    """Whether attention on x takes the GPU path: x is off the CPU (the CPU path calls CPU-only
    ops), or `kernel` (`model.kernel`) is "flex", which forces it on a CPU tensor. The one device
    test of the kernels."""
    return kernel == "flex" or x.device.type != "cpu"


def gpu_sdpa(q, k, v, **options) -> torch.Tensor:
    """SDPA on the GPU path. Grouped-query attention goes as `enable_gqa` only where CUDA has a fused
    kernel for it (flash: fp16 / bf16 without a mask); otherwise k and v are repeated per query
    head first, as CUDA serves `enable_gqa` in fp32 or with a mask only with its math backend (a
    [B, H, Tq, Tk] score tensor: over 100 GiB at 32K with 32 heads)."""
    if _gqa(q, k) and (q.dtype not in (torch.float16, torch.bfloat16) or options.get("attn_mask") is not None):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=_gqa(q, k), **options)


def _flex_call(q, k, v, score_mod, block_mask, enable_gqa):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)


# Below one 128-token tile a CPU runs FlexAttention's dense reference, not inductor's C++ kernel:
# torch 2.13's kernel returns wrong values there on an AVX2 CPU (measured: lengths 24, 40, 56 and 72
# with two threads, and a kernel compiled dynamic at 256 tokens run at 24 with one), while the
# reference is exact and, that short, as cheap.
CPU_DENSE_BELOW = 128


def _dense_flex(q, k, v, score_mod, block_mask, enable_gqa):
    """`_flex_call` uncompiled, on purpose: torch's warning about that is not news here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        return _flex_call(q, k, v, score_mod, block_mask, enable_gqa)


def _compile_errors() -> tuple[type[Exception], ...]:
    """torch's compile errors (inductor's own type where this torch has it). A function, not a
    constant: naming them imports dynamo and inductor, two seconds every CPU process would pay."""
    import torch._dynamo.exc
    import torch._inductor.exc

    return tuple(e for e in (getattr(torch._inductor.exc, "InductorError", None),
                             torch._dynamo.exc.BackendCompilerFailed) if e is not None)


_NOT_DYNAMIC: set[Hashable] = set()  # variants whose dynamic compile inductor could not lower or build


@functools.cache
def _compiled_flex(variant: Hashable, dynamic: bool) -> Callable:
    """FlexAttention compiled for one `variant` (`_variant`), with a code object of its own.

    Dynamo keeps its compiled entries per code object and stops at `recompile_limit` (8 by default)
    of them, and every design's score and mask functions, dtype and grad mode is another entry:
    compiled once for all, one process running every design hit the limit (`FailOnRecompileLimitHit`).
    Here each variant has its own code object, so its entries differ only in the sequence length:
    `dynamic` (every size symbolic from the first call) one or two (a size of 1 is specialised),
    else torch's automatic dynamic shapes, the first length static and then one dynamic entry.
    The batch size is part of the variant, not a dynamic size: inductor's C++ template (the forced
    GPU path on a CPU, torch 2.13) fails to compile FoX's score modification once a batch size
    turns dynamic. fullgraph: a graph break would leave FlexAttention to torch's dense reference
    (an N x N score matrix) without a word; so would a hit limit, which fullgraph makes an error."""
    code = _flex_call.__code__.replace(co_name=f"flex_attention_{abs(hash((variant, dynamic))):x}")
    function = types.FunctionType(code, _flex_call.__globals__, code.co_name)
    return torch.compile(function, fullgraph=True, dynamic=True if dynamic else None)


def _fingerprint(value) -> Hashable:
    """What dynamo specialises on in a score or mask function: its code, the functions and
    constants it closes over, and for tensors their dtype and rank (sizes may vary: dynamic)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.dim(), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(_fingerprint(x) for x in value)
    if isinstance(value, types.FunctionType):
        cells = tuple(_fingerprint(cell.cell_contents) for cell in value.__closure__ or ())
        return (value.__code__, cells) if value.__closure__ else value
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    return type(value)


def _variant(q, k, v, score_mod, block_mask, enable_gqa: bool) -> Hashable:
    """The compile's variant: everything but the sequence lengths (device, dtypes, batch, heads and
    head sizes, the score and mask functions, grad mode and autocast)."""
    device = q.device.type
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device)
    mask = None if block_mask is None else (_fingerprint(block_mask.mask_mod), block_mask.BLOCK_SIZE,
                                            block_mask.kv_num_blocks.shape[0])
    return (device, q.dtype, k.dtype, v.dtype, q.shape[0], q.shape[1], k.shape[1], q.shape[-1], v.shape[-1],
            enable_gqa, _fingerprint(score_mod), mask, grad, autocast)


def run_flex(q, k, v, score_mod=None, block_mask=None, enable_gqa: bool = False) -> torch.Tensor:
    """The GPU path's one call of FlexAttention, compiled per variant (`_compiled_flex`), every size
    dynamic, or with torch's automatic dynamic shapes where inductor cannot compile that: Triton
    kernels on a GPU, C++ on a CPU, where torch has its forward only (and below `CPU_DENSE_BELOW`
    tokens the dense reference)."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError("model.kernel=flex on a CPU runs forward only (torch's CPU FlexAttention has no "
                         "backward): use it for evaluation and generation, and train with model.kernel=auto")
    if q.device.type == "cpu" and min(q.shape[-2], k.shape[-2]) < CPU_DENSE_BELOW:
        return _dense_flex(q, k, v, score_mod, block_mask, enable_gqa)
    variant = _variant(q, k, v, score_mod, block_mask, enable_gqa)
    if variant not in _NOT_DYNAMIC:
        try:
            return _compiled_flex(variant, True)(q, k, v, score_mod, block_mask, enable_gqa)
        except _compile_errors():
            # dynamic where inductor can: on a CPU (torch 2.13) FoX's score modification compiles
            # only with every size dynamic and FIRE's (100 captured tensors) only with the automatic
            # shapes; a variant that fails both raises from the call below
            _NOT_DYNAMIC.add(variant)
    return _compiled_flex(variant, False)(q, k, v, score_mod, block_mask, enable_gqa)
