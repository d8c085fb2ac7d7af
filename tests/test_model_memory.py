"""A 16K-token forward of the tiny model needs far less memory than one N x N score matrix; on the
GPU path, no tensor grows faster than the length (`test_gpu_path_largest_tensor_grows_linearly`).

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
import torch

from bench.attention import WORKER_ENV
from model.designs import DESIGNS

needs_proc = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")

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


@needs_proc
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


# ---- the GPU path's largest tensor: O(T), never T x T ---------------------------------------------------------

SHORT = 256  # T; the test runs T and 2T (tiles of 128: 2 and 4 per row)
GROWTH = 2.2  # 2x length may at most double the largest tensor (a T x T tensor quadruples)


def _largest(key: str, documents: bool, mode: str, length: int, **overrides) -> tuple[int, str]:
    """The largest tensor (elements) any op makes in a training forward (training mode, gradients
    on) or an evaluation forward (per-token losses, no gradient) of the forced GPU path at `length`,
    documents of 100 tokens where on; FlexAttention as its output (`LargestTensor`)."""
    from bench.gpu_path import VOCAB, LargestTensor, config, eager_flex
    from model import GPT

    torch.manual_seed(0)
    model = GPT(config(key, documents, max_seq_len=length, **overrides))
    idx = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    docs = (torch.arange(length) // 100).expand(2, length) if documents else None
    recorder = LargestTensor()
    with eager_flex(recorder), recorder:
        if mode == "train":
            model.train()(idx, idx.roll(-1, dims=1), documents=docs)
        else:
            model.eval().token_losses(idx, idx.roll(-1, dims=1), documents=docs)
    return recorder.numel, recorder.op


# the fast tier: the paths of their own (window masks, stick-breaking, a gated and an MLP bias, GQA)
FAST = ("hybrid", "stick_breaking", "fox", "fire", "origin+gqa")


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("key", [pytest.param(key, marks=() if key in FAST else pytest.mark.slow)
                                 for key in [*DESIGNS, "origin+gqa"]])
def test_gpu_path_largest_tensor_grows_linearly(key, documents, mode, single_thread):
    """Every design (and fp32 grouped-query attention, arch=llama: k and v repeated per query head,
    not SDPA's math backend) on the forced GPU path, with and without documents: the largest tensor
    of a forward at 2T is at most about twice that at T (the hybrid's window masks were [T, T] and
    [B, 1, T, T]; stick-breaking's document masks B T^2 / 2 in all)."""
    design, *gqa = key.split("+")
    overrides = dict(arch="llama", n_kv_head=1, parallel_residual=False) if gqa else {}
    short, op = _largest(design, documents, mode, SHORT, **overrides)
    long, long_op = _largest(design, documents, mode, 2 * SHORT, **overrides)
    assert long <= GROWTH * short, f"{short} ({op}) at {SHORT} -> {long} ({long_op}) at {2 * SHORT}"
