"""One process runs every design on the GPU path's compiled FlexAttention under torch's default
dynamo configuration (issue 59, item 1): before, one compiled FlexAttention served every design, and
each design's score function, dtype and shape was another entry of the same code object, until
dynamo's recompile limit (8) raised `FailOnRecompileLimitHit` from FIRE in bf16 onwards.

Forced on a CPU (`model.kernel=flex`): inductor's C++ FlexAttention in forward (torch has no CPU
backward), so evaluation and generation; a GPU compiles the Triton template instead."""

from __future__ import annotations

import warnings

import pytest
import torch

import model.kernel_path as kernel_path
from bench.gpu_path import VOCAB, config
from model import GPT
from model.designs import DESIGNS

TRAIN = 256  # the training length: evaluation at 1x..32x is 256..8192 tokens
FACTORS = (1, 2, 4, 8, 16, 32)
# every design, and the modifiers (`model.<name>=true`) on a design without FlexAttention and one with it
VARIANTS = [*DESIGNS, "origin+sinks+ssmax+qk_norm", "alibi+ssmax+qk_norm"]


def _model(name: str) -> GPT:
    key, *modifiers = name.split("+")
    torch.manual_seed(0)
    return GPT(config(key, False, max_seq_len=TRAIN, **dict.fromkeys(modifiers, True))).eval()


@pytest.mark.slow
def test_every_design_compiles_in_one_process_under_the_default_config():
    """Every variant x {fp32, bf16 autocast} x {evaluation at six lengths, generation}, in that order
    (the designs of one dtype, then the other: what `bench/generation.py` and an evaluation sweep do),
    in one process with torch's dynamo configuration untouched: every call compiled (fullgraph: a
    graph break or a hit recompile limit is an error, and FlexAttention run uncompiled, torch's
    dense reference, warns, here an error), every loss finite."""
    torch._dynamo.reset()  # no entries left by other tests: this process starts as a user's would
    assert torch._dynamo.config.recompile_limit == 8 and torch._dynamo.config.automatic_dynamic_shapes
    kernel_path._compiled_flex.cache_clear()
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "flex_attention called without torch.compile")
        for dtype in ("fp32", "bf16"):
            for name in VARIANTS:
                model = _model(name)
                with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
                    for factor in FACTORS:
                        idx = torch.randint(0, VOCAB, (1, TRAIN * factor + 1), generator=g)
                        losses = model.token_losses(idx[:, :-1], idx[:, 1:])
                        assert torch.isfinite(losses).all(), (name, dtype, factor)
                    tokens = list(model.stream(idx[:, :TRAIN], 4, greedy=True))
                    assert len(tokens) == 4, (name, dtype)
    # the designs with a score bias or a window compiled a variant per score or mask function and dtype
    assert kernel_path._compiled_flex.cache_info().currsize >= 2 * 5


@pytest.mark.slow
def test_fox_compiles_at_a_second_batch_size():
    """FoX's evaluation at batch 1 then 2 in one process: a dynamic batch size made inductor's C++
    template fail (`cur_kvSplitSize1` undeclared); the batch is part of the compiled variant."""
    torch._dynamo.reset()
    model = _model("fox")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for batch in (1, 2, 1):
            idx = torch.randint(0, VOCAB, (batch, TRAIN + 1), generator=g)
            assert torch.isfinite(model.token_losses(idx[:, :-1], idx[:, 1:])).all()
