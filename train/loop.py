"""The training run: set up (resume, data, engine), then one flat loop.

Per optimizer step: `grad_accum` micro-batches of forward/backward through the DeepSpeed engine,
one small all-reduce (mean loss, non-finite flag, stop request), then logging, periodic
validation and checkpoints. SIGTERM/SIGINT finish the current step, save, and exit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from omegaconf import OmegaConf

from data.loader import build_loader
from data.stream import continuation
from data.synthetic import split_block
from data.tokenizer import get_tokenizer
from model import GPT
from train import checkpoint
from train import distributed as dist
from train import elastic
from train import resume
from train.config import ConfigError, TrainConfig
from train.engine import build_engine, deepspeed_config, resolve_precision
from train.export import TOKENIZER_FILE, fp32_state_dict
from train.flops import device_peak_flops, flops_per_token
from train.metrics import Reporter, peak_memory_gb
from train.schedule import lr_at


class NonFiniteLossError(Exception):
    """The training loss became NaN or infinite."""


MAX_CONSECUTIVE_SKIPS = 20  # with nonfinite=skip: a run that only produces NaN still stops


class _StopRequest:
    """Remembers the first SIGTERM/SIGINT so the loop can finish its step and save before exiting.

    Installed before any setup, so a signal during a long start (engine, resume) is not fatal.
    Repeats are ignored: launchers and schedulers often deliver the same request twice (to the
    process group and again through the launcher); SIGKILL aborts without saving.
    """

    def __init__(self) -> None:
        self.signum = 0
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)
        launcher = _deepspeed_runner()
        if launcher is not None:
            threading.Thread(target=self._watch, args=(launcher,), daemon=True).start()

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = self.signum or signum

    def _watch(self, launcher: psutil.Process) -> None:
        """The `deepspeed` runner has no signal handler on one node: SIGTERM ends it alone and its
        ranks would train on, unsaved. Its end is therefore taken as the SIGTERM it must have been."""
        while not self.signum:
            try:
                gone = not launcher.is_running() or launcher.status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                gone = True
            if gone:
                self.signum = signal.SIGTERM
                return
            time.sleep(1.0)


def _deepspeed_runner() -> psutil.Process | None:
    """The `deepspeed` command that started this rank (runner -> deepspeed.launcher.launch -> rank), if any."""
    try:
        parent = psutil.Process().parent()
        runner = parent.parent() if parent is not None else None
        if parent is None or runner is None or "deepspeed.launcher.launch" not in parent.cmdline():
            return None
        args = runner.cmdline()[:3]
    except psutil.Error:
        return None
    if any(Path(arg).name == "deepspeed" or arg == "deepspeed.launcher.runner" for arg in args):
        return runner
    return None


@dataclass
class _Progress:
    step: int = 0
    tokens: int = 0
    skipped: int = 0


def _resume_checkpoint(cfg: TrainConfig) -> Path | None:
    """The checkpoint this run continues from, if any; refuse to overwrite a run silently."""
    if cfg.resume == "auto":
        found = checkpoint.complete_checkpoints(cfg.run_dir)
        return found[-1] if found else None
    if cfg.resume:
        return checkpoint.find_checkpoint(cfg.resume)
    found = checkpoint.complete_checkpoints(cfg.run_dir)
    if found:
        raise checkpoint.CheckpointError(
            f"run_dir {cfg.run_dir} already holds checkpoints (newest {found[-1].name}): pass resume=auto "
            "to continue that run, or set name=<new name> for a new one"
        )
    return None


def _kill_now() -> None:
    """A debug hook: die here as a hard kill would (tests of crash safety)."""
    os.kill(os.getpid(), signal.SIGKILL)


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _val_batches(cfg: TrainConfig, tokenizer) -> list[torch.Tensor]:
    """A fixed validation set: the first `eval_batches` batches of the val split on this rank,
    cut to the same count on every rank (ZeRO-3 forwards are collective)."""
    loader = build_loader(cfg.data, tokenizer, split="val", seq_len=cfg.model.max_seq_len,
                          batch_size=cfg.micro_batch_size, rank=dist.rank(), world_size=dist.world_size())
    batches = list(islice(loader, cfg.eval_batches))
    count = int(dist.all_reduce([len(batches)], op="min")[0])
    if count == 0:
        raise ConfigError("the val split has no full block on some rank: use a larger corpus or smaller model.max_seq_len")
    return batches[:count]


@torch.no_grad()
def evaluate(engine, batches: list[torch.Tensor]) -> float:
    """Mean validation loss per token over all ranks."""
    engine.eval()
    loss_sum, tokens = 0.0, 0
    for batch in batches:
        inputs, targets = split_block(batch.to(engine.device))
        loss = engine(inputs, targets)
        counted = int((targets != -100).sum())
        loss_sum += loss.float().item() * counted
        tokens += counted
    engine.train()
    total, count = dist.all_reduce([loss_sum, tokens])
    return total / count


def _grad_norm(model: torch.nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else float("nan")


class _BlockLog:
    """Debug: every training block (a fingerprint and its tokens), to prove none is repeated or
    skipped on resume, and to replay the run's global batches in a test."""

    def __init__(self, run_dir: Path, resumed_step: int):
        self.path = run_dir / f"blocks_rank{dist.rank()}.jsonl"
        if self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resumed_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = open(self.path, "a")

    def write(self, step: int, batch: torch.Tensor) -> None:
        hashes = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in batch.cpu()]
        self.file.write(json.dumps({"step": step, "blocks": hashes, "tokens": batch.tolist()}) + "\n")
        self.file.flush()


