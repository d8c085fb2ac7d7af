"""One training step under sequence parallelism (`parallel.sequence=2`), for many cases in one
launch: what tests/test_sequence_parallel.py compares with a one-process step on the whole rows.

    deepspeed --num_gpus 2 tests/sequence_parallel_steps.py BATCH.pt OUT.pt CASE...

BATCH.pt holds the `[B, T + 1]` block batch; each sequence group (ranks 2g, 2g + 1) reads its
data-parallel share of the rows (on 2 ranks all of them, on 4 half each). A
CASE is `ARCH:DESIGN:DATA:SCALING` (float64, plain PyTorch: the trainer's inputs, normaliser and
loss, the gradients then averaged over the ranks as DeepSpeed averages them) or
`zeroS:ARCH:DESIGN:DATA:SCALING` (fp32 through the DeepSpeed engine under ZeRO stage S, the
trainer's `backward_micro_batches`, one row per micro-batch). ARCH: neox | llama (GQA, 4 heads
over 2 kv heads) | mqa (llama, 1 kv head: replicated); DESIGN: a registry key; DATA: plain |
docs (document masking and `doc_positions`); SCALING: none | dynamic (dynamic NTK x2 from half
the row: the global length changes the base). Rank 0 writes OUT.pt: per case the logged loss and
every parameter's full gradient.
"""

from __future__ import annotations

import sys

import torch
from deepspeed.utils import safe_get_full_grad

from model import GPT
from model.config import ModelConfig, RopeScaling
from model.designs import DESIGNS
from model.sequence_parallel import enable
from train import distributed as dist
from train.config import compose, to_train_config
from train.distributed import strip_local_rank
from train.engine import build_engine
from train.inputs import model_inputs
from train.trainer import backward_micro_batches, loss_normaliser

SEED = 0
EOS = 0
SEQ_LEN = 32
VOCAB = 64
ARCHS = {"neox": {}, "llama": dict(arch="llama", parallel_residual=False, n_kv_head=2),
         "mqa": dict(arch="llama", parallel_residual=False, n_kv_head=1)}


# Parameters that make a design's feature act in 32 tokens: the hybrid's layer 0 in a window of 5
# (its layer 1 global NoPE), p-RoPE rotating half its pairs.
PARAMS = {"hybrid": {"hybrid": {"window": 5, "nope_every": 2}}, "prope": {"prope": {"p": 0.5}},
          "pope": {"pope": {"phase_bias": True}}}


def model_config(arch: str, design: str, data: str, scaling: str) -> ModelConfig:
    """Two layers of 4 heads of 8 dims at 32 tokens; `scaling` dynamic stretches from 16, temp is
    the length temperature from L0 = 8 (so that it acts on most of the row), softmax the softmax
    modifiers (sinks and SSMax)."""
    rope = RopeScaling("dynamic", 2.0, original_max_seq_len=SEQ_LEN // 2) if scaling == "dynamic" else RopeScaling()
    temp = dict(length_temperature=True, max_seq_len=SEQ_LEN // 4) if scaling == "temp" else dict(max_seq_len=SEQ_LEN)
    if scaling == "softmax":
        temp.update(sinks=True, ssmax=True)
    return ModelConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, ffn_hidden=64, **temp,
                       **{**DESIGNS[design].settings(),
                          **({"design_params": PARAMS[design]} if design in PARAMS else {})},
                       rope_scaling=rope,
                       doc_mask=data == "docs", doc_positions=data == "docs", **ARCHS[arch])


def overrides(cfg: ModelConfig) -> list[str]:
    """The same model as `train` overrides."""
    fields = ("arch", "n_layer", "n_head", "n_embd", "ffn_hidden", "max_seq_len", "attention",
              "doc_mask", "doc_positions", "parallel_residual", "length_temperature",
              "sinks", "ssmax")
    out = [f"model.{name}={getattr(cfg, name)}" for name in fields] + [f"model.vocab_size={VOCAB}"]
    params = cfg.params
    if params is not None:
        out += [f"model.design_params.{cfg.attention}.{k}={v}" for k, v in vars(params).items()]
    if cfg.n_kv_head is not None:
        out.append(f"model.n_kv_head={cfg.n_kv_head}")
    s = cfg.rope_scaling
    if s.type != "none":
        out += [f"model.rope_scaling.type={s.type}", f"model.rope_scaling.factor={s.factor}",
                f"model.rope_scaling.original_max_seq_len={s.original_max_seq_len}"]
    return out


def rows(batch: torch.Tensor, sp) -> torch.Tensor:
    """This rank's sequence group's share of the rows."""
    dp_rank, dp_size = dist.data_parallel(sp.size)
    return batch.chunk(dp_size)[dp_rank]


def float64_step(case: str, batch: torch.Tensor, sp) -> dict:
    """The trainer's arithmetic without DeepSpeed: inputs, normaliser, forward and backward on this
    rank's shard, then the mean of the ranks' gradients (DeepSpeed's reduction)."""
    cfg = model_config(*case.split(":"))
    torch.manual_seed(SEED)
    model = GPT(cfg).double()
    enable(model, sp)
    inputs = model_inputs(rows(batch, sp), "cpu", EOS if cfg.doc_mask else None, (sp.rank, sp.size))
    loss_tokens = loss_normaliser([inputs], 1)
    loss = model(**inputs, loss_tokens=loss_tokens)
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        torch.distributed.all_reduce(grad)
        grads[name] = grad / dist.world_size()
    loss_sum, tokens = dist.all_reduce([loss.item() * loss_tokens, float((inputs["targets"] != -100).sum())])
    return {"loss": loss_sum / tokens, "grads": grads}


def engine_step(case: str, batch: torch.Tensor, sp) -> dict:
    """`backward_micro_batches` through a DeepSpeed engine (fp32, one row per micro-batch)."""
    stage, *spec = case.split(":")
    model_cfg = model_config(*spec)
    cfg = to_train_config(compose(["experiment=micro", f"deepspeed={stage}", "deepspeed.precision=fp32",
                                   f"batch_size={batch.shape[0]}", "micro_batch_size=1",
                                   f"parallel.sequence={sp.size}", *overrides(model_cfg)]))
    grad_accum = cfg.grad_accum(dist.data_parallel(sp.size)[1])
    torch.manual_seed(SEED)
    model = GPT(cfg.model)
    enable(model, sp)
    engine = build_engine(model, cfg, dist.world_size())
    eos = EOS if cfg.model.doc_mask else None
    micro = [model_inputs(row, engine.device, eos, (sp.rank, sp.size)) for row in rows(batch, sp).split(1)]
    totals = backward_micro_batches(engine, iter(micro), loss_normaliser(micro, grad_accum), grad_accum)
    loss_sum, tokens = dist.all_reduce([totals.loss_sum, totals.tokens])
    grads = {name: safe_get_full_grad(p).detach().cpu().clone() for name, p in engine.module.named_parameters()}
    engine.step()
    return {"loss": loss_sum / tokens, "grads": grads}


def main(argv: list[str]) -> None:
    batch_path, out_path, *cases = strip_local_rank(argv)
    dist.init()
    sp = dist.sequence_parallel(2)
    batch = torch.load(batch_path)
    results = {case: (engine_step if case.startswith("zero") else float64_step)(case, batch, sp) for case in cases}
    if dist.is_main():
        torch.save(results, out_path)
    dist.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
