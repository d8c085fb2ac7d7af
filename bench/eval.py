"""Evaluation throughput and peak memory at long lengths, per attention design.

    python bench/eval.py [--lengths 2048 8192 32768] [--flavor tiny] [--device cpu]

Each cell runs in a fresh process (peak memory is per process): the `tiny` model (random weights:
speed and memory do not depend on training) reads one window of L tokens the way each task does:
- ppl: `token_losses` (LM head in chunks, no [T, V] logits), as the sliding-window perplexity;
- passkey: the teacher-forced forward (LM head on the 6 key positions only, argmax there).
Columns: tokens/s of the forward, peak memory (CPU: the process's peak RSS, imports included;
GPU: peak allocated), and growth: that peak minus the peak once the model is loaded (on CPU an
under-estimate if the forward needs less than the import peak). The machine may be shared:
compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from model.designs import BY_LABEL  # noqa: E402  (after the path: run as a script)

VARIANTS = tuple(BY_LABEL)  # every design of the registry, by label


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(variant: str, length: int, task: str, flavor_name: str, device: str, repeats: int) -> dict:
    """One measurement, in this process."""
    import torch

    from model import GPT
    from model.config import flavor

    torch.manual_seed(0)
    model = GPT(flavor(flavor_name, **BY_LABEL[variant].settings())).to(device).eval()
    idx = torch.randint(0, model.cfg.vocab_size, (1, length), device=device)
    targets = torch.roll(idx, -1, dims=1)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mb()

    def step() -> None:
        with torch.inference_mode():
            if task == "ppl":
                model.token_losses(idx, targets).sum().item()
            else:
                model(idx, logits_to_keep=6)[0].argmax(-1).tolist()

    step()  # warm-up (FlexAttention compiles on first use)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / repeats
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mb()
    return {"tok_s": length / seconds, "peak_mb": peak, "growth_mb": peak - base}


def measure(variant: str, length: int, task: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, str(length), task,
           "--flavor", args.flavor, "--device", args.device, "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:60]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--tasks", nargs="+", default=["ppl", "passkey"], choices=["ppl", "passkey"])
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--worker", nargs=3, metavar=("VARIANT", "LENGTH", "TASK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        variant, length, task = args.worker
        print(json.dumps(worker(variant, int(length), task, args.flavor, args.device, args.repeats)))
        return
    print(f"flavor {args.flavor}, device {args.device}; peak = process peak RSS (CPU) or peak allocated (GPU)")
    print("| variant | task | length | tokens/s | peak MB | growth MB |")
    print("|---|---|---|---|---|---|")
    for variant in args.variants:
        for task in args.tasks:
            for length in args.lengths:
                r = measure(variant, length, task, args)
                if "error" in r:
                    print(f"| {variant} | {task} | {length} | error: {r['error']} | | |", flush=True)
                else:
                    print(f"| {variant} | {task} | {length} | {r['tok_s']:.0f} | {r['peak_mb']:.0f} | "
                          f"{r['growth_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
