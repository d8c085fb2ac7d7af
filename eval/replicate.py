"""Does a run reproduce? Two evaluations of one training setup and seed (a published run and its
retraining on another machine or after a code change), compared case for case.

    python -m eval.replicate docs/results/study/origin_s1 runs/designs/origin_s1/eval

Passkey: the two must hold the same prompts (scaling, length, depth, key); then every case's
predicted tokens are compared and the cases that differ are listed. Perplexity: the relative
difference per row. Exit status 0 when the two agree, 1 otherwise: with passkey evaluations, when
every passkey prediction agrees; with perplexity alone (the perplexity study's runs), when every
row agrees to `PPL_AGREEMENT` (one model evaluated on two instruction sets differs by about 1e-6:
the float32 forward's rounding; a retraining that is not bitwise the same run differs by more).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from data.config import DataError
from eval.results import load_results

PROMPT = ("scaling", "length", "depth", "key")
PPL_AGREEMENT = 1e-5  # largest relative difference of a perplexity row that counts as the same


def passkey_differences(a: dict, b: dict) -> tuple[int, list[str]]:
    """(cases compared, one line per case whose predictions differ), in the evaluations' first
    mode; a `DataError` if the two do not hold the same prompts in the same order."""
    mode = a["modes"][0]
    if b["modes"][0] != mode or len(a["cases"]) != len(b["cases"]):
        raise DataError(f"the two passkey evaluations differ in mode or case count "
                        f"({mode}, {len(a['cases'])} vs {b['modes'][0]}, {len(b['cases'])})")
    lines = []
    for i, (x, y) in enumerate(zip(a["cases"], b["cases"])):
        if [x[k] for k in PROMPT] != [y[k] for k in PROMPT]:
            raise DataError(f"case {i}: different prompts ({[x[k] for k in PROMPT]} vs {[y[k] for k in PROMPT]})")
        if x[f"{mode}_pred"] != y[f"{mode}_pred"]:
            lines.append(f"case {i} ({x['scaling']}, {x['length']} tokens, key {x['key']}): "
                         f"{x[f'{mode}_pred']} vs {y[f'{mode}_pred']}")
    return len(a["cases"]), lines


def ppl_differences(a: dict, b: dict) -> list[tuple[str, int, float]]:
    """(scaling, length, relative difference of b's perplexity from a's) per row both hold."""
    mine = {(r["scaling"], r["length"]): r["ppl"] for r in a["rows"]}
    return [(r["scaling"], r["length"], r["ppl"] / mine[(r["scaling"], r["length"])] - 1)
            for r in b["rows"] if (r["scaling"], r["length"]) in mine]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="an evaluation folder (a published run or a run's eval/)")
    parser.add_argument("b", type=Path, help="the other one")
    args = parser.parse_args(argv)
    try:
        a, b = load_results(args.a), load_results(args.b)
        if not ({"passkey", "ppl"} & a.keys() & b.keys()):
            raise DataError("the two folders hold no evaluation of the same kind (passkey.json or ppl.json)")
        passkey = "passkey" in a and "passkey" in b
        n, differing = passkey_differences(a["passkey"], b["passkey"]) if passkey else (0, [])
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if passkey:
        print(f"passkey: {n - len(differing)} of {n} cases predict the same tokens")
        for line in differing:
            print(f"  {line}")
    if "ppl" in a and "ppl" in b:
        diffs = ppl_differences(a["ppl"], b["ppl"])
        worst = max(diffs, key=lambda d: abs(d[2]))
        print(f"perplexity: {len(diffs)} rows, largest relative difference {worst[2]:+.2e} "
              f"({worst[0]}, {worst[1]} tokens)")
        if not passkey:
            differing = [d for d in diffs if abs(d[2]) > PPL_AGREEMENT]
            for scaling, length, diff in diffs:
                print(f"  {scaling}, {length} tokens: {diff:+.2e}")
            print(f"{len(diffs) - len(differing)} of {len(diffs)} rows agree to {PPL_AGREEMENT:g}")
    return 0 if not differing else 1


if __name__ == "__main__":
    sys.exit(main())
