"""Wall time of one training step under Muon against AdamW, on the study model on the CPU.

The model, batch and length are `experiment=study_origin`'s (2 layers, width 128, 256 tokens, batch
16); each optimizer is the one `train.engine.build_optimizer` builds. Steps alternate between the
two optimizers (each on its own copy of the model) so that both see the same machine load, and the
medians are compared: the whole step (forward, backward, optimizer) and the optimizer step alone
(Newton-Schulz's cost).

    OMP_NUM_THREADS=1 python -m bench.optim_step --steps 30
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from model import GPT
from train.config import compose, to_train_config
from train.engine import build_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="study_origin")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    runs = {}
    torch.manual_seed(0)
    model = None
    for name in ("adamw", "muon"):
        cfg = to_train_config(compose([f"experiment={args.experiment}", f"optim={name}"]))
        model = GPT(cfg.model) if model is None else copy.deepcopy(model)
        runs[name] = (model, build_optimizer(model, cfg), {"step": [], "optimizer": []})
    m = cfg.model
    gen = torch.Generator().manual_seed(1)
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, m.vocab_size, (cfg.micro_batch_size, m.max_seq_len + 1), generator=gen)
        for model, optimizer, times in runs.values():
            start = time.perf_counter()
            optimizer.zero_grad()
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            before = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            if i >= args.warmup:
                times["step"].append(end - start)
                times["optimizer"].append(end - before)
    medians = {name: {k: statistics.median(v) for k, v in times.items()} for name, (_, _, times) in runs.items()}
    print(f"{args.experiment}: {m.n_layer} layers, width {m.n_embd}, {m.max_seq_len} tokens x "
          f"{cfg.micro_batch_size} rows, torch threads {torch.get_num_threads()}, {args.steps} steps each")
    for name, med in medians.items():
        print(f"  {name:6s} step {med['step'] * 1e3:8.1f} ms   optimizer {med['optimizer'] * 1e3:7.2f} ms")
    print(f"  Muon / AdamW: step {medians['muon']['step'] / medians['adamw']['step']:.3f}x, "
          f"optimizer {medians['muon']['optimizer'] / medians['adamw']['optimizer']:.2f}x")


if __name__ == "__main__":
    main()
