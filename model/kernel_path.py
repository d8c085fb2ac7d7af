"""Which kernels attention runs, decided in one place (`takes_gpu_path`), and each path's raw call:
the CPU flash kernel's ops (`_FLASH`, called directly by the CPU path's fused kernels) and the GPU
path's compiled FlexAttention (`run_flex`). Forcing the GPU path on a CPU (`model.kernel=flex`) is
how its code is tested without a GPU (docs/GPU.md)."""

from __future__ import annotations

import functools

import torch

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


@functools.cache
def _compiled_flex():
    """FlexAttention compiled whole: a graph break would leave it to torch's dense reference (an
    N x N score matrix) without a word."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, fullgraph=True)


def run_flex(q, k, v, **options) -> torch.Tensor:
    """The GPU path's one call of FlexAttention (`options`: its block_mask, score_mod, enable_gqa),
    compiled: Triton kernels on a GPU, C++ on a CPU, where torch has its forward only."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError("model.kernel=flex on a CPU runs forward only (torch's CPU FlexAttention has no "
                         "backward): use it for evaluation and generation, and train with model.kernel=auto")
    return _compiled_flex()(q, k, v, **options)

