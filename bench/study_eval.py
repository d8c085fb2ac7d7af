"""What one study run's evaluation costs, before and after the study's evaluation settings.

    OMP_NUM_THREADS=1 python -m bench.study_eval runs/study/origin_s1
    python -m bench.study_eval runs/study/origin_s1 --parts after after-unbatched after-2threads

Each part runs the real commands on one trained run, in subprocesses, timed by the wall clock:
`python -m eval run=<run> task=all ...` (ppl, passkey, recall, attention; per-task seconds from the
result JSONs, the rest is loading, prompt building and the report) and the training bar
(`python -m bench.passkey_progress` on every checkpoint, 60 cases at 256).
- before: the pilot study's settings (docs/RESULTS.md; launch/reproduce_study.sh until the
  pre-registered study): ppl on 3 documents, passkey 16 and recall 8 cases per cell at 1x .. 32x,
  RoPE scalings none and dynamic 2 / 4 / 8, the fixed prompts, every case in its own forward;
- after: launch/reproduce_study.sh's settings (`--print-eval`): 100 passkey cases per cell at
  1x .. 32x, ppl on 20 documents, recall 20 cases at 1x .. 4x, scalings none and dynamic 8, the
  run's own prompts, equal-length cases batched (`passkey.batch_tokens`, default 16384 tokens);
- after-unbatched: the same with one case per forward (what batching buys);
- after-2threads: the same on two threads (OMP_NUM_THREADS=2; the study runs two one-thread jobs).
Threads are set per part (`before` and `after` on one thread). The machine may be shared: compare
rows of one invocation.

Measured on runs/study/origin_s1 (1500 steps), 2-core CPU shared with the study's training job
and other engineers' tests; two invocations, seconds:

| run (load) | part | scalings | passkey cases | ppl docs | ppl | passkey | recall | bar | total | s/case |
|---|---|---|---|---|---|---|---|---|---|---|
| 1 (4-6) | before | none, dynamic 2/4/8 | 384 | 3 | 84 | 132 | 77 | 22 | 329 | 0.344 |
| 1 (4-6) | after | none, dynamic 8 | 1200 | 20 | 249 | 303 | 2 | 8 | 577 | 0.252 |
| 2 (1.5-2.3) | before | none, dynamic 2/4/8 | 384 | 3 | 53 | 59 | 38 | 5 | 165 | 0.153 |
| 2 (1.5-2.3) | after | none, dynamic 8 | 1200 | 20 | 170 | 295 | 5 | 11 | 489 | 0.246 |

The study's evaluation of one run: 8.2 minutes on one thread on the quieter machine (9.6 under
load), 3.0x (1.75x under load) the pilot's time for 3.1x the passkey cases and 6.7x the documents.
Per case, batching is no gain on one CPU thread (1.36x and 0.62x, within the load's noise): the
forward is compute-bound (at 8192 tokens, 69% is SDPA's flash kernel, 17% matmuls); it is for
GPUs. torch.compile per block: a 25% faster forward at 2048 and 8192 tokens, but 25-45 s to compile
each new length, more than it saves over six lengths. The time went down by evaluating only the
study's cells (two scalings, not four; recall, untrained in the study, at 1x .. 4x only).

Then the passkey scorer's forward stopped running the last block on positions it does not score
(`logits_to_keep`: the last block's queries and MLP on the answer positions only, the same
logits). Measured on runs/study/origin_s10, an otherwise idle Intel Xeon (AVX-512, AMX), one
invocation at the commit before that change (edff7cd) and one after it, seconds:

| code | part | passkey cases | ppl docs | ppl | passkey | recall | bar | total | s/case |
|---|---|---|---|---|---|---|---|---|---|
| edff7cd | before | 384 | 3 | 36 | 47 | 24 | 5 | 116 | 0.121 |
| edff7cd | after | 1200 | 20 | 125 | 169 | 2 | 5 | 306 | 0.141 |
| last block on kept positions | before | 384 | 3 | 35 | 26 | 13 | 4 | 83 | 0.067 |
| last block on kept positions | after | 1200 | 20 | 122 | 92 | 1 | 4 | 224 | 0.077 |
| last block on kept positions | after-unbatched | 1200 | 20 | 123 | 87 | 1 | 4 | 218 | 0.072 |

The study's evaluation of one run is now 3.7 minutes on one thread here: 1.9x the time of the
pilot's settings on the earlier code for 3.1x the passkey cases and 6.7x the documents, 1.6x
faster per passkey case (0.121 -> 0.077 s). Passkey scoring itself is 1.8x faster (169 -> 92 s);
perplexity, which scores every position, is unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from model.config import upgrade_saved
from model.designs import design_of

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = "[256,512,1024,2048,4096,8192]"
BEFORE_EVAL = (f"ppl.lengths={LENGTHS} ppl.stride=2048 ppl.n_docs=3 passkey.lengths={LENGTHS} "
               f"passkey.n_cases=16 recall.lengths={LENGTHS} recall.n_cases=8 prompt_seed=fixed "
               "passkey.batch_tokens=1 recall.batch_tokens=1")
BEFORE_SCALINGS = "[none,dynamic:2,dynamic:4,dynamic:8]"
TASKS = ("ppl", "passkey", "recall", "attention")
PARTS = ("before", "after", "after-unbatched", "after-2threads")


def study_settings() -> tuple[str, str]:
    """The study's evaluation overrides and scalings, from launch/reproduce_study.sh itself."""
    done = subprocess.run(["bash", "launch/reproduce_study.sh", "--print-eval"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    overrides, scalings = done.stdout.strip().splitlines()
    return overrides, scalings


def part_settings(part: str) -> tuple[list[str], str, int, int]:
    """(eval overrides, scalings, threads, the bar's batch tokens) of one part."""
    if part == "before":
        return BEFORE_EVAL.split(), BEFORE_SCALINGS, 1, 1
    overrides, scalings = study_settings()
    if part == "after-unbatched":
        return overrides.split() + ["passkey.batch_tokens=1", "recall.batch_tokens=1"], scalings, 1, 1
    return overrides.split(), scalings, 2 if part == "after-2threads" else 1, 16384


def timed(cmd: list[str], threads: int) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:4])} ... failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return time.perf_counter() - start


