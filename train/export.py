"""Trained models out of checkpoints: `load_model(path) -> (GPT, TrainConfig, Tokenizer)`.

Weights are gathered to fp32 whatever the ZeRO stage or precision of the run: ZeRO 1-3 (and the
bf16 optimizer) keep fp32 master partitions, merged with DeepSpeed's own `zero_to_fp32`; a
ZeRO-0 fp32 run stores the full module. Every checkpoint carries its config and tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from data.tokenizer import Tokenizer
from model import GPT
from train.checkpoint import CheckpointError, find_checkpoint, saved_config
from train.config import ConfigError, TrainConfig, to_train_config

TOKENIZER_FILE = "tokenizer.model"


def fp32_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state of a complete checkpoint directory."""
    try:
        if any(ckpt.glob("*zero_pp_rank_*_optim_states.pt")):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
        else:
            state = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    except Exception as error:  # noqa: BLE001 - torch/DeepSpeed raise many types for a bad file
        raise CheckpointError(f"checkpoint {ckpt} is corrupt or unreadable: {type(error).__name__}: "
                              f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}") from None
    return {name: tensor.float() for name, tensor in state.items()}


def checkpoint_config(ckpt: Path) -> TrainConfig:
    try:
        return to_train_config(saved_config(ckpt))
    except ConfigError as error:
        raise CheckpointError(f"checkpoint {ckpt}: its config.yaml does not fit this code ({error})") from None


def load_model(path: str, device: str = "cpu") -> tuple[GPT, TrainConfig, Tokenizer]:
    """A run directory (its newest complete checkpoint) or a checkpoint directory, as an fp32
    model in eval mode on `device`, with the run's config and tokenizer."""
    ckpt = find_checkpoint(path)
    cfg = checkpoint_config(ckpt)
    model = GPT(cfg.model)
    model.load_state_dict(fp32_state_dict(ckpt))
    tokenizer = Tokenizer(ckpt / TOKENIZER_FILE)
    return model.to(device).eval(), cfg, tokenizer
