"""The trainer: the components a run is made of, built once by `setup`, and one optimizer step.

`setup` builds the run its `train.start.Start` says (fresh, resumed, elastic, a branch, from
`init_from`): it checks what can still fail (the resume rules, the metrics log, the tokenizer)
before the run writes a file, then builds model, engine, loader and validator, restores a resumed
run, and writes `config.yaml` and `deepspeed.json`. `Trainer.train_step` is one optimizer
step: the step's `grad_accum` micro-batches fetched and their counted targets summed over ranks
(one all-reduce of one number), their forward/backward through the DeepSpeed engine weighted by
tokens (`backward_micro_batches`), then one small all-reduce (summed token losses, counted
targets, non-finite flag, stop request).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from data.loader import build_loader
from data.sources import check_sources
from data.tokenizer import get_tokenizer, load_tokenizer
from hf.imports import HFImportError
from hf.imports import state_dict as hf_state_dict
from model import GPT
from model.convert import convert, t_init
from model.sequence_parallel import SequenceParallel, enable
from train import checkpoint, resume
from train import distributed as dist
from train.checkpoint import Checkpointer, Progress
from train.config import ConfigError, TrainConfig
from train.engine import build_engine, deepspeed_config, resolve_precision
from train.faults import FaultInjector
from train.flops import device_peak_flops, flops_per_token
from train.inputs import counted_targets, documents_eos, model_inputs
from train.load import fp32_state_dict
from train.metrics import Reporter, Throughput, peak_memory_gb, records_up_to
from train.modifiers import neutral_start
from train.restore import plan_resume, restore
from train.schedule import lr_at
from train.start import ModelSource, Start
from train.stop import StopRequest
from train.validate import Validator

MAX_CONSECUTIVE_SKIPS = 20  # with nonfinite=skip: a run that only produces NaN still stops


class NonFiniteLossError(Exception):
    """The training loss became NaN or infinite."""


@dataclass
class StepOutcome:
    loss: float  # the global batch's token mean: summed token losses / counted targets, all ranks
    lr: float  # what this step's update used
    pre_step_norm: Optional[float]  # the gradient norm where DeepSpeed does not report one (ZeRO 0)
    stopping: bool  # a stop request reached some rank


@dataclass
class Trainer:
    cfg: TrainConfig
    engine: Any
    loader: Any
    progress: Progress
    validator: Validator
    checkpointer: Checkpointer
    reporter: Reporter
    throughput: Throughput
    faults: FaultInjector
    stop: StopRequest
    eos: Optional[int] = None  # document masking: the EOS that numbers a row's documents
    shard: tuple[int, int] = (0, 1)  # this rank's share of every row: (index, parallel.sequence)
    consecutive_skips: int = 0
    val_loss: Optional[float] = None  # the newest validation loss
    step_inputs: list = field(default_factory=list)  # the last step's planned micro-batches (`train.qk_clip`)
    batches: Any = field(init=False)

    def __post_init__(self) -> None:
        self.batches = iter(self.loader)

    @property
    def done(self) -> bool:
        return self.progress.step >= self.cfg.max_steps

    def train_step(self) -> StepOutcome:
        """One optimizer step on the global batch's token-mean loss (see `backward_micro_batches`)."""
        cfg, engine, progress = self.cfg, self.engine, self.progress
        lr = engine.get_lr()[0]
        grad_accum = cfg.grad_accum(dist.data_parallel(cfg.parallel.sequence)[1])
        step = progress.step + 1
        planned = self.step_inputs = [self._next_micro_batch(step) for _ in range(grad_accum)]
        totals = backward_micro_batches(engine, self._micro_batches(step, planned),
                                        loss_normaliser(planned, grad_accum), grad_accum,
                                        kept=lambda loss: self._kept(step, loss))
        engine.step()
        progress.step += 1
        progress.tokens += cfg.batch_size * cfg.model.max_seq_len
        loss_sum, tokens, nonfinite, stopping = dist.all_reduce(
            [totals.loss_sum, totals.tokens, float(not np.isfinite(totals.loss_sum)), float(self.stop.signum > 0)]
        )
        if nonfinite:
            raise NonFiniteLossError(
                f"non-finite training loss at step {progress.step} "
                f"(lr {lr_at(progress.step - 1, cfg.optim, cfg.max_steps):.3g}); "
                "stopped without saving: the newest checkpoint holds the last good weights "
                "(lower optim.lr, or set nonfinite=skip to drop such batches)"
            )
        self.faults.after_step()
        return StepOutcome(loss_sum / max(tokens, 1.0), lr, totals.pre_step_norm, bool(stopping))

    def _next_micro_batch(self, step: int) -> dict[str, torch.Tensor]:
        batch = next(self.batches)
        self.faults.on_batch(step, batch)
        return model_inputs(batch, self.engine.device, self.eos, self.shard)

    def _micro_batches(self, step: int, planned: list[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """The step's planned micro-batches, then the loader's next ones (replacing skipped ones)."""
        yield from planned
        while True:
            yield self._next_micro_batch(step)

    def _kept(self, step: int, loss: torch.Tensor) -> Optional[torch.Tensor]:
        """The micro-batch's loss to train on, or None where `nonfinite=skip` drops it (on every rank)."""
        loss = self.faults.poison(step, loss)
        if self.cfg.nonfinite != "skip" or not dist.all_reduce([float(not torch.isfinite(loss))], op="max")[0]:
            self.consecutive_skips = 0
            return loss
        self.progress.skipped += 1
        self.consecutive_skips += 1
        self.reporter.message(f"skipped a batch with a non-finite loss at step {step}")
        if self.consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
            raise NonFiniteLossError(
                f"{self.consecutive_skips} consecutive batches gave a non-finite loss at step {step}; "
                "stopping (lower optim.lr?)"
            )
        return None

    def report(self, outcome: StepOutcome) -> None:
        """A metrics record every `logger.log_every` steps and at the last; the progress bar always."""
        step, last = self.progress.step, self.cfg.max_steps
        if step % self.cfg.logger.log_every == 0 or step == last:
            tokens_per_s, mfu = self.throughput.measure(self.progress.tokens)
            norm = self.engine.get_global_grad_norm()
            record = {"step": step, "loss": outcome.loss, "lr": outcome.lr, "tokens_seen": self.progress.tokens,
                      "tokens_per_s": tokens_per_s,
                      "grad_norm": outcome.pre_step_norm if norm is None else float(norm),
                      "mem_gb": peak_memory_gb()}
            if mfu is not None:
                record["mfu"] = mfu
            if self.progress.skipped:
                record["skipped"] = self.progress.skipped
            self.reporter.log(record)
        self.reporter.progress(step, loss=f"{outcome.loss:.4f}", lr=f"{outcome.lr:.2e}")

    def validate_if_due(self) -> None:
        step = self.progress.step
        if not self.validator.due(step):
            return
        val_loss = self.val_loss = self.validator(self.engine)
        self.reporter.log({"step": step, "val_loss": val_loss, "val_ppl": float(np.exp(min(val_loss, 50.0))),
                           "tokens_seen": self.progress.tokens})
        self.reporter.message(f"step {step}: val_loss {val_loss:.4f}")


def summary(trainer: Trainer, seconds: float) -> str:
    """The end of a finished run in two lines: what it did, and the command to evaluate it."""
    progress, cfg = trainer.progress, trainer.cfg
    minutes, secs = divmod(round(seconds), 60)
    val = f", final val_loss {trainer.val_loss:.4f}" if trainer.val_loss is not None else ""
    return (f"done: {progress.step} steps, {progress.tokens:,} tokens in {minutes}m{secs:02d}s{val}; "
            f"checkpoint {trainer.checkpointer.last_saved}\n"
            f"next: python -m eval run={cfg.run_dir}")


@dataclass
class MicroBatchTotals:
    """What one rank trained on in a step: its kept micro-batches' summed token losses and counted
    targets (the logged loss is their all-reduced ratio), and the ZeRO-0 gradient norm."""

    loss_sum: float
    tokens: int
    pre_step_norm: Optional[float]


def loss_normaliser(planned: Sequence[dict[str, torch.Tensor]], grad_accum: int) -> float:
    """What each micro-batch's forward divides its summed token losses by: N / (grad_accum x world
    size), N the global batch's counted targets (one all-reduce of one number, before any backward).

    DeepSpeed 0.19.8's `engine.backward` divides the loss by `gradient_accumulation_steps`, and its
    gradient reduction averages the ranks (ZeRO 0 `allreduce_bucket`, ZeRO 1-2 `average_tensor` /
    `gradient_reduction_w_predivide`, ZeRO 3 `__avg_scatter_contiguous_grads`: a division by the
    data-parallel world size, `gradient_predivide_factor` 1), so the step's gradient is that of
    (sum of token losses over the global batch) / N whatever the micro-batch size, accumulation and
    world size. A global batch with no counted target has loss and gradient 0 (N taken as 1).

    The world size, not the data-parallel size: under sequence parallelism each rank counts and
    trains on its shard of the rows (a parameter's gradient is the sum of its ranks' parts), and
    DeepSpeed, told nothing of the sequence groups, averages every rank alike, so the same division
    leaves sum / N in every ZeRO stage (`train.engine.deepspeed_config`)."""
    local = float(sum(counted_targets(inputs) for inputs in planned))
    (total,) = dist.all_reduce([local])
    return max(total, 1.0) / (grad_accum * dist.world_size())


def backward_micro_batches(
    engine,
    micro_batches: Iterator[dict[str, torch.Tensor]],
    loss_tokens: float,
    grad_accum: int,
    kept: Callable[[torch.Tensor], Optional[torch.Tensor]] = lambda loss: loss,
) -> MicroBatchTotals:
    """Forward and backward of `grad_accum` micro-batches taken in order from `micro_batches`, each
    one's summed token losses divided by `loss_tokens` (`loss_normaliser`), with `engine.step()` after
    each backward but the last: the caller makes the last step, so the step's full gradient can be
    read first (tests/test_token_weighted_loss.py does).

    `kept` gives the loss to train on, or None to drop the micro-batch (`nonfinite=skip`, decided
    on every rank alike); the next one from `micro_batches` takes its place. Such a step still
    divides by the count planned before its first backward (the skipped micro-batch's counted
    targets in, its replacement's out), since the earlier backwards used it: its gradient is the
    token mean only up to that ratio; its logged loss divides by the count actually trained on."""
    loss_sum, tokens, done, pre_step_norm = 0.0, 0, 0, None
    while done < grad_accum:
        inputs = next(micro_batches)
        loss = kept(engine(**inputs, loss_tokens=loss_tokens))
        if loss is None:
            continue
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary() and engine.zero_optimization_stage() == 0:
            pre_step_norm = _grad_norm(engine.module)
        done += 1
        if done < grad_accum:
            engine.step()
        loss_sum += loss.float().item() * loss_tokens
        tokens += int(counted_targets(inputs))
    return MicroBatchTotals(loss_sum, tokens, pre_step_norm)


def _grad_norm(model: torch.nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else float("nan")


@dataclass
class _Checked:
    """What `setup` learns before anything is written (the resume rules, the metrics log, the
    tokenizer); `train.preflight` made the cheap checks, and decided the start, before DeepSpeed
    started."""

    changed: list[str]  # the settings a resume changes (honoured), for the log
    metrics_kept: list[str]
    metrics_warning: Optional[str]
    tokenizer: Any


def _checks(start: Start) -> _Checked:
    """The checks that can fail, in order, before the run writes anything. A run whose model comes
    from a `ModelSource` (init_from=<Hugging Face directory>, or a checkpoint of such a run: resumed
    or named by init_from) has its model config from there already (`Start.cfg`, which the resume
    rules compare) and takes its tokenizer from there too."""
    cfg, resume_from, init_from, source = start.cfg, start.checkpoint, start.init_from, start.source
    changed = resume.check(resume_from, cfg) if resume_from is not None else []
    step = checkpoint.marker(resume_from)["step"] if resume_from is not None else 0
    kept, warning = records_up_to(Path(cfg.run_dir) / "metrics.jsonl", step) if dist.is_main() else ([], None)
    tokenizer = _source_tokenizer(cfg, source) if source is not None else get_tokenizer(cfg.data)
    if source is not None and init_from is not None and dist.is_main():
        m = cfg.model
        print(f"model from {source.where}: arch={m.arch}, attention={m.attention}, {m.n_layer} layers of "
              f"{m.n_embd}, {m.n_head} heads ({m.kv_heads} kv), vocab_size {m.vocab_size}, max_seq_len "
              f"{m.max_seq_len}, rope_base {m.rope_base:g}, rope_scaling {m.rope_scaling.type}; tokenizer "
              f"{tokenizer.path} ({tokenizer.vocab_size} tokens, EOS {tokenizer.eos_id})", file=sys.stderr)
        for note in source_notes(start):
            print(note, file=sys.stderr)
    if resume_from is not None and source is None:
        resume.check_tokenizer(resume_from, tokenizer)
    if source is None and tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} pieces but model.vocab_size={cfg.model.vocab_size}: "
            "set data.tokenizer.vocab_size to match"
        )
    return _Checked(changed, kept, warning, tokenizer)


def source_notes(start: Start) -> list[str]:
    """What a run from a model source is told besides its model: what the import noted (a tied
    head's separate tensor, not read), and a warning where it trains with RoPE past the source's
    training length (an HF directory's max_position_embeddings) with neither a RoPE scaling nor
    another base: positions the source's RoPE never saw, which the extend_* recipes stretch RoPE for."""
    notes = list(start.source.hf.notes) if start.source.hf is not None else []
    model, source = start.cfg.model, start.source.model
    if (not model.design.rope or model.max_seq_len <= source.max_seq_len or model.rope_scaling.type != "none"
            or model.rope_base != source.rope_base):
        return notes
    length = "max_position_embeddings" if start.source.hf is not None else "model.max_seq_len"
    return [*notes, f"warning: {start.source.where} has {length}={source.max_seq_len} and this run trains at "
            f"model.max_seq_len={model.max_seq_len} with no model.rope_scaling and the same model.rope_base: "
            "its RoPE meets positions it never saw (set model.rope_scaling.type or a larger model.rope_base, as "
            "conf/experiment/extend_*.yaml do)"]


def _source_tokenizer(cfg: TrainConfig, source: ModelSource):
    """The tokenizer of a model source (the directory's, or the checkpoint's copy). A
    `data.tokenizer.model_path`, if given, must be the same tokenizer. Its size may be below the
    model's `vocab_size` (Hugging Face embeddings are often padded), never above."""
    check_sources(cfg.data, ("train", "val"))
    tokenizer = load_tokenizer(source.path)
    if cfg.data.tokenizer.model_path and get_tokenizer(cfg.data).files() != tokenizer.files():
        raise ConfigError(f"data.tokenizer.model_path={cfg.data.tokenizer.model_path} is not the tokenizer of "
                          f"{source.where} ({tokenizer.path}), which this run trains with: drop the override")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise HFImportError(f"the tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, more than the "
                            f"model's vocab_size={cfg.model.vocab_size} ({source.where})")
    return tokenizer


def _build_model(start: Start, sp: Optional[SequenceParallel]) -> GPT:
    """The model, with the weights of `init_from` (a checkpoint's, or a Hugging Face directory's,
    read in fp32) when given: a fresh run from them (step 0, a new optimizer); with `sp`, running on
    this rank's shard of every row (`model.sequence_parallel`)."""
    cfg = start.cfg
    checkpoint.seed_all(cfg.seed)
    model = GPT(cfg.model)
    if start.init_from is not None:
        model.load_state_dict(_initial_state(start, model))
    enable(model, sp)
    if cfg.compile:
        model.compile_blocks()
    return model


def _initial_state(start: Start, model: GPT) -> dict[str, torch.Tensor]:
    """init_from's weights for `model`, converted where this run has another attention
    (`model.convert`: Origin to CoCA, T per `design_params.coca.t_init`, or to ALiBi), else with the
    modifiers this run adds at their neutral start (`train.modifiers`); either is said on stderr
    (rank 0)."""
    cfg, source, init_from = start.cfg, start.source, start.init_from
    if source is not None and source.hf is not None:
        state, source_model = hf_state_dict(source.hf), source.model
    else:
        source_model = checkpoint.saved_model(init_from)
        if source_model.attention == cfg.model.attention:
            checkpoint.check_compatible(init_from, cfg.model)
        state = fp32_state_dict(init_from)
    if source_model.attention == cfg.model.attention:
        state, said = neutral_start(model, state, source_model)
        if said and dist.is_main():
            print(f"init_from {init_from}: {said}", file=sys.stderr)
        return state
    state, done = convert(state, source_model, cfg.model, seed=cfg.seed)
    if dist.is_main():
        target = cfg.model.design.label
        start = t_init(cfg.model)
        t_init_note = "" if start is None else f" (t_init={start})"
        print(f"init_from {init_from}: {source_model.attention} converted to {target}{t_init_note}: "
              f"{done.describe()}", file=sys.stderr)
    return state


def _write_run_files(start: Start, checked: _Checked) -> dict[str, bytes]:
    """`config.yaml`, `deepspeed.json`, the tokenizer's files and, for a run from a model source,
    `hf_origin.json` into the run directory (rank 0), saying so when a tokenizer file there is
    replaced (a resumed run's, edited by hand); returns the files every checkpoint carries (all of
    them but deepspeed.json)."""
    cfg = start.cfg
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    files = {"config.yaml": config_yaml.encode(), **checked.tokenizer.files()}
    if start.source is not None:
        files[checkpoint.ORIGIN] = (json.dumps(start.source.origin, indent=2) + "\n").encode()
    if dist.is_main():
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        edited = [name for name in checked.tokenizer.files()
                  if (run_dir / name).is_file() and (run_dir / name).read_bytes() != files[name]]
        if edited:
            trained = "its checkpoint's copy" if start.checkpoint else "the one it loaded"
            print(f"warning: {run_dir / edited[0]} differs from the tokenizer this run trains with ({trained}): "
                  "replaced by it", file=sys.stderr)
        for name, content in files.items():
            (run_dir / name).write_bytes(content)
        (run_dir / "deepspeed.json").write_text(json.dumps(deepspeed_config(cfg, dist.world_size()), indent=2))
    dist.barrier()
    return files


def setup(start: Start, stop: StopRequest) -> Trainer:
    """Check, build, restore, then write the run's files and open its reporter: the run `start`
    (`train.start.plan_start`) says, under its config `start.cfg`."""
    cfg = start.cfg
    checked = _checks(start)
    faults = FaultInjector(cfg.debug)
    sp = dist.sequence_parallel(cfg.parallel.sequence)
    shard = (sp.rank, sp.size) if sp is not None else (0, 1)
    model = _build_model(start, sp)
    plan = plan_resume(start, checked.tokenizer, faults) if start.checkpoint is not None else None
    engine = build_engine(model, cfg, dist.world_size(), load_universal=plan is not None and plan.universal)
    layout_step = plan.layout_step if plan else 0
    dp_rank, dp_size = dist.data_parallel(cfg.parallel.sequence)  # a sequence group reads the same rows
    loader = build_loader(cfg.data, checked.tokenizer, split="train", seq_len=cfg.model.max_seq_len,
                          batch_size=cfg.micro_batch_size, rank=dp_rank, world_size=dp_size,
                          layout_step=layout_step, carry=plan.carry if plan else None)
    validator = Validator(cfg, checked.tokenizer, shard)
    if plan is not None:
        progress = restore(plan, engine, loader, cfg)
    else:
        progress = Progress()
        checkpoint.seed_all(cfg.seed + 1 + dist.rank())  # per-rank streams for anything random after init
    files = _write_run_files(start, checked)
    run_dir = Path(cfg.run_dir)
    reporter = Reporter(cfg.logger, run_dir, cfg.name, OmegaConf.to_container(OmegaConf.structured(cfg)),
                        enabled=dist.is_main(), resumed_step=progress.step, kept_records=checked.metrics_kept,
                        max_steps=cfg.max_steps)
    faults.open_block_log(run_dir, progress.step)
    if checked.metrics_warning:
        reporter.message(checked.metrics_warning)
    if start.checkpoint is not None:
        reporter.message(f"resumed from {start.checkpoint} at step {progress.step}"
                         + (f" with changed settings: {', '.join(checked.changed)}" if checked.changed else ""))
    checkpointer = Checkpointer(engine, loader, run_dir, files, every=cfg.ckpt_every, last=cfg.max_steps,
                                keep_last=cfg.keep_last, layout_step=layout_step, faults=faults,
                                say=reporter.message, sequence=cfg.parallel.sequence)
    peak = device_peak_flops(resolve_precision(cfg.deepspeed.precision), cfg.logger.peak_flops)
    throughput = Throughput(progress.tokens, flops_per_token(cfg.model, cfg.model.max_seq_len), peak,
                            dist.world_size())
    return Trainer(cfg, engine, loader, progress, validator, checkpointer, reporter, throughput, faults, stop,
                   documents_eos(cfg, checked.tokenizer), shard=shard)
