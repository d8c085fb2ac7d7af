"""A 16K-token forward of the tiny model needs far less memory than one N x N score matrix.

Peak memory is the growth of the peak resident set of a fresh subprocess over the 16K forward: after
short warm-up forwards (which also compile what needs compiling) the kernel's peak mark is reset
(Linux /proc/self/clear_refs) and VmHWM is read after the forward, as `bench.attention` does.

The subprocess runs in the bench's memory environment (`WORKER_ENV`: glibc's mmap threshold fixed at
1 MiB), so the resident set follows the live tensors. With glibc's default threshold (adapting up to
32 MiB) freed blocks stay in per-thread heaps, and the same forward read anywhere from 266 to 431 MiB
across runs and CPUs; fixed, it reads the same to the MiB.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.attention import WORKER_ENV

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")

ROOT = Path(__file__).resolve().parents[1]
N = 16384

SCRIPT = """
import json, sys
import torch
from bench.attention import peak_rss, reset_peak_rss
from model import GPT, flavor

attention, form, n, name = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
model = GPT(flavor(name, attention=attention, design_params={"coca": {"form": form}})).eval()
idx = torch.randint(0, model.cfg.vocab_size, (1, n + 1))
with torch.no_grad():
    for warm in (256, 1024, 2048):  # ALiBi: compiles FlexAttention (static, then dynamic shapes) here
        model.token_losses(idx[:, :warm], idx[:, 1 : warm + 1])
    before = reset_peak_rss()
    losses = model.token_losses(idx[:, :-1], idx[:, 1:])
print(json.dumps(dict(peak_bytes=peak_rss() - before, heads=model.cfg.n_head,
                      finite=bool(torch.isfinite(losses).all()))))
"""


def peak_forward_memory(attention: str, form: str, name: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, attention, form, str(N), name],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
        env=WORKER_ENV,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "attention, form, name",
    [
        ("coca", "slack", "tiny"),  # Origin and Strict run the same SDPA kernel (see bench/attention.py)
        ("coca", "slack", "llama_tiny"),  # grouped-query attention: SDPA's enable_gqa, no N x N fallback
        pytest.param("alibi", "slack", "tiny", marks=pytest.mark.slow),  # compiled FlexAttention on CPU
    ],
)
def test_16k_forward_memory_is_far_below_a_score_matrix(attention, form, name):
    result = peak_forward_memory(attention, form, name)
    score_matrices = N * N * 4 * result["heads"]  # float32 scores of one layer, all heads
    print(f"{name} {attention}-{form}: peak {result['peak_bytes'] / 2**20:.0f} MiB vs {score_matrices / 2**20:.0f} MiB")
    assert result["finite"]
    assert result["peak_bytes"] < score_matrices / 10
