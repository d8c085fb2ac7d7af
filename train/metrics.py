"""Rank-0 reporting: console progress bar, `metrics.jsonl`, W&B, and model FLOPs utilisation.

MFU = achieved model FLOP/s / the device's peak. The peak comes from a table of dense bf16/fp16
(and fp32) tensor throughput per device, never a constant for one GPU; unknown devices (and the
CPU) report no MFU unless `logger.peak_flops` is set.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from model.config import ModelConfig, count_parameters
from train.config import LoggerConfig

# Peak dense FLOP/s per device for 16-bit and 32-bit (TF32 where the device has it) math.
# Matched as substrings of torch.cuda.get_device_name(), most specific first.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 378e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}),
    ("GH200", {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "fp32": 1100e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
    ("A800", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12}),
    ("A6000", {"bf16": 155e12, "fp16": 155e12, "fp32": 77e12}),
    ("A10G", {"bf16": 70e12, "fp16": 70e12, "fp32": 35e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12}),
    ("RTX 4090", {"bf16": 165e12, "fp16": 165e12, "fp32": 83e12}),
    ("V100", {"bf16": 0.0, "fp16": 125e12, "fp32": 15.7e12}),
    ("MI300X", {"bf16": 1307e12, "fp16": 1307e12, "fp32": 163e12}),
    ("MI250X", {"bf16": 383e12, "fp16": 383e12, "fp32": 47.9e12}),
]


def device_peak_flops(precision: str, override: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of this process's device at `precision`, or None when unknown."""
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, peaks in PEAK_FLOPS:
        if key in name:
            return peaks.get(precision) or None
    return None


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward + backward) plus attention scores.

    Matmul weights are the non-embedding parameters and the LM head (the input embedding is a
    lookup); attention adds 12 * layers * width * length (PaLM, appendix B).
    """
    matmul_params = count_parameters(cfg)["non_embedding"] + cfg.vocab_size * cfg.n_embd
    return 6.0 * matmul_params + 12.0 * cfg.n_layer * cfg.n_embd * seq_len


def peak_memory_gb() -> float:
    """Peak accelerator memory allocated, or the process's peak resident set on the CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def wandb_mode(mode: str) -> str:
    """`auto`: WANDB_MODE if the user set it, online with credentials, offline without."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    has_login = netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
    return "online" if os.environ.get("WANDB_API_KEY") or has_login else "offline"


class Reporter:
    """Writes metrics from rank 0; on other ranks every method is a no-op."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, run_name: str, config: dict[str, Any],
                 *, enabled: bool, resumed_step: int, max_steps: int):
        self.enabled = enabled
        self.wandb_run = None
        self.bar = None
        if not enabled:
            return
        self.path = run_dir / "metrics.jsonl"
        _truncate_after(self.path, resumed_step)
        self.file = open(self.path, "a")
        mode = wandb_mode(cfg.wandb)
        if mode != "disabled":
            self.wandb_run = _init_wandb(cfg, run_dir, run_name, config, mode)
        if cfg.progress:
            self.bar = tqdm(total=max_steps, initial=resumed_step, desc="train", dynamic_ncols=True,
                            file=sys.stderr, mininterval=1.0)

    def log(self, record: dict[str, Any]) -> None:
        """One JSON line, and the same values to W&B at the record's step."""
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def progress(self, step: int, **values: str) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(values, refresh=False)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self, exit_code: int = 0) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)


def _truncate_after(path: Path, step: int) -> None:
    """Drop records beyond `step` (written after the checkpoint a run resumes from)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


def _init_wandb(cfg: LoggerConfig, run_dir: Path, run_name: str, config: dict[str, Any], mode: str):
    import wandb

    id_file = run_dir / "wandb_id.txt"
    if not id_file.is_file():
        id_file.write_text(uuid.uuid4().hex[:8])
    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=run_name,
        id=id_file.read_text().strip(),
        resume="allow",
        dir=str(run_dir),
        mode=mode,
        config=config,
        settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
    )
