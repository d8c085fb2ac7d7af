"""How far checkpoints are from retrieving the passkey: finer than the all-or-nothing passkey score.

For held-out passkey cases at one length (the evaluation's prompts and keys), prints per
checkpoint the mean log-probability the model gives each key token under teacher forcing
(uniform over the 10 digits: -2.30), the fraction of key tokens that are the argmax, and the
passkey accuracy (every key token right). Used to size the CPU study (docs/RESULTS.md).

    python -m bench.passkey_progress runs/a/checkpoints/step_* runs/b --length 256 --cases 30
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from data.tasks import make_cases
from train.checkpoint import CheckpointError
from train.export import load_model


@torch.inference_mode()
def progress(path: str, length: int, n_cases: int, seed: int) -> dict:
    model, _, tok = load_model(path)
    cases = make_cases(tok, length, n_cases, seed, prefix=[tok.eos_id])
    logp = right = whole = count = 0.0
    for case in cases:
        idx = torch.tensor([case.tokens[:-1]])
        lp = torch.log_softmax(model(idx, logits_to_keep=len(case.answer))[0].float(), dim=-1)
        target = torch.tensor(case.answer)
        hits = lp.argmax(dim=-1) == target
        whole += float(hits.all())
        key = torch.tensor([bool(tok.decode([t]).strip()) for t in case.answer])  # not the leading space
        logp += float(lp.gather(1, target[:, None])[key, 0].sum())
        right += float(hits[key].sum())
        count += int(key.sum())
    return {"logp": logp / count, "token_acc": right / count, "passkey": whole / len(cases)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.passkey_progress", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help="run or checkpoint directories")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--cases", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"| checkpoint | key-token log-prob | key-token accuracy | passkey ({args.cases} cases at {args.length}) |")
    print("|---|---|---|---|")
    for path in args.checkpoints:
        try:
            r = progress(path, args.length, args.cases, args.seed)
        except (CheckpointError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
        print(f"| {Path(path).parent.parent.name}/{Path(path).name} | {r['logp']:.2f} | {r['token_acc']:.2f} | {r['passkey']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
