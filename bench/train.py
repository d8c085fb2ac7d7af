"""Training throughput and peak memory: our GPT beside Hugging Face GPTNeoXForCausalLM.

Same shape (GPT-NeoX config built from our flavor: parallel residual, full rotary, exact GELU,
untied embeddings), same batch, same AdamW step; fp32 on a CPU, bf16 autocast on a GPU. Speed:
both models in one process, their steps interleaved, so a machine whose speed drifts slows both
alike (separate runs on this 2-core machine swung the ratio by +-10%). Peak memory: each model
in its own process. On a GPU it also reports the MFU of the `350m` model at 512 tokens, from the
same FLOPs count and peak table the trainer logs.

    python -m bench.train                      # tiny and 125m, CPU or GPU (or: python bench/train.py)
    python -m bench.train --flavors tiny --steps 30
    python -m bench.train --compile            # ours with compile=true (torch.compile per block)
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
from train.flops import device_peak_flops, flops_per_token  # noqa: E402


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


class Trainee:
    """One implementation's model, optimizer and a fixed batch; `step()` is one optimizer step."""

    def __init__(self, impl: str, name: str, batch: int, seq_len: int, vocab: int, compile: bool):
        torch.manual_seed(0)
        self.cuda = torch.cuda.is_available()
        self.device = "cuda" if self.cuda else "cpu"
        self.impl = impl
        cfg = flavor(name, max_seq_len=seq_len, vocab_size=vocab)
        self.model = (GPT(cfg) if impl == "ours" else hf_model(cfg)).to(self.device).train()
        if compile and impl == "ours":
            self.model.compile_blocks()  # as the trainer's compile=true
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95))
        self.data = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), device=self.device)
        self.step()
        self.step()  # a second warm-up step: compiled code may recompile once after the first

    def step(self) -> None:
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.cuda):
            if self.impl == "ours":
                loss = self.model(self.data[:, :-1], self.data[:, 1:])
            else:
                loss = self.model(input_ids=self.data[:, :-1], labels=self.data[:, :-1]).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.step()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def measure_speed(impls: list[str], name: str, batch: int, seq_len: int, vocab: int, steps: int, compile: bool,
                  queue) -> None:
    """One process, the implementations' steps interleaved (A B B A ...), so that a machine whose
    speed drifts (shared cores, clocks) slows each alike; reports tokens/s from median step times."""
    trainees = [Trainee(impl, name, batch, seq_len, vocab, compile) for impl in impls]
    times: list[list[float]] = [[] for _ in trainees]
    for i in range(steps):
        order = range(len(trainees)) if i % 2 == 0 else reversed(range(len(trainees)))
        for j in order:
            times[j].append(trainees[j].timed_step())
    queue.put([batch * seq_len / statistics.median(t) for t in times])


def measure_memory(impl: str, name: str, batch: int, seq_len: int, vocab: int, compile: bool, queue) -> None:
    """One process per implementation: peak memory (MB) over warm-up and one step."""
    baseline = _rss_mb()
    trainee = Trainee(impl, name, batch, seq_len, vocab, compile)
    if trainee.cuda:
        torch.cuda.reset_peak_memory_stats()
    trainee.timed_step()
    queue.put(torch.cuda.max_memory_allocated() / 2**20 if trainee.cuda
              else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline)


def in_process(target, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavors", nargs="+", default=["tiny", "125m"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--compile", action="store_true", help="compile our blocks (HF stays eager)")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="4096: the stdlib tokenizer's; 50304: the paper presets'")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    # (batch, tokens) per flavor: the trainer's defaults on a CPU, larger batches on a GPU.
    shapes = {"tiny": (64, 128) if cuda else (16, 128), "125m": (16, 512) if cuda else (2, 512),
              "350m": (32, 512) if cuda else (1, 512), "1.3b": (8, 512) if cuda else (1, 512)}
    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores), fp32"
    print(f"device: {device}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
          f"vocabulary {args.vocab_size}; ours {'compiled' if args.compile else 'eager'}\n")
    print("| model | batch x tokens | ours tokens/s | HF GPT-NeoX tokens/s | speed-up | ours peak MB | HF peak MB |")
    print("|---|---|---|---|---|---|---|")
    for name in args.flavors:
        batch, seq_len = shapes[name]
        ours, hf = in_process(measure_speed, ["ours", "hf"], name, batch, seq_len, args.vocab_size, args.steps,
                              args.compile)
        ours_mem, hf_mem = (in_process(measure_memory, impl, name, batch, seq_len, args.vocab_size, args.compile)
                            for impl in ("ours", "hf"))
        print(f"| {name} | {batch} x {seq_len} | {ours:,.0f} | {hf:,.0f} | {ours / hf:.2f}x "
              f"| {ours_mem:,.0f} | {hf_mem:,.0f} |",
              flush=True)
    if cuda:
        batch, seq_len = shapes["350m"]
        (tokens_per_s,) = in_process(measure_speed, ["ours"], "350m", batch, seq_len, args.vocab_size,
                                     max(args.steps, 10), args.compile)
        peak = device_peak_flops("bf16")
        if peak:
            mfu = flops_per_token(flavor("350m", vocab_size=args.vocab_size), seq_len) * tokens_per_s / peak
            print(f"\n350m at {seq_len} tokens, batch {batch}, bf16: {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}")
        else:
            print(f"\n350m: {tokens_per_s:,.0f} tokens/s (device not in the peak-FLOPs table: no MFU)")


if __name__ == "__main__":
    main()
