"""Periodic validation: a fixed set of val-split batches, its loss a token mean over all ranks
(summed token losses / counted targets, like the training loss)."""

from __future__ import annotations

from itertools import islice
from typing import Optional

import torch

from data.loader import build_loader
from train import distributed as dist
from train.config import ConfigError, TrainConfig
from train.inputs import counted_targets, documents_eos, model_inputs


def val_batches(cfg: TrainConfig, tokenizer) -> list[torch.Tensor]:
    """The first `eval_batches` batches of the val split on this rank's data-parallel rank (a
    sequence group shares its rows), cut to the same count on every rank (ZeRO-3 forwards and
    sequence parallelism are collective)."""
    dp_rank, dp_size = dist.data_parallel(cfg.parallel.sequence)
    loader = build_loader(cfg.data, tokenizer, split="val", seq_len=cfg.model.max_seq_len,
                          batch_size=cfg.micro_batch_size, rank=dp_rank, world_size=dp_size)
    batches = list(islice(loader, cfg.eval_batches))
    count = int(dist.all_reduce([len(batches)], op="min")[0])
    if count == 0:
        raise ConfigError("the val split has no full block on some rank: "
                          "use a larger corpus or smaller model.max_seq_len")
    return batches[:count]


@torch.no_grad()
def evaluate(engine, batches: list[torch.Tensor], eos: Optional[int] = None,
             shard: tuple[int, int] = (0, 1)) -> float:
    """Mean validation loss per token over all ranks: every batch's summed token losses
    (`loss_tokens=1`), over all batches and ranks, divided by their counted targets. `eos`, `shard`:
    see `train.inputs.model_inputs` (document masking; sequence parallelism: each rank sums its
    shard's tokens, so every token is counted once)."""
    engine.eval()
    loss_sum, tokens = 0.0, 0
    for batch in batches:
        inputs = model_inputs(batch, engine.device, eos, shard)
        loss_sum += engine(**inputs, loss_tokens=1.0).item()
        tokens += int(counted_targets(inputs))
    engine.train()
    total, count = dist.all_reduce([loss_sum, tokens])
    return total / count


class Validator:
    """Validates every `eval_every` steps and at the last one."""

    def __init__(self, cfg: TrainConfig, tokenizer, shard: tuple[int, int] = (0, 1)):
        self.every, self.last = cfg.eval_every, cfg.max_steps
        self.batches = val_batches(cfg, tokenizer)
        self.eos = documents_eos(cfg, tokenizer)
        self.shard = shard

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last

    def __call__(self, engine) -> float:
        return evaluate(engine, self.batches, self.eos, self.shard)
