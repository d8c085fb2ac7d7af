"""A loader batch as the model's forward arguments: the one place training and validation turn a
raw `[B, T + 1]` block batch into what `GPT.forward` takes, so an argument added there (a
document id, say) is added once."""

from __future__ import annotations

from typing import Optional

import torch

from data.synthetic import document_ids, split_block


def model_inputs(batch: torch.Tensor, device: torch.device | str, documents_eos: Optional[int] = None,
                 shard: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
    """`GPT.forward`'s keyword arguments for a loader batch, on `device`: `idx` and `targets`
    (-100 where a synthetic row's token is input only, `data.synthetic.split_block`); with
    `documents_eos` (document masking on: the tokenizer's EOS), each token's `documents` id too.

    shard (index, count): under sequence parallelism (`parallel.sequence` = count) the contiguous
    index-th 1/count of every row's tokens, cut after targets are shifted and document ids counted
    on the whole row, so a shard's last target is the next shard's first token and its ids are
    the row's."""
    idx, targets = split_block(batch.to(device))
    inputs = {"idx": idx, "targets": targets}
    if documents_eos is not None:
        inputs["documents"] = document_ids(idx, documents_eos)
    index, count = shard
    if count == 1:
        return inputs
    return {name: value.chunk(count, dim=1)[index] for name, value in inputs.items()}


def documents_eos(cfg, tokenizer) -> Optional[int]:
    """The EOS id whose count numbers the documents of a row where `model.doc_mask` is on, else None."""
    return tokenizer.eos_id if cfg.model.doc_mask else None


def counted_targets(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The number of targets the loss counts (not -100), as a 0-d tensor on the inputs' device."""
    return (inputs["targets"] != -100).sum()
