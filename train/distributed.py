"""Process-group setup for every way of starting `train`.

`python -m train` (one process: the environment defaults are set here), `torchrun` and the
`deepspeed` launcher (which appends `--local_rank=N`, an argument Hydra would reject) all end in
the same `env://` initialisation. CPU runs use gloo; GPUs use the accelerator's backend (NCCL).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

_LOCAL_RANK_ARG = re.compile(r"^--local[_-]rank(=(\d+))?$")
_OP_BANNER = re.compile(r"^DeepSpeed \S+ built successfully$")


def strip_local_rank(argv: list[str]) -> list[str]:
    """Remove `--local_rank=N` / `--local_rank N` (added by the deepspeed launcher), keeping LOCAL_RANK."""
    kept: list[str] = []
    args = iter(argv)
    for arg in args:
        match = _LOCAL_RANK_ARG.match(arg)
        if match is None:
            kept.append(arg)
            continue
        value = match.group(2) if match.group(1) else next(args, None)
        if value is not None:
            os.environ.setdefault("LOCAL_RANK", value)
    return kept


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_env_defaults() -> None:
    """Single-process defaults for the variables `env://` initialisation reads, when absent."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())


def init() -> None:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU) and pin the local device."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    set_env_defaults()
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ["LOCAL_RANK"]))
    elif "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a CPU each get their share of the cores (oversubscribed OpenMP crawls).
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    backend = "gloo" if accelerator.device_name() == "cpu" else accelerator.communication_backend_name()
    with _banner_off_stdout():
        deepspeed.init_distributed(dist_backend=backend, verbose=False)


@contextlib.contextmanager
def _banner_off_stdout() -> Iterator[None]:
    """DeepSpeed prints `DeepSpeed <op> built successfully` on stdout when it loads an op (the CPU
    shared-memory collective, at every start): it is dropped, anything else printed goes to stderr,
    so stdout holds only what `train` itself reports."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        kept = [line for line in printed.getvalue().splitlines() if not _OP_BANNER.match(line)]
        if kept:
            print("\n".join(kept), file=sys.stderr)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Reduce a few floats over all ranks (`sum`, `max` or `min`), in float64."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    device = "cpu" if accelerator.device_name() == "cpu" else accelerator.current_device_name()
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(tensor, op=reduce_op)
    return tensor.tolist()


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
