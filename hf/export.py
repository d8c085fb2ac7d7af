"""Write a trained model as a self-contained Hugging Face model directory (`export_hf`).

The directory holds `config.json`, `model.safetensors` (our parameters under GPT-NeoX's names for
arch=neox, the head `embed_out.weight` as GPTNeoXForCausalLM's checkpoints name it, Llama's for
arch=llama: `hf.names`), `generation_config.json`, the tokenizer, and the
marker `coca_lm_export.json` listing these files. The tokenizer is the run's: our SentencePiece
model written as a `tokenizer.json` that `AutoTokenizer` loads (standard `PreTrainedTokenizerFast`,
same ids as `data.tokenizer.Tokenizer`), or, for a run that trained with a Hugging Face tokenizer
(one imported with its model), that tokenizer's own files as the run stores them
(`HFTokenizer.files`: its tokenizer.json, tokenizer_config.json, special tokens and chat template),
with its BOS, EOS and pad ids in config.json and generation_config.json.

- origin (a design whose registry record says `native_hf`): a plain `GPTNeoXForCausalLM`
  (arch=neox) or `LlamaForCausalLM` (arch=llama: grouped-query attention, tied or untied
  embeddings), no custom code.
- every other design (alibi, coca slack, coca strict, ...): also the model's own code, our
  `model.gpt.GPT`, with the thin wrapper `modeling_coca_lm.py` (beside this file) named in
  `auto_map` (`CocaLMForCausalLM`, either architecture: `arch` in the config); load with
  `trust_remote_code=True`. The files are the wrapper and the closure of its one-dot imports
  (`REMOTE_CODE`: `model/gpt.py`, `model/hf_layout.py` and what they import, `model/designs/` among
  them), written flat as transformers' remote code wants them (a one-dot import names a sibling
  file; `model/designs/__init__.py` is `designs.py`). They import only torch (and the wrapper
  transformers).

`out` must be new, empty, or (to replace it, with `overwrite`) a previous export holding only what
the marker lists (`check_out`); the export is written into a temporary sibling and renamed in, so
a failure leaves the previous export or nothing. What a run or a checkpoint looks like is train's
knowledge: `python -m train.export_hf` refuses those places before calling this.

RoPE scalings map onto transformers' `rope_parameters`, the same for both architectures: none ->
default, linear -> linear, dynamic -> dynamic, yarn -> yarn, llama3 -> llama3, ntk (a static base)
-> default with `rope_theta` = the scaled base (Llama's rotary is always full: no
`partial_rotary_factor`). The length YaRN, llama3 and dynamic NTK scale from (the training length,
or `rope_scaling.original_max_seq_len` when set) goes where transformers reads it: yarn's and
llama3's `original_max_position_embeddings`, and under dynamic `max_position_embeddings`
(otherwise the training length).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
from pathlib import Path

from safetensors.torch import save_file

import model as model_package
from data.config import check_dir
from data.tokenizer import HFTokenizer, Tokenizer
from hf.names import hf_state_dict
from model import GPT, ModelConfig, designs

EXPORT_MARKER = "coca_lm_export.json"  # names what the export wrote: overwrite=true replaces only that


class ExportError(Exception):
    """Bad input to the export, reported as one line."""


WRAPPER = Path(__file__).with_name("modeling_coca_lm.py")
# What transformers reads as a module's relative imports (`dynamic_module_utils.get_relative_imports`):
# `from .x import` and `import .x`, each the sibling file x.py.
_RELATIVE = re.compile(r"^\s*(?:from\s+\.(\S+)\s+import|import\s+\.(\S+)\s*$)", re.MULTILINE)


def remote_code() -> dict[str, Path]:
    """The remote code of every export but Origin's, as shipped name -> source: the wrapper and,
    transitively, each file its one-dot imports name, in the one flat folder of `model/`'s and
    `model/designs/`'s files (that package's `__init__` as `designs.py`). A name that is no such
    file (a two-part `.designs.base`, an import outside `model/`) is this project's bug: raised."""
    root = Path(model_package.__file__).parent
    package = Path(designs.__file__).parent
    files = {p.name: p for p in sorted(root.glob("*.py")) if p.name != "__init__.py"}
    flat = {p.name: p for p in sorted(package.glob("*.py")) if p.name != "__init__.py"}
    flat["designs.py"] = package / "__init__.py"
    if set(files) & set(flat):
        raise RuntimeError(f"model/ and model/designs/ both have {sorted(set(files) & set(flat))}: they ship flat")
    files.update(flat)
    shipped, todo = {WRAPPER.name: WRAPPER}, [WRAPPER]
    while todo:
        for match in _RELATIVE.finditer(todo.pop().read_text()):
            name = f"{match.group(1) or match.group(2)}.py"
            if name not in shipped:
                if name not in files:
                    raise RuntimeError(f"the remote code imports .{name[:-3]}, which is not a file of model/")
                shipped[name] = files[name]
                todo.append(files[name])
    return dict(sorted(shipped.items()))


