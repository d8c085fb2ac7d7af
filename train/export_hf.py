"""`python -m train.export_hf run=<run or checkpoint> out=<dir> [rope_scaling=dynamic:4] [overwrite=true]`

Writes a self-contained Hugging Face model directory from any checkpoint kind (ZeRO 0-3, bf16 or
fp32; weights gathered to fp32 by `train.export.load_model`): `config.json`, `model.safetensors`,
`generation_config.json`, and the run's SentencePiece model as a `tokenizer.json` that
`AutoTokenizer` loads (standard `PreTrainedTokenizerFast`, same ids as `data.tokenizer.Tokenizer`).

- origin: a plain `GPTNeoXForCausalLM` (no custom code).
- alibi, coca slack, coca strict: `modeling_coca_lm.py` (beside this file, imports only torch and
  transformers) is copied in and named in `auto_map`; load with `trust_remote_code=True`.

`out` is checked before anything loads (`check_out`): never a run or checkpoint directory, inside
one or holding one; a non-empty `out` must be a previous export, recognised by the marker
`coca_lm_export.json` that lists its files, and is replaced only with `overwrite=true`. The export
is written beside `out` and renamed in: a failure leaves the previous export or nothing.

RoPE scalings map onto transformers' `rope_parameters`: none -> default, linear -> linear,
dynamic -> dynamic, yarn -> yarn (`original_max_position_embeddings` = training length), ntk (a
static base) -> default with `rope_theta` = the scaled base. It lives in its own module, not in
`train.export`, because that one is the loader every evaluation imports.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from data.config import check_dir
from data.tokenizer import Tokenizer
from model import GPT, ModelConfig
from model.transforms import Rope
from train.checkpoint import MARKER, CheckpointError, find_checkpoint
from train.config import one_line

REMOTE_CODE = Path(__file__).with_name("modeling_coca_lm.py")
EXPORT_MARKER = "coca_lm_export.json"  # names what the export wrote: overwrite=true replaces only that
RUN_FILES = ("checkpoints", "metrics.jsonl", "deepspeed.json")  # beside config.yaml: a run directory
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


def _tokenizer_proto(tokenizer: Tokenizer):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(tokenizer.path).read_bytes())
    return proto


def tokenizer_refusal(tokenizer: Tokenizer) -> str | None:
    """Why `save_tokenizer` cannot write this SentencePiece model as a `tokenizer.json` that encodes
    exactly as `data.tokenizer` does, or None. Ours (`data.tokenizer.train_tokenizer`) always fits;
    a `data.tokenizer.model_path` of another origin may not (a unigram model, a normalization rule,
    a dummy prefix): it is refused rather than exported to encode differently."""
    proto = _tokenizer_proto(tokenizer)
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    unsupported = [
        (trainer.model_type != trainer.BPE,
         f"model_type={trainer.ModelType.Name(trainer.model_type)} (not BPE)"),
        (not trainer.byte_fallback, "byte_fallback=false"),
        (bool(norm.precompiled_charsmap) or norm.name not in ("identity", ""),
         f"normalization_rule_name={norm.name!r} (not identity)"),
        (norm.add_dummy_prefix, "add_dummy_prefix=true"),
        (norm.remove_extra_whitespaces, "remove_extra_whitespaces=true"),
        (not norm.escape_whitespaces, "escape_whitespaces=false"),
        (trainer.treat_whitespace_as_suffix, "treat_whitespace_as_suffix=true"),
    ]
    found = [what for bad, what in unsupported if bad]
    if not found:
        return None
    return (f"tokenizer {tokenizer.path} has {', '.join(found)}: the export writes tokenizer.json only "
            "for SentencePiece BPE models trained like data.tokenizer's (identity normalization, no dummy "
            "prefix, byte fallback), so that it encodes exactly as ours")


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json (BPE with byte fallback, no pre-tokenizer, spaces as U+2581) + its config.

    Our SentencePiece model is BPE with identity normalization and no dummy prefix, so the same
    model in the `tokenizers` library is: replace " " by U+2581, then BPE whose merge ranks follow
    the piece scores. SentencePiece's user-defined pieces (the digit groups of
    `data.tokenizer.digit_group` 2 and 3) are matched first, longest first, and never merged:
    added tokens (not special, matched in the raw text) do the same, as in transformers'
    `SpmConverter`. Control pieces are special tokens, never matched inside text
    (`split_special_tokens`), as in SentencePiece. One difference remains: a literal U+2581 in the
    text is the space piece here, where `data.tokenizer` encodes it as its three bytes.
    A model that this cannot express is refused (`tokenizer_refusal`).
    """
    from tokenizers import AddedToken, decoders, normalizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    refusal = tokenizer_refusal(tokenizer)
    if refusal:
        raise ExportError(refusal)
    proto = _tokenizer_proto(tokenizer)
    kinds = proto.SentencePiece.Type
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = [(i, p.piece) for i, p in enumerate(proto.pieces) if p.type == kinds.NORMAL]
    merges = []
    for _, piece in sorted(normal, key=lambda x: (-proto.pieces[x[0]].score, x[0])):
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        known = (s for s in splits if s[0] in vocab and s[1] in vocab)
        merges += sorted(known, key=lambda s: (vocab[s[0]], vocab[s[1]]))
    model = BPE(vocab=vocab, merges=merges, unk_token=proto.pieces[tokenizer.unk_id].piece, byte_fallback=True,
                fuse_unk=True)
    backend = HFTokenizer(model)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    special_ids = {tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id}
    special_ids |= {i for i, p in enumerate(proto.pieces) if p.type == kinds.CONTROL}
    backend.add_special_tokens([AddedToken(proto.pieces[i].piece, special=True, normalized=False)
                                for i in sorted(special_ids)])
    backend.add_tokens([AddedToken(p.piece, special=False, normalized=False)
                        for p in proto.pieces if p.type == kinds.USER_DEFINED])
    eos = proto.pieces[tokenizer.eos_id].piece
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=eos, eos_token=eos, unk_token=proto.pieces[tokenizer.unk_id].piece,
        pad_token=proto.pieces[tokenizer.pad_id].piece, split_special_tokens=True,
        clean_up_tokenization_spaces=False, model_max_length=int(1e30),
    )
    hf.save_pretrained(out)


