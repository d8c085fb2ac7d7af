"""Generation with every design, in fp32 and bf16: the KV-cache path (fewer queries than keys) a GPU
takes, timed and checked.

    python -m bench.generation                                   # 350m, 512-token prompt, 32 new tokens
    python -m bench.generation --flavor tiny --prompt 48 --new 8 --designs alibi fox origin+sinks+ssmax

A design may carry modifiers, `<key>+<modifier>...` (`model.<modifier>=true`: sinks, ssmax,
qk_norm), as bench.attention's variants do. Per design and precision (bf16: autocast, as training
runs it): a model at random initialisation (the path is the point, not the text), greedy decoding
over the KV cache (`GPT.stream`: the prompt, then one token per step), then one full forward over
the prompt and the generated tokens, whose logits at the last position must equal the last cached
step's (relative to their largest magnitude: 1e-4 in fp32, 5e-2 in bf16, whose roundings differ
between the two paths). Prints one row each and exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from model import GPT, KVCache, flavor
from model.convert import MODIFIERS
from model.denormals import flush_denormals
from model.designs import DESIGNS

TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def variant(name: str) -> str:
    """A design's key, optionally with modifiers: `origin`, `origin+sinks+ssmax+qk_norm`."""
    key, *modifiers = name.split("+")
    if key not in DESIGNS or not set(modifiers) <= set(MODIFIERS):
        raise argparse.ArgumentTypeError(f"{name!r} is not <design>[+<modifier>...]: designs {', '.join(DESIGNS)}; "
                                         f"modifiers {', '.join(MODIFIERS)}")
    return name


def build(name: str, args, device: torch.device) -> GPT:
    """The variant's model at random initialisation, built on the device (no CPU copy to move)."""
    torch.manual_seed(0)
    key, *modifiers = name.split("+")
    cfg = flavor(args.flavor, **DESIGNS[key].settings(), **dict.fromkeys(modifiers, True),
                 vocab_size=args.vocab_size, max_seq_len=max(args.prompt + args.new, 8))
    with device:
        return GPT(cfg).eval()


def generate_once(model: GPT, dtype: str, args, device: torch.device) -> tuple[float, float, float]:
    """(prompt seconds, generated tokens per second, relative logit difference cached vs full)."""
    cfg = model.cfg
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt), device=device,
                           generator=torch.Generator(device).manual_seed(1))
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=dtype == "bf16"):
        cache = KVCache(cfg.n_layer)
        _sync(device)
        start = time.perf_counter()
        logits = model(prompt, cache=cache, logits_to_keep=1)[:, -1]
        _sync(device)
        prompt_s = time.perf_counter() - start
        tokens = [logits.argmax(-1)]
        start = time.perf_counter()
        for _ in range(args.new - 1):
            logits = model(tokens[-1][:, None], cache=cache)[:, -1]
            tokens.append(logits.argmax(-1))
        _sync(device)
        per_s = (args.new - 1) / (time.perf_counter() - start)
        full = model(torch.cat([prompt, *(t[:, None] for t in tokens[:-1])], dim=1), logits_to_keep=1)[:, -1]
    difference = ((logits.float() - full.float()).abs().max() / full.float().abs().max()).item()
    return prompt_s, per_s, difference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="350m")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--designs", nargs="+", type=variant, default=list(DESIGNS), metavar="DESIGN",
                        help="design keys, each optionally +modifiers (default: every design)")
    parser.add_argument("--dtypes", nargs="+", choices=list(TOLERANCE), default=list(TOLERANCE))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.new < 2:
        parser.error("--new must be at least 2 (one step after the prompt)")
    flush_denormals()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{args.flavor}, prompt {args.prompt}, {args.new} new tokens, greedy, batch 1, {name}\n")
    print("| design | dtype | prompt ms | tokens/s | cached vs full logits | ok |\n|---|---|---|---|---|---|")
    failed = 0
    for design in args.designs:
        model = build(design, args, device)
        for dtype in args.dtypes:
            prompt_s, per_s, difference = generate_once(model, dtype, args, device)
            ok = difference <= TOLERANCE[dtype]
            failed += not ok
            print(f"| {design} | {dtype} | {prompt_s * 1e3:.1f} | {per_s:.1f} | {difference:.1e} | "
                  f"{'yes' if ok else 'NO'} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
