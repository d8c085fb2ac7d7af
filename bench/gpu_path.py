"""The GPU path run on a CPU: which ops it dispatches, and whether every one exists on CUDA.

    python -m bench.gpu_path                          # every design: the fake-CUDA sweep (about a minute)
    python -m bench.gpu_path --designs alibi fox      # some designs
    python -m bench.gpu_path --flex alibi fox         # also compiled FlexAttention vs the CPU kernels (a compile each)

`model.kernel=flex` makes `model.kernel_path.takes_gpu_path` true for CPU tensors, so the model runs
the code it runs on a GPU (FlexAttention with block masks and score modifications, SDPA, the
chunked bias path) on the CPU. `CudaOpCheck` records every aten op that code dispatches and names
each one that has no CUDA kernel: what would crash on a GPU (the CPU flash kernel called directly,
a CPU tile). The sweep runs every design x {plain, documents} x {fp32, bf16 autocast, bf16
parameters (DeepSpeed's bf16: `module.bfloat16()`, no autocast)} x {training step (forward +
backward), the same with activation checkpointing (`model.activation_checkpointing`: the block's
forward recomputed in backward), KV-cache generation, evaluation forward} and prints one row per
case. Ops that activation checkpointing recomputes in backward are forward ops and are filed so
("forward, recomputed in backward of ..."), not under the autograd node whose backward triggered
the recomputation. `LargestTensor` records the largest tensor any op makes (the memory tests).

What it cannot see: the Triton code FlexAttention compiles to on a GPU (here FlexAttention is torch's
dense reference of the same score and mask functions, `eager_flex`), NCCL, memory and speed
(docs/GPU.md). Whether an op has a CUDA kernel comes from the dispatcher where torch is a CUDA
build, else from the operator table this torch was built from (torchgen's native_functions.yaml,
shipped with it: the table that registers each op's CUDA kernel in a CUDA build).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import model.kernel_path as kernel_path
from model import GPT, KVCache
from model.config import ModelConfig
from model.denormals import flush_denormals
from model.designs import DESIGNS

# Dispatch keys whose kernel serves a CUDA tensor: CUDA's own, and the composite ones (device-generic code).
CUDA_KEYS = ("CUDA", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional", "CompositeImplicitAutograd")
# SDPA's CPU backends: F.scaled_dot_product_attention picks them for a CPU tensor and a CUDA backend
# (flash, memory-efficient, cuDNN or math) for a CUDA one, so called by SDPA they are not a finding.
SDPA_CPU = {"aten::_scaled_dot_product_flash_attention_for_cpu": "ScaledDotProductFlashAttentionForCpuBackward0",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward": None}


@functools.cache
def _native_dispatch() -> dict[str, set[str]]:
    """`aten::name.overload` -> the dispatch keys of its kernels in this torch's operator table
    (an op without a `dispatch` entry is CompositeImplicitAutograd; a structured one has its
    delegate's)."""
    import torchgen
    import yaml

    table = Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"
    entries = yaml.load(table.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    keys: dict[str, set[str]] = {}
    delegates: dict[str, str] = {}
    for entry in entries:
        name = "aten::" + entry["func"].split("(", 1)[0]
        if "dispatch" in entry:
            keys[name] = {k.strip() for spec in entry["dispatch"] for k in spec.split(",")}
        elif "structured_delegate" in entry:
            delegates[name] = "aten::" + entry["structured_delegate"]
        else:
            keys[name] = {"CompositeImplicitAutograd"}
    for name, delegate in delegates.items():
        keys[name] = keys.get(delegate, set())
    return keys


def has_cuda_kernel(op: torch._ops.OpOverload) -> bool:
    """Whether a CUDA tensor can run `op`: a CUDA or composite kernel (`CUDA_KEYS`)."""
    name = op.name() if op._overloadname == "default" else f"{op._schema.name}.{op._overloadname}"
    if name.startswith("aten::") and name.endswith(".default"):
        name = name[: -len(".default")]
    if any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key) for key in CUDA_KEYS[1:]):
        return True
    if torch.backends.cuda.is_built():
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA")
    return bool(_native_dispatch().get(name, set()) & set(CUDA_KEYS))


class _Depth:
    """A reusable context that counts how deeply it is entered (a recomputation may run again, nested)."""

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc) -> None:
        self.depth -= 1


class _InsideSdpa(TorchFunctionMode):
    """Counts the open calls of F.scaled_dot_product_attention (whose backend choice is the device's)
    in `calls`."""

    def __init__(self, calls: _Depth) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        with self.calls:
            return func(*args, **(kwargs or {}))


