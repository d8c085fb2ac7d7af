"""The GPU path proven on a CPU (docs/GPU.md).

`model.kernel=flex` forces `model.kernel_path.takes_gpu_path` on CPU tensors, so the code a GPU runs
runs here: FlexAttention with block masks and score modifications (compiled through C++ in forward;
torch's dense reference of the same score and mask functions where gradients are needed), SDPA and
the chunked bias path. These tests check that it computes what the CPU kernels compute for every
design (documents, windows, `doc_positions`, KV-cache continuations), that it dispatches no op
without a CUDA kernel (`bench.gpu_path.CudaOpCheck`), and that bf16 autocast trains every design
as fp32 does.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import yaml
from torch.overrides import TorchFunctionMode

import model.kernel_path as attention
from bench.gpu_path import (
    DOCUMENTS,
    DTYPES,
    FLEX_DOCUMENTS,
    FLEX_T,
    MODES,
    VOCAB,
    Case,
    CudaOpCheck,
    T,
    config,
    eager_flex,
    has_cuda_kernel,
)
from model import GPT, KVCache
from model.config import ModelConfig
from model.designs import DESIGNS

ROOT = Path(__file__).resolve().parents[1]
BIASED = [key for key, d in DESIGNS.items() if d.bias]  # the designs with a score bias: alibi, kerple, fire, fox
# The softmax modifiers (model.sinks, model.ssmax) on one design of each kernel route: the q/k
# designs' plain kernel (origin, PoPE's wider q_eff with its padded v), the fused key-bias kernel
# (alibi, fox), the tiled additive one (kerple) and a window (hybrid).
MODIFIED = ["origin", "pope", "alibi", "fox", "kerple", "hybrid"]


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    yield


# ---- the checker itself -------------------------------------------------------------------------------------


def test_op_table_knows_which_ops_have_cuda_kernels():
    """Read from the operator table this torch was built from: a CPU-only kernel is named as such."""
    assert has_cuda_kernel(torch.ops.aten.add.Tensor) and has_cuda_kernel(torch.ops.aten.mm.default)
    assert has_cuda_kernel(torch.ops.aten.embedding_dense_backward.default)
    assert has_cuda_kernel(torch.ops.aten.expand.default)  # composite: any device
    assert not has_cuda_kernel(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not has_cuda_kernel(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def test_check_names_a_cpu_only_call_and_not_sdpas_own_choice():
    """The CPU flash kernel called directly is a finding, in forward and in backward; called by SDPA
    (which picks a CUDA backend for a CUDA tensor), including its autograd formula, it is not."""
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    with CudaOpCheck() as sdpa:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert sdpa.missing == {} and "aten::_scaled_dot_product_flash_attention_for_cpu" in sdpa.seen

    class Direct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = attention._FLASH(q, k, v, 0.0, True)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            return attention._FLASH_BACKWARD(grad, *ctx.saved_tensors, 0.0, True)

    with CudaOpCheck() as direct:
        Direct.apply(q, k, v).sum().backward()
    assert direct.missing == {
        "aten::_scaled_dot_product_flash_attention_for_cpu": {"forward"},
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward": {"backward of DirectBackward"},
    }


def test_check_files_ops_recomputed_by_activation_checkpointing_as_forward():
    """Under activation checkpointing the forward runs again inside backward: SDPA's own CPU kernel
    recomputed there is SDPA's choice (was filed under the autograd node whose backward triggered
    the recomputation, `backward of AddmmBackward0`, and reported), and a CPU-only call recomputed
    there is a forward call, named so."""
    assert Case("origin", False, "fp32", "train_checkpointed").run().missing == {}
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(1, 2, 8, 4, requires_grad=True)

    def direct(x):
        y = linear(x)
        return attention._FLASH(y, y, y, 0.0, True)[0]

    with CudaOpCheck() as checked:
        linear(torch.utils.checkpoint.checkpoint(direct, x, use_reentrant=False)).sum().backward()
    assert checked.missing == {"aten::_scaled_dot_product_flash_attention_for_cpu": {
        "forward", "forward, recomputed in backward of ScaledDotProductFlashAttentionForCpuBackward0"}}


# ---- no CPU-only op on the GPU path ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["kv_cache", "eval"])
@pytest.mark.parametrize("key", BIASED)
def test_bias_kv_cache_step_on_the_gpu_path_has_cuda_kernels(key, mode):
    """A KV-cache step (and the passkey scorer's last-position logits) has fewer queries than keys:
    on the GPU path it took the CPU kernels, the CPU flash kernel called directly for ALiBi and FoX
    and the CPU tiles for KERPLE and FIRE (in fp32); now the chunked SDPA path, which any device has."""
    assert Case(key, False, "fp32", mode).run().missing == {}


@pytest.mark.slow
@pytest.mark.parametrize("key", list(DESIGNS))
def test_fake_cuda_sweep(key):
    """Every design x {plain, documents} x {fp32, bf16 autocast, bf16 parameters} x {training step,
    the same with activation checkpointing, KV-cache steps, evaluation forward}: every op the forced
    GPU path dispatches has a CUDA kernel, and FlexAttention's backward passes inductor's check
    (each tensor needing gradients read by one index)."""
    found = {}
    for documents in (False, True):
        for dtype in DTYPES:
            for mode in MODES:
                checked = Case(key, documents, dtype, mode).run()
                if checked.missing:
                    found[(documents, dtype, mode)] = checked.missing
                if mode.startswith("train") and DESIGNS[key].softmax and (documents or DESIGNS[key].bias
                                                                 or DESIGNS[key].for_layer):
                    assert "flex_attention" in checked.seen and "flex_attention_backward" in checked.seen
    assert found == {}


@pytest.mark.parametrize("mode", ["train", "kv_cache"])
@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("key", MODIFIED)
def test_softmax_modifiers_on_the_gpu_path_have_cuda_kernels(key, documents, mode):
    """With sinks and SSMax the GPU path takes the explicit sink chunks (FlexAttention's score_mod
    cannot add a column to the softmax's denominator: `model.sink_attention`), never the CPU kernels
    and never FlexAttention."""
    checked = Case(key, documents, "fp32", mode, modifiers=True).run()
    assert checked.missing == {} and "flex_attention" not in checked.seen


class _SdpaCalls(TorchFunctionMode):
    """Each F.scaled_dot_product_attention call's (dtype, query heads, key heads, enable_gqa)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, int, int, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k = args[0], args[1]
            self.calls.append((q.dtype, q.shape[1], k.shape[1], bool(kwargs.get("enable_gqa", False))))
        return func(*args, **kwargs)


@pytest.mark.parametrize("key", ["origin", "hybrid", "alibi"])
def test_fp32_grouped_query_attention_never_asks_sdpa_for_gqa_on_the_gpu_path(key):
    """CUDA serves SDPA's `enable_gqa` in fp32 only with its math backend (a [B, H, T, T] tensor): on
    the GPU path an fp32 call gets k and v repeated per query head instead (`gpu_sdpa`), in training,
    generation (causal, window and bias chunks) and evaluation, arch=llama with one kv head."""
    torch.manual_seed(0)
    model = GPT(config(key, False, arch="llama", n_kv_head=1, parallel_residual=False))
    idx = torch.randint(0, VOCAB, (2, 24))
    recorded = _SdpaCalls()
    with eager_flex(), recorded:
        for mode in ("train", "kv_cache", "eval"):
            MODES[mode](model, idx, None)
    assert recorded.calls and all(q == k and not gqa for _, q, k, gqa in recorded.calls), recorded.calls


@pytest.mark.slow
@pytest.mark.parametrize("key", [key for key, d in DESIGNS.items() if d.softmax])
def test_fake_cuda_sweep_with_softmax_modifiers(key):
    """The sweep's cases again with sinks and SSMax on, every softmax design (stick-breaking has no
    softmax: it refuses them)."""
    found = {}
    for documents in (False, True):
        for dtype in DTYPES:
            for mode in MODES:
                checked = Case(key, documents, dtype, mode, modifiers=True).run()
                if checked.missing:
                    found[(documents, dtype, mode)] = checked.missing
    assert found == {}


def test_flex_joint_graph_check_catches_a_tensor_read_twice():
    """FoX's prefix sums read at m and at n of one tensor had no GPU backward: the check names it."""
    torch.manual_seed(0)
    hi = torch.randn(1, 2, 16, requires_grad=True)

    def score_mod(score, b, h, m, n):
        return score + hi[b, h, m] - hi[b, h, n]

    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    q.requires_grad_()
    checked = CudaOpCheck()
    with eager_flex(checked), checked:
        attention.run_flex(q, k, v, score_mod=score_mod).sum().backward()
    assert "multiple indexing" in next(iter(checked.missing["flex_attention_backward"]))


# ---- forced Flex against the CPU kernels ---------------------------------------------------------------------


def _pair(key: str, documents: bool, positions: bool = True, **modifiers) -> tuple[GPT, GPT]:
    """The same weights on the CPU kernels and on the forced GPU path."""
    torch.manual_seed(1)
    cpu = GPT(config(key, documents, kernel="auto", doc_positions=positions and documents, **modifiers))
    gpu = GPT(config(key, documents, kernel="flex", doc_positions=positions and documents, **modifiers))
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu


def _logits_and_grads(model: GPT, idx: torch.Tensor, documents: torch.Tensor | None):
    model.zero_grad()
    logits = model(idx, documents=documents)
    (logits.float().square().mean()).backward()  # every output feeds the gradients
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(got, want, rtol=2e-4, atol=2e-5):
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def _fast(key: str, setting: str) -> bool:
    """The fast tier's share of the equivalence cases (the rest are slow): every design plain and with
    documents, but FIRE (whose 100 captured tensors take ~25 s a case to trace) plain only."""
    return setting == "plain" or (setting == "documents" and key != "fire")


@pytest.mark.parametrize(("key", "setting"), [
    pytest.param(key, setting, marks=() if _fast(key, setting) else pytest.mark.slow)
    for key in DESIGNS for setting in ("plain", "documents", "documents, row positions")])
def test_forced_flex_equals_cpu_kernels_with_gradients(key, setting):
    """Logits and every parameter's gradient on the GPU path (FlexAttention as torch's dense
    reference, the GPU's score and mask functions traced) equal the CPU kernels', with documents
    across rows, `doc_positions` on and off (a bias then reads positions from the row's start), the
    hybrid's window; and a KV-cache continuation of 8 tokens (queries at positions 16..23: the
    chunked path on a GPU) equals the full forward's last rows."""
    _equal_paths(key, setting)


@pytest.mark.parametrize("setting", ["plain", "documents"])
@pytest.mark.parametrize("key", MODIFIED)
def test_forced_flex_equals_cpu_kernels_with_softmax_modifiers(key, setting):
    """The same with sinks and SSMax on: the GPU path's explicit sink chunks against the CPU path's
    fused kernels (the sink taken into their output and log-sum-exp), logits, every gradient (the
    sinks' and SSMax's scales among them) and a KV-cache continuation."""
    _equal_paths(key, setting, sinks=True, ssmax=True)


def _equal_paths(key: str, setting: str, **modifiers) -> None:
    documents = setting != "plain"
    cpu, gpu = _pair(key, documents, positions=setting == "documents", **modifiers)
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    docs = DOCUMENTS if documents else None
    want = _logits_and_grads(cpu, idx, docs)
    with eager_flex():
        got = _logits_and_grads(gpu, idx, docs)
    _close(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        _close(got[1][name], want[1][name])
    if not documents:  # a KV cache continues one document
        with torch.no_grad():
            cache = KVCache(gpu.cfg.n_layer)
            gpu(idx[:, :16], cache=cache)
            _close(gpu(idx[:, 16:], cache=cache), want[0][:, 16:])


@pytest.fixture
def compiled_only():
    """From a clean slate, under torch's default dynamo configuration: `run_flex` compiles each
    variant on its own (fullgraph: no graph break and no hit recompile limit can fall back to the
    dense reference), and FlexAttention run uncompiled, which warns, is an error here."""
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "flex_attention called without torch.compile")
        yield


def _forward_pair(key: str, setting: str, length: int) -> None:
    """The forced GPU path's forward equals the CPU kernels' at `length` tokens, compiled from one
    tile on (below it, the dense reference)."""
    documents = setting != "plain"
    cpu, gpu = _pair(key, documents, positions=setting == "documents", max_seq_len=length)
    idx = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(3))
    docs = (DOCUMENTS if length == T else FLEX_DOCUMENTS) if documents else None
    attention._compiled_flex.cache_clear()
    with torch.no_grad():
        _close(gpu(idx, documents=docs), cpu(idx, documents=docs))
    # a design with its own attention (stick-breaking) never reaches FlexAttention
    flex = DESIGNS[key].attend is None
    assert (attention._compiled_flex.cache_info().currsize > 0) == (flex and length >= attention.CPU_DENSE_BELOW)


@pytest.mark.usefixtures("compiled_only")
@pytest.mark.parametrize("key", ["alibi", "fox"])
def test_forced_flex_compiled_forward_equals_cpu_kernels(key):
    """The compiled kernel (inductor's C++ FlexAttention on a CPU, as Triton on a GPU) in forward,
    with documents: ALiBi (a bias of the distance) and FoX (prefix sums restarted per document); and
    at 24 tokens, below one tile, the dense reference a CPU runs there."""
    _forward_pair(key, "documents", FLEX_T)
    _forward_pair(key, "documents", T)


@pytest.mark.slow
@pytest.mark.usefixtures("compiled_only")
@pytest.mark.parametrize("setting", ["plain", "documents", "documents, row positions"])
@pytest.mark.parametrize("key", list(DESIGNS))
def test_forced_flex_compiled_forward_every_design(key, setting):
    """The compiled kernel for every design and setting (a compile per score and mask function)."""
    if setting == "plain" and not (DESIGNS[key].bias or DESIGNS[key].for_layer):
        pytest.skip("no FlexAttention: plain causal attention is SDPA (or the design's own kernel) on either path")
    _forward_pair(key, setting, FLEX_T)


def test_forced_flex_refuses_cpu_training():
    """torch has no CPU FlexAttention backward: training on it says so in one line, not deep in torch."""
    model = GPT(config("alibi", False, kernel="flex"))
    with pytest.raises(ValueError, match="model.kernel=flex on a CPU runs forward only"):
        model(torch.zeros(1, 24, dtype=torch.long), torch.zeros(1, 24, dtype=torch.long))


def test_kernel_setting_is_checked():
    with pytest.raises(ValueError, match="model.kernel='triton' is not one of auto, flex"):
        ModelConfig(kernel="triton")
    x = torch.zeros(1)
    assert not attention.takes_gpu_path(x) and attention.takes_gpu_path(x, "flex")
    assert attention.takes_gpu_path(torch.zeros(1, device="meta"))  # off the CPU: never the CPU kernels


# ---- bf16 numerics -----------------------------------------------------------------------------------------

MICRO = yaml.safe_load((ROOT / "conf" / "experiment" / "micro.yaml").read_text())
STEPS = 20
# bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3); autocast runs the matmuls on bf16 inputs
# with fp32 accumulation and keeps the loss, norms and softmax statistics in fp32. Measured here (AMD
# EPYC, AVX-512 bf16 and AMX), every design: the largest relative difference of a step's loss 4e-5 to
# 9e-5, the last 5 steps' mean 0 to 3e-5. Stated tolerance: 1e-3 of fp32's loss at every step (half
# bf16's roundoff, ~11x the largest measured) and 2e-4 on the last 5 steps' mean.
STEP_RTOL, TAIL_RTOL = 1e-3, 2e-4


def _micro_losses(key: str, bf16: bool) -> list[float]:
    """20 steps of the micro preset's model, batch and learning rate (AdamW, betas 0.9/0.95, its
    warm-up) on a fixed token stream with structure to learn (a random first-order Markov chain)."""
    shape = MICRO["model"]
    vocab = MICRO["data"]["tokenizer"]["vocab_size"]
    torch.manual_seed(0)
    design, *modifiers = key.split("+")  # origin+sinks: the design with model.sinks=true
    cfg = ModelConfig(**DESIGNS[design].settings(), vocab_size=vocab, **shape, **dict.fromkeys(modifiers, True))
    model = GPT(cfg)
    g = torch.Generator().manual_seed(5)
    successors = torch.randint(0, vocab, (vocab, 2), generator=g)  # each token has 2 successors
    T, B = shape["max_seq_len"], MICRO["batch_size"]
    lr, warmup = MICRO["optim"]["lr"], MICRO["optim"]["warmup_steps"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        rows = torch.empty(B, T + 1, dtype=torch.long)
        rows[:, 0] = torch.randint(0, vocab, (B,), generator=g)
        for t in range(T):
            rows[:, t + 1] = successors[rows[:, t], torch.randint(0, 2, (B,), generator=g)]
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / (warmup + 1))
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = model(rows[:, :-1], rows[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("key", [*DESIGNS, "origin+sinks", "alibi+sinks", "origin+ssmax+qk_norm"])
def test_bf16_autocast_trains_as_fp32(key):
    """Every design's (and the modifiers': sinks on the CPU flash kernel, where autocast leaves RoPE's
    q and k in fp32 and v in bf16) loss curve over 20 micro-preset steps in bf16 autocast stays within the stated
    tolerance of fp32's. On a CPU without bf16 units torch emulates bf16 (9x slower in the study's
    runs), but the micro model's 20 steps take a fraction of a second either way: no skip needed."""
    fp32, bf16 = _micro_losses(key, False), _micro_losses(key, True)
    assert fp32[-1] < fp32[0] - 0.5  # it learns (6.25 -> 5.47): the comparison is of a moving curve
    for step, (a, b) in enumerate(zip(fp32, bf16)):
        assert abs(b - a) <= STEP_RTOL * a, f"step {step + 1}: bf16 {b:.4f} vs fp32 {a:.4f}"
    tail = sum(fp32[-5:]) / 5
    assert abs(sum(bf16[-5:]) / 5 - tail) <= TAIL_RTOL * tail