def measure(run: Path, part: str) -> dict:
    overrides, scalings, threads, bar_batch = part_settings(part)
    m = upgrade_saved(OmegaConf.to_container(OmegaConf.load(run / "config.yaml")))["model"]
    if not design_of(m["attention"], m.get("design_params")).rope:
        scalings = "[none]"  # as launch/reproduce_study.sh
    with tempfile.TemporaryDirectory() as out:
        wall = timed([sys.executable, "-m", "eval", f"run={run}", "task=all", f"scalings={scalings}",
                      "progress=false", "wandb.mode=disabled", f"out_dir={out}", *overrides], threads)
        results = {t: json.loads((Path(out) / f"{t}.json").read_text()) for t in TASKS}
    checkpoints = sorted(str(p) for p in (run / "checkpoints").glob("step_*"))
    bar = timed([sys.executable, "-m", "bench.passkey_progress", *checkpoints, "--cases", "60",
                 "--batch-tokens", str(bar_batch)], threads)
    return {"part": part, "threads": threads, "scalings": scalings, "eval": wall, "bar": bar,
            "cases": len(results["passkey"]["cases"]), "docs": results["ppl"]["rows"][0]["documents"],
            **{t: results[t]["seconds"] for t in TASKS}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.study_eval",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a trained study run (runs/study/<design>_s<seed>)")
    parser.add_argument("--parts", nargs="+", default=["before", "after"], choices=PARTS)
    args = parser.parse_args(argv)
    if not (args.run / "config.yaml").exists() or not list((args.run / "checkpoints").glob("step_*")):
        parser.error(f"{args.run} is not a trained run (no config.yaml or checkpoints/step_*)")
    print(f"run {args.run}; seconds of wall clock; passkey cases = cases x lengths x scalings")
    print("| part | threads | scalings | passkey cases | ppl docs | ppl | passkey | recall | attention | "
          "eval total | bar | total | s per passkey case |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for part in args.parts:
        r = measure(args.run, part)
        rows.append(r)
        total = r["eval"] + r["bar"]
        print(f"| {part} | {r['threads']} | {r['scalings']} | {r['cases']} | {r['docs']} | {r['ppl']:.0f} | "
              f"{r['passkey']:.0f} | {r['recall']:.0f} | {r['attention']:.0f} | {r['eval']:.0f} | "
              f"{r['bar']:.0f} | {total:.0f} | {r['passkey'] / r['cases']:.3f} |", flush=True)
    by_part = {r["part"]: r for r in rows}
    if "before" in by_part and "after" in by_part:
        b, a = by_part["before"], by_part["after"]
        print(f"\nafter / before: total {(a['eval'] + a['bar']) / (b['eval'] + b['bar']):.2f}x the time for "
              f"{a['cases'] / b['cases']:.1f}x the passkey cases; per passkey case "
              f"{(b['passkey'] / b['cases']) / (a['passkey'] / a['cases']):.2f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
