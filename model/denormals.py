"""Flush subnormal floats to zero on CPU (the x86 FTZ/DAZ flags; ARM's FZ), for a whole process.

Why: attention probabilities exp(s - lse) are subnormal (below 1.2e-38 in fp32) wherever a score
lies 87 to 104 nats under its row's log-sum-exp, which a position bias reaches at every length
beyond a few hundred keys (ALiBi's shallowest head at 8K: thousands of keys per row). Many x86
CPUs take a microcode assist on each subnormal operand: on an Intel Xeon with AVX-512 and AMX, the
flash kernel's backward made ALiBi's fused path several times slower at 4K than flushed, while
Origin's time did not change (`python -m bench.attention` measures it). Flushed, those terms are
exactly 0: each changes what it is added to by less than 1.2e-38, far below fp32's resolution of
any sum they enter (and fp64's tests compare at 1e-10).

The flag is per thread and a new thread inherits its creator's: set it before the process's first
parallel operation, so that OpenMP's workers start with it (the entry points call this first).
"""

from __future__ import annotations

import torch


def flush_denormals() -> bool:
    """Flush subnormals to zero in this thread and every thread it starts from now on; False where
    the CPU has no such mode (then nothing changes)."""
    return torch.set_flush_denormal(True)
