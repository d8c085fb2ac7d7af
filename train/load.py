"""Trained models out of checkpoints, or out of Hugging Face directories through the import path:
`load_model(path) -> (GPT, TrainConfig, Tokenizer)`.

Weights are gathered to fp32 whatever the ZeRO stage or precision of the run: ZeRO 1-3 (and the
bf16 optimizer) keep fp32 master partitions, merged with DeepSpeed's own `zero_to_fp32`; a
ZeRO-0 fp32 run stores the full module. Every checkpoint carries its config and tokenizer (a
SentencePiece `tokenizer.model`, or a Hugging Face `tokenizer.json` with its `tokenizer_config.json`
for a run started from a Hugging Face model: `checkpoint_tokenizer`).
A Hugging Face directory (a `config.json`, no `config.yaml`: a GPT-NeoX or Llama checkpoint, or
one of our exports) is imported (`hf.imports`) and given the default training config, whose data
sources (standard-library text) are what an evaluation reads unless it names its own.
The loader of every command that reads a trained model (`eval`, `generate`, `train.export_hf`):
so the device check and the messages for a corrupt checkpoint live here, written once.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from data.config import DataError
from data.tokenizer import SP_TOKENIZER_FILE, HFTokenizer, Tokenizer, load_tokenizer
from hf.imports import HFImportError, is_hf_dir, missing_config
from hf.imports import read as read_hf
from hf.imports import state_dict as hf_state_dict
from model import GPT, ModelConfig
from train.bf16_checkpoint import bf16_optimizer_state_dict, is_bf16_optimizer_checkpoint
from train.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    find_checkpoint,
    older_hint,
    saved_config,
    saved_model,
    verify,
)
from train.config import ConfigError, TrainConfig, to_train_config

TOKENIZER_FILE = SP_TOKENIZER_FILE  # a SentencePiece run's tokenizer in its checkpoints (every run's, before HF ones)


def check_device(device: str) -> None:
    """`cpu`, or a CUDA device that this machine has (else a one-line `ValueError`, before anything
    loads): the one check of every command that takes `device=` (eval, generate)."""
    if device == "cpu":
        return
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"device={device!r} is not one of cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but this machine has no CUDA device (torch.cuda.is_available() "
                         "is False); use device=cpu")
    index = device.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise ValueError(f"device={device!r}: this machine has CUDA devices "
                         f"0..{torch.cuda.device_count() - 1}")


def sound_older(ckpt: Path) -> str:
    """'; run=<path> loads step N, ...' naming the newest sound checkpoint of the run older than
    `ckpt`, for the commands that read a model (train's own hint names `resume=`)."""
    if ckpt.parent.name != "checkpoints":
        return ""
    for older in reversed([p for p in complete_checkpoints(ckpt.parent.parent) if p.name < ckpt.name]):
        try:
            verify(older)
        except CheckpointError:
            continue
        step = int(older.name.removeprefix("step_"))
        return f"; run={older} loads step {step}, the newest sound one before it"
    return "; the run has no older sound checkpoint"


def _reworded(error: CheckpointError, ckpt: Path) -> CheckpointError:
    """A checkpoint error with `sound_older`'s `run=` hint, in place of the `resume=` one that
    `train.checkpoint` gives its errors (for train)."""
    return CheckpointError(str(error).removesuffix(older_hint(ckpt)) + sound_older(ckpt))


@contextlib.contextmanager
def deepspeed_quiet() -> Iterator[None]:
    """DeepSpeed's progress (its merge's prints and bars, its accelerator notice) kept off the
    command's output: a successful command says only its own result, a failed one its error line.
    DeepSpeed is imported here first, so that its logger is not bound to the silenced stream."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # said, instead of DeepSpeed's detection warning
    import deepspeed  # noqa: F401

    level = logging.getLogger("DeepSpeed").level
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.getLogger("DeepSpeed").setLevel(level)


def fp32_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state of a complete checkpoint directory (DeepSpeed's merge quiet)."""
    try:
        if is_bf16_optimizer_checkpoint(ckpt):  # ZeRO 1 under bf16: DeepSpeed's merge refuses these
            state = bf16_optimizer_state_dict(ckpt)
        elif any(ckpt.glob("*zero_pp_rank_*_optim_states.pt")):
            with deepspeed_quiet():
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
    except CheckpointError as error:
        raise _reworded(error, ckpt) from None


def checkpoint_tokenizer(ckpt: Path) -> Tokenizer | HFTokenizer:
    """The tokenizer a checkpoint stores: its tokenizer.json (with the roles of its
    tokenizer_config.json), else its tokenizer.model (`data.tokenizer.load_tokenizer`)."""
    try:
        return load_tokenizer(ckpt)
    except (OSError, DataError) as error:
        raise CheckpointError(f"checkpoint {ckpt}: its tokenizer is unusable ({error})") from None


def is_hf_model(path: str | Path) -> bool:
    """A Hugging Face directory rather than a run or checkpoint (which hold a config.yaml)."""
    return is_hf_dir(path) and not (Path(path) / "config.yaml").exists()


def model_path(path: str | Path) -> Path:
    """`path` as the commands that read a model take it: a Hugging Face directory as it is, else the
    checkpoint it names (`find_checkpoint`); a directory of a Hugging Face model's files without its
    config.json is refused naming config.json (it is not a run without checkpoints)."""
    if is_hf_model(path):
        return Path(path)
    unreadable = missing_config(path)
    if unreadable:
        raise HFImportError(unreadable)
    return find_checkpoint(path)


def model_config_of(path: str | Path) -> ModelConfig:
    """The model config of what `load_model(path)` loads, read without loading the weights (an
    HF directory's config.json mapped and its tensor headers checked)."""
    return read_hf(path).model if is_hf_model(path) else saved_model(model_path(path))


def load_model(path: str, device: str = "cpu") -> tuple[GPT, TrainConfig, Tokenizer | HFTokenizer]:
    """A run directory (its newest complete checkpoint), a checkpoint directory or a Hugging Face
    directory, as an fp32 model in eval mode on `device`, with the run's config (an HF directory:
    the default one around its imported model) and tokenizer. A damaged checkpoint (a file missing
    or not at its written size) is refused first, naming the older sound one."""
    if is_hf_model(path):
        hf = read_hf(path)
        tokenizer = load_tokenizer(path)
        if tokenizer.vocab_size > hf.model.vocab_size:
            raise HFImportError(f"the tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, more than the "
                                f"model's vocab_size={hf.model.vocab_size} ({Path(path) / 'config.json'}): its ids "
                                f"from {hf.model.vocab_size} on have no embedding")
        for note in hf.notes:
            print(note, file=sys.stderr)
        model = GPT(hf.model)
        model.load_state_dict(hf_state_dict(hf))
        return model.to(device).eval(), TrainConfig(model=hf.model), tokenizer
    ckpt = find_checkpoint(model_path(path))
    try:
        verify(ckpt)
    except CheckpointError as error:
        raise _reworded(error, ckpt) from None
    cfg = checkpoint_config(ckpt)
    try:
        state = fp32_state_dict(ckpt)
    except CheckpointError as error:
        raise _reworded(error, ckpt) from None
    model = GPT(cfg.model)
    model.load_state_dict(state)
    tokenizer = checkpoint_tokenizer(ckpt)
    return model.to(device).eval(), cfg, tokenizer