@dataclass
class _ResumePlan:
    """A resume, read before the engine and the loader are built (both depend on it)."""

    ckpt: Path
    client: dict[str, Any]  # this rank's client state; rank 0's when the world size changed
    same_world: bool
    universal: bool  # ZeRO state re-sliced through DeepSpeed's universal format (`train.elastic`)
    layout_step: int  # the step the data layout began at (`data.stream.PackedStream`)
    carry: dict | None  # where the new ranks' data streams start, when the world size changed


def _plan_resume(ckpt: Path, cfg: TrainConfig, tokenizer) -> _ResumePlan:
    """Read the checkpoint's client state; on another world size, convert the ZeRO state once and
    work out where the new ranks' data streams start from every old rank's loader state."""
    rank, world = dist.rank(), dist.world_size()
    written_by = checkpoint.marker(ckpt)["world_size"]
    if written_by == world:
        client = checkpoint.client_state(ckpt, rank)
        return _ResumePlan(ckpt, client, True, False, client.get("layout_step", 0), None)
    universal = elastic.needs_universal(written_by, world, cfg.deepspeed.zero_stage)
    if universal:
        elastic.universal_checkpoint(ckpt, before_commit=_kill_now if cfg.debug.kill_in_conversion else None)
    clients = [checkpoint.client_state(ckpt, r) for r in range(written_by)]
    carry = continuation(cfg.data, tokenizer, cfg.model.max_seq_len, [client["loader"] for client in clients])
    return _ResumePlan(ckpt, clients[0], False, universal, clients[0]["step"], carry)


def _restore(plan: _ResumePlan, engine, loader, cfg: TrainConfig) -> _Progress:
    """Load the engine, then this rank's RNG and data position (or, on another world size, reseed:
    the old ranks' RNG streams do not map onto the new ranks)."""
    checkpoint.load(engine, plan.ckpt, universal=plan.universal)
    client = plan.client
    if plan.same_world:
        checkpoint.set_rng_state(client["rng"])
        loader.load_state_dict(client["loader"])
    else:
        _seed(cfg.seed + 1 + dist.rank() + 1_000_003 * client["step"])
    return _Progress(client["step"], client["tokens"], client["skipped"])


