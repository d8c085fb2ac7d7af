"""Sequence parallelism benchmark: per-rank peak memory and step time of one training step, one
rank on whole rows (P=1) against two ranks each holding half of every row (P=2), in one run.

    python -m bench.sequence_parallel                                  # 4K, 8K, 16K tokens on CPU (gloo)
    python -m bench.sequence_parallel --device cuda --lengths 16384 32768 65536   # >= 2 GPUs (NCCL)

A step is the forward (with the chunked loss), backward and AdamW update of a model where attention
and activations dominate (`--layers` layers of width `--width`, `--heads` heads, Origin, a
512-piece vocabulary, one row). Each P runs in its own processes (P=1 one, P=2 two, over
`torch.distributed` with `model.sequence_parallel`), one torch thread per rank on CPU. Per length:
a warm-up step, then `--repeats` timed steps (the best is kept); memory is the peak growth of the
step beyond what the rank held before it: on CPU the resident-set high-water mark
(`/proc/self/clear_refs`, glibc's mmap threshold fixed at 1 MiB as in `bench.doc_mask`), on GPU
`max_memory_allocated`. Tokens/s per rank is the tokens the rank holds over its step time. On a
shared CPU the wall time of two ranks includes waiting for cores, so the table also gives each
step's CPU time (`time.process_time`, one thread) and the all-to-alls' share: the step's 8 per
layer (q, k, v and the output forward; their gradients backward) timed alone on tensors of q's size.
Targets (the issue's): at 16K, P=2's per-rank peak at most 0.6x P=1's and its tokens/s per rank
within 1.5x of P=1's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time

import torch

from bench.attention import peak_rss, reset_peak_rss
from model import GPT, ModelConfig
from model.denormals import flush_denormals
from model.sequence_parallel import SequenceParallel, enable

WORKER_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20), "OMP_NUM_THREADS": "1"}


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=512, n_layer=args.layers, n_head=args.heads, n_embd=args.width,
                       ffn_hidden=2 * args.width, max_seq_len=max(args.lengths))


def worker(args) -> None:
    """One rank: every length's step time and peak memory growth, as JSON lines on stdout."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    sp = None
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
        sp = SequenceParallel(dist.group.WORLD, world, rank)
    torch.manual_seed(0)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model = GPT(model_config(args)).to(device)
    enable(model, sp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = torch.bfloat16 if cuda else torch.float32

    def step(n: int) -> None:
        rows = torch.randint(0, 512, (1, n + 1), generator=torch.Generator().manual_seed(n)).to(device)
        idx, targets = (x.chunk(world, dim=1)[rank] for x in (rows[:, :-1], rows[:, 1:]))
        with torch.autocast(device.type, dtype=dtype, enabled=cuda):
            loss = model(idx, targets, loss_tokens=float(n))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    step(256 * world)  # library start-up buffers, the optimizer's state
    for n in args.lengths:
        step(n)  # warm-up at this length
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = reset_peak_rss()
        best, cpu = math.inf, math.inf
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            step(n)
            best, cpu = min(best, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
        peak = (torch.cuda.max_memory_allocated() if cuda else peak_rss()) - base
        exchange = exchanges(sp, n, args, device) if sp is not None else 0.0
        print(json.dumps({"rank": rank, "n": n, "seconds": best, "cpu": cpu, "peak": peak, "all_to_all": exchange}),
              flush=True)
    if world > 1:
        dist.destroy_process_group()


def exchanges(sp: SequenceParallel, n: int, args, device: torch.device) -> float:
    """Seconds of one step's all-to-alls (8 per layer, each of a q-sized [1, H, n/P, D] tensor)."""
    q = torch.randn(1, args.heads, n // sp.size, args.width // args.heads, device=device)
    sp.to_heads(q)  # warm-up
    start = time.perf_counter()
    for _ in range(4 * args.layers):
        sp.to_sequence(sp.to_heads(q))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(ranks: int, args) -> list[dict]:
    """Start `ranks` worker processes (one sequence group) and collect their JSON lines."""
    port = str(_free_port())
    flags = ["--device", args.device, "--layers", str(args.layers), "--width", str(args.width), "--heads",
             str(args.heads), "--repeats", str(args.repeats), "--lengths", *map(str, args.lengths)]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.sequence_parallel", "--worker", *flags],
                              env={**WORKER_ENV, "RANK": str(r), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port}, stdout=subprocess.PIPE, text=True)
             for r in range(ranks)]
    lines = [line for proc in procs for line in proc.communicate()[0].splitlines() if line.startswith("{")]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a P={ranks} worker failed (exit codes {[proc.returncode for proc in procs]})")
    return [json.loads(line) for line in lines]


def table(one: list[dict], two: list[dict], args) -> str:
    mib = 2**20
    rows = ["| tokens | P=1 peak MiB | P=2 peak MiB per rank (max) | memory ratio | P=1 step s | P=2 step s "
            "(max rank) | P=1 tokens/s | P=2 tokens/s per rank | per-rank speed ratio | P=1 CPU s | P=2 CPU s "
            "(max rank) | P=2 all-to-all s |", "|" + "---|" * 12]
    for n in args.lengths:
        a = next(r for r in one if r["n"] == n)
        b = [r for r in two if r["n"] == n]
        peak2, secs2 = max(r["peak"] for r in b), max(r["seconds"] for r in b)
        rate1, rate2 = n / a["seconds"], n / 2 / secs2
        rows.append(f"| {n} | {a['peak'] / mib:,.0f} | {peak2 / mib:,.0f} | {peak2 / a['peak']:.2f} | "
                    f"{a['seconds']:.2f} | {secs2:.2f} | {rate1:,.0f} | {rate2:,.0f} | {rate1 / rate2:.2f} | "
                    f"{a['cpu']:.2f} | {max(r['cpu'] for r in b):.2f} | {max(r['all_to_all'] for r in b):.2f} |")
    return "\n".join(rows)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(n % 2 for n in args.lengths) or args.heads % 2:
        parser.error("lengths and --heads must be even (two ranks split rows and heads)")
    if args.device == "cuda" and not args.worker and torch.cuda.device_count() < 2:
        parser.error(f"P=2 needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    flush_denormals()  # first: OpenMP's workers inherit it (model/denormals.py)
    if args.worker:
        worker(args)
        return
    one, two = run(1, args), run(2, args)
    print(f"{args.layers} layers x {args.width} wide, {args.heads} heads, Origin, one row, {args.device}, "
          f"best of {args.repeats}; peak = the step's memory growth per rank")
    print(table(one, two, args))


if __name__ == "__main__":
    main()
