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
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from errors import ConfigError, UserError
from model.sequence_parallel import SequenceParallel

_LOCAL_RANK_ARG = re.compile(r"^--local[_-]rank(=(\d+))?$")
_OP_BANNER = re.compile(r"^DeepSpeed \S+ built successfully$")
_BUILD_ERROR = re.compile(r"Error building extension|Unable to JIT load")
_COMPILER_ERROR = re.compile(r"\berror: ")  # a diagnostic, as gcc and clang write one
BUILD_NOTICE = "building DeepSpeed's CPU communication op, once, about 40 s (cached in {dir})"
BUILD_NEEDS = "a C++ compiler and Python's headers (Debian/Ubuntu: apt-get install g++ python3-dev)"


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
    build_dir = shm_op_to_build()
    if build_dir is not None:
        check_build_tools()
        if int(os.environ["LOCAL_RANK"]) == 0:  # the other local ranks wait for its build
            print(BUILD_NOTICE.format(dir=build_dir), file=sys.stderr, flush=True)
    with _banner_off_stdout(), _build_failure_in_one_line(build_dir):
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    if accelerator.device_name() == "cpu":  # one rank under a launcher has a buffer too
        dist.barrier()  # every rank has mapped every rank's buffer (init_distributed maps them all)
        shm_buffer(dist.get_rank()).unlink(missing_ok=True)


def shm_buffer(rank: int) -> Path:
    """The POSIX shared-memory buffer (66 MB) of `rank` in DeepSpeed's CPU all-reduce (its `shm.cpp`
    name: uid, MASTER_ADDR, MASTER_PORT, rank). DeepSpeed never removes it, so each CPU run under a
    launcher would leave one per rank in /dev/shm, which is RAM, until a reboot; `init` removes the name
    once every rank has mapped the buffer: the mappings stay, and the memory goes when the ranks
    exit, however they exit."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def shm_op_to_build() -> Path | None:
    """The folder DeepSpeed's CPU shared-memory op is about to be compiled in, or None when
    `init_distributed` will not compile it: not a CPU accelerator, an op shipped prebuilt, or one
    torch's extension cache already holds up to date (the conditions of DeepSpeed's
    `comm.torch.build_shm_op` and `OpBuilder.load`; the folder is the one torch's JIT loader uses)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    accelerator = get_accelerator()
    on_cpu = accelerator.device_name() == "cpu"
    builder = accelerator.create_op_builder("ShareMemCommBuilder") if on_cpu else None
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    if installed_ops.get(builder.NAME, False) and accelerator_name == accelerator._name:
        return None
    build_dir = Path(_get_build_directory(builder.NAME, verbose=False))
    return None if extension_up_to_date(build_dir, builder.NAME) else build_dir


def extension_up_to_date(build_dir: Path, name: str) -> bool:
    """Whether torch's JIT build in `build_dir` has its library and nothing to redo: ninja itself
    is asked (`ninja -n`), as torch's loader runs ninja there and it rebuilds what changed."""
    if not (build_dir / f"{name}.so").is_file() or not (build_dir / "build.ninja").is_file():
        return False
    try:
        dry_run = subprocess.run(["ninja", "-n", "-C", str(build_dir)], capture_output=True, text=True)
    except OSError:
        return False
    return dry_run.returncode == 0 and "no work to do" in dry_run.stdout


def check_build_tools() -> None:
    """The op is built with ninja and the C++ compiler torch uses (`$CXX`, else `c++`): refuse, in
    one line that says what to install, when either is not on PATH (instead of torch's traceback)."""
    from torch.utils.cpp_extension import get_cxx_compiler, is_ninja_available

    compiler = get_cxx_compiler()
    if shutil.which(compiler) is None:
        raise UserError(
            f"DeepSpeed compiles its CPU communication op on this first start, and the C++ compiler "
            f"{compiler!r} is not on PATH: install {BUILD_NEEDS}, or set CXX to one"
        )
    if not is_ninja_available():
        raise UserError(
            "DeepSpeed compiles its CPU communication op on this first start, and ninja is not on PATH: "
            "activate the environment the requirements were installed in (its bin/ has ninja), "
            "or pip install ninja"
        )


@contextlib.contextmanager
def _build_failure_in_one_line(build_dir: Path | None) -> Iterator[None]:
    """A compiler that is there but fails (missing headers, a broken install) ends torch's JIT build
    with the whole build log in one exception: say it in one line, with the compiler's first error."""
    try:
        yield
    except subprocess.CalledProcessError as error:  # torch asking the compiler for its version
        if build_dir is None:
            raise
        raise UserError(_build_failure(build_dir, f"{error}\n{_text(error.output)}")) from None
    except RuntimeError as error:  # ninja's build failing, its log in the message
        if build_dir is None or not _BUILD_ERROR.search(str(error)):
            raise
        raise UserError(_build_failure(build_dir, str(error))) from None


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _build_failure(build_dir: Path, log: str) -> str:
    error_lines = [line.strip() for line in log.splitlines() if _COMPILER_ERROR.search(line)]
    first = (error_lines or log.strip().splitlines() or ["no output"])[0]
    where = f"DeepSpeed's CPU communication op did not build in {build_dir}"
    return f"{where} ({first[:200]}): it needs {BUILD_NEEDS}"


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


def data_parallel(sequence: int) -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel size) when `sequence` consecutive ranks
    share every row (`parallel.sequence`): what the loader shards by and accumulation counts."""
    return rank() // sequence, world_size() // sequence


def check_sequence(sequence: int, world: int) -> None:
    """`parallel.sequence` must divide the world size (a `ConfigError`, the same on every rank)."""
    if world % sequence:
        raise ConfigError(f"parallel.sequence={sequence} does not divide the world size {world}: launch a "
                          f"multiple of {sequence} ranks, or set parallel.sequence to a divisor of {world}")


def sequence_parallel(sequence: int) -> SequenceParallel | None:
    """This rank's sequence-parallel group (ranks r - r % P .. r - r % P + P - 1), or None for P = 1.
    Every rank creates every group, in the same order (torch's rule for `new_group`)."""
    check_sequence(sequence, world_size())
    if sequence == 1:
        return None
    mine = None
    for first in range(0, world_size(), sequence):
        group = dist.new_group(list(range(first, first + sequence)))
        if first <= rank() < first + sequence:
            mine = group
    return SequenceParallel(mine, sequence, rank() % sequence)


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
    """End the process group through DeepSpeed, which `init` started it through: DeepSpeed's own
    teardown also drops the groups it cached, which a later engine in the same process would
    otherwise find destroyed ("Group ... is not registered")."""
    if dist.is_initialized():
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
