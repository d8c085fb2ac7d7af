"""Attention benchmark: time and peak memory of each variant, as ratios to Origin, in one run.

    python -m bench.attention                                  # N = 512 .. 16K, train (fwd + bwd)
    python -m bench.attention --lengths 512 1024 2048 --repeats 2 --heads 4
    python -m bench.attention --mode eval                      # forward only, no autograd

Each case is one attention layer (`model.attention.CausalSelfAttention`: fused qkv projection, the
design's q/k transform, the shared kernel, output projection) on random x [B, N, H * D]. Variants:
every design of the registry by its label (origin, alibi, coca-slack, coca-strict, ...: the model's
code), each with a softmax modifier, `<label>+sinks` and `<label>+ssmax` (not run by default), and
`coca-released`, the released CoCA code's formulation written out here as a baseline on
the same projections: it materialises the
N x N score matrix (`contract('bpnd,bpsd,bpnd->bpns', q, rope(t), rope(q))`, a boolean causal-mask
buffer, softmax).

Memory is the peak growth beyond the inputs: on GPU `torch.cuda.max_memory_allocated`; on CPU the
growth of the peak resident set over one run in a fresh subprocess per case, after resetting the
kernel's peak mark (Linux `/proc/self/clear_refs`; the import of torch alone peaks higher than many
cases), with glibc's mmap threshold fixed (`WORKER_ENV`). Time is the best of `--repeats` runs
after a warm-up, the variants timed round-robin in one process (fair on a shared machine).
Cases whose N x N tensors would exceed `--max-gib` are skipped and shown as "-".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

from model.attention import CausalSelfAttention
from model.config import ModelConfig, RopeScaling
from model.denormals import flush_denormals
from model.designs import BY_LABEL, Design, Rope, RopeTables, apply_rope
from model.designs.coca import COCA_SLACK, coca_tie

# glibc's mmap threshold fixed at 1 MiB in the memory workers: every tensor of a MiB or more is its own
# mapping, returned when freed, so the peak tracks the live tensors (with the moving threshold, Origin's
# 8K peak varied from 220 to 330 MiB between runs; fixed: 179-180).
WORKER_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
RELEASED = "coca-released"  # the released CoCA code's formulation (below), on CoCA slack's layer
MODIFIERS = ("sinks", "ssmax", "qk_norm")  # a variant `<label>+<modifier>` switches on `model.<modifier>`
VARIANTS = (*BY_LABEL, RELEASED)
MODIFIED = tuple(f"{label}+{modifier}" for label, d in BY_LABEL.items() if d.softmax for modifier in MODIFIERS)


def released_coca(q, t, v, rope: RopeTables) -> torch.Tensor:
    """The released code's CoCA attention (materialised scores), as the memory baseline."""
    d, n = q.shape[-1], q.shape[-2]
    t = apply_rope(coca_tie(t, d), rope)
    q_rot = apply_rope(q, rope)
    # opt_einsum evaluates 'bpnd,bpsd,bpnd->bpns' as (q * q_rot) @ t^T: an N x N score matrix.
    scores = (q * q_rot) @ t.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # the released `bias` buffer
    scores = torch.where(causal, scores, torch.tensor(torch.finfo(scores.dtype).min, device=q.device))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def released_layer(layer: CausalSelfAttention, x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    B, N, C = x.shape
    q, t, v = layer.qkv(x).view(B, N, layer.n_head, 3, layer.head_dim).transpose(1, 2).unbind(dim=3)
    return layer.proj(released_coca(q, t, v, rope).transpose(1, 2).reshape(B, N, C))


def design(variant: str) -> Design:
    return COCA_SLACK if variant == RELEASED else BY_LABEL[variant.split("+")[0]]


def modifiers(variant: str) -> dict[str, bool]:
    """The softmax modifiers a variant switches on: {"sinks": True} for `origin+sinks`."""
    return dict.fromkeys(variant.split("+")[1:], True)


def build_layer(variant: str, args) -> CausalSelfAttention:
    cfg = ModelConfig(n_head=args.heads, n_embd=args.heads * args.head_dim, **design(variant).settings(),
                      **modifiers(variant))
    return CausalSelfAttention(cfg).to(args.device, getattr(torch, args.dtype))


def materialised_bytes(variant: str, n: int, args) -> int:
    """Rough size of the N x N tensors a case keeps alive (0 when it has none)."""
    per_score = args.batch * args.heads * n * n
    if variant == RELEASED:
        return per_score * (3 * 4 + 1)  # scores, where, softmax (kept for backward) + mask
    if design(variant).bias is not None and args.device == "cpu" and args.mode == "train":
        return per_score * 4 * 2  # CPU fallback: additive bias chunks kept for backward
    return 0


def make_step(variant: str, n: int, args):
    """Inputs for one case and a function running it once (forward, plus backward in train mode)."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    layer = build_layer(variant, args)
    train = args.mode == "train"
    shape = (args.batch, n, args.heads * args.head_dim)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=train)
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    rope = None
    if design(variant).rope:
        width = design(variant).rope_width(args.head_dim) if design(variant).rope_width else args.head_dim
        rope = Rope(width, 10000.0, 512, RopeScaling()).tables(torch.arange(n, device=device), n, dtype)
    inputs = [x, *layer.parameters()] if train else []
    counts = torch.arange(1, n + 1, device=device)  # SSMax's n per query

    def step() -> None:
        with torch.set_grad_enabled(train):
            out = released_layer(layer, x, rope) if variant == RELEASED else layer(x, rope, key_counts=counts)
            if train:
                torch.autograd.grad(out, inputs, grad_out)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def peak_memory(variant: str, n: int, args) -> int:
    """Peak extra memory (bytes) of one run of a case, beyond its inputs and the layer."""
    if args.device == "cuda":
        step = make_step(variant, n, args)
        step()  # warm-up (compiles FlexAttention for a design with a bias)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        return torch.cuda.max_memory_allocated() - base
    # CPU, in a fresh worker process: warm up the same code on small inputs first (library start-up
    # buffers; for a bias design in eval mode, compiling FlexAttention for static and then dynamic
    # shapes), then reset the kernel's peak-RSS mark (VmHWM) and read its growth over one full-size run.
    biased = design(variant).bias is not None
    warm_lengths = (64, 1024, 2048) if biased and args.mode == "eval" else (64,)
    for warm in warm_lengths:
        make_step(variant, warm, args)()
    step = make_step(variant, n, args)
    base = reset_peak_rss()
    step()
    return peak_rss() - base


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> int:
    """Reset the process's peak resident set to the current one (Linux) and return it in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    return _status_bytes("VmHWM")


def best_times(variants: list[str], n: int, args) -> dict[str, float]:
    """Best-of-repeats seconds per variant, timed round-robin in one process so that load from
    other work on a shared machine falls on all variants alike."""
    steps = {v: make_step(v, n, args) for v in variants}
    for step in steps.values():
        step()  # warm-up
    best = dict.fromkeys(variants, math.inf)
    for _ in range(args.repeats):
        for variant, step in steps.items():
            start = time.perf_counter()
            step()
            best[variant] = min(best[variant], time.perf_counter() - start)
    return best


def measure(n: int, args) -> dict[str, dict]:
    """{variant: {time, peak}} at length n, for the variants that fit in --max-gib."""
    variants = [v for v in args.variants if materialised_bytes(v, n, args) <= args.max_gib * 2**30]
    peaks = {}
    for variant in variants:
        if args.device == "cuda":
            peaks[variant] = peak_memory(variant, n, args)
            continue
        cmd = [sys.executable, "-m", "bench.attention", "--worker", variant, str(n)] + worker_flags(args)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=WORKER_ENV)
        if done.returncode:
            raise RuntimeError(f"{variant} at N={n} failed:\n{done.stderr[-2000:]}")
        peaks[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    times = best_times(variants, n, args)
    return {v: dict(time=times[v], peak=peaks[v]) for v in variants}


def worker_flags(args) -> list[str]:
    flags = ["--device", args.device, "--dtype", args.dtype, "--mode", args.mode, "--repeats", str(args.repeats)]
    flags += ["--batch", str(args.batch), "--heads", str(args.heads), "--head-dim", str(args.head_dim)]
    return flags + ["--threads", str(args.threads)] if args.threads else flags


def table(results: dict, lengths: list[int], variants: list[str]) -> str:
    head = "| N | variant | time (ms) | time / origin | peak (MiB) | peak / origin |"
    rows = [head, "|---|---|---|---|---|---|"]
    for n in lengths:
        ref = results.get(("origin", n))
        for variant in variants:
            r = results.get((variant, n))
            if r is None:
                rows.append(f"| {n} | {variant} | - | - | - | - |")
                continue
            t_ratio = f"{r['time'] / ref['time']:.2f}" if ref else "-"
            m_ratio = f"{r['peak'] / ref['peak']:.2f}" if ref and ref["peak"] > 0 else "-"
            rows.append(
                f"| {n} | {variant} | {r['time'] * 1e3:.1f} | {t_ratio} | {r['peak'] / 2**20:.0f} | {m_ratio} |"
            )
    return "\n".join(rows)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + MODIFIED)
    p.add_argument("--mode", choices=("train", "eval"), default="train", help="train: forward + backward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--max-gib", type=float, default=4.0, help="skip cases whose N x N tensors exceed this")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--worker", nargs=2, metavar=("VARIANT", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.repeats < 1 or min(args.lengths) < 1:
        p.error("--repeats and --lengths must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    flush_denormals()  # first: OpenMP's workers inherit it (model/denormals.py)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(peak_memory(args.worker[0], int(args.worker[1]), args)))
        return
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# attention {args.mode}: B={args.batch} H={args.heads} D={args.head_dim} {args.dtype} on {name}")
    results = {}
    for n in args.lengths:
        for variant, r in measure(n, args).items():
            results[(variant, n)] = r
            print(f"  N={n} {variant}: {r}", file=sys.stderr, flush=True)
    print(table(results, args.lengths, args.variants))


if __name__ == "__main__":
    main()
