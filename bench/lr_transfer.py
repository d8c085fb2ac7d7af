"""Learning-rate transfer across widths, with and without muP: a learning-rate sweep at several
widths, each point one real training run (`python -m train`, the stdlib corpus, 2 layers, 8 rows
of 64 tokens a step), scored by its final validation loss. Under the standard parametrization the best learning
rate moves as the model widens; under muP (`model.mup=true`, base width the narrowest) it should stay.

    OMP_NUM_THREADS=1 python -m bench.lr_transfer --runs runs/lr_transfer --out docs/lr_transfer.png --seeds 1 2

Runs already finished in `--runs` are read, not retrained, so an interrupted sweep continues. The
table (markdown) goes to stdout and `<runs>/lr_transfer.csv`; the figure to `--out`.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WIDTHS = (32, 64, 128)
LOG2_LRS = tuple(range(-11, -4))  # 4.9e-4 .. 3.1e-2, one grid step = 2x


def run_name(mup: bool, width: int, log2_lr: int, optimizer: str, seed: int = 1) -> str:
    return f"{optimizer}_{'mup' if mup else 'sp'}_w{width}_lr2e{log2_lr}" + (f"_s{seed}" if seed != 1 else "")


def overrides(mup: bool, width: int, log2_lr: int, optimizer: str, steps: int, run_dir: Path,
              base_width: int = WIDTHS[0], seed: int = 1) -> list[str]:
    """One sweep point: the model at `width` (4 heads, ffn 4x), under muP relative to `base_width`
    or not, everything else fixed (8 rows x 64 tokens a step, warmup 10% then cosine)."""
    lr = 2.0 ** log2_lr
    muon = [f"optim.muon_lr={lr}"] if optimizer == "muon" else []
    return [f"name={run_dir.name}", f"run_dir={run_dir}", f"optim={optimizer}", f"optim.lr={lr}", *muon,
            f"optim.warmup_steps={max(1, steps // 10)}", "model.n_layer=2", "model.n_head=4",
            f"model.n_embd={width}", f"model.ffn_hidden={4 * width}", "model.max_seq_len=64",
            f"model.mup={str(mup).lower()}", f"model.mup_base_width={base_width}", "batch_size=8",
            "micro_batch_size=8", f"max_steps={steps}", f"eval_every={steps}", f"ckpt_every={steps}",
            "eval_batches=16", "logger=none", f"seed={seed}",
            f"data.seed={1233 + seed}"]  # seed 1: the default data order


def final_val_loss(run_dir: Path, steps: int) -> float | None:
    """The validation loss at `steps` in the run's metrics, inf for a run that stopped on a
    non-finite loss (diverged), None for a run not finished."""
    if (run_dir / "DIVERGED").exists():
        return math.inf
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    for line in reversed(metrics.read_text().splitlines()):
        row = json.loads(line)
        if row.get("step") == steps and "val_loss" in row:
            return float(row["val_loss"])
    return None


def train_point(run_dir: Path, args: list[str], steps: int) -> float:
    loss = final_val_loss(run_dir, steps)
    if loss is not None:
        return loss
    result = subprocess.run([sys.executable, "-m", "train", *args], capture_output=True, text=True,
                            env={**os.environ, "WANDB_MODE": "disabled"})
    if result.returncode != 0:
        if "non-finite" in result.stdout + result.stderr:
            (run_dir / "DIVERGED").write_text(result.stderr[-2000:])
            return math.inf
        raise SystemExit(f"{run_dir.name} failed (exit {result.returncode}): {result.stderr.strip()[-1500:]}")
    loss = final_val_loss(run_dir, steps)
    if loss is None:
        raise SystemExit(f"{run_dir.name}: no validation loss at step {steps} in its metrics.jsonl")
    return loss


def plot(rows: list[dict], widths: tuple[int, ...], optimizer: str, out: Path) -> None:
    import matplotlib.pyplot as plt

    from eval.plots import save  # sets matplotlib's file-only backend

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    finite = [r["val_loss"] for r in rows if math.isfinite(r["val_loss"])]
    top = min(max(finite), min(finite) + 2.0)
    for ax, mup in zip(axes, (False, True)):
        for width in widths:
            points = sorted((r["lr"], r["val_loss"]) for r in rows if r["mup"] == mup and r["width"] == width)
            xs = [lr for lr, loss in points if math.isfinite(loss)]
            ys = [min(loss, top) for lr, loss in points if math.isfinite(loss)]
            line, = ax.plot(xs, ys, marker="o", label=f"width {width}")
            best = min(points, key=lambda p: p[1])
            ax.plot([best[0]], [min(best[1], top)], marker="*", markersize=16, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("learning rate (muP: at the base width)" if mup else "learning rate")
        ax.set_title(f"{'muP' if mup else 'standard parametrization'} ({optimizer})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final validation loss, seed mean")
    fig.suptitle("star: each width's best learning rate; a diverged run is not drawn", fontsize=9, y=0.02)
    axes[1].legend()
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    save(fig, out, dpi=110)  # a palette PNG, as every committed figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("runs/lr_transfer"))
    parser.add_argument("--out", type=Path, default=Path("docs/lr_transfer.png"))
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    parser.add_argument("--log2-lrs", type=int, nargs="+", default=list(LOG2_LRS))
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1],
                        help="replicates (training and data-order seed); each point is their mean")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (give each OMP_NUM_THREADS=1)")
    args = parser.parse_args()
    if args.jobs < 1 or args.steps < 1:
        parser.error("--jobs and --steps must be at least 1")
    args.runs.mkdir(parents=True, exist_ok=True)
    # at the base width muP is the standard model: trained once, drawn in both panels
    points = [(mup, w, k, seed) for seed in args.seeds for mup in (False, True) for w in args.widths
              for k in args.log2_lrs if not (mup and w == args.widths[0])]

    def one(point: tuple[bool, int, int, int]) -> dict:
        mup, width, k, seed = point
        run_dir = args.runs / run_name(mup, width, k, args.optimizer, seed)
        loss = train_point(run_dir, overrides(mup, width, k, args.optimizer, args.steps, run_dir, args.widths[0],
                                              seed), args.steps)
        print(f"  {run_dir.name}: val_loss {loss:.4f}", flush=True)
        return {"mup": mup, "width": width, "log2_lr": k, "lr": 2.0 ** k, "seed": seed, "val_loss": loss}

    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(one, points))
    runs += [{**r, "mup": True} for r in runs if not r["mup"] and r["width"] == args.widths[0]]
    with open(args.runs / "lr_transfer.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["mup", "width", "log2_lr", "lr", "seed", "val_loss"])
        writer.writeheader()
        writer.writerows(runs)
    rows = []  # one per point: the mean over seeds (inf if any diverged)
    for key in dict.fromkeys((r["mup"], r["width"], r["log2_lr"]) for r in runs):
        losses = [r["val_loss"] for r in runs if (r["mup"], r["width"], r["log2_lr"]) == key]
        rows.append({"mup": key[0], "width": key[1], "log2_lr": key[2], "lr": 2.0 ** key[2],
                     "val_loss": sum(losses) / len(losses)})
    print(f"\nmean of seeds {', '.join(map(str, args.seeds))}")
    print(f"\n| parametrization | {' | '.join(f'width {w}' for w in args.widths)} |")
    print(f"|---|{'---|' * len(args.widths)}")
    for mup in (False, True):
        best = [min((r for r in rows if r["mup"] == mup and r["width"] == w), key=lambda r: r["val_loss"])
                for w in args.widths]
        cells = " | ".join(f"2^{b['log2_lr']} ({b['val_loss']:.3f})" for b in best)
        shift = best[-1]["log2_lr"] - best[0]["log2_lr"]
        print(f"| {'muP' if mup else 'standard'}: best lr (val loss) | {cells} |  shift {shift:+d} grid steps")
    plot(rows, tuple(args.widths), args.optimizer, args.out)
    print(f"\nfigure: {args.out}")


if __name__ == "__main__":
    main()
