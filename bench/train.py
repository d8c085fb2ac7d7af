"""Training throughput and peak memory of one step (forward, backward, AdamW): our model beside
other implementations of the same shape, as ratios to Hugging Face's measured in the same run.

`--arch neox` (default): our GPT-NeoX beside HF GPTNeoXForCausalLM (parallel residual, full rotary,
exact GELU, untied embeddings). `--arch llama`: our arch=llama beside HF LlamaForCausalLM and
litgpt's `litgpt.model.GPT` from a `litgpt.Config` of the same shape (RMSNorm, SwiGLU, grouped-query
attention, no biases, sequential residual; untied embeddings as the llama flavors but
llama3.2_1b, whose embedding litgpt's head is then tied to). Each trains the way its library does:
ours its chunked loss (no [batch, tokens, vocab] logits), HF `labels=`, litgpt its pretraining
loss (`chunked_cross_entropy` of the logits). fp32 on a CPU, bf16 autocast on a GPU.

Same function: before timing, one set of random weights (ours, norm gains and biases too) is mapped
by name into every baseline (`hf.names`; litgpt's fused `attn.qkv` is q, k, v stacked, its
`mlp.fc_1/fc_2/proj` gate, up, down) and their fp32 logits must agree with ours to 1e-4, with equal
parameter counts. Speed: all implementations in one process, steps interleaved (A B C, C B A, ...),
so a machine whose speed drifts slows each alike (separate runs on this 2-core machine swung the
ratio by +-10%); tokens/s from the median step. Peak memory: each in its own process, the growth of
the peak resident set (CPU; GPU: max allocated) after its library is imported. On a GPU it also
reports the MFU of the `350m` model at 512 tokens, from the trainer's FLOPs count and peak table.

litgpt is optional: without it (`pip install --no-deps litgpt==0.5.13`, see requirements-dev.txt)
its column is skipped with a note.

    python -m bench.train                      # tiny and 125m, CPU or GPU (or: python bench/train.py)
    python -m bench.train --flavors tiny --steps 30
    python -m bench.train --compile            # ours with compile=true (torch.compile per block)
    python -m bench.train --arch llama --vocab-size 32000 --threads 1   # ours vs HF Llama vs litgpt
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script, bench/ would come first on the path and this file would shadow the `train` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hf.names import hf_names, llama_hf_names  # noqa: E402
from model import GPT, count_parameters, flavor  # noqa: E402
from model.config import ARCHS, ModelConfig  # noqa: E402
from model.denormals import flush_denormals  # noqa: E402
from train.flops import device_peak_flops, flops_per_token  # noqa: E402

# (batch, tokens) per flavor on a CPU and on a GPU: the trainer's defaults on a CPU, larger on a GPU.
SHAPES = {"tiny": ((16, 128), (64, 128)), "125m": ((2, 512), (16, 512)), "350m": ((1, 512), (32, 512)),
          "1.3b": ((1, 512), (8, 512)), "llama_tiny": ((16, 128), (64, 128)), "llama_wide": ((4, 512), (16, 512)),
          "tinyllama_1.1b": ((1, 512), (8, 512)), "llama3.2_1b": ((1, 512), (8, 512))}
# A benchmark-only shape: llama_tiny widened to a CPU-sized model of some depth (55M parameters at
# a 32000-piece vocabulary, 26M at 4096).
WIDENED = {"llama_wide": ("llama_tiny", dict(n_layer=8, n_head=8, n_kv_head=2, n_embd=512, ffn_hidden=1376))}
DEFAULT_FLAVORS = {"neox": ["tiny", "125m"], "llama": ["llama_tiny", "llama_wide"]}
HF_NAME = {"neox": "HF GPT-NeoX", "llama": "HF Llama"}
TOLERANCE = 1e-4  # fp32 logits: ours against each baseline, before anything is timed
LITGPT_INSTALL = "pip install --no-deps litgpt==0.5.13 (see requirements-dev.txt)"


def bench_config(name: str, seq_len: int, vocab: int) -> ModelConfig:
    """The flavor (or benchmark-only shape) `name` at `seq_len` tokens and `vocab` pieces."""
    base, overrides = WIDENED.get(name, (name, {}))
    return flavor(base, **overrides, max_seq_len=seq_len, vocab_size=vocab)


def hf_model(cfg: ModelConfig) -> torch.nn.Module:
    """Hugging Face's model of our shape: LlamaForCausalLM (arch=llama) or GPTNeoXForCausalLM."""
    if cfg.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
            num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
            hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.layernorm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
            tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        )
        return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, intermediate_size=cfg.ffn_hidden, hidden_act="gelu",
        rotary_pct=cfg.rotary_pct, rotary_emb_base=cfg.rope_base, max_position_embeddings=cfg.max_seq_len,
        layer_norm_eps=cfg.layernorm_eps, use_parallel_residual=cfg.parallel_residual,
        tie_word_embeddings=cfg.tie_embeddings, attention_dropout=0.0, hidden_dropout=0.0,
    )
    return GPTNeoXForCausalLM._from_config(config, attn_implementation="sdpa")