REMOTE_CODE = remote_code()


def rope_parameters(m: ModelConfig) -> dict:
    """transformers' `rope_parameters` for our RoPE settings (see the module docstring)."""
    s = m.rope_scaling
    params = {"rope_type": "default", "rope_theta": float(m.rope_base)}
    if m.arch == "neox":
        params["partial_rotary_factor"] = float(m.rotary_pct)
    if s.type == "ntk":
        if any(m.layer_design(i).rope_base for i in range(m.n_layer)):
            raise ExportError("rope_scaling ntk on a model whose layers have RoPE bases of their own: the export "
                              "writes a static NTK base as rope_theta, which only the model's base can carry; "
                              "export it unscaled or with another scaling (dynamic, yarn, linear, llama3)")
        rope = designs.Rope(m.rope_width(), m.rope_base, m.max_seq_len, s)
        params["rope_theta"] = rope.base_at(m.max_seq_len)
    elif s.type in ("linear", "dynamic"):
        params.update(rope_type=s.type, factor=float(s.factor))
    elif s.type == "yarn":
        params.update(rope_type="yarn", factor=float(s.factor), beta_fast=float(s.beta_fast),
                      beta_slow=float(s.beta_slow),
                      original_max_position_embeddings=s.original_max_seq_len or m.max_seq_len)
    elif s.type == "llama3":
        params.update(rope_type="llama3", factor=float(s.factor), low_freq_factor=float(s.low_freq_factor),
                      high_freq_factor=float(s.high_freq_factor),
                      original_max_position_embeddings=s.original_max_seq_len or m.max_seq_len)
    return params


def max_position_embeddings(m: ModelConfig) -> int:
    """The training length; under dynamic NTK the length it scales from (`rope_scaling.
    original_max_seq_len` when set), which transformers' dynamic NTK reads from this field."""
    s = m.rope_scaling
    return (s.original_max_seq_len or m.max_seq_len) if s.type == "dynamic" else m.max_seq_len


def _architecture(m: ModelConfig) -> dict:
    """The fields of GPT-NeoX's layout, or of Llama's (grouped-query attention, no biases)."""
    if m.arch == "llama":
        return {"num_key_value_heads": m.kv_heads, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    return {"hidden_act": "gelu", "attention_bias": True}


def token_ids(tokenizer: Tokenizer | HFTokenizer) -> dict[str, int | None]:
    """config.json's and generation_config.json's BOS, EOS and pad ids: a Hugging Face tokenizer's
    own (None where it has none); ours has EOS before every document, so EOS is its BOS too."""
    if isinstance(tokenizer, HFTokenizer):
        bos, pad = tokenizer.bos_id, tokenizer.pad_id
        return {"bos_token_id": bos if bos >= 0 else None, "eos_token_id": tokenizer.eos_id,
                "pad_token_id": pad if pad >= 0 else None}
    return {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}


def hf_config(m: ModelConfig, tokenizer: Tokenizer | HFTokenizer) -> dict:
    """config.json: for Origin (`native_hf`) a plain GPT-NeoX or Llama config (`m.arch`), with the
    pre-5.0 names of the RoPE fields too, for older transformers; for the others a `coca_lm` config,
    which adds `arch`, `attention`, `design_params` and the `auto_map` naming the remote code."""
    config = {
        "vocab_size": m.vocab_size, "hidden_size": m.n_embd, "num_hidden_layers": m.n_layer,
        "num_attention_heads": m.n_head, "intermediate_size": m.ffn_hidden, **_architecture(m),
        "max_position_embeddings": max_position_embeddings(m), "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "use_cache": True, "torch_dtype": "float32",
        **token_ids(tokenizer), "rope_parameters": rope_parameters(m),
    }
    rope = config["rope_parameters"]
    scaling = rope if rope["rope_type"] != "default" else None
    if not native(m):
        return _remote_config(m, config)
    if m.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **config,
                "rms_norm_eps": m.layernorm_eps, "rope_theta": rope["rope_theta"], "rope_scaling": scaling}
    return {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", **config, **_residual_and_norm(m),
            "rotary_pct": m.rotary_pct, "rotary_emb_base": rope["rope_theta"], "rope_scaling": scaling}


