"""`python -m train.export_hf run=<run or checkpoint> out=<dir> [rope_scaling=dynamic:4] [overwrite=true]`

Writes a self-contained Hugging Face model directory from any checkpoint kind (ZeRO 0-3, bf16 or
fp32; weights gathered to fp32 by `train.export.load_model`): `config.json`, `model.safetensors`,
`generation_config.json`, and the run's SentencePiece model as a `tokenizer.json` that
`AutoTokenizer` loads (standard `PreTrainedTokenizerFast`, same ids as `data.tokenizer.Tokenizer`).

- origin: a plain `GPTNeoXForCausalLM` (no custom code).
- alibi, coca slack, coca strict: `modeling_coca_lm.py` (beside this file, imports only torch and
  transformers) is copied in and named in `auto_map`; load with `trust_remote_code=True`.

RoPE scalings map onto transformers' `rope_parameters`: none -> default, linear -> linear,
dynamic -> dynamic, yarn -> yarn (`original_max_position_embeddings` = training length), ntk (a
static base) -> default with `rope_theta` = the scaled base. It lives in its own module, not in
`train.export`, because that one is the loader every evaluation imports.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from data.tokenizer import Tokenizer
from model import GPT, ModelConfig
from model.rope import Rope
from train.checkpoint import CheckpointError
from train.config import one_line

REMOTE_CODE = Path(__file__).with_name("modeling_coca_lm.py")
USAGE = ("usage: python -m train.export_hf run=<run dir or checkpoint> out=<dir> "
         "[rope_scaling=none|linear:F|ntk:F|dynamic:F|yarn:F] [overwrite=true]")
_LAYER_NAMES = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.qkv": "attention.query_key_value",
    "attn.proj": "attention.dense",
    "mlp.fc": "mlp.dense_h_to_4h",
    "mlp.proj": "mlp.dense_4h_to_h",
}


class ExportError(Exception):
    """Bad input to the export, reported as one line."""


def parse_scaling(spec: str) -> tuple[str, float]:
    """`none`, or `type:factor` (linear | ntk | dynamic | yarn), as `(type, factor)`."""
    kind, _, factor = spec.partition(":")
    if kind == "none" and not factor:
        return "none", 1.0
    try:
        value = float(factor)
    except ValueError:
        raise ExportError(f"rope_scaling={spec!r}: expected none or type:factor, e.g. dynamic:4") from None
    if kind not in ("linear", "ntk", "dynamic", "yarn"):
        raise ExportError(f"rope_scaling={spec!r}: type {kind!r} is not one of none, linear, ntk, dynamic, yarn")
    return kind, value


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our parameters under GPT-NeoX's names (the custom models use the same layout and names)."""
    out = {"gpt_neox.embed_in.weight": model.wte.weight, "gpt_neox.final_layer_norm.weight": model.ln_f.weight,
           "gpt_neox.final_layer_norm.bias": model.ln_f.bias}
    if not model.cfg.tie_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for i in range(model.cfg.n_layer):
        for ours, theirs in _LAYER_NAMES.items():
            module = model.h[i].get_submodule(ours)
            for p in ("weight", "bias"):
                out[f"gpt_neox.layers.{i}.{theirs}.{p}"] = getattr(module, p)
    return {name: t.detach().to(torch.float32).contiguous().clone() for name, t in out.items()}


def rope_parameters(m: ModelConfig) -> dict:
    """transformers' `rope_parameters` for our RoPE settings (see the module docstring)."""
    s = m.rope_scaling
    params = {"rope_type": "default", "rope_theta": float(m.rope_base), "partial_rotary_factor": float(m.rotary_pct)}
    if s.type == "ntk":
        params["rope_theta"] = Rope(m.rotary_dims, m.rope_base, m.max_seq_len, s).base_at(m.max_seq_len)
    elif s.type in ("linear", "dynamic"):
        params.update(rope_type=s.type, factor=float(s.factor))
    elif s.type == "yarn":
        params.update(rope_type="yarn", factor=float(s.factor), beta_fast=float(s.beta_fast),
                      beta_slow=float(s.beta_slow), original_max_position_embeddings=m.max_seq_len)
    return params