class _Recomputation:
    """Activation checkpointing's recomputation context (`_marking_recomputation`): counted in
    `depth`, with SDPA's calls counted in `sdpa` as in forward (the autograd engine runs it without
    the caller's torch-function modes)."""

    def __init__(self, sdpa: _Depth) -> None:
        self.depth, self.sdpa = _Depth(), sdpa
        self._modes: list[_InsideSdpa] = []

    def __enter__(self) -> None:
        self.depth.__enter__()
        self._modes.append(_InsideSdpa(self.sdpa))
        self._modes[-1].__enter__()

    def __exit__(self, *exc) -> None:
        self._modes.pop().__exit__(*exc)
        self.depth.__exit__(*exc)


@contextlib.contextmanager
def _marking_recomputation(mark: _Recomputation) -> Iterator[None]:
    """torch's non-reentrant `checkpoint` (torch.utils.checkpoint's and the name each module of
    `model` imported) given `mark` as its recomputation context (`context_fn`): what runs inside it
    is a forward recomputed in backward."""
    import torch.utils.checkpoint as torch_checkpoint

    original = torch_checkpoint.checkpoint

    def marked(function, *args, use_reentrant: bool | None = None, **kwargs):
        if use_reentrant is False and "context_fn" not in kwargs:
            kwargs["context_fn"] = lambda: (contextlib.nullcontext(), mark)
        return original(function, *args, use_reentrant=use_reentrant, **kwargs)

    holders = [torch_checkpoint] + [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "model"
                                    and getattr(m, "checkpoint", None) is original]
    for holder in holders:
        holder.checkpoint = marked
    try:
        yield
    finally:
        for holder in holders:
            holder.checkpoint = original


@dataclass
class CudaOpCheck(TorchDispatchMode):
    """Records every op dispatched while active; `missing` holds those without a CUDA kernel, with
    the phase (forward; forward recomputed by activation checkpointing in the backward of an
    autograd node; or the autograd node running them in backward) that dispatched them."""

    seen: set[str] = field(default_factory=set)
    missing: dict[str, set[str]] = field(default_factory=dict)
    supports_higher_order_operators = True

    def __post_init__(self) -> None:
        super().__init__()
        self._in_sdpa = _Depth()
        self._sdpa = _InsideSdpa(self._in_sdpa)
        self._recomputing = _Recomputation(self._in_sdpa)
        self._marking = _marking_recomputation(self._recomputing)

    def __enter__(self):
        self._sdpa.__enter__()
        self._marking.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._marking.__exit__(*exc)
        return self._sdpa.__exit__(*exc)

    def flex_ran(self, out: torch.Tensor) -> None:
        """FlexAttention ran outside the mode (`eager_flex`)."""
        self.seen.add("flex_attention")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.OpOverload):
            self._check(func)
        else:  # a higher-order op: FlexAttention's (Triton kernels on a GPU)
            self.seen.add(str(func))
            if str(func) == "flex_attention_backward":
                self._check_joint(args[8])
        return func(*args, **(kwargs or {}))

    def _check_joint(self, joint: torch.fx.GraphModule) -> None:
        """The check inductor runs on FlexAttention's backward before lowering it to Triton (a
        score_mod that indexes a tensor needing gradients more than once has no GPU backward)."""
        from torch._inductor.kernel.flex.flex_attention import validate_joint_graph

        joint.graph.eliminate_dead_code()  # as the lowering does first
        try:
            validate_joint_graph(joint.graph)
        except NotImplementedError as error:
            self.missing.setdefault("flex_attention_backward", set()).add(str(error).split(". ")[0])

    def _check(self, op: torch._ops.OpOverload) -> None:
        name = op.name()
        self.seen.add(name)
        if name.startswith("prim::") or has_cuda_kernel(op):
            return
        node = torch._C._current_autograd_node()
        forward = node is None or self._recomputing.depth.depth > 0
        if node is None:
            where = "forward"
        elif forward:
            where = f"forward, recomputed in backward of {node.name()}"
        else:
            where = f"backward of {node.name()}"
        if name in SDPA_CPU and (self._in_sdpa.depth > 0 if forward else node.name() == SDPA_CPU[
                "aten::_scaled_dot_product_flash_attention_for_cpu"]):
            return  # SDPA's own choice for a CPU tensor (its autograd formula's, in backward)
        self.missing.setdefault(name, set()).add(where)


