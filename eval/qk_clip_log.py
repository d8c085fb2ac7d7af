"""How often QK-clip fired in a run, from its training log (`optim.qk_clip`, train/qk_clip.py):

    python -m eval.qk_clip_log docs/results/qk_clip/*_clip_s* [--out qk_clip_log.csv]

A run logs `qk_max_logit/<layer>` and `qk_clipped/<layer>` (heads rescaled) at every step where a
head was clipped and at every `logger.log_every` step, so the steps a layer was clipped at are
exactly its records with `qk_clipped/<layer>` > 0. Per run and layer: the run's steps, the steps
clipped, the heads clipped per step on average, the first and last step clipped, and the largest
logit logged (measured after an update, before that step's clip brings the head back to the
threshold: it can exceed the threshold).
Reads a run folder's `metrics.jsonl` or its published `metrics.jsonl.gz`. Exit 0; 1 for a run
without a training log or without QK-clip records; 2 for a wrong command line.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from data.cli import OneLineParser
from data.config import DataError
from errors import exit_code, report_error
from eval.results import result_file, write_csv
from eval.tables import markdown

LAYER = re.compile(r"qk_clipped/(\d+)")


def records(run: Path) -> list[dict]:
    """The run's training log (metrics.jsonl, or the published .gz)."""
    path = result_file(run, "metrics.jsonl")
    if path is None:
        raise DataError(f"{run}: no training log (metrics.jsonl or metrics.jsonl.gz)")
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: line {e.lineno} is not JSON (a training log has one record per line)") from None


def summary(run: Path) -> list[dict]:
    """Per layer of one run: steps, steps clipped, heads clipped per step, first/last step clipped,
    largest logit logged."""
    log = records(run)
    layers = sorted({int(m[1]) for r in log for k in r if (m := LAYER.fullmatch(k))})
    if not layers:
        raise DataError(f"{run}: its training log has no QK-clip records (trained without optim.qk_clip?)")
    steps = max(r["step"] for r in log if "step" in r)
    rows = []
    for layer in layers:
        clip = [r for r in log if f"qk_clipped/{layer}" in r]
        fired = [r["step"] for r in clip if r[f"qk_clipped/{layer}"] > 0]
        rows.append({"run": run.name, "layer": layer, "steps": steps, "steps_clipped": len(fired),
                     "heads_per_step": sum(r[f"qk_clipped/{layer}"] for r in clip) / steps,
                     "first_clipped": fired[0] if fired else None, "last_clipped": fired[-1] if fired else None,
                     "max_logit": max(r[f"qk_max_logit/{layer}"] for r in clip)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m eval.qk_clip_log", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (trained or published)")
    parser.add_argument("--out", type=Path, help="also write the table as CSV")
    args = parser.parse_args(argv)
    try:
        rows = [row for run in args.runs for row in summary(run)]
    except (FileNotFoundError, ValueError) as e:
        return report_error(e, exit_code(e))
    print(markdown(["run", "layer", "steps", "steps clipped", "heads clipped / step", "first", "last",
                    "largest logit"],
                   [[r["run"], r["layer"], r["steps"], r["steps_clipped"], f"{r['heads_per_step']:.3f}",
                     r["first_clipped"] or "-", r["last_clipped"] or "-", f"{r['max_logit']:.2f}"] for r in rows]))
    if args.out:
        write_csv(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
