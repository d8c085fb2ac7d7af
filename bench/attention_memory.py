"""Estimated peak attention memory of one layer's forward on the GPU path, per design, from the
shapes alone (no model is built): what the attention holds at once beside the q, k, v projections
and its output, which every design shares (docs/GPU.md, "Peak attention memory").

    python -m bench.attention_memory                     # the 350M preset, 8K and 32K, batch 1, bf16
    python -m bench.attention_memory --lengths 4096 --batch 2

Counted per design (B rows of T tokens, H heads of D channels, tiles of 128 tokens, activations in
`--bytes` per element; fp32 where the kernels compute wider):
  every design: q, k, v and the output [B, H, T, D] and FlexAttention's / SDPA's log-sum-exp [B, H, T] fp32;
  FlexAttention (a bias, documents, the hybrid's window): the block mask's four index tables [B, 1, tiles, tiles]
    int32 (B = 1 without documents);
  FoX (basic and Pro): the gates [B, H, T] fp32, their prefix sums fp64, and the (hi, lo) pairs twice, fp32;
  stick-breaking: fp32 copies of q and of k and v reversed, an fp32 output, and one chunk's work: four
    [B, H, 64, 256] fp32 score tensors and, with documents, its [B, 64, T] mask and int64 key ends;
  the hybrid before issue 59: its window mask evaluated densely, a [T, T] int64 and a [B, 1, T, T] bool.
Estimates: allocator rounding, fragmentation and autograd's saved tensors in training are not in them.
"""

from __future__ import annotations

import argparse

from model.config import FLAVORS
from model.designs import DESIGNS

TILE = 128
CHUNK, BLOCK = 64, 256  # stick-breaking's chunk of query rows and block of keys (model.designs.stick_breaking)


def attention_bytes(key: str, T: int, B: int, H: int, D: int, size: int, documents: bool,
                    dense_window: bool = False) -> int:
    """Bytes one attention layer holds at once (module docstring) for design `key`."""
    design = DESIGNS[key]
    common = 4 * B * H * T * D * size + B * H * T * 4
    flex = design.bias is not None or design.for_layer is not None or documents
    tiles = -(-T // TILE)
    extra = 4 * (B if documents else 1) * tiles * tiles * 4 if flex and design.attend is None else 0
    if design.bias is not None and design.bias.__name__ == "ForgetBias":
        extra += B * H * T * (4 + 8 + 4 * 4)
    if design.attend is not None:  # stick-breaking
        extra += 4 * B * H * T * D * 4 + 4 * B * H * CHUNK * BLOCK * 4
        if documents:
            extra += B * CHUNK * T * (1 + 8)
    if dense_window:
        extra += T * T * 8 + B * T * T
    return common + extra


def table(lengths: list[int], batch: int, size: int, flavor: str = "350m") -> str:
    shape = FLAVORS[flavor]
    H, D = shape["n_head"], shape["n_embd"] // shape["n_head"]
    head = " | ".join(f"{T // 1024}K{', documents' if docs else ''}" for T in lengths for docs in (False, True))
    rows = [f"| design | {head} |", "|---" * (1 + 2 * len(lengths)) + "|"]

    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"

    for key in DESIGNS:
        cells = [gib(attention_bytes(key, T, batch, H, D, size, docs)) for T in lengths for docs in (False, True)]
        rows.append(f"| {key} | " + " | ".join(cells) + " |")
    cells = [gib(attention_bytes("hybrid", T, batch, H, D, size, docs, dense_window=True))
             for T in lengths for docs in (False, True)]
    rows.append("| hybrid, before (dense window mask) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--bytes", type=int, default=2, help="bytes per activation element (2: bf16)")
    args = parser.parse_args(argv)
    print(table(args.lengths, args.batch, args.bytes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
