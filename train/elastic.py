"""Resume on another number of ranks through DeepSpeed's universal checkpoint format.

A ZeRO 1-3 checkpoint holds each rank's slice of the fp32 master weights and Adam moments, cut for
the world size that wrote it. `deepspeed.checkpoint.ds_to_universal` rewrites those slices as one
file per parameter and state, which an engine with `checkpoint.load_universal` re-slices for its
own world size. The conversion runs once per checkpoint, on rank 0, into `<ckpt>/universal/`
(written under a temporary name and renamed, so a kill during it leaves nothing that is used),
and is reused by later resumes; pruning the checkpoint removes it too. ZeRO 0 keeps the whole
optimizer state in one file: DeepSpeed loads it on any world size, with no conversion.

Its cost against a save: `python -m bench.elastic` (figures in docs/DESIGN.md).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from errors import first_line
from train import distributed as dist
from train.checkpoint import UNIVERSAL, CheckpointError


def needs_universal(written_by: int, world_size: int, zero_stage: int) -> bool:
    """Whether resuming needs the universal format: ZeRO-partitioned state, another world size."""
    return written_by != world_size and zero_stage > 0


def universal_checkpoint(ckpt: Path, before_commit: Optional[Callable[[], None]] = None) -> Path:
    """`<ckpt>/universal`, converted on rank 0 if absent; every rank waits for it.

    `before_commit` runs after the conversion and before the rename (a test kills the process there).
    """
    final = ckpt / UNIVERSAL
    if dist.is_main() and not (final / "DONE").is_file():
        for leftover in ckpt.glob(f".{UNIVERSAL}_tmp_*"):
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = ckpt / f".{UNIVERSAL}_tmp_{os.getpid()}"
        _convert(ckpt, tmp)
        (tmp / "DONE").write_text("converted by deepspeed.checkpoint.ds_to_universal\n")
        if before_commit is not None:
            before_commit()
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()
    return final


def _convert(ckpt: Path, out: Path) -> None:
    """DeepSpeed's converter, in-process and quiet; `inject_missing_state` supplies the
    `universal_checkpoint_info` entry our saves do not write (it only records a format version)."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(ckpt), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
        (ckpt / "latest_universal").unlink(missing_ok=True)  # the converter's pointer: we load by path
    except Exception as error:  # noqa: BLE001 - the converter raises assertions and many other types
        shutil.rmtree(out, ignore_errors=True)
        raise CheckpointError(
            f"checkpoint {ckpt}: converting it for another world size failed ({first_line(error)}); "
            "resume with the number of ranks that wrote it"
        ) from None