def hf_config(m: ModelConfig, tokenizer: Tokenizer) -> dict:
    """config.json: GPT-NeoX fields; the custom models add `attention`, `coca_form` and `auto_map`."""
    config = {
        "vocab_size": m.vocab_size, "hidden_size": m.n_embd, "num_hidden_layers": m.n_layer,
        "num_attention_heads": m.n_head, "intermediate_size": m.ffn_hidden, "hidden_act": "gelu",
        "max_position_embeddings": m.max_seq_len, "layer_norm_eps": m.layernorm_eps,
        "use_parallel_residual": m.parallel_residual, "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": True, "initializer_range": m.init_std, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id,
        "rope_parameters": rope_parameters(m),
    }
    if m.attention == "origin":  # + the pre-5.0 names of the RoPE fields, for older transformers
        rope = config["rope_parameters"]
        legacy = {"rotary_pct": m.rotary_pct, "rotary_emb_base": rope["rope_theta"],
                  "rope_scaling": rope if rope["rope_type"] != "default" else None}
        return {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", **config, **legacy}
    if m.attention == "alibi":
        del config["rope_parameters"]
    return {"architectures": ["CocaLMForCausalLM"], "model_type": "coca_lm", "attention": m.attention,
            "coca_form": m.coca_form, **config,
            "auto_map": {"AutoConfig": "modeling_coca_lm.CocaLMConfig",
                         "AutoModelForCausalLM": "modeling_coca_lm.CocaLMForCausalLM"}}


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json (BPE with byte fallback, no pre-tokenizer, spaces as U+2581) + its config.

    Our SentencePiece model is BPE with identity normalization and no dummy prefix, so the same
    model in the `tokenizers` library is: replace " " by U+2581, then BPE whose merge ranks follow
    the piece scores. Special tokens are never matched inside text (`split_special_tokens`), as in
    SentencePiece. One difference remains: a literal U+2581 in the text is the space piece here,
    where `data.tokenizer` encodes it as its three bytes.
    """
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(tokenizer.path).read_bytes())
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = [(i, p.piece) for i, p in enumerate(proto.pieces) if p.type == p.NORMAL]
    merges = []
    for i, piece in sorted(normal, key=lambda x: (-proto.pieces[x[0]].score, x[0])):
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        merges += sorted((s for s in splits if s[0] in vocab and s[1] in vocab), key=lambda s: (vocab[s[0]], vocab[s[1]]))
    model = BPE(vocab=vocab, merges=merges, unk_token=proto.pieces[tokenizer.unk_id].piece, byte_fallback=True,
                fuse_unk=True)
    backend = HFTokenizer(model)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    special = {i: proto.pieces[i].piece for i in (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id)}
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
    eos = special[tokenizer.eos_id]
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=eos, eos_token=eos, unk_token=special[tokenizer.unk_id],
        pad_token=special[tokenizer.pad_id], split_special_tokens=True, clean_up_tokenization_spaces=False,
        model_max_length=int(1e30),
    )
    hf.save_pretrained(out)


def export_hf(model: GPT, tokenizer: Tokenizer, out: str | Path) -> Path:
    """Write `model` (fp32) and `tokenizer` as a Hugging Face model directory at `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    m = model.cfg
    if tokenizer.vocab_size != m.vocab_size:
        raise ExportError(f"tokenizer has {tokenizer.vocab_size} pieces but model.vocab_size={m.vocab_size}")
    config = hf_config(m, tokenizer)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    generation = {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id,
                  "pad_token_id": tokenizer.pad_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if m.attention != "origin":
        shutil.copyfile(REMOTE_CODE, out / REMOTE_CODE.name)
    save_tokenizer(tokenizer, out)
    return out


def _parse_args(argv: list[str]) -> dict[str, str]:
    args = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key not in ("run", "out", "rope_scaling", "overwrite"):
            raise ExportError(f"unknown argument {arg!r}; {USAGE}")
        args[key] = value
    for key in ("run", "out"):
        if not args.get(key):
            raise ExportError(f"{key}= is required; {USAGE}")
    if args.get("overwrite", "false") not in ("true", "false"):
        raise ExportError(f"overwrite={args['overwrite']!r} must be true or false")
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit 0 with the directory written, or 2 with one `error: ...` line on stderr."""
    from train.export import load_model

    try:
        args = _parse_args(sys.argv[1:] if argv is None else argv)
        out = Path(args["out"])
        if out.exists() and any(out.iterdir()) and args.get("overwrite") != "true":
            raise ExportError(f"out={out} exists and is not empty (add overwrite=true)")
        scaling = parse_scaling(args["rope_scaling"]) if "rope_scaling" in args else None
        if not Path(args["run"]).exists():
            raise ExportError(f"run or checkpoint not found: {args['run']}")
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's merge prints progress to stdout
            model, _, tokenizer = load_model(args["run"])
        if scaling is not None:
            model.set_rope_scaling(*scaling)
        if out.exists() and args.get("overwrite") == "true":
            shutil.rmtree(out)
        export_hf(model, tokenizer, out)
    except (ExportError, CheckpointError, ValueError, OSError) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    m = model.cfg
    kind = m.attention if m.attention != "coca" else f"coca {m.coca_form}"
    code = "" if m.attention == "origin" else " (trust_remote_code=True)"
    print(f"exported {kind} ({m.rope_scaling.type} RoPE scaling) to {out}: AutoModelForCausalLM{code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
