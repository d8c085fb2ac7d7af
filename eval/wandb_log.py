"""Evaluation tables and figures to W&B, as an `eval` job grouped with its training run.

Offline by default (synced later with `wandb sync <run>/wandb/offline-run-*`); `wandb.mode=disabled`
(or a run trained with W&B disabled) logs nothing.
"""

from __future__ import annotations

import csv
from pathlib import Path


def log_to_wandb(cfg, train_cfg, run_dir: Path, out_dir: Path, written: dict[str, list[Path]]) -> str | None:
    """Log every CSV as a table and every PNG as an image; returns the W&B run directory or None."""
    logger = getattr(train_cfg, "logger", None)
    mode = cfg.wandb.mode or getattr(logger, "wandb_mode", None) or "offline"
    if mode == "disabled":
        return None
    import wandb

    project = cfg.wandb.project or getattr(logger, "wandb_project", None) or "coca-lm"
    run = wandb.init(
        project=project,
        name=f"{run_dir.name}-eval",
        group=run_dir.name,
        job_type="eval",
        dir=str(run_dir),
        mode=mode,
        config={"run": cfg.run, "task": cfg.task, "scalings": list(cfg.scalings), "split": cfg.split},
        reinit="finish_previous",
    )
    data = {}
    for task, paths in written.items():
        for path in paths:
            key = f"eval/{path.stem}"
            if path.suffix == ".png":
                data[key] = wandb.Image(str(path))
            elif path.suffix == ".csv":
                with path.open() as f:
                    rows = list(csv.reader(f))
                data[key] = wandb.Table(columns=rows[0], data=rows[1:])
    run.log(data)
    run_path = run.dir
    run.finish()
    return run_path
