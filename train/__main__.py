"""`python -m train [--cfg job] key=value ...`: compose the config, then train.

Also runs under `torchrun` and `deepspeed --module train` (its `--local_rank=N` is removed
before the overrides are parsed). Exit codes (errors.py, as every command): 0 done, 1 unusable
input (a missing or bad checkpoint or corpus file, and a non-finite loss with nonfinite=stop),
2 bad usage (a bad key or value, a batch that does not split over the ranks), 128 + signal
(143 SIGTERM, 130 SIGINT) after a signal: every rank finishes its step and the checkpoint of that
step is complete on disk (a signal before training starts ends the process without one: there
is nothing new to save). Under a launcher an error is said by rank 0 alone (`_say_once`), the
configuration's every reason in that one line (`_compose_checked`: the world size the launcher set
is checked with the rest).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

from omegaconf import OmegaConf

from data.cli import exit_code
from errors import EXIT_INPUT, UserError, report_error
from model.config import unselected_params
from train.config import ConfigError, TrainConfig, compose, to_train_config
from train.distributed import check_sequence, strip_local_rank

USAGE = """usage: python -m train [--cfg job] [key=value | group=option ...]
  groups: model (tiny, 125m, 350m, 1.3b), data, optim, deepspeed (zero0..zero3, zero3_offload),
          logger (wandb, none), experiment (presets in conf/experiment/)
  e.g.    python -m train model=125m deepspeed=zero2 max_steps=1000 optim.lr=6e-4
          python -m train resume=auto          (continue runs/<name> from its newest checkpoint)
  --cfg job   print the composed config and exit"""


def _split_args(argv: list[str]) -> tuple[list[str], bool]:
    overrides, show = [], False
    args = iter(argv)
    for arg in args:
        if arg in ("--cfg", "-c"):
            show = True
            next(args, None)  # `job` (the only kind there is here)
        elif arg.startswith("--cfg="):
            show = True
        else:
            overrides.append(arg)
    return overrides, show


def check_world_size(cfg: TrainConfig, world_size: int, start=None) -> None:
    """parallel.sequence divides this many ranks and the global batch splits over the data-parallel
    ones (a `ConfigError`, said once by rank 0, if not; for a `train.start.Start` continuing a
    checkpoint trained with another parallel.sequence that would split it, naming that one)."""
    check_sequence(cfg.parallel.sequence, world_size)
    try:
        cfg.grad_accum(world_size // cfg.parallel.sequence)
    except ValueError as error:
        raise ConfigError(f"{error}{_resumed_layout(cfg, world_size, start)}") from None


def _resumed_layout(cfg: TrainConfig, world_size: int, start) -> str:
    """The hint for a resume whose batch does not split here but did under the checkpoint's
    parallel.sequence on this many ranks ("" when there is none to give)."""
    if start is None or start.written is None:
        return ""
    trained = start.written[1]
    if trained == cfg.parallel.sequence or world_size % trained:
        return ""
    try:
        cfg.grad_accum(world_size // trained)
    except ValueError:
        return ""
    return (f"; checkpoint {start.checkpoint} was trained with parallel.sequence={trained}, which splits this "
            f"batch over {world_size} ranks: resume with parallel.sequence={trained}")


def _compose_checked(overrides: list[str]) -> TrainConfig:
    """The checked config, every refusal in one `ConfigError`: the schema's checks and, under a
    launcher (its WORLD_SIZE), whether parallel.sequence divides the ranks it starts."""
    composed = compose(overrides)
    reasons = []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sequence = composed.parallel.sequence
    if isinstance(sequence, int) and sequence >= 1 and world % sequence:
        try:
            check_sequence(sequence, world)
        except ConfigError as error:
            reasons.append(str(error))
    try:
        cfg = to_train_config(composed)
        unread = unselected_params(cfg.model)
        if unread:
            raise ConfigError(unread)
    except ConfigError as error:
        reasons.insert(0, str(error))
    if reasons:
        raise ConfigError("; ".join(reasons))
    return cfg


RANK0_FIRST_S = 10.0  # how long another rank leaves rank 0 to say an error it met too


def _say_once(error: BaseException, code: int, *, shared: bool) -> int:
    """Report `error` under a launcher with rank 0's voice alone: rank 0 says it; any other rank
    first waits RANK0_FIRST_S for rank 0 to end the job (the launcher then stops this rank), and
    says it itself, prefixed with its rank, only if it is still running and the error may be its own
    (not `shared`: a verdict on the configuration, which every rank reaches alike)."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        return report_error(error, code)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's stop ends the wait, silently
    time.sleep(RANK0_FIRST_S)
    return code if shared else report_error(error, code, prefix=f"[rank {rank}] ")


def main(argv: list[str] | None = None) -> int:
    argv = strip_local_rank(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return 0
    overrides, show = _split_args(argv)
    try:
        cfg = _compose_checked(overrides)
    except ConfigError as error:
        return _say_once(error, exit_code(error), shared=True)  # every rank composes alike
    if show:
        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
        return 0

    from model.denormals import flush_denormals
    from train.preflight import preflight

    flush_denormals()  # first: OpenMP's workers inherit it (model/denormals.py)
    try:
        start = preflight(cfg, overrides)
    except (UserError, FileNotFoundError, ValueError) as error:
        return _say_once(error, exit_code(error), shared=True)  # every rank makes the same checks

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say so, instead of DeepSpeed's detection warning
    from train import distributed as dist
    from train.loop import NonFiniteLossError, run

    try:
        dist.init()
        check_world_size(start.cfg, dist.world_size(), start)
        return run(start)
    except KeyboardInterrupt:  # SIGINT before run() takes over the signal (import, rendezvous)
        print("interrupted before training started: nothing to save", file=sys.stderr)
        return 128 + signal.SIGINT
    except (UserError, NonFiniteLossError, FileNotFoundError, ValueError) as error:
        if os.environ.get("TRAIN_TRACEBACK"):
            traceback.print_exc()
        code = EXIT_INPUT if isinstance(error, NonFiniteLossError) else exit_code(error)
        return _say_once(error, code, shared=isinstance(error, ConfigError))
    finally:
        dist.destroy()


if __name__ == "__main__":
    sys.exit(main())