def export_hf(model: GPT, tokenizer: Tokenizer, out: str | Path, *, overwrite: bool = False,
              checkpoint: str | Path | None = None) -> Path:
    """Write `model` (fp32) and `tokenizer` as a Hugging Face model directory at `out`.

    `out` must be new, empty, or (with `overwrite`) a previous export (`check_out`). The files
    are written into a temporary sibling, which then replaces `out`: a failure leaves the old
    export or nothing. `checkpoint` is recorded in the export's marker.
    """
    out = Path(out)
    check_out(out, overwrite)
    m = model.cfg
    if tokenizer.vocab_size != m.vocab_size:
        raise ExportError(f"tokenizer has {tokenizer.vocab_size} pieces but model.vocab_size={m.vocab_size}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export_tmp_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own leftover (a pid is reused only once it ended)
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config(m, tokenizer), indent=2) + "\n")
        save_file(hf_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        generation = {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id,
                      "pad_token_id": tokenizer.pad_id, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if m.attention != "origin":
            shutil.copyfile(REMOTE_CODE, tmp / REMOTE_CODE.name)
        save_tokenizer(tokenizer, tmp)
        files = sorted([p.name for p in tmp.iterdir()] + [EXPORT_MARKER])
        marker = {"written_by": "python -m train.export_hf", "files": files,
                  "checkpoint": str(checkpoint) if checkpoint else None}
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _replace(out, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace(out: Path, new: Path) -> None:
    """Rename the complete export `new` to `out`; a previous export (checked) is moved aside first."""
    if not out.exists():
        os.replace(new, out)
        return
    old = out.parent / f".{out.name}.export_old_{os.getpid()}"
    os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old)


def training_files(path: Path) -> str | None:
    """'run' or 'checkpoint' when `path` holds a training run's or a checkpoint's files, else None."""
    if not path.is_dir():
        return None
    if (path / "config.yaml").is_file() and any((path / name).exists() for name in RUN_FILES):
        return "run"
    if (path / MARKER).is_file() or any(path.glob("*model_states.pt")) or any(path.glob("client_rank*.pt")):
        return "checkpoint"
    return None


def _previous_export(out: Path) -> list[str] | None:
    """The names listed in `out`'s export marker, if `out` holds one that parses."""
    try:
        files = json.loads((out / EXPORT_MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, list) and all(isinstance(f, str) for f in files) else None


def check_out(out: Path, overwrite: bool, run: Path | None = None) -> None:
    """Refuse, before anything is loaded, an `out` whose replacement could lose what the export
    did not write: one that is, lies inside or contains a run or checkpoint directory (or `run`),
    a non-empty directory that is not a previous export, a previous export holding other files,
    a file, or a place where the temporary sibling cannot be written."""
    target = out.expanduser().absolute()
    if target.is_symlink():
        raise ExportError(f"out={out} is a symbolic link: give out= the directory itself")
    real = target.resolve()
    for place in (real, *real.parents):
        kind = training_files(place)
        if kind:
            where = "is" if place == real else f"lies inside {place}, which is"
            raise ExportError(f"out={out} {where} a {kind} directory: give out= a directory outside runs")
    if run is not None:
        source = run.expanduser().resolve()
        if source == real or real in source.parents:
            raise ExportError(f"out={out} contains run={run}: give out= a directory outside the run")
    check_dir(target.parent, "out's parent")
    if target.exists() and not target.is_dir():
        raise ExportError(f"out={out} is a file, not a directory: give out= a directory path")
    if not target.exists() or not any(target.iterdir()):
        return
    held = sorted(p for p in target.iterdir())
    inner = next((p for p in held if training_files(p)), None)
    if inner is not None:
        raise ExportError(f"out={out} contains the {training_files(inner)} directory {inner}: "
                          "give out= a new or empty directory")
    listed = _previous_export(target)
    if listed is None:
        raise ExportError(f"out={out} exists and is not empty, and is not an export written by this command "
                          f"(no {EXPORT_MARKER}): overwrite=true replaces only a previous export; "
                          "give out= a new or empty directory")
    if not overwrite:
        raise ExportError(f"out={out} exists and is not empty: a previous export "
                          "(add overwrite=true to replace it)")
    foreign = [p.name for p in held if p.name not in listed or not p.is_file() or p.is_symlink()]
    if foreign:
        raise ExportError(f"out={out} is a previous export but also holds {', '.join(foreign[:3])}, which "
                          "the export did not write: move them away or give out= another directory")


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
    from train.export import TOKENIZER_FILE, load_model

    try:
        args = _parse_args(sys.argv[1:] if argv is None else argv)
        out, run, overwrite = Path(args["out"]), Path(args["run"]), args.get("overwrite") == "true"
        scaling = parse_scaling(args["rope_scaling"]) if "rope_scaling" in args else None
        if not run.exists():
            raise ExportError(f"run or checkpoint not found: {run}")
        check_out(out, overwrite, run)
        ckpt = find_checkpoint(run)
        refusal = tokenizer_refusal(Tokenizer(ckpt / TOKENIZER_FILE))
        if refusal:
            raise ExportError(refusal)
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's merge prints progress to stdout
            model, _, tokenizer = load_model(str(ckpt))
        if scaling is not None:
            model.set_rope_scaling(*scaling)
        export_hf(model, tokenizer, out, overwrite=overwrite, checkpoint=ckpt)
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
