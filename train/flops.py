"""Model FLOPs per token and device peak FLOP/s, the two halves of MFU.

The peak comes from a table of dense bf16/fp16 (and fp32) tensor throughput per device, never a
constant for one GPU; unknown devices (and the CPU) have none unless the user gives one. Needs
only torch, so the benchmarks run where the training stack is not installed.
"""

from __future__ import annotations

from typing import Optional

import torch

from model.config import ModelConfig, count_parameters

# Peak dense FLOP/s per device for 16-bit and 32-bit (TF32 where the device has it) math.
# Matched as substrings of torch.cuda.get_device_name(), most specific first.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 378e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}),
    ("GH200", {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "fp32": 1100e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
    ("A800", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12}),
    ("A6000", {"bf16": 155e12, "fp16": 155e12, "fp32": 77e12}),
    ("A10G", {"bf16": 70e12, "fp16": 70e12, "fp32": 35e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12}),
    ("RTX 4090", {"bf16": 165e12, "fp16": 165e12, "fp32": 83e12}),
    ("V100", {"bf16": 0.0, "fp16": 125e12, "fp32": 15.7e12}),
    ("MI300X", {"bf16": 1307e12, "fp16": 1307e12, "fp32": 163e12}),
    ("MI250X", {"bf16": 383e12, "fp16": 383e12, "fp32": 47.9e12}),
]


def device_peak_flops(precision: str, override: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of this process's device at `precision`, or None when unknown."""
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, peaks in PEAK_FLOPS:
        if key in name:
            return peaks.get(precision) or None
    return None


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward + backward) plus attention scores.

    Matmul weights are the non-embedding parameters and the LM head (the input embedding is a
    lookup); attention adds 12 * layers * width * length (PaLM, appendix B). For arch=llama the
    count has SwiGLU's three matrices and k/v of n_kv_head heads (`count_parameters`); the score
    term is per query head, so grouped-query attention leaves it unchanged.
    """
    matmul_params = count_parameters(cfg)["non_embedding"] + cfg.vocab_size * cfg.n_embd
    return 6.0 * matmul_params + 12.0 * cfg.n_layer * cfg.n_embd * seq_len
