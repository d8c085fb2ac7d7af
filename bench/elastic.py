"""What converting a checkpoint for another world size costs, beside saving it.

`train.elastic` converts a ZeRO checkpoint to DeepSpeed's universal format when a run resumes on
another number of ranks, once, rather than writing the universal format at every save. This
measures both on the same engine, in one process (one rank: the conversion's work is per
parameter and state, whatever the number of ranks that wrote them): the median time of a
checkpoint save, and of its conversion, and their ratio.

    python -m bench.elastic                        # model=tiny, ZeRO 2
    python -m bench.elastic --model 125m --zero 3 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, bench/ would come first on the path and this file would shadow the `train` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _one_rank_group() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    from train import distributed as dist

    dist.init()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a model preset (conf/model/)")
    parser.add_argument("--zero", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    _one_rank_group()
    from model import GPT
    from train import checkpoint, elastic
    from train.config import compose, to_train_config
    from train.engine import build_engine

    cfg = to_train_config(compose([f"model={args.model}", f"deepspeed=zero{args.zero}", "micro_batch_size=2",
                                   "batch_size=2", "logger=none"]))
    engine = build_engine(GPT(cfg.model), cfg, 1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 65))
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()  # Adam moments exist
    params = sum(p.numel() for p in engine.module.parameters())
    saves, conversions = [], []
    with tempfile.TemporaryDirectory() as root:
        for step in range(1, args.repeats + 1):
            start = time.perf_counter()
            ckpt = checkpoint.save(engine, root, step, {"step": step}, {}, keep_last=args.repeats)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            elastic.universal_checkpoint(ckpt)
            conversions.append(time.perf_counter() - start)
        size = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    save, convert = statistics.median(saves), statistics.median(conversions)
    print(f"model={args.model} ({params / 1e6:.1f}M parameters), ZeRO {args.zero}, checkpoint {size / 2**20:.0f} MiB")
    print("| save (s) | conversion (s) | conversion / save |")
    print("|---|---|---|")
    print(f"| {save:.2f} | {convert:.2f} | {convert / save:.1f}x |")


if __name__ == "__main__":
    main()