def litgpt_model(cfg: ModelConfig) -> torch.nn.Module:
    """litgpt's GPT of an arch=llama shape (its Llama configs' fields), built from a Config: no download."""
    from litgpt.config import Config
    from litgpt.model import GPT as LitGPT

    model = LitGPT(Config(
        block_size=cfg.max_seq_len, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
        n_query_groups=cfg.kv_heads, vocab_size=cfg.vocab_size, padded_vocab_size=cfg.vocab_size,
        intermediate_size=cfg.ffn_hidden, rope_base=cfg.rope_base, rotary_percentage=1.0, parallel_residual=False,
        bias=False, norm_class_name="RMSNorm", norm_eps=cfg.layernorm_eps, mlp_class_name="LLaMAMLP",
    ))
    if cfg.tie_embeddings:  # litgpt has no tying option (its converter copies the embedding)
        model.lm_head.weight = model.transformer.wte.weight
    return model


def litgpt_missing() -> str | None:
    """Why the litgpt column cannot run here, or None when it can."""
    try:
        import litgpt.model  # noqa: F401
    except ImportError as e:
        return f"litgpt column skipped: `import litgpt.model` failed ({e}); {LITGPT_INSTALL}"
    return None


BUILDERS: dict[str, Callable[[ModelConfig], torch.nn.Module]] = {"ours": GPT, "hf": hf_model, "litgpt": litgpt_model}


def import_library(impl: str) -> None:
    """Import what `impl` builds its model with, so that its memory is not counted in the peak."""
    if impl == "hf":  # transformers loads its modelling modules lazily: name the classes
        from transformers import GPTNeoXForCausalLM, LlamaForCausalLM  # noqa: F401
    elif impl == "litgpt":
        import litgpt.model  # noqa: F401


def baseline_state_dict(impl: str, ours: GPT) -> dict[str, torch.Tensor]:
    """Our parameters under `impl`'s names (HF: `hf.names`; litgpt: its Llama layout)."""
    cfg, state = ours.cfg, ours.state_dict()
    if impl == "hf":
        names = (llama_hf_names if cfg.arch == "llama" else hf_names)(cfg)
        mapped = {theirs: state[name] for name, theirs in names.items()}
        if cfg.tie_embeddings:
            mapped["lm_head.weight"] = state["wte.weight"]
        return mapped
    mapped = {"transformer.wte.weight": state["wte.weight"], "transformer.ln_f.weight": state["ln_f.weight"],
              "lm_head.weight": state["lm_head.weight"]}
    for i in range(cfg.n_layer):
        a, b = f"h.{i}.", f"transformer.h.{i}."
        mapped[b + "attn.qkv.weight"] = torch.cat([state[a + f"attn.{p}.weight"] for p in "qkv"])
        for ours_name, theirs in (("ln_1", "norm_1"), ("ln_2", "norm_2"), ("attn.proj", "attn.proj"),
                                  ("mlp.gate", "mlp.fc_1"), ("mlp.up", "mlp.fc_2"), ("mlp.down", "mlp.proj")):
            mapped[f"{b}{theirs}.weight"] = state[f"{a}{ours_name}.weight"]
    return mapped


