"""The training run: set up, then one flat loop of step, report, validate, save, stop.

SIGTERM/SIGINT finish the current step, save, and exit 128 + signal (`train.stop`); the
components are in `train.trainer` (setup, the step), `train.checkpoint` (the checkpointer), `train.validate`,
`train.metrics` (reporter, throughput) and `train.faults` (every `debug.*` hook).
"""

from __future__ import annotations

import logging
import signal
import sys
import time
import warnings

from train import distributed as dist
from train import qk_clip
from train.start import Start
from train.stop import StopRequest
from train.trainer import NonFiniteLossError, setup, summary

__all__ = ["NonFiniteLossError", "run"]


def run(start: Start) -> int:
    """Train from `start` (`train.start.plan_start`); returns the process exit code (0, or 128 +
    signal after a stop request: every rank stops at the same step, since the request is
    all-reduced with the step's loss)."""
    stop = StopRequest()  # first: a signal during a long setup is not fatal
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata on torch 2.13
    # DeepSpeed's ZeRO-3 calls collectives torch 2.13 deprecates: its business, not the run's output
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    started, cfg = time.perf_counter(), start.cfg
    if start.kind == "finished":
        if dist.is_main():
            print(f"run {cfg.run_dir} is complete ({start.checkpoint.name}, max_steps={cfg.max_steps}): nothing "
                  f"to train; raise max_steps to continue it, or evaluate it: python -m eval run={cfg.run_dir}",
                  file=sys.stderr)
        return 0
    trainer = setup(start, stop)
    threshold = cfg.optim.qk_clip
    degree = qk_clip.degrees(trainer.engine.module) if threshold is not None else None
    exit_code = 0
    try:
        while not trainer.done:
            outcome = trainer.train_step()
            trainer.report(outcome)
            if degree is not None:  # MuonClip: the heads above the threshold, rescaled before the next step
                clipped = qk_clip.clip(trainer.engine.module, [b["idx"] for b in trainer.step_inputs], threshold,
                                       degree)
                if trainer.progress.step % cfg.logger.log_every == 0 or any(
                        v for k, v in clipped.items() if k.startswith("qk_clipped")):
                    trainer.reporter.log({"step": trainer.progress.step, **clipped})
            with trainer.throughput.paused():  # tokens/s measures training only
                trainer.validate_if_due()
                if outcome.stopping and not trainer.done:  # at max_steps the run is simply done
                    trainer.checkpointer.save(trainer.progress)
                    exit_code = 128 + (stop.signum or signal.SIGTERM)
                    trainer.reporter.message(f"stopped by a signal at step {trainer.progress.step}; "
                                             "continue with resume=auto")
                    break
                trainer.checkpointer.maybe_save(trainer.progress)
    except BaseException:
        trainer.reporter.close(exit_code=1)
        raise
    if exit_code == 0:
        trainer.reporter.message(summary(trainer, time.perf_counter() - started))
    trainer.reporter.close(exit_code=exit_code)
    return exit_code
