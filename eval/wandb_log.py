"""Evaluation tables and figures to W&B, as an `eval` job grouped with its training run.

The mode follows the training run's logger (`auto`: online with credentials, else offline; sync
later with `wandb sync <run>/eval/wandb/offline-run-*`); `wandb.mode=disabled` logs nothing.
"""

from __future__ import annotations

import csv
from pathlib import Path

from train.metrics import wandb_mode


def log_to_wandb(cfg, train_cfg, run_dir: Path, out_dir: Path, written: dict[str, list[Path]]) -> str | None:
    """Log every CSV as a table and every PNG as an image; returns the W&B run directory or None.

    A separate W&B run (job_type `eval`, grouped by the training run's name): resuming the
    training run would log at steps below its last one, which W&B drops.
    """
    logger = train_cfg.logger
    mode = wandb_mode(cfg.wandb.mode or logger.wandb)
    if mode == "disabled":
        return None
    import wandb

    run = wandb.init(
        project=cfg.wandb.project or logger.project,
        entity=logger.entity,
        name=f"{run_dir.name}-eval",
        group=run_dir.name,
        job_type="eval",
        dir=str(out_dir),
        mode=mode,
        config={"run": cfg.run, "task": cfg.task, "scalings": list(cfg.scalings), "split": cfg.split},
        reinit="finish_previous",
        settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
    )
    data = {}
    for paths in written.values():
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
