"""Training throughput and peak memory: our GPT beside Hugging Face GPTNeoXForCausalLM.

Same shape (GPT-NeoX config built from our flavor: parallel residual, full rotary, exact GELU,
untied embeddings), same batch, same AdamW step; fp32 on a CPU, bf16 autocast on a GPU. Each
measurement runs in its own process (so peak memory is per model) and the two implementations
alternate, best of `--rounds`, because a shared machine is noisy. On a GPU it also reports the MFU
of the `350m` model at 512 tokens, from the same FLOPs count and peak table the trainer logs.

    python -m bench.train                      # tiny and 125m, CPU or GPU (or: python bench/train.py)
    python -m bench.train --flavors tiny --steps 5 --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path

# Run as a script, bench/ would come first on the path and this file would shadow the `train` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from model import GPT, flavor  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from train.metrics import device_peak_flops, flops_per_token  # noqa: E402


def hf_model(cfg: ModelConfig) -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, intermediate_size=cfg.ffn_hidden, hidden_act="gelu",
        rotary_pct=cfg.rotary_pct, rotary_emb_base=cfg.rope_base, max_position_embeddings=cfg.max_seq_len,
        layer_norm_eps=cfg.layernorm_eps, use_parallel_residual=cfg.parallel_residual,
        tie_word_embeddings=cfg.tie_embeddings, attention_dropout=0.0, hidden_dropout=0.0,
    )
    return GPTNeoXForCausalLM._from_config(config, attn_implementation="sdpa")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(impl: str, name: str, batch: int, seq_len: int, steps: int, queue) -> None:
    """One process: build the model, warm up, time `steps` optimizer steps; report tokens/s, peak MB."""
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cfg = flavor(name, max_seq_len=seq_len)
    baseline = _rss_mb()
    model = (GPT(cfg) if impl == "ours" else hf_model(cfg)).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    data = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), device=device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            if impl == "ours":
                loss = model(data[:, :-1], data[:, 1:])
            else:
                loss = model(input_ids=data[:, :-1], labels=data[:, :-1]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline)
    queue.put((batch * seq_len / statistics.median(times), peak))


def run(impl: str, name: str, batch: int, seq_len: int, steps: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=measure, args=(impl, name, batch, seq_len, steps, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavors", nargs="+", default=["tiny", "125m"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    # (batch, tokens) per flavor: the trainer's defaults on a CPU, larger batches on a GPU.
    shapes = {"tiny": (64, 128) if cuda else (16, 128), "125m": (16, 512) if cuda else (2, 512),
              "350m": (16, 512) if cuda else (1, 512), "1.3b": (8, 512) if cuda else (1, 512)}
    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores), fp32"
    print(f"device: {device}; torch {torch.__version__}; threads {torch.get_num_threads()}\n")
    print("| model | batch x tokens | ours tokens/s | HF GPT-NeoX tokens/s | speed-up | ours peak MB | HF peak MB |")
    print("|---|---|---|---|---|---|---|")
    for name in args.flavors:
        batch, seq_len = shapes[name]
        best = {"ours": (0.0, 0.0), "hf": (0.0, 0.0)}
        for _ in range(args.rounds):
            for impl in ("ours", "hf"):
                result = run(impl, name, batch, seq_len, args.steps)
                if result[0] > best[impl][0]:
                    best[impl] = result
        (ours, ours_mem), (hf, hf_mem) = best["ours"], best["hf"]
        print(f"| {name} | {batch} x {seq_len} | {ours:,.0f} | {hf:,.0f} | {ours / hf:.2f}x | {ours_mem:,.0f} | {hf_mem:,.0f} |",
              flush=True)
    if cuda:
        batch, seq_len = shapes["350m"]
        tokens_per_s, _ = run("ours", "350m", batch, seq_len, max(args.steps, 10))
        peak = device_peak_flops("bf16")
        if peak:
            mfu = flops_per_token(flavor("350m"), seq_len) * tokens_per_s / peak
            print(f"\n350m at {seq_len} tokens, batch {batch}, bf16: {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}")
        else:
            print(f"\n350m: {tokens_per_s:,.0f} tokens/s (device not in the peak-FLOPs table: no MFU)")


if __name__ == "__main__":
    main()
