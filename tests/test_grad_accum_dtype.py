"""bf16 training accumulates and reduces gradients in fp32 in every ZeRO stage DeepSpeed allows it in
(`train.engine.bf16_gradient_dtypes`), read from the real engine built from the run's config, not
from the config dict alone.

The probe: one bf16 weight w, loss_i = w * x_i over four micro-batches, whose gradients (x_i / 4,
DeepSpeed's mean over micro-batches) are 1 and three times 2^-8, each exact in bf16. Their sum,
1 + 3 * 2^-8, is exact in fp32, but a bf16 running sum never leaves 1 (1 + 2^-8 rounds to even, 1):
so the accumulated gradient says which dtype accumulated it."""

from __future__ import annotations

import pytest
import torch

from train.config import compose, to_train_config
from train.engine import build_engine, deepspeed_config

MICRO = 4
X = (4.0, 2.0**-6, 2.0**-6, 2.0**-6)  # the inputs; the gradients are x / MICRO


class Probe(torch.nn.Module):
    """loss = w * x: d loss / d w = x, with one decayed [1, 1] matrix (AdamW's group) and no other."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x.to(self.w.dtype)).sum()


def _cfg(stage: int):
    return to_train_config(compose(["experiment=micro", f"deepspeed=zero{stage}", "deepspeed.precision=bf16",
                                    f"batch_size={MICRO}", "micro_batch_size=1"]))


def _engine(config: dict):
    """The real engine of `config` around a fresh probe, with SGD at lr 1 and no clipping, so that
    the step writes w - (accumulated gradient) into the fp32 master weight."""
    import deepspeed

    config = {**config, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True}
    probe = Probe()
    engine, *_ = deepspeed.initialize(model=probe, optimizer=torch.optim.SGD(probe.parameters(), lr=1.0),
                                      config=config)
    return engine


def _stepped(engine) -> float:
    """The fp32 master weight after the four micro-batches (`engine.step()` after each, as the trainer
    does: DeepSpeed steps the optimizer at the fourth): 1 - their accumulated gradient."""
    from deepspeed.utils import safe_get_full_fp32_param

    for x in X:
        engine.backward(engine(torch.tensor([x])))
        engine.step()
    return float(safe_get_full_fp32_param(engine.module.w))


def _accum_dtype(engine) -> torch.dtype:
    """The dtype the engine's optimizer accumulates gradients in (BF16_Optimizer: `grad_acc_dtype`;
    the ZeRO optimizers: `gradient_accumulation_dtype`)."""
    optimizer = engine.optimizer
    return getattr(optimizer, "grad_acc_dtype", None) or optimizer.gradient_accumulation_dtype


REFERENCE = sum(torch.tensor(X, dtype=torch.float64) / MICRO).item()  # 1 + 3 * 2^-8


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_gradients_accumulate_and_reduce_in_fp32(process_group, stage, single_thread):
    engine = _engine(deepspeed_config(_cfg(stage), 1))
    assert engine.bfloat16_enabled() and engine.module.w.dtype == torch.bfloat16  # bf16 parameters
    assert engine.gradient_accumulation_steps() == MICRO
    assert _accum_dtype(engine) == torch.float32
    assert engine.communication_data_type == torch.float32
    assert _stepped(engine) == 1.0 - REFERENCE


def test_without_the_setting_deepspeed_accumulates_in_bf16(process_group, single_thread):
    """The control (ZeRO 2, the check's stage): the same probe with the two settings removed
    accumulates in bf16 and loses the three small gradients, so the fp32 result above is the setting's."""
    config = deepspeed_config(_cfg(2), 1)
    del config["data_types"], config["communication_data_type"]
    engine = _engine(config)
    assert engine.get_data_types() == (torch.bfloat16, torch.bfloat16)
    assert engine.communication_data_type == torch.bfloat16
    assert _stepped(engine) == 0.0  # 1 - 1: the bf16 running sum


def test_stage_0_is_left_in_bf16_because_deepspeed_refuses_fp32_accumulation(process_group, single_thread):
    """Without ZeRO, DeepSpeed 0.19 has no bf16-parameter / fp32-accumulation optimizer: the config
    leaves stage 0 alone (docs/GPU.md), and DeepSpeed refuses the setting if it is added."""
    config = deepspeed_config(_cfg(0), 1)
    assert "data_types" not in config and "communication_data_type" not in config
    with pytest.raises(NotImplementedError, match="unsupported mix"):
        _engine({**config, "data_types": {"grad_accum_dtype": "fp32"}})


def test_stage_1_bf16_checkpoints_merge_and_load(process_group, tmp_path, single_thread):
    """Stage 1 under bf16 now runs DeepSpeed's BF16_Optimizer, whose files (`bf16_zero_pp_rank_*`)
    DeepSpeed's own fp32 merge refuses: the run's save, its fp32 merge (`train.load.fp32_state_dict`,
    what export and evaluation read: `train.bf16_checkpoint`) and its load into a new engine give
    every parameter's trained master weight, tied embeddings and buffers included."""
    from deepspeed.utils import safe_get_full_fp32_param

    from model import GPT
    from train import checkpoint
    from train.load import fp32_state_dict

    cfg = to_train_config(compose(["experiment=micro", "deepspeed=zero1", "deepspeed.precision=bf16",
                                   "model.tie_embeddings=true"]))
    torch.manual_seed(0)
    engine = build_engine(GPT(cfg.model), cfg, 1)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 33))
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    trained = {name: safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}
    saved = checkpoint.save(engine, tmp_path, 1, {"step": 1}, {}, keep_last=1)
    assert list(saved.glob("bf16_zero_pp_rank_0_*optim_states.pt"))
    merged = fp32_state_dict(saved)
    assert merged.keys() == engine.module.state_dict().keys()
    assert torch.equal(merged["lm_head.weight"], merged["wte.weight"])
    for name, weight in trained.items():
        assert torch.equal(merged[name], weight), name
        assert not torch.equal(weight, weight.bfloat16().float()), name  # fp32 masters, not bf16 copies
    torch.manual_seed(1)
    fresh = build_engine(GPT(cfg.model), cfg, 1)
    checkpoint.load(fresh, saved)
    for name, p in fresh.module.named_parameters():
        assert torch.equal(safe_get_full_fp32_param(p), trained[name]), name


def test_fp32_and_fp16_runs_are_unchanged():
    for precision in ("fp32", "fp16"):
        cfg = to_train_config(compose(["experiment=micro", "deepspeed=zero2", f"deepspeed.precision={precision}"]))
        config = deepspeed_config(cfg, 1)
        assert "data_types" not in config and "communication_data_type" not in config
