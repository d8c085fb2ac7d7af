"""How far checkpoints are from retrieving the passkey: finer than the all-or-nothing passkey score.

For held-out passkey cases at one length, prints per checkpoint the mean log-probability the model
gives each key token under teacher forcing (uniform over the 10 digits: -2.30), the fraction of key
tokens that are the argmax, and the passkey accuracy (every key token right). The study's training
bar (docs/RESULTS.md: the steps each run took to it) is read from this table, so its cases come from
the `bar` stream of `data.tasks`, seeded by the run's own seed: other generators and other keys than
the final evaluation's (`python -m eval`, stream `eval`), never a key or a (key, depth) pair of it.

    python -m bench.passkey_progress runs/a/checkpoints/step_* runs/b --length 256 --cases 30
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from data.tasks import PasskeyCase, make_cases
from eval.bar import table_header, table_row
from eval.passkey import answer_logits
from model.denormals import flush_denormals
from train.checkpoint import CheckpointError
from train.load import load_model


def bar_cases(tokenizer, length: int, n_cases: int, seed: int) -> list[PasskeyCase]:
    """The bar's cases for a run of training seed `seed` (the EOS prefix of every training document)."""
    return make_cases(tokenizer, length, n_cases, seed, prefix=[tokenizer.eos_id], stream="bar")


@torch.inference_mode()
def progress(path: str, length: int, n_cases: int, seed: int | None, batch_tokens: int = 16384) -> dict:
    """Key-token log-prob, key-token accuracy and passkey accuracy of one checkpoint; `seed` None:
    the run's training seed."""
    model, train_cfg, tok = load_model(path)
    cases = bar_cases(tok, length, n_cases, train_cfg.seed if seed is None else seed)
    logp = right = whole = count = 0.0
    for case, logits in zip(cases, answer_logits(model, cases, batch_tokens)):
        lp = torch.log_softmax(logits.float(), dim=-1)
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
    parser.add_argument("--seed", type=int, default=None, help="prompt seed (default: the run's training seed)")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="tokens per forward (1: one case each)")
    args = parser.parse_args(argv)
    flush_denormals()  # first: OpenMP's workers inherit it (model/denormals.py)
    if args.batch_tokens < 1:
        parser.error(f"--batch-tokens {args.batch_tokens} must be >= 1")
    print("\n".join(table_header(args.cases, args.length)))
    for path in args.checkpoints:
        try:
            r = progress(path, args.length, args.cases, args.seed, args.batch_tokens)
        except (CheckpointError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
        name = f"{Path(path).parent.parent.name}/{Path(path).name}"
        print(table_row(name, r["logp"], r["token_acc"], r["passkey"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
