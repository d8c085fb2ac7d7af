"""How far back a trained stick-breaking model reads: the keys its kernel visits, and its forward's
time, with the early stop (a chunk ends where every row's stick is used up) and without it, in one run.

    python -m bench.stick_breaking_reach runs/perplexity/stick_breaking_s1 --length 8192

The benchmark's random inputs use their sticks up within a few hundred keys; a trained model's heads
that read far back make their chunks go further. The text: standard-library modules (argparse,
typing, ...), tokenized by the run's tokenizer, the first `--length` tokens.
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch

import model.designs.stick_breaking as sb
from train.load import load_model

TEXT_MODULES = ("argparse", "typing", "dataclasses", "inspect", "pathlib", "json.decoder")


def text(tokens: int, encode) -> list[int]:
    """The first `tokens` tokens of the standard-library modules' source, one after another."""
    ids: list[int] = []
    for name in TEXT_MODULES:
        ids += encode(inspect.getsource(__import__(name, fromlist=["_"])))
        if len(ids) >= tokens:
            return ids[:tokens]
    raise SystemExit(f"error: the modules give {len(ids)} tokens, fewer than --length {tokens}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a stick-breaking run (its latest checkpoint is loaded)")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model, cfg, tokenizer = load_model(args.run)
    if cfg.model.attention != "stick_breaking":
        raise SystemExit(f"error: {args.run} is a {cfg.model.attention} run, not stick_breaking")
    ids = torch.tensor(text(args.length + 1, tokenizer.encode))[None, :-1]
    weights_of, visited = sb._weights, []
    sb._weights = lambda *a: visited.append(a[1].shape[-2]) or weights_of(*a)
    results = {}
    for _ in range(args.repeats):
        for label, block in (("full", 2**62), ("early stop", sb.BLOCK)):
            sb.BLOCK, visited[:] = block, []
            start = time.perf_counter()
            with torch.no_grad():
                model.eval()(ids)
            seconds = time.perf_counter() - start
            results[label] = (min(seconds, results.get(label, (seconds,))[0]), sum(visited))
    full = results["full"]
    print(f"# {args.run}: {args.length} tokens, forward, {torch.get_num_threads()} threads")
    print("| kernel | keys visited | share | forward (s) | time / full |")
    print("|---|---|---|---|---|")
    for label, (seconds, keys) in results.items():
        print(f"| {label} | {keys:,} | {keys / full[1]:.2f} | {seconds:.2f} | {seconds / full[0]:.2f} |")


if __name__ == "__main__":
    main()