def n_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # each shared (tied) tensor once


def check_same_function(cfg: ModelConfig, baselines: list[str]) -> dict[str, float]:
    """Ours with random weights (norm gains and biases too, so a misplaced one shows), mapped into each
    baseline; fp32 logits on one batch of the benchmark's length must agree to TOLERANCE and the
    parameter counts be equal. Returns each baseline's largest logit difference."""
    torch.manual_seed(0)
    ours = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
            elif p.dim() == 1:
                p.normal_(1.0, 0.1)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ours(idx)
    diffs = {}
    for impl in baselines:
        model = BUILDERS[impl](cfg).eval()
        model.load_state_dict(baseline_state_dict(impl, ours), strict=True)
        if n_parameters(model) != n_parameters(ours):
            raise RuntimeError(f"{impl} has {n_parameters(model):,} parameters, ours {n_parameters(ours):,}: "
                               "not the same shape")
        with torch.no_grad():
            got = model(idx)
        got = got.logits if hasattr(got, "logits") else got
        diffs[impl] = (got - want).abs().max().item()
        if not diffs[impl] <= TOLERANCE:
            raise RuntimeError(f"{impl}'s logits differ from ours by {diffs[impl]:.2e} (> {TOLERANCE:g}) on the "
                               f"same weights: the benchmark would compare different functions")
    return diffs


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Trainee:
    """One implementation's model, optimizer and a fixed batch; `step()` is one optimizer step."""

    def __init__(self, impl: str, cfg: ModelConfig, batch: int, compile: bool):
        torch.manual_seed(0)
        self.cuda = torch.cuda.is_available()
        self.device = "cuda" if self.cuda else "cpu"
        self.impl = impl
        self.model = BUILDERS[impl](cfg).to(self.device).train()
        if compile and impl == "ours":
            self.model.compile_blocks()  # as the trainer's compile=true
        if impl == "litgpt":
            from litgpt.utils import chunked_cross_entropy

            self.litgpt_loss = chunked_cross_entropy  # as litgpt's pretraining loop
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95))
        self.data = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len + 1), device=self.device)
        self.step()
        self.step()  # a second warm-up step: compiled code may recompile once after the first

    def step(self) -> None:
        inputs = self.data[:, :-1]
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.cuda):
            if self.impl == "ours":
                loss = self.model(inputs, self.data[:, 1:])
            elif self.impl == "hf":
                loss = self.model(input_ids=inputs, labels=inputs).loss  # HF shifts the labels itself
            else:
                loss = self.litgpt_loss(self.model(inputs), self.data[:, 1:])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.step()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def _set_cpu(threads: int | None) -> None:
    """Each measuring process's CPU settings, first thing: subnormals flushed (model/denormals.py),
    then its threads."""
    flush_denormals()
    if threads:
        torch.set_num_threads(threads)


def measure_speed(impls: list[str], cfg: ModelConfig, batch: int, steps: int, compile: bool, threads: int | None,
                  queue) -> None:
    """One process, the implementations' steps interleaved (A B C, C B A, ...), so that a machine whose
    speed drifts (shared cores, clocks) slows each alike; reports tokens/s from median step times."""
    _set_cpu(threads)
    trainees = [Trainee(impl, cfg, batch, compile) for impl in impls]
    times: list[list[float]] = [[] for _ in trainees]
    for i in range(steps):
        order = range(len(trainees)) if i % 2 == 0 else reversed(range(len(trainees)))
        for j in order:
            times[j].append(trainees[j].timed_step())
    queue.put([batch * cfg.max_seq_len / statistics.median(t) for t in times])


def measure_memory(impl: str, cfg: ModelConfig, batch: int, compile: bool, threads: int | None, queue) -> None:
    """One process per implementation: peak memory (MiB) over warm-up and one step, beyond the
    process after importing the implementation's library."""
    _set_cpu(threads)
    import_library(impl)
    baseline = _rss_mb()
    trainee = Trainee(impl, cfg, batch, compile)
    if trainee.cuda:
        torch.cuda.reset_peak_memory_stats()
    trainee.timed_step()
    queue.put(torch.cuda.max_memory_allocated() / 2**20 if trainee.cuda
              else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline)


