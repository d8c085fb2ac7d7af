"""One optimizer step's full gradient on a fixed global batch, for several ZeRO stages, micro-batch
sizes and normalisations, on however many ranks it is launched on (`deepspeed --num_gpus N`, or
plain `python` for one): what tests/test_token_weighted_loss.py compares.

    python tests/token_weighted_grads.py BATCH.pt OUT.pt CASE...

BATCH.pt holds the `[16, T + 1]` block batch (rank r trains on the r-th equal share of its rows);
a CASE is `STAGE:MICRO:NORM` (`0:4:tokens`): ZeRO stage, micro-batch size, and `tokens` (the
trainer's token weighting, `train.trainer.backward_micro_batches`), `skip` (the same, with
micro-batch 1 dropped as `nonfinite=skip` drops one, and micro-batch 0 again in its place) or
`mean` (each micro-batch its own mean and DeepSpeed's equal weights, the normalisation before
token weighting). Rank 0 writes OUT.pt:
per case, every parameter's full gradient after the last backward (before the last step) and the
loss the trainer would log.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Optional

import torch
from deepspeed.utils import safe_get_full_grad

from model import GPT
from train import distributed as dist
from train.config import TrainConfig, compose, to_train_config
from train.distributed import strip_local_rank
from train.engine import build_engine
from train.inputs import counted_targets, model_inputs
from train.trainer import backward_micro_batches, loss_normaliser

SEED = 0
BATCH_SIZE = 16


def config(stage: int, micro: int, seq_len: int) -> TrainConfig:
    """The test's tiny model (`experiment=micro`, one 32-wide layer) at `seq_len` tokens, in fp32."""
    return to_train_config(compose(["experiment=micro", f"model.max_seq_len={seq_len}", f"batch_size={BATCH_SIZE}",
                                    f"micro_batch_size={micro}", f"deepspeed=zero{stage}",
                                    "deepspeed.precision=fp32"]))


def old_mean_of_means(engine, micro_batches: list[dict[str, torch.Tensor]]) -> float:
    """The normalisation before token weighting: each micro-batch's mean, DeepSpeed's equal weights
    over micro-batches and ranks; returns that mean of means."""
    means = []
    for i, inputs in enumerate(micro_batches):
        loss = engine(**inputs)
        engine.backward(loss)
        if i < len(micro_batches) - 1:
            engine.step()
        means.append(loss.item())
    (total,) = dist.all_reduce([sum(means)])
    return total / (len(means) * dist.world_size())


def dropping_call(index: int) -> Callable[[torch.Tensor], Optional[torch.Tensor]]:
    """A `kept` for `backward_micro_batches` that drops the loss of its `index`-th call (from 0;
    -1: none)."""
    calls = itertools.count()
    return lambda loss: None if next(calls) == index else loss


def run_case(case: str, batch: torch.Tensor) -> dict:
    stage, micro, norm = case.split(":")
    cfg = config(int(stage), int(micro), batch.shape[1] - 1)
    world = dist.world_size()
    grad_accum = cfg.grad_accum(world)
    torch.manual_seed(SEED)
    engine = build_engine(GPT(cfg.model), cfg, world)
    rows = batch.chunk(world)[dist.rank()]
    micro_batches = [model_inputs(part, engine.device) for part in rows.split(int(micro))]
    assert len(micro_batches) == grad_accum, (case, len(micro_batches), grad_accum)
    if norm == "mean":
        loss = old_mean_of_means(engine, micro_batches)
    else:
        skip = norm == "skip"
        offered = [*micro_batches, micro_batches[0]] if skip else micro_batches
        totals = backward_micro_batches(engine, iter(offered), loss_normaliser(micro_batches, grad_accum),
                                        grad_accum, kept=dropping_call(1 if skip else -1))
        trained = [inputs for i, inputs in enumerate(offered) if not (skip and i == 1)]
        assert totals.tokens == sum(int(counted_targets(inputs)) for inputs in trained)
        loss_sum, tokens = dist.all_reduce([totals.loss_sum, totals.tokens])  # as `Trainer.train_step` logs it
        loss = loss_sum / tokens
    grads = {name: safe_get_full_grad(param).detach().cpu().clone() for name, param in engine.module.named_parameters()}
    engine.step()
    return {"grads": grads, "loss": loss}


def main(argv: list[str]) -> None:
    batch_path, out_path, *cases = strip_local_rank(argv)
    dist.init()
    batch = torch.load(batch_path)
    results = {case: run_case(case, batch) for case in cases}
    if dist.is_main():
        torch.save(results, out_path)
    dist.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