class LargestTensor(TorchDispatchMode):
    """The largest tensor (elements) any op makes while active, and the op: a T x T tensor anywhere
    in a forward shows as growth 4x for 2x length. FlexAttention run by `eager_flex` (outside the
    mode: torch's dense reference, not the GPU's kernel) counts as its output, the fused kernel's
    only allocation."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.op = 0, ""

    def _record(self, name: str, out) -> None:
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor) and x.numel() > self.numel:
                self.numel, self.op = x.numel(), name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._record(str(func), out)
        return out

    def flex_ran(self, out: torch.Tensor) -> None:
        self._record("flex_attention", out)


@contextlib.contextmanager
def eager_flex(checked: CudaOpCheck | LargestTensor | None = None) -> Iterator[None]:
    """FlexAttention as torch's dense reference (its score and mask functions traced, not compiled)
    with gradients on a CPU: torch refuses CPU backward in `flex_attention`'s entry only because it
    compiles no CPU backward kernel; the traced reference has one. Under a `CudaOpCheck` the call runs
    outside it (a traced call cannot run under a Python dispatch mode) and is recorded as FlexAttention."""
    import torch.nn.attention.flex_attention as flex

    def run(q, k, v, **options):
        with _disable_current_modes():
            out = flex.flex_attention(q, k, v, **options)
        if checked is not None:
            checked.flex_ran(out)
        return out

    # `run_flex` in each module of `model` that calls it: a `from .kernel_path import` binds its own name
    original = kernel_path.run_flex
    holders = [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "model"
               and getattr(m, "run_flex", None) is original]
    refuse = flex._validate_device
    flex._validate_device = lambda *tensors: None
    for holder in holders:
        holder.run_flex = run
    try:
        with warnings.catch_warnings():  # "called without torch.compile": the point here
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            yield
    finally:
        flex._validate_device = refuse
        for holder in holders:
            holder.run_flex = original


# ---- the sweep ---------------------------------------------------------------------------------------

VOCAB, T = 64, 24
FLEX_RTOL = 1e-4  # float32 kernels that sum in different orders
DOCUMENTS = torch.tensor([[0] * 7 + [1] * 10 + [2] * 7, [0] * 24])  # boundaries inside rows, and a row of one
# The compiled kernel's checks: past one 128-token tile, as a CPU runs FlexAttention's dense reference
# below it (`kernel_path.CPU_DENSE_BELOW`), and 8 mod 16 (lengths torch 2.13's CPU kernel got wrong
# below a tile); documents end inside the first tile, across the tile boundary, and a row of one.
FLEX_T = 136
FLEX_DOCUMENTS = torch.tensor([[0] * 50 + [1] * 80 + [2] * 6, [0] * FLEX_T])


def config(key: str, documents: bool, kernel: str = "flex", **overrides) -> ModelConfig:
    """A two-layer model of design `key` (the hybrid: one windowed layer, window 8, and one global)."""
    design = DESIGNS[key]
    chosen = design.settings()
    params = chosen.pop("design_params", {}) | ({"hybrid": {"nope_every": 2, "window": 8}} if key == "hybrid" else {})
    settings = dict(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, max_seq_len=T,
                    doc_mask=documents, doc_positions=documents, kernel=kernel, design_params=params)
    return ModelConfig(**chosen, **{**settings, **overrides})


def _train_step(model: GPT, idx: torch.Tensor, documents: torch.Tensor | None) -> None:
    loss = model(idx, idx.roll(-1, dims=1), documents=documents)
    loss.backward()


def _kv_steps(model: GPT, idx: torch.Tensor, documents: torch.Tensor | None) -> None:
    """Generation: the prompt (its last position's logits only), then two one-token steps."""
    with torch.no_grad():
        for _ in model.stream(idx[:, :16], 3, greedy=True):
            pass


def _evaluation(model: GPT, idx: torch.Tensor, documents: torch.Tensor | None) -> None:
    """Perplexity's per-token losses and the passkey scorer's last-position logits."""
    with torch.no_grad():
        model.token_losses(idx, idx.roll(-1, dims=1), documents=documents)
        model(idx, logits_to_keep=1)


# train_checkpointed: the training step with `model.activation_checkpointing` (the 350M presets')
MODES: dict[str, Callable[[GPT, torch.Tensor, torch.Tensor | None], None]] = {
    "train": _train_step, "train_checkpointed": _train_step, "kv_cache": _kv_steps, "eval": _evaluation}
# bf16: autocast (fp32 parameters); bf16_params: the parameters themselves bf16, no autocast (DeepSpeed's bf16)
DTYPES = ("fp32", "bf16", "bf16_params")


@dataclass(frozen=True)
class Case:
    design: str
    documents: bool
    dtype: str
    mode: str
    modifiers: bool = False  # the softmax modifiers on (model.sinks and model.ssmax)

    def model(self) -> GPT:
        """The case's model on the forced GPU path, in its dtype and mode's settings."""
        torch.manual_seed(0)
        model = GPT(config(self.design, self.documents, sinks=self.modifiers, ssmax=self.modifiers,
                           activation_checkpointing=self.mode == "train_checkpointed"))
        return model.bfloat16() if self.dtype == "bf16_params" else model

    def run(self) -> CudaOpCheck:
        """The case on the forced GPU path, under a `CudaOpCheck`."""
        model = self.model()
        idx = torch.randint(0, VOCAB, (2, T))
        documents = DOCUMENTS if self.documents else None
        checked = CudaOpCheck()
        autocast = torch.autocast("cpu", torch.bfloat16, enabled=self.dtype == "bf16")
        with eager_flex(checked), checked, autocast:
            MODES[self.mode](model, idx, documents)
        return checked


def cases(designs: list[str] | None = None) -> list[Case]:
    return [Case(d, docs, dtype, mode) for d in designs or DESIGNS for docs in (False, True) for dtype in DTYPES
            for mode in MODES]


def sweep(designs: list[str] | None = None, out=sys.stdout) -> int:
    """Every case, one table row each; the number of cases with an op that has no CUDA kernel."""
    print("| design | documents | dtype | mode | ops | FlexAttention | ops without a CUDA kernel |", file=out)
    print("|---|---|---|---|---|---|---|", file=out)
    bad = 0
    for case in cases(designs):
        checked = case.run()
        missing = "; ".join(f"{op} ({', '.join(sorted(w))})" for op, w in sorted(checked.missing.items()))
        bad += bool(missing)
        print(f"| {case.design} | {'yes' if case.documents else 'no'} | {case.dtype} | {case.mode} | "
              f"{len(checked.seen)} | {'yes' if 'flex_attention' in checked.seen else 'no'} | {missing or '-'} |",
              file=out, flush=True)
    return bad


# ---- compiled FlexAttention against the CPU kernels -----------------------------------------------------


def flex_against_cpu(key: str, documents: bool) -> float:
    """The largest difference of the forced GPU path's logits (compiled FlexAttention, forward) from
    the CPU kernels' on the same weights, relative to their largest magnitude: with documents and
    `doc_positions`, or without and then also over a KV-cache continuation (8 queries after the
    same `FLEX_T` tokens: below one tile, the dense reference on a CPU)."""
    torch.manual_seed(0)
    cpu = GPT(config(key, documents, kernel="auto", max_seq_len=FLEX_T + 8)).eval()
    gpu = GPT(config(key, documents, kernel="flex", max_seq_len=FLEX_T + 8)).eval()
    gpu.load_state_dict(cpu.state_dict())
    idx = torch.randint(0, VOCAB, (2, FLEX_T + 8))
    docs = FLEX_DOCUMENTS if documents else None
    with torch.no_grad():
        pairs = [(gpu(idx[:, :FLEX_T], documents=docs), cpu(idx[:, :FLEX_T], documents=docs))]
        if not documents:  # a KV cache continues one document
            cache = KVCache(gpu.cfg.n_layer)
            gpu(idx[:, :FLEX_T], cache=cache)
            pairs.append((gpu(idx[:, FLEX_T:], cache=cache), cpu(idx)[:, FLEX_T:]))
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--designs", nargs="+", choices=list(DESIGNS), default=None)
    parser.add_argument("--flex", nargs="*", choices=list(DESIGNS), default=None, metavar="DESIGN",
                        help="also compiled FlexAttention vs the CPU kernels for these designs (none: --designs)")
    args = parser.parse_args(argv)
    flush_denormals()
    start = time.perf_counter()
    bad = sweep(args.designs)
    print(f"\nfake-CUDA sweep: {len(cases(args.designs))} cases, {bad} with an op that has no CUDA kernel "
          f"({time.perf_counter() - start:.0f} s)")
    if args.flex is not None:
        print(f"\n| design | documents | compiled Flex vs CPU kernels (relative; at most {FLEX_RTOL:.0e}) |")
        print("|---|---|---|")
        for key in args.flex or args.designs or DESIGNS:
            for documents in (False, True):
                difference = flex_against_cpu(key, documents)
                bad += not difference <= FLEX_RTOL
                print(f"| {key} | {'yes' if documents else 'no'} | {difference:.1e} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