def native(m: ModelConfig) -> bool:
    """Whether the model exports as its architecture's own HF class (Origin without the length
    temperature, sinks, SSMax or QK-norm, which transformers' GPT-NeoX and Llama classes cannot
    express), else as the remote-code model."""
    return m.design.native_hf and not (m.length_temperature or m.sinks or m.ssmax or m.qk_norm or m.mup)


def _residual_and_norm(m: ModelConfig) -> dict:
    """config.json's residual form and norm eps (GPT-NeoX's field names; the coca_lm config's too)."""
    return {"layer_norm_eps": m.layernorm_eps, "use_parallel_residual": m.parallel_residual}


def _remote_config(m: ModelConfig, config: dict) -> dict:
    """The `coca_lm` config: the design (attention, its parameters: CoCA's form among them), the length
    temperature's L0 (0: off), the modifiers (sinks, ssmax, qk_norm) and the `auto_map` naming the
    remote code."""
    if not m.design.rope:
        del config["rope_parameters"]
    params = {} if m.params is None else dataclasses.asdict(m.params)
    return {"architectures": ["CocaLMForCausalLM"], "model_type": "coca_lm", "arch": m.arch,
            "attention": m.attention, "design_params": params,
            "length_temperature": m.max_seq_len if m.length_temperature else 0, "sinks": m.sinks, "ssmax": m.ssmax,
            "qk_norm": m.qk_norm, **({"mup_base_width": m.mup_base_width} if m.mup else {}), **config,
            **_residual_and_norm(m),
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


def save_tokenizer(tokenizer: Tokenizer | HFTokenizer, out: Path) -> None:
    """A Hugging Face tokenizer's files as the run stores them; for ours, tokenizer.json (BPE with
    byte fallback, no pre-tokenizer, spaces as U+2581) + its config.

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
    if isinstance(tokenizer, HFTokenizer):
        for name, content in tokenizer.files().items():
            (out / name).write_bytes(content)
        return
    from tokenizers import AddedToken, decoders, normalizers
    from tokenizers import Tokenizer as Backend
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
    backend = Backend(model)
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


def export_hf(model: GPT, tokenizer: Tokenizer | HFTokenizer, out: str | Path, *, overwrite: bool = False,
              checkpoint: str | Path | None = None) -> Path:
    """Write `model` (fp32) and `tokenizer` as a Hugging Face model directory at `out`.

    `out` must be new, empty, or (with `overwrite`) a previous export (`check_out`). The files
    are written into a temporary sibling, which then replaces `out`: a failure leaves the old
    export or nothing. `checkpoint` is recorded in the export's marker.
    """
    out = Path(out)
    check_out(out, overwrite)
    m = model.cfg
    if tokenizer.vocab_size > m.vocab_size:  # fewer is a padded embedding (Pythia's 50,277 of 50,304 rows)
        raise ExportError(f"tokenizer has {tokenizer.vocab_size} pieces but model.vocab_size={m.vocab_size}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export_tmp_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own leftover (a pid is reused only once it ended)
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config(m, tokenizer), indent=2) + "\n")
        save_file(hf_state_dict(model, neox_checkpoint=native(m)), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        # safetensors >= 0.8 writes through a temporary file created 0600, whatever the umask
        # (safetensors issue #782): give it the mode config.json got, as every other file here.
        os.chmod(tmp / "model.safetensors", stat.S_IMODE((tmp / "config.json").stat().st_mode))
        generation = {**token_ids(tokenizer), "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if not native(m):
            for name, source in REMOTE_CODE.items():
                shutil.copyfile(source, tmp / name)
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


def _previous_export(out: Path) -> list[str] | None:
    """The names listed in `out`'s export marker, if `out` holds one that parses."""
    try:
        files = json.loads((out / EXPORT_MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, list) and all(isinstance(f, str) for f in files) else None


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse, before anything is written, an `out` whose replacement could lose what the export did
    not write: a symbolic link, a file, a non-empty directory that is not a previous export, a
    previous export (without `overwrite`, or holding other files), or a place where the temporary
    sibling cannot be written."""
    target = out.expanduser().absolute()
    if target.is_symlink():
        raise ExportError(f"out={out} is a symbolic link: give out= the directory itself")
    check_dir(target.parent, "out's parent")
    if target.exists() and not target.is_dir():
        raise ExportError(f"out={out} is a file, not a directory: give out= a directory path")
    if not target.exists() or not any(target.iterdir()):
        return
    held = sorted(p for p in target.iterdir())
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


if __name__ == "__main__":  # `python -m hf.export`: this is the library; the command is train's
    import sys

    from errors import UsageError, report_error

    sys.exit(report_error(UsageError("hf.export is the exporter's library: export a run with "
                                     "python -m train.export_hf run=<run or checkpoint> out=<dir>")))