def run(cfg: TrainConfig) -> int:
    """Train as configured; returns the process exit code (0, or 128 + signal after a stop request:
    every rank stops at the same step, since the request is all-reduced with the step's loss)."""
    stop = _StopRequest()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata on torch 2.13
    run_dir = Path(cfg.run_dir)
    rank, world = dist.rank(), dist.world_size()
    seq_len = cfg.model.max_seq_len
    grad_accum = cfg.grad_accum(world)
    resume_from = _resume_checkpoint(cfg)
    changed = resume.check(resume_from, cfg) if resume_from is not None else []
    init_from = checkpoint.find_checkpoint(cfg.init_from) if cfg.init_from else None

    tokenizer = get_tokenizer(cfg.data)
    if resume_from is not None:
        resume.check_tokenizer(resume_from, tokenizer.path)
    if tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} pieces but model.vocab_size={cfg.model.vocab_size}: "
            "set data.tokenizer.vocab_size to match"
        )

    _seed(cfg.seed)
    model = GPT(cfg.model)
    if init_from is not None:
        checkpoint.check_compatible(init_from, cfg.model)
        model.load_state_dict(fp32_state_dict(init_from))
    if cfg.compile:
        model.compile_blocks()
    plan = _plan_resume(resume_from, cfg, tokenizer) if resume_from is not None else None
    engine = build_engine(model, cfg, world, load_universal=plan is not None and plan.universal)
    layout_step = plan.layout_step if plan else 0
    loader = build_loader(cfg.data, tokenizer, split="train", seq_len=seq_len, batch_size=cfg.micro_batch_size,
                          rank=rank, world_size=world, layout_step=layout_step, carry=plan.carry if plan else None)
    val_batches = _val_batches(cfg, tokenizer)
    if plan is not None:
        progress = _restore(plan, engine, loader, cfg)
    else:
        progress = _Progress()
        _seed(cfg.seed + 1 + rank)  # per-rank streams for anything random after the common init

    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    files = {"config.yaml": config_yaml.encode(), TOKENIZER_FILE: Path(tokenizer.path).read_bytes()}
    if dist.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)
        (run_dir / "deepspeed.json").write_text(json.dumps(deepspeed_config(cfg, world), indent=2))
    dist.barrier()
    reporter = Reporter(cfg.logger, run_dir, cfg.name, OmegaConf.to_container(OmegaConf.structured(cfg)),
                        enabled=dist.is_main(), resumed_step=progress.step, max_steps=cfg.max_steps)
    blocks = _BlockLog(run_dir, progress.step) if cfg.debug.log_blocks else None
    if resume_from is not None:
        reporter.message(f"resumed from {resume_from} at step {progress.step}"
                         + (f" with changed settings: {', '.join(changed)}" if changed else ""))

    def save() -> None:
        hook = _kill_now if progress.step == cfg.debug.kill_in_checkpoint_at_step else None
        prune_hook = _kill_now if progress.step == cfg.debug.kill_in_prune_at_step else None
        client = {"step": progress.step, "tokens": progress.tokens, "skipped": progress.skipped,
                  "loader": loader.state_dict(), "layout_step": layout_step}
        path = checkpoint.save(engine, run_dir, progress.step, client, files, cfg.keep_last, before_commit=hook,
                               in_prune=prune_hook)
        reporter.message(f"saved {path}")

    peak = device_peak_flops(resolve_precision(cfg.deepspeed.precision), cfg.logger.peak_flops)
    token_flops = flops_per_token(cfg.model, seq_len)
    exit_code = 0
    batches = iter(loader)
    nan_pending = cfg.debug.nan_at_step  # injected once, into the first micro-batch of that step
    consecutive_skips = 0
    window_start, window_tokens = time.perf_counter(), progress.tokens
    try:
        while progress.step < cfg.max_steps:
            lr = engine.get_lr()[0]  # what this step's update uses (logged as is)
            loss_sum, done, pre_step_norm = 0.0, 0, None
            while done < grad_accum:
                batch = next(batches)
                if blocks is not None:
                    blocks.write(progress.step + 1, batch)
                loss = engine(*split_block(batch.to(engine.device)))
                if dist.is_main() and progress.step + 1 == nan_pending:  # the other ranks must follow
                    loss, nan_pending = loss * float("nan"), -1
                if cfg.nonfinite == "skip" and dist.all_reduce([float(not torch.isfinite(loss))], op="max")[0]:
                    progress.skipped += 1
                    consecutive_skips += 1
                    reporter.message(f"skipped a batch with a non-finite loss at step {progress.step + 1}")
                    if consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
                        raise NonFiniteLossError(
                            f"{consecutive_skips} consecutive batches gave a non-finite loss at step "
                            f"{progress.step + 1}; stopping (lower optim.lr?)"
                        )
                    continue
                consecutive_skips = 0
                engine.backward(loss)
                if engine.is_gradient_accumulation_boundary() and engine.zero_optimization_stage() == 0:
                    pre_step_norm = _grad_norm(engine.module)
                engine.step()
                loss_sum += loss.float().item()
                done += 1
            progress.step += 1
            progress.tokens += cfg.batch_size * seq_len

            loss_total, nonfinite, stopping = dist.all_reduce(
                [loss_sum / grad_accum, float(not np.isfinite(loss_sum)), float(stop.signum > 0)]
            )
            if nonfinite:
                raise NonFiniteLossError(
                    f"non-finite training loss at step {progress.step} (lr {lr_at(progress.step - 1, cfg.optim, cfg.max_steps):.3g}); "
                    "stopped without saving: the newest checkpoint holds the last good weights "
                    "(lower optim.lr, or set nonfinite=skip to drop such batches)"
                )
            if cfg.debug.step_sleep_s:
                time.sleep(cfg.debug.step_sleep_s)

            loss_mean = loss_total / world
            if progress.step % cfg.logger.log_every == 0 or progress.step == cfg.max_steps:
                elapsed = time.perf_counter() - window_start
                tokens_per_s = (progress.tokens - window_tokens) / max(elapsed, 1e-9)
                norm = engine.get_global_grad_norm()
                norm = pre_step_norm if norm is None else float(norm)
                record = {"step": progress.step, "loss": loss_mean, "lr": lr, "tokens_seen": progress.tokens,
                          "tokens_per_s": tokens_per_s, "grad_norm": norm, "mem_gb": peak_memory_gb()}
                if peak:
                    record["mfu"] = token_flops * tokens_per_s / (peak * world)
                if progress.skipped:
                    record["skipped"] = progress.skipped
                reporter.log(record)
                window_start, window_tokens = time.perf_counter(), progress.tokens
            reporter.progress(progress.step, loss=f"{loss_mean:.4f}", lr=f"{lr:.2e}")

            paused = time.perf_counter()  # tokens/s measures training only
            if progress.step % cfg.eval_every == 0 or progress.step == cfg.max_steps:
                val_loss = evaluate(engine, val_batches)
                reporter.log({"step": progress.step, "val_loss": val_loss, "val_ppl": float(np.exp(min(val_loss, 50.0))),
                              "tokens_seen": progress.tokens})
                reporter.message(f"step {progress.step}: val_loss {val_loss:.4f}")
            if stopping and progress.step < cfg.max_steps:  # at max_steps the run is simply done
                save()
                exit_code = 128 + (stop.signum or signal.SIGTERM)
                reporter.message(f"stopped by a signal at step {progress.step}; continue with resume=auto")
                break
            if progress.step % cfg.ckpt_every == 0 or progress.step == cfg.max_steps:
                save()
            window_start += time.perf_counter() - paused
    except BaseException:
        reporter.close(exit_code=1)
        raise
    reporter.close(exit_code=exit_code)
    return exit_code
