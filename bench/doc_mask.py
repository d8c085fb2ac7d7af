"""Document masking benchmark: time and peak memory of masked vs unmasked attention, in one run.

    python -m bench.doc_mask                            # N = 512, 2K, 8K; fwd + bwd; every attention
    python -m bench.doc_mask --lengths 512 --repeats 2 --attentions origin alibi

Each case is one attention layer (`model.attention.CausalSelfAttention`) on random x [B, N, H * D],
with B = max(1, --tokens / N) so that every length processes the same number of tokens. The masked
case gets rows packed from the stdlib corpus's documents with their real token lengths (the default
tokenizer), as the training stream packs them; the table gives the documents per row. The unmasked
case is today's path (fused `is_causal` SDPA; ALiBi's own kernel).

Time is the best of `--repeats` after a warm-up, masked and unmasked timed round-robin in one
process; memory is the peak growth of one run: on GPU `max_memory_allocated`; on CPU the
resident-set peak of a fresh subprocess (`bench.attention`'s method), the least of
`--memory-repeats`, with glibc's mmap threshold fixed at 1 MiB (`MALLOC_MMAP_THRESHOLD_`) so that
every tensor of a MiB or more is its own mapping, returned to the system when freed, and the peak
tracks the live tensors: masked and unmasked differ by a few MiB, and with glibc's moving
threshold the peak of one case varied by tens of MiB from run to run. Targets: masked / unmasked
at most 1.3x time and 1.1x memory on CPU, 1.1x time on GPU.
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

from bench.attention import peak_rss, reset_peak_rss
from model.attention import CausalSelfAttention
from model.config import ModelConfig, RopeScaling
from model.denormals import flush_denormals
from model.designs import BY_LABEL, Rope
from model.documents import Documents

ATTENTIONS = tuple(BY_LABEL)  # every design of the registry, by label
WORKER_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}  # see the module docstring


def packed_documents(n: int, batch: int, args) -> torch.Tensor:
    """Document ids [batch, n] of rows packed as the training stream packs them (each document
    then its EOS, back to back), from the stdlib train split's documents with their real token
    lengths, in a seeded order from a seeded offset: the first rows of the stream itself may all
    lie inside one long file, which would time nothing but the one-document path."""
    import numpy as np

    from data.config import DataConfig, TokenizerConfig
    from data.sources import open_source, text_of
    from data.tokenizer import get_tokenizer

    sizes = {"vocab_size": args.vocab_size, "sample_docs": args.sample_docs}
    tokenizer = TokenizerConfig(**{key: value for key, value in sizes.items() if value})
    cfg = DataConfig(tokenizer=tokenizer, **({"cache_dir": args.cache_dir} if args.cache_dir else {}))
    tok = get_tokenizer(cfg)
    src = cfg.sources[0]
    lengths = []
    for example in open_source(src, "train", cfg, seed=0):
        lengths.append(len(tok.encode(text_of(example, src))) + 1)
        if sum(lengths) >= 4 * n * batch and len(lengths) >= 50:
            break
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(len(lengths)), rng.permutation(lengths))
    ids = np.concatenate([ids, ids + len(lengths)])  # room for the offset
    start = int(rng.integers(0, len(ids) // 2))
    rows = torch.from_numpy(ids[start : start + n * batch].reshape(batch, n).copy())
    return rows - rows[:, :1]  # ids count from 0 in each row


def make_step(attention: str, masked: bool, n: int, args, documents: torch.Tensor):
    """One case's inputs and a function running forward and backward once."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    design = BY_LABEL[attention]
    cfg = ModelConfig(n_head=args.heads, n_embd=args.heads * args.head_dim, **design.settings(), doc_mask=masked)
    torch.manual_seed(0)
    layer = CausalSelfAttention(cfg).to(device, dtype)
    shape = (documents.shape[0], n, cfg.n_embd)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    rope = None
    if design.rope:
        rope = Rope(cfg.rope_width(), 10000.0, 512, RopeScaling()).tables(torch.arange(n, device=device), n, dtype)
    docs = Documents(documents.to(device)) if masked else None
    inputs = [x, *layer.parameters()]

    def step() -> None:
        torch.autograd.grad(layer(x, rope, documents=docs), inputs, grad_out)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def peak_memory(attention: str, masked: bool, n: int, args, documents: torch.Tensor) -> int:
    """Peak extra bytes of one forward + backward, beyond the inputs and the layer."""
    if args.device == "cuda":
        step = make_step(attention, masked, n, args, documents)
        step()  # warm-up (compiles FlexAttention)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        return torch.cuda.max_memory_allocated() - base
    make_step(attention, masked, 64, args, documents[:, :64])()  # library start-up buffers
    step = make_step(attention, masked, n, args, documents)
    base = reset_peak_rss()
    step()
    return peak_rss() - base


