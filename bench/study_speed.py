"""Tokens/s of the CPU study preset through the real trainer: precision, threads, compile, jobs.

Each case is a short `python -m train experiment=study_origin` run (a log line every step); its
speed is the median tokens/s of the steps after the first two (warm-up, compile). The baseline,
fp32 on all cores, runs in the same invocation, so the ratios compare like with like.

    python -m bench.study_speed                 # all cases, about 6 minutes on 2 cores
    python -m bench.study_speed --steps 12 --cases fp32 bf16

Cases: `fp32` (all cores), `bf16` (all cores; bf16 weights as DeepSpeed trains them), `fp32-1t`
(one thread), `compile` (fp32, torch.compile per block), `2x1t` (two one-thread runs at once,
summed: how `launch/reproduce_study.sh` trains with JOBS=2), `fp32-1t-4layers` and
`fp32-1t-8layers` (one thread, the preset at 4 and 8 layers: what a deeper study costs). The last
column is each case's speed against the first case run (fp32 where it runs).

    python -m bench.study_speed --cases fp32-1t fp32-1t-4layers fp32-1t-8layers   # depth's cost
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "fp32": ({"OMP_NUM_THREADS": str(os.cpu_count())}, []),
    "bf16": ({"OMP_NUM_THREADS": str(os.cpu_count())}, ["deepspeed.precision=bf16"]),
    "fp32-1t": ({"OMP_NUM_THREADS": "1"}, []),
    "compile": ({"OMP_NUM_THREADS": str(os.cpu_count())}, ["compile=true"]),
    "2x1t": ({"OMP_NUM_THREADS": "1"}, []),
    "fp32-1t-4layers": ({"OMP_NUM_THREADS": "1"}, ["model.n_layer=4"]),
    "fp32-1t-8layers": ({"OMP_NUM_THREADS": "1"}, ["model.n_layer=8"]),
}


def start(run_dir: Path, steps: int, env: dict, overrides: list[str], experiment: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "train", f"experiment={experiment}", f"run_dir={run_dir}", f"max_steps={steps}",
           "logger.log_every=1", "logger=none", "logger.progress=false", f"eval_every={10**6}", "eval_batches=1",
           f"ckpt_every={10**6}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def speed(proc: subprocess.Popen, run_dir: Path) -> float:
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"training failed: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}")
    rates = [json.loads(line)["tokens_per_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "tokens_per_s" in line]
    return statistics.median(rates[2:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.study_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per case (the first two are not timed)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--experiment", default="study_origin")
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("--steps must be >= 4")
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            env, overrides = CASES[case]
            jobs = 2 if case == "2x1t" else 1
            dirs = [Path(tmp) / f"{case}-{j}" for j in range(jobs)]
            procs = [start(d, args.steps, env, overrides, args.experiment) for d in dirs]
            results[case] = sum(speed(p, d) for p, d in zip(procs, dirs))
            print(f"{case}: {results[case]:.0f} tokens/s", file=sys.stderr, flush=True)
    base_case = "fp32" if "fp32" in results else next(iter(results))
    print(f"| case ({args.experiment}, {os.cpu_count()} cores) | tokens/s | vs {base_case} |")
    print("|---|---|---|")
    for case, rate in results.items():
        print(f"| {case} | {rate:.0f} | {rate / results[base_case]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
