"""The DeepSpeed engine, built from the one `TrainConfig`.

`deepspeed_config` derives the DeepSpeed JSON (batch sizes, precision, clipping, ZeRO stage and
offload) from the run config, so no value is kept in two places; `build_engine` wraps the model
with AdamW and the warm-up/decay schedule.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from model.mup import lr_multiplier
from train.config import ConfigError, TrainConfig
from train.optim import build_muon
from train.optim import param_groups as optim_groups
from train.schedule import scheduler_factory


def resolve_precision(precision: str) -> str:
    """`auto` is bf16 on an accelerator that supports it, fp32 on the CPU."""
    if precision != "auto":
        return precision
    accelerator = get_accelerator()
    return "bf16" if accelerator.device_name() != "cpu" and accelerator.is_bf16_supported() else "fp32"


def precision_refusal(precision: str, device: str, accelerator_has_bf16: bool) -> str | None:
    """This project's precision policy, the same on every host: fp16 needs an accelerator (on the
    CPU, DeepSpeed's answer depends on the CPU model: it accepts fp16 where mkldnn has AVX-512 FP16);
    bf16 runs anywhere on the CPU (torch emulates it where the CPU lacks it) and on an accelerator
    that has it; fp32 runs everywhere. Returns the reason a precision is refused, or None."""
    if precision == "fp16" and device == "cpu":
        return "fp16 needs a GPU (dynamic loss scaling is not run on the CPU)"
    if precision == "bf16" and device != "cpu" and not accelerator_has_bf16:
        return "this accelerator has no bf16"
    return None


def check_precision_supported(precision: str) -> None:
    """A clear error, before DeepSpeed's, for a precision this project does not train in here."""
    accelerator = get_accelerator()
    device = accelerator.device_name()
    has_bf16 = device != "cpu" and accelerator.is_bf16_supported()
    reason = precision_refusal(precision, device, has_bf16)
    if reason:
        raise ConfigError(
            f"deepspeed.precision={precision} is not supported on this device ({device}): {reason}; "
            "use deepspeed.precision=auto, fp32 or bf16"
        )


def deepspeed_config(cfg: TrainConfig, world_size: int, *, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON of this run on `world_size` ranks; `load_universal` when it resumes from a
    checkpoint written by another world size (`train.elastic`).

    DeepSpeed is not told about sequence parallelism: to it each of the world's ranks is a
    data-parallel rank training on row shards (a "sample" is 1/P of a row, so its batch is
    batch_size x P of them), which ZeRO partitions over and averages gradients over in every stage.
    `train.trainer.loss_normaliser` divides by the whole world size for that reason."""
    ds = cfg.deepspeed
    sequence = cfg.parallel.sequence
    precision = resolve_precision(ds.precision)
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_batch_size": cfg.batch_size * sequence,
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum(world_size // sequence),
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {
            "enabled": precision == "fp16",
            "loss_scale": 0,
            "initial_scale_power": ds.fp16_initial_scale_power,
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    config.update(bf16_gradient_dtypes(precision, ds.zero_stage))
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def bf16_gradient_dtypes(precision: str, zero_stage: int) -> dict[str, Any]:
    """Under bf16, gradients accumulated over micro-batches and reduced over ranks in fp32, in every
    ZeRO stage where DeepSpeed 0.19 can (`data_types.grad_accum_dtype`; docs/GPU.md, "fp32 gradient
    accumulation"): stage 1 then takes DeepSpeed's BF16_Optimizer (fp32 gradient buffers), stages 2
    and 3 their fp32 gradient partitions. Without it DeepSpeed accumulates in the model's dtype, bf16,
    where 1 + 2^-8 rounds back to 1. The reduction is fp32 too (`communication_data_type`): summing
    the ranks' gradients is the same accumulation, and a bf16 reduce rounds every partial sum to 8
    bits; it costs twice the reduce traffic, small beside the step's compute at this project's scale.
    Stage 0 is left in bf16: DeepSpeed refuses bf16 parameters with fp32 accumulation without ZeRO
    (`NotImplementedError: unsupported mix`); ZeRO 1 accumulates in fp32 for an fp32 gradient buffer
    more (4 bytes a parameter). Tested in tests/test_grad_accum_dtype.py."""
    if precision != "bf16" or zero_stage == 0:
        return {}
    return {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (linear and embedding weights) only; biases and norm gains are not decayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, or Muon with AdamW (`optim.name=muon`: `train.optim`); with optimizer offload,
    DeepSpeedCPUAdam (the step runs on the CPU, as ZeRO-Offload needs). Under `model.mup` every
    group's lr carries its muP factor (`model.mup.lr_multiplier`)."""
    o = cfg.optim
    multiplier = partial(lr_multiplier, model, o.muon_adjust_lr) if cfg.model.mup else None
    if o.name == "muon":
        return build_muon(model, cfg, multiplier)
    groups = param_groups(model, o.weight_decay) if multiplier is None else optim_groups(model, cfg, multiplier)
    if cfg.deepspeed.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def build_engine(model: torch.nn.Module, cfg: TrainConfig, world_size: int, *, load_universal: bool = False):
    """`deepspeed.initialize` with our optimizer and schedule; returns the engine."""
    check_precision_supported(resolve_precision(cfg.deepspeed.precision))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=build_optimizer(model, cfg),
        lr_scheduler=scheduler_factory(cfg.optim, cfg.max_steps),
        config=deepspeed_config(cfg, world_size, load_universal=load_universal),
    )
    return engine