def in_process(target, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=ARCHS, default="neox",
                        help="neox: ours vs HF GPT-NeoX; llama: ours vs HF Llama and litgpt")
    parser.add_argument("--flavors", nargs="+", help="default: tiny 125m (neox), llama_tiny llama_wide (llama)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--compile", action="store_true", help="compile our blocks (the others stay eager)")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="4096: the stdlib tokenizer's; 32000: Llama 2's, TinyLlama's; 50304: the paper presets'")
    parser.add_argument("--threads", type=int, help="torch threads in each measuring process (default: torch's)")
    args = parser.parse_args(argv)
    args.flavors = args.flavors or DEFAULT_FLAVORS[args.arch]
    for name in args.flavors:
        if name not in SHAPES:
            parser.error(f"--flavors: {name!r} is not one of {', '.join(SHAPES)}")
        if bench_config(name, 128, args.vocab_size).arch != args.arch:
            parser.error(f"--flavors: {name!r} is not an arch={args.arch} flavor (use --arch for the other)")
    if args.steps < 1 or args.vocab_size < 2 or (args.threads is not None and args.threads < 1):
        parser.error("--steps and --threads must be >= 1, --vocab-size >= 2")
    return args


def main() -> None:
    args = parse_args()
    _set_cpu(args.threads)
    cuda = torch.cuda.is_available()
    baselines = ["hf"]
    skipped = None
    if args.arch == "llama":
        skipped = litgpt_missing()
        if skipped is None:
            baselines.append("litgpt")
    impls = ["ours", *baselines]
    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores), fp32"
    print(f"device: {device}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
          f"vocabulary {args.vocab_size}; ours {'compiled' if args.compile else 'eager'}")
    if skipped:
        print(skipped)
    print()
    label = {"ours": "ours", "hf": HF_NAME[args.arch], "litgpt": "litgpt"}
    ratios = [(a, "hf") for a in impls if a != "hf"] + ([("ours", "litgpt")] if "litgpt" in impls else [])
    header = ["model", "batch x tokens", *(f"{label[i]} tokens/s" for i in impls),
              *(f"{a} / {'HF' if b == 'hf' else b}" for a, b in ratios), *(f"{label[i]} peak MiB" for i in impls)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    checks = []
    for name in args.flavors:
        batch, seq_len = SHAPES[name][cuda]
        cfg = bench_config(name, seq_len, args.vocab_size)
        diffs = check_same_function(cfg, baselines)
        checks.append(f"{name}: " + ", ".join(f"{label[i]} {d:.1e}" for i, d in diffs.items()))
        speed = dict(zip(impls, in_process(measure_speed, impls, cfg, batch, args.steps, args.compile,
                                           args.threads)))
        memory = {i: in_process(measure_memory, i, cfg, batch, args.compile, args.threads) for i in impls}
        params = count_parameters(cfg)["total"] / 1e6
        cells = [f"{name} ({params:.0f}M)", f"{batch} x {seq_len}", *(f"{speed[i]:,.0f}" for i in impls),
                 *(f"{speed[a] / speed[b]:.2f}x" for a, b in ratios), *(f"{memory[i]:,.0f}" for i in impls)]
        print("| " + " | ".join(cells) + " |", flush=True)
    print(f"\nSame weights, fp32 logits, largest difference from ours (<= {TOLERANCE:g}, equal parameter counts): "
          + "; ".join(checks))
    if cuda:
        batch, seq_len = SHAPES["350m"][cuda]
        (tokens_per_s,) = in_process(measure_speed, ["ours"], bench_config("350m", seq_len, args.vocab_size), batch,
                                     max(args.steps, 10), args.compile, args.threads)
        peak = device_peak_flops("bf16")
        if peak:
            mfu = flops_per_token(flavor("350m", vocab_size=args.vocab_size), seq_len) * tokens_per_s / peak
            print(f"\n350m at {seq_len} tokens, batch {batch}, bf16: {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}")
        else:
            print(f"\n350m: {tokens_per_s:,.0f} tokens/s (device not in the peak-FLOPs table: no MFU)")


if __name__ == "__main__":
    main()