def batch_at(n: int, args) -> int:
    return max(1, args.tokens // n)


def measure(n: int, args) -> dict[tuple[str, bool], dict]:
    documents = packed_documents(n, batch_at(n, args), args)
    cases = [(a, m) for a in args.attentions for m in (False, True)]
    peaks = {}
    for attention, masked in cases:
        if args.device == "cuda":
            peaks[attention, masked] = peak_memory(attention, masked, n, args, documents)
            continue
        cmd = [sys.executable, "-m", "bench.doc_mask", "--worker", attention, str(int(masked)), str(n),
               *worker_flags(args)]
        runs = []
        for _ in range(args.memory_repeats):  # the resident-set peak varies by a few tens of MiB
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=WORKER_ENV)
            if done.returncode:
                raise RuntimeError(f"{attention} masked={masked} at N={n} failed:\n{done.stderr[-2000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        peaks[attention, masked] = min(runs)
    steps = {case: make_step(*case, n, args, documents) for case in cases}
    for step in steps.values():
        step()  # warm-up
    best = dict.fromkeys(cases, math.inf)
    for _ in range(args.repeats):
        for case, step in steps.items():
            start = time.perf_counter()
            step()
            best[case] = min(best[case], time.perf_counter() - start)
    docs_per_row = float((documents[:, -1] - documents[:, 0] + 1).float().mean())
    return {case: dict(time=best[case], peak=peaks[case], docs=docs_per_row) for case in cases}


def worker_flags(args) -> list[str]:
    flags = ["--device", args.device, "--dtype", args.dtype, "--tokens", str(args.tokens)]
    flags += ["--heads", str(args.heads), "--head-dim", str(args.head_dim)]
    flags += ["--vocab-size", str(args.vocab_size), "--sample-docs", str(args.sample_docs)]
    flags += ["--cache-dir", args.cache_dir] if args.cache_dir else []
    return flags + ["--threads", str(args.threads)] if args.threads else flags


def table(results: dict, args) -> str:
    rows = ["| N | B | documents / row | attention | unmasked (ms) | masked (ms) | time ratio "
            "| unmasked (MiB) | masked (MiB) | memory ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n in args.lengths:
        for attention in args.attentions:
            plain, masked = results[n][attention, False], results[n][attention, True]
            mem = f"{masked['peak'] / plain['peak']:.2f}" if plain["peak"] > 0 else "-"
            rows.append(f"| {n} | {batch_at(n, args)} | {plain['docs']:.1f} | {attention} "
                        f"| {plain['time'] * 1e3:.1f} | {masked['time'] * 1e3:.1f} "
                        f"| {masked['time'] / plain['time']:.2f} "
                        f"| {plain['peak'] / 2**20:.0f} | {masked['peak'] / 2**20:.0f} | {mem} |")
    return "\n".join(rows)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--attentions", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-repeats", type=int, default=3, help="CPU: fresh processes per memory figure (min)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per case: batch = tokens / N")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--vocab-size", type=int, default=0, help="the stream's tokenizer size (0: the default)")
    p.add_argument("--sample-docs", type=int, default=0, help="documents it is trained on (0: the default)")
    p.add_argument("--cache-dir", default="", help="data.cache_dir of the stream (default: the default)")
    p.add_argument("--worker", nargs=3, metavar=("ATTENTION", "MASKED", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if min(args.repeats, args.memory_repeats, args.tokens, *args.lengths) < 1:
        p.error("--repeats, --memory-repeats, --lengths and --tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    flush_denormals()  # first: OpenMP's workers inherit it (model/denormals.py)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        attention, masked, n = args.worker[0], bool(int(args.worker[1])), int(args.worker[2])
        print(json.dumps(peak_memory(attention, masked, n, args, packed_documents(n, batch_at(n, args), args))))
        return
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# document masking, fwd + bwd: {args.tokens} tokens a case, H={args.heads} D={args.head_dim} "
          f"{args.dtype} on {name}")
    results = {}
    for n in args.lengths:
        results[n] = measure(n, args)
        print(f"  N={n} done", file=sys.stderr, flush=True)
    print(table(results, args))


if __name__ == "__main__":
    main()
