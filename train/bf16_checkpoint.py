"""The fp32 master weights of a checkpoint written by DeepSpeed's BF16_Optimizer (ZeRO 1 under bf16
with fp32 gradient accumulation, `train.engine.bf16_gradient_dtypes`).

DeepSpeed 0.19's `zero_to_fp32` refuses these files ("is not a zero checkpoint": their optimizer
state has no `zero_stage` key), although they are laid out as ZeRO 1's: per rank, one flat fp32
partition per parameter group (`single_partition_of_fp32_groups`); concatenated in rank order they
hold the group's parameters back to back, in the order of the model file's `param_shapes`, padded
only at the group's end. This merges them the way `zero_to_fp32` merges ZeRO 1/2 files.
"""

from __future__ import annotations

from pathlib import Path

import torch

OPTIM_GLOB = "bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"


def is_bf16_optimizer_checkpoint(ckpt: Path) -> bool:
    return any(ckpt.glob(OPTIM_GLOB))


def _rank(path: Path) -> int:
    return int(path.name.split("_")[4])  # bf16_zero_pp_rank_<R>_mp_rank_00_optim_states.pt


def bf16_optimizer_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """name -> fp32 tensor for every parameter (tied ones under both names) and buffer of the module."""
    model = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    files = sorted(ckpt.glob(OPTIM_GLOB), key=_rank)
    partitions = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
                  ["single_partition_of_fp32_groups"] for f in files]
    state = {name: model["module"][name].float() for name in model["buffer_names"]}
    for group, shapes in enumerate(model["param_shapes"]):
        flat = torch.cat([ranks[group].detach() for ranks in partitions])
        offset = 0
        for name, shape in shapes.items():
            state[name] = flat[offset:offset + shape.numel()].view(shape).clone()
            offset += shape.numel()
        if flat.numel() - offset >= 2 * len(files):  # more than the end padding: another layout
            raise ValueError(f"{ckpt}: group {group} holds {flat.numel()} values, its parameters {offset}")
    for shared, original in model["shared_params"].items():  # {tied name: the name it is stored under}
        state[shared] = state[original]
    return state
