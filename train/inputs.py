"""A loader batch as the model's forward arguments: the one place training and validation turn a
raw `[B, T + 1]` block batch into what `GPT.forward` takes, so an argument added there (a
document id, say) is added once."""

from __future__ import annotations

import torch

from data.synthetic import split_block


def model_inputs(batch: torch.Tensor, device: torch.device | str) -> dict[str, torch.Tensor]:
    """`GPT.forward`'s keyword arguments for a loader batch, on `device`: `idx` and `targets`
    (-100 where a synthetic row's token is input only, `data.synthetic.split_block`)."""
    idx, targets = split_block(batch.to(device))
    return {"idx": idx, "targets": targets}


def counted_targets(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The number of targets the loss counts (not -100), as a 0-d tensor on the inputs' device."""
    return (inputs["targets"] != -100).sum()
