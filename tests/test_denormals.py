"""Subnormals are flushed to zero in every thread of a process that calls `flush_denormals` first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# 2 threads multiply 4M normal floats into the subnormal range; prints the fraction left nonzero.
SCRIPT = """
import sys, torch
from model.denormals import flush_denormals
supported = flush_denormals() if sys.argv[1] == "flush" else True
torch.set_num_threads(2)
y = torch.full((4_000_000,), 1e-30) * 1e-10
print(supported, (y != 0).double().mean().item())
"""


def nonzero_fraction(mode: str) -> tuple[bool, float]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=120, check=True)
    supported, fraction = done.stdout.split()
    return supported == "True", float(fraction)


def test_every_thread_flushes() -> None:
    supported, flushed = nonzero_fraction("flush")
    if not supported:
        pytest.skip("this CPU has no flush-to-zero mode")
    assert nonzero_fraction("keep") == (True, 1.0)  # without it, the products are subnormal
    assert flushed == 0.0  # with it, none is, in the main thread and in OpenMP's worker alike
