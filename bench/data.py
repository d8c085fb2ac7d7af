"""Data pipeline throughput beside model training consumption (tokens per second).

    python bench/data.py [--seconds 5] [--skip-350m]

Rows: the streaming pipeline on the stdlib corpus (tokenize + pack + loader, 0/1/2 workers),
pre-tokenized memory-mapped shards (one process, i.e. one core), and the measured CPU
training rate (forward + backward + AdamW step) of the `tiny` and `350m` flavors, plus a
FLOPs-based GPU estimate (6 N tokens/s at 40% of an H100's 989 dense bf16 TFLOP/s) for scale.
The machine may be shared: compare rows of the same run, not runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from data.config import DataConfig, SourceConfig  # noqa: E402
from data.loader import build_loader  # noqa: E402
from data.prepare import prepare  # noqa: E402
from data.sources import open_source  # noqa: E402
from data.tokenizer import get_tokenizer  # noqa: E402

SEQ_LEN, BATCH = 1024, 8


def loader_rate(cfg: DataConfig, tok, seconds: float) -> float:
    """Tokens/s delivered by the train loader after its first batch (workers started).

    Run with shuffle_buffer=0 so that no prefilled window inflates the rate (the window
    shuffle itself is one permutation per window: no measurable cost).
    """
    loader = build_loader(cfg, tok, split="train", seq_len=SEQ_LEN, batch_size=BATCH)
    it = iter(loader)
    next(it)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += next(it).numel()
    return n / (time.perf_counter() - t0)


def encode_rate(cfg: DataConfig, tok, seconds: float) -> float:
    """Tokenizer alone (reading + encoding documents), one process."""
    examples = iter(open_source(cfg.sources[0], "train", cfg, seed=0))
    next(examples)  # `datasets` start-up is not throughput
    n, t0 = 0, time.perf_counter()
    for example in examples:
        n += len(tok.encode(example["text"]))
        if time.perf_counter() - t0 > seconds:
            break
    return n / (time.perf_counter() - t0)


def train_rate(name: str, batch: int, steps: int) -> tuple[float, float, int]:
    """(tokens/s measured on CPU, FLOPs-estimated H100 tokens/s, sequence length)."""
    from model import GPT, flavor
    from model.config import count_parameters

    cfg = flavor(name)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len + 1))

    def step() -> None:
        loss = model(x[:, :-1], targets=x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    cpu = batch * cfg.max_seq_len * steps / (time.perf_counter() - t0)
    gpu = 0.4 * 989e12 / (6 * count_parameters(cfg)["total"])
    return cpu, gpu, cfg.max_seq_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measuring time per pipeline row")
    parser.add_argument("--skip-350m", action="store_true", help="skip the (slow on CPU) 350m training row")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    cfg = DataConfig()
    tok = get_tokenizer(cfg)
    rows: list[tuple[str, float, str]] = []
    rows.append(("tokenizer encode (1 process)", encode_rate(cfg, tok, args.seconds), ""))
    for workers in (0, 1, 2):
        c = DataConfig(num_workers=workers, shuffle_buffer=0)
        rows.append((f"stream stdlib, num_workers={workers}", loader_rate(c, tok, args.seconds),
                     f"seq_len={SEQ_LEN} batch={BATCH}"))

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        meta = prepare(cfg, tmp, splits=("train",))
        n = sum(s["tokens"] for s in meta["splits"]["train"]["shards"])
        rows.append(("prepare (one-off tokenization)", n / (time.perf_counter() - t0), f"{n} tokens"))
        shards = DataConfig(sources=[SourceConfig(kind="tokens", path=tmp)], num_workers=0, shuffle_buffer=0)
        rows.append(("pre-tokenized shards, num_workers=0 (1 core)", loader_rate(shards, tok, args.seconds),
                     "global block shuffle"))

    tiny_cpu, tiny_gpu, tiny_t = train_rate("tiny", batch=16, steps=5)
    rows.append(("train tiny: CPU fwd+bwd+AdamW", tiny_cpu, f"batch 16 x {tiny_t}"))
    rows.append(("train tiny: H100 estimate (6N FLOPs/token, 40% MFU)", tiny_gpu, "estimate, not measured"))
    if not args.skip_350m:
        big_cpu, big_gpu, big_t = train_rate("350m", batch=1, steps=1)
        rows.append(("train 350m: CPU fwd+bwd+AdamW", big_cpu, f"batch 1 x {big_t}"))
        rows.append(("train 350m: H100 estimate (6N FLOPs/token, 40% MFU)", big_gpu, "estimate, not measured"))

    stream = max(r[1] for r in rows if r[0].startswith("stream"))
    print(f"\n{'what':<55} {'tokens/s':>12}  notes   ({os.cpu_count()} CPUs, possibly shared)")
    for what, rate, note in rows:
        print(f"{what:<55} {rate:>12,.0f}  {note}")
    print(f"\nbest stream / tiny CPU training = {stream / tiny_cpu:.1f}x (target >= 10x)")


if __name__ == "__main__":
    main()
