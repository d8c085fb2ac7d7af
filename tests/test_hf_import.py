"""Starting from a Hugging Face directory (`hf.imports`, `init_from=<dir>`), with its tokenizer.

Fast tier: random-weight GPT-NeoX (Pythia-shaped: rotary_pct 0.25, parallel residual), Llama (GQA,
tied and untied) and our own exports, saved here with transformers, read back by `import_hf` into
models whose logits are transformers' (float64, as tests/test_model_parity.py); the Hugging Face
tokenizer class (`data.tokenizer.HFTokenizer`): EOS only where the stream puts it, the roles from
the model's files, pickling, passkey and recall prompts; how a directory's config and the command
line combine; one-line refusals (exit 1, and 2 for a shape override) before DeepSpeed starts.
Slow tier: `python -m train init_from=<dir>` for both tokenizer kinds: the first loss is the
directory's model on the first blocks, a resumed run repeats an uninterrupted one, and
`python -m eval` reads the run.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from data.sources import stdlib_files, stdlib_root
from data.synthetic import document_ids
from data.tasks import build_case, make_recall_cases, passkey_min_length
from data.tokenizer import HFTokenizer, Tokenizer, get_tokenizer, load_tokenizer
from errors import ConfigError
from hf.imports import HFImportError, combine, import_hf, model_config
from model import GPT, ModelConfig
from run_checks import clean_env, error_line, losses, ok

pytestmark = pytest.mark.usefixtures("single_thread")

REPO = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"
L0 = 32  # the training length of the e2e runs


# ---- building directories ---------------------------------------------------------------------------


def _docs(n: int = 40) -> list[str]:
    files = stdlib_files()
    return [(stdlib_root() / f).read_text(errors="replace") for f in files[:: len(files) // n][:n]]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (GPT-NeoX's kind, 1024 tokens, EOS `<|endoftext|>` = 0) trained
    here on standard-library files, saved by transformers as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(_docs(), trainers.BpeTrainer(
        vocab_size=1024, special_tokens=[EOT, "<|padding|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOT, bos_token=EOT,
                            pad_token="<|padding|>").save_pretrained(out)
    return out


def _randomised(model, std: float):
    torch.manual_seed(0)
    with torch.no_grad():  # transformers zero-initialises biases and norm shifts: draw everything
        for p in model.parameters():
            p.normal_(0.0, std)
    return model.eval()


def neox_dir(out: Path, tokenizer_dir: Path | None = None, vocab: int = 1040, shard: bool = False, std: float = 0.3,
             **config) -> Path:
    """A Pythia-shaped GPTNeoXForCausalLM (rotary_pct 0.25, parallel residual, untied) with random
    weights, saved by transformers (sharded with an index if `shard`), its tokenizer beside it."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                        intermediate_size=64, rotary_pct=0.25, max_position_embeddings=64, use_parallel_residual=True,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, **config)
    _randomised(GPTNeoXForCausalLM(cfg), std).save_pretrained(out, max_shard_size="40KB" if shard else "10GB")
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def llama_dir(out: Path, sp: Tokenizer | None = None, vocab: int = 520, tied: bool = False, kv: int = 2,
              shard: bool = False, std: float = 0.3, **config) -> Path:
    """A LlamaForCausalLM with grouped-query attention and random weights; `sp`: a SentencePiece
    tokenizer.model beside it, its ids in config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = dict(bos_token_id=sp.bos_id, eos_token_id=sp.eos_id, pad_token_id=sp.pad_id) if sp else {}
    config = {"max_position_embeddings": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
              **config}
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, num_attention_heads=4, num_key_value_heads=kv,
                      num_hidden_layers=2, intermediate_size=48, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                      **ids, **config)
    _randomised(LlamaForCausalLM(cfg), std).save_pretrained(out, max_shard_size="30KB" if shard else "10GB")
    if sp is not None:
        shutil.copyfile(sp.path, out / "tokenizer.model")
    return out


def hf_logits(path: Path, idx: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).double().eval()
    with torch.no_grad():
        return model(input_ids=idx).logits


def our_logits(path: Path, idx: torch.Tensor) -> tuple[ModelConfig, torch.Tensor]:
    cfg, state = import_hf(path)
    assert all(t.dtype == torch.float32 for t in state.values())
    model = GPT(cfg)
    model.load_state_dict(state)
    with torch.no_grad():
        return cfg, model.double().eval()(idx)


def _idx(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))


# ---- import: logits equal transformers' -------------------------------------------------------------


@pytest.mark.parametrize("shard", [False, True], ids=["single-file", "sharded"])
def test_pythia_shaped_directory_gives_gpt_neox_logits(tmp_path, shard):
    path = neox_dir(tmp_path / "neox", shard=shard)
    assert (path / "model.safetensors.index.json").is_file() == shard
    idx = _idx(1040)
    cfg, got = our_logits(path, idx)
    assert (cfg.arch, cfg.attention, cfg.rotary_pct, cfg.parallel_residual, cfg.tie_embeddings) == \
        ("neox", "origin", 0.25, True, False)
    assert (cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.ffn_hidden, cfg.max_seq_len) == \
        (1040, 2, 4, 32, 64, 64)
    want = hf_logits(path, idx)
    # transformers computes RoPE angles in float32 even in a float64 model: 1e-6, not 1e-12
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert want.std() > 0.1


@pytest.mark.parametrize("tied, kv, shard", [(False, 2, True), (True, 2, False), (False, 1, False)],
                         ids=["gqa-untied-sharded", "gqa-tied", "mqa-untied"])
def test_llama_directory_gives_llama_logits(tmp_path, tied, kv, shard):
    path = llama_dir(tmp_path / "llama", tied=tied, kv=kv, shard=shard)
    idx = _idx(520)
    cfg, got = our_logits(path, idx)
    assert (cfg.arch, cfg.kv_heads, cfg.tie_embeddings, cfg.layernorm_eps, cfg.parallel_residual) == \
        ("llama", kv, tied, 1e-5, False)
    torch.testing.assert_close(got, hf_logits(path, idx), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["pythia", "llama-gqa-untied", "llama-tied"])
def test_import_then_export_gives_back_the_same_tensors_and_logits(kind, tok, tmp_path):
    """A Hugging Face directory imported (`import_hf`) and exported again (`hf.export.export_hf`)
    holds the same tensors, bitwise, under the same names (GPT-NeoX's head as its checkpoints name
    it, `embed_out`), and transformers' logits are the same."""
    from safetensors.torch import load_file

    from hf.export import export_hf
    from hf.imports import tensor_files

    if kind == "pythia":
        source = neox_dir(tmp_path / "src", vocab=tok.vocab_size)
    else:
        source = llama_dir(tmp_path / "src", tok, vocab=tok.vocab_size, tied=kind == "llama-tied")
    cfg, state = import_hf(source)
    model = GPT(cfg)
    model.load_state_dict(state)
    out = export_hf(model, tok, tmp_path / "out")
    original = {}
    for file in set(tensor_files(source).values()):
        original.update(load_file(str(file)))
    exported = load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)
    idx = _idx(tok.vocab_size)
    torch.testing.assert_close(hf_logits(out, idx), hf_logits(source, idx), rtol=0, atol=0)


# Llama 3.1's RoPE at this head size (8 dims: wavelengths 6.3, 63, 628, 6283) from L0 = 64: one pair
# kept (under 64 / 4), one on the ramp, two divided by the factor (over 64 / 1).
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_llama3_rope_directory_gives_llama_logits_and_exports_back(tok, tmp_path):
    """A LlamaForCausalLM with Llama 3's RoPE scaling: ours equals transformers' in float64 at 4x its
    original length, the scaling read into `rope_scaling` (type llama3, its bounds, L0); exported,
    config.json carries the same `rope_parameters` and transformers' logits are ours again."""
    from hf.export import export_hf

    source = llama_dir(tmp_path / "src", tok, vocab=tok.vocab_size, max_position_embeddings=256,
                       rope_parameters=LLAMA3)
    idx = torch.randint(0, tok.vocab_size, (2, 256), generator=torch.Generator().manual_seed(3))
    cfg, got = our_logits(source, idx)
    s = cfg.rope_scaling
    assert (cfg.max_seq_len, s.type, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_seq_len) == \
        (256, "llama3", 8.0, 1.0, 4.0, 64)
    want = hf_logits(source, idx)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    unscaled = GPT(replace(cfg, rope_scaling=replace(s, type="none")))
    unscaled.load_state_dict(import_hf(source)[1])
    with torch.no_grad():
        assert (unscaled.double().eval()(idx) - want).abs().max() > 1e-2  # the scaling changes the logits
    model = GPT(cfg)
    model.load_state_dict(import_hf(source)[1])
    out = export_hf(model, tok, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == LLAMA3 and config["rope_scaling"] == LLAMA3
    torch.testing.assert_close(hf_logits(out, idx), want, rtol=0, atol=0)


def test_llama3_rope_frequencies_follow_their_definition():
    """`designs.Rope` under llama3 against the definition in float64: kept below L0 / high,
    divided by the factor above L0 / low, and (1 - s) f / factor + s f between, s linear in L0 / wavelength."""
    from model.config import RopeScaling
    from model.designs import Rope

    r, base, l0, factor, low, high = 64, 5e5, 8192, 32.0, 1.0, 4.0
    inv, scale = Rope(r, base, l0, RopeScaling("llama3", factor, low_freq_factor=low, high_freq_factor=high)
                      ).inv_freq(100_000)
    assert scale == 1.0
    for j in range(r // 2):
        f = base ** (-2 * j / r)
        wavelength = 2 * math.pi / f
        if wavelength < l0 / high:
            want = f
        elif wavelength > l0 / low:
            want = f / factor
        else:
            smooth = (l0 / wavelength - low) / (high - low)
            want = (1 - smooth) * f / factor + smooth * f
        assert inv[j].item() == pytest.approx(want, rel=1e-12), j
    assert (inv < base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)).sum() > 0


def test_legacy_config_fields_read_as_the_new_ones(tmp_path):
    """A transformers-4 config.json (Pythia's on the hub: rotary_pct, rotary_emb_base, no
    rope_parameters) gives the same model config as transformers 5's."""
    path = neox_dir(tmp_path / "neox")
    config = json.loads((path / "config.json").read_text())
    legacy = {k: v for k, v in config.items() if k != "rope_parameters"}
    legacy.update(rotary_pct=0.25, rotary_emb_base=20000, rope_scaling=None)
    new = model_config({**config, "rope_parameters": {**config["rope_parameters"], "rope_theta": 20000.0}})
    assert model_config(legacy) == new and new.rope_base == 20000.0


def test_our_exports_import_back_exactly(micro_run, tmp_path):
    """Our own exports: the trained micro run (Origin, a GPTNeoXForCausalLM directory), a random
    CoCA strict model, a random hybrid with its own parameters (global RoPE layers at their own
    base) and the length temperature, and a random PoPE with its phase bias, sinks, SSMax and QK-norm
    (coca_lm directories) come back with their config and bitwise weights."""
    from hf.export import export_hf
    from train.load import load_model

    model, _, tokenizer = load_model(str(micro_run))
    strict = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64,
                             max_seq_len=L0, attention="coca", design_params={"coca": {"form": "strict"}},
                             tie_embeddings=True))
    hybrid = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64,
                             max_seq_len=L0, attention="hybrid", length_temperature=True,
                             design_params={"hybrid": {"nope_every": 2, "window": 7, "global_layers": "origin",
                                                       "global_rope_base": 500.0}}))
    pope = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                           ffn_hidden=64, max_seq_len=L0, attention="pope", arch="llama", parallel_residual=False,
                           design_params={"pope": {"phase_bias": True}}, sinks=True, ssmax=True, qk_norm=True))
    for name, ours in (("origin", model), ("coca", _randomised(strict, 0.1)), ("hybrid", _randomised(hybrid, 0.1)),
                       ("pope", _randomised(pope, 0.1))):
        out = export_hf(ours, tokenizer, tmp_path / name)
        cfg, state = import_hf(out)
        fixed = ("arch", "vocab_size", "n_layer", "n_head", "n_embd", "ffn_hidden", "max_seq_len", "attention",
                 "rotary_pct", "rope_base", "parallel_residual", "layernorm_eps", "tie_embeddings",
                 "design_params", "length_temperature", "sinks", "ssmax", "qk_norm", "n_kv_head")
        assert {f: getattr(cfg, f) for f in fixed} == {f: getattr(ours.cfg, f) for f in fixed}
        mine = ours.state_dict()
        assert set(state) == set(mine) and all(torch.equal(state[k], mine[k].float()) for k in mine)
        idx = _idx(tokenizer.vocab_size)  # 40 tokens, past L0: the temperature and the window act
        back = GPT(cfg)
        back.load_state_dict(state)
        with torch.no_grad():
            assert torch.equal(back.eval()(idx), ours.eval()(idx))
        assert load_tokenizer(out).encode("def main(): return 1") == tokenizer.encode("def main(): return 1")


def test_scaled_rope_and_alibi_configs_map_onto_ours():
    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 48, "max_position_embeddings": 256}
    yarn = model_config({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                     "original_max_position_embeddings": 64, "beta_fast": 16}})
    s = yarn.rope_scaling
    assert (yarn.max_seq_len, s.type, s.factor, s.original_max_seq_len, s.beta_fast, s.beta_slow) == \
        (256, "yarn", 4.0, 64, 16.0, 1.0)
    dynamic = model_config({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert (dynamic.rope_scaling.type, dynamic.rope_scaling.factor, dynamic.max_seq_len) == ("dynamic", 2.0, 256)
    alibi = model_config({**base, "model_type": "coca_lm", "arch": "neox", "attention": "alibi",
                          "hidden_act": "gelu", "use_parallel_residual": True})
    assert (alibi.arch, alibi.attention, alibi.parallel_residual) == ("neox", "alibi", True)


# ---- refusals --------------------------------------------------------------------------------------


REFUSALS = {  # config.json change -> what the one line names
    "model_type": ({"model_type": "mistral"}, "model_type=\"mistral\" is not supported"),
    "longrope": ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0,
                                      "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}},
                 "rope_parameters.rope_type=\"longrope\" is not supported"),
    "llama3_extra": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "mscale": 0.7,
                                          "original_max_position_embeddings": 16}},
                     "rope_parameters.mscale=0.7 is not supported"),
    "llama3_bounds": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                           "original_max_position_embeddings": 16}},
                      "rope_parameters of RoPE type llama3 lacks low_freq_factor, high_freq_factor (transformers"),
    "attention_bias": ({"attention_bias": True}, "attention_bias=true is not supported"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act=\"gelu\" is not supported: this llama model uses silu"),
    "yarn_mscale": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 0.7,
                                         "original_max_position_embeddings": 16}},
                    "rope_parameters.mscale=0.7 is not supported"),
    "head_dim": ({"head_dim": 16}, "head_dim=16 is not supported"),
}


@pytest.fixture(scope="module")
def llama_plain(tmp_path_factory) -> Path:
    return llama_dir(tmp_path_factory.mktemp("llama") / "plain")


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_config_is_one_line_naming_the_field(llama_plain, tmp_path, case):
    change, needle = REFUSALS[case]
    bad = tmp_path / case
    shutil.copytree(llama_plain, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(HFImportError) as error:
        import_hf(bad)
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_missing_misshapen_and_unexpected_tensors_are_named(tmp_path):
    sharded = neox_dir(tmp_path / "sharded", shard=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (sharded / gone).unlink()
    with pytest.raises(HFImportError, match=f"names {gone}, which is missing"):
        import_hf(sharded)
    single = neox_dir(tmp_path / "single")
    config = json.loads((single / "config.json").read_text())
    for change, needle in [({"intermediate_size": 96}, "has shape [64, 32], config.json gives [96, 32]"),
                           ({"num_hidden_layers": 3}, "tensor gpt_neox.layers.2.input_layernorm.weight is missing"),
                           ({"num_hidden_layers": 1}, "tensor gpt_neox.layers.1.* is not a parameter of a neox model")]:
        (single / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(HFImportError, match=needle.replace("[", r"\[")):
            import_hf(single)
    (single / "model.safetensors").unlink()
    (single / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFImportError, match="holds config.json but no model.safetensors"):
        import_hf(single)


def test_a_directory_config_combines_with_the_command_line():
    """The directory fixes the shapes and the function; the run sets the length, a RoPE scaling or
    base, masking, another attention (converted from Origin); a disagreeing shape override, or a
    conversion that cannot make sense, is refused (exit 2)."""
    source = ModelConfig(arch="llama", parallel_residual=False, vocab_size=520, n_layer=2, n_head=4, n_kv_head=2,
                         n_embd=32, ffn_hidden=48, max_seq_len=64, rope_base=5e5, tie_embeddings=True)
    got = combine(source, ModelConfig(), "d/config.json")
    assert got == source
    got = combine(source, ModelConfig(max_seq_len=256, doc_mask=True, n_layer=2, arch="llama", parallel_residual=False,
                                      n_kv_head=2,
                                      rope_scaling={"type": "yarn", "factor": 4.0, "original_max_seq_len": 64}),
                  "d/config.json")
    assert (got.max_seq_len, got.doc_mask, got.rope_scaling.type, got.rope_base, got.arch) == \
        (256, True, "yarn", 5e5, "llama")
    assert combine(source, ModelConfig(rope_base=2e6), "d/config.json").rope_base == 2e6  # ABF
    with pytest.raises(ConfigError, match=r"model.n_layer=6 disagrees with d/config.json, whose weights fix "
                                          r"model.n_layer=2: drop the override"):
        combine(source, ModelConfig(n_layer=6), "d/config.json")
    with pytest.raises(ConfigError, match="model.vocab_size=512 disagrees"):
        combine(source, ModelConfig(vocab_size=512), "d/config.json")
    strict = {"coca": {"form": "strict"}}
    converted = combine(source, ModelConfig(attention="coca", design_params=strict), "d/config.json")
    assert (converted.attention, converted.design.form) == ("coca", "strict")  # the weights are converted
    assert combine(source, ModelConfig(attention="alibi"), "d/config.json").attention == "alibi"
    with pytest.raises(ConfigError, match="cannot convert attention=alibi into attention=coca: only Origin"):
        combine(replace(source, attention="alibi"), ModelConfig(attention="coca"), "d/config.json")
    assert ConfigError.exit_code == 2


# ---- the Hugging Face tokenizer -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe(bpe_dir) -> HFTokenizer:
    tok = load_tokenizer(bpe_dir)
    assert isinstance(tok, HFTokenizer)
    return tok


TEXT = "def f(x):\n    return x  # naïve café, €12.50, 日本語 🙂\r\n"


def test_hf_tokenizer_round_trips_and_never_writes_eos_inside_text(bpe):
    assert (bpe.eos_id, bpe.bos_id, bpe.pad_id, bpe.unk_id, bpe.vocab_size) == (0, 0, 1, -1, 1024)
    assert bpe.decode(bpe.encode(TEXT)) == TEXT
    literal = f"a {EOT} b </s> {EOT}"
    ids = bpe.encode(literal)
    assert bpe.eos_id not in ids and bpe.decode(ids) == literal
    # a packed stream's rows: document ids count the EOS the stream writes, never one from the text
    row = [bpe.eos_id] + ids + [bpe.eos_id] + bpe.encode(TEXT) + [bpe.eos_id] + bpe.encode("x")
    assert document_ids(torch.tensor([row]), bpe.eos_id)[0].unique().tolist() == [1, 2, 3]
    again = pickle.loads(pickle.dumps(bpe))
    assert again.encode(TEXT) == bpe.encode(TEXT) and again.sha256 == bpe.sha256
    assert bpe.piece(bpe.encode(" return")[0]).startswith("\u2581")  # byte-level "Ġ" written as "▁"
    with pytest.raises(ValueError, match="token id 1024 is out of range"):
        bpe.decode([5, 1024])


def test_roles_follow_the_model_config_and_survive_a_checkpoint(bpe_dir, tmp_path):
    """config.json's eos_token_id wins over tokenizer_config.json; what a run stores (`files()`) loads
    back as the same tokenizer; a tokenizer whose model maps the text of EOS to EOS is refused."""
    model_dir = tmp_path / "model"
    shutil.copytree(bpe_dir, model_dir)
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": None}))
    tok = load_tokenizer(model_dir)
    assert (tok.eos_id, tok.bos_id, tok.roles["eos"]) == (1, 0, "<|padding|>")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name, content in tok.files().items():
        (ckpt / name).write_bytes(content)
    back = load_tokenizer(ckpt)
    assert back.files() == tok.files() and back.eos_id == 1 and back.encode(TEXT) == tok.encode(TEXT)
    assert load_tokenizer(ckpt / "tokenizer.json").files() == tok.files()
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    words = Backend(models.WordLevel({"[UNK]": 0, "</s>": 1, "a": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "words.json"))
    with pytest.raises(ValueError, match="encodes the text '</s>' to its EOS id 1"):
        HFTokenizer(tmp_path / "words.json", {"eos": "</s>"})
    with pytest.raises(ValueError, match="has no EOS token"):
        HFTokenizer(tmp_path / "words.json", {"unk": "[UNK]"})
    words = Backend(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.add_special_tokens(["</s>"])
    words.save(str(tmp_path / "plain.json"))
    plain = HFTokenizer(tmp_path / "plain.json", {"eos": "</s>"})
    assert plain.eos_id == 2 and plain.encode("a </s> a") == [1, 0, 1]  # the text "</s>" is an unknown word
    with pytest.raises(ValueError, match=r"0 whole-word pieces \(a leading space.*use the passkey task"):
        make_recall_cases(plain, 64, 1, 1, seed=0)


def test_sentencepiece_model_of_a_directory_must_have_its_eos(tok, tmp_path):
    shutil.copyfile(tok.path, tmp_path / "tokenizer.model")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": tok.eos_id}))
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, Tokenizer) and loaded.files() == tok.files()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    with pytest.raises(ValueError, match="eos_token_id=7 but .*tokenizer.model's EOS is 3"):
        load_tokenizer(tmp_path)


def test_model_path_may_name_a_hugging_face_tokenizer(bpe_dir):
    from data.config import DataConfig, TokenizerConfig

    for path in (bpe_dir, bpe_dir / "tokenizer.json"):
        tok = get_tokenizer(DataConfig(tokenizer=TokenizerConfig(model_path=str(path))))
        assert isinstance(tok, HFTokenizer) and tok.eos_id == 0


def test_passkey_and_recall_prompts_build_with_a_byte_level_tokenizer(bpe):
    prefix = [bpe.eos_id]
    case = build_case(bpe, 400, 0.5, "71432", prefix)
    assert len(case.tokens) <= 400 and case.filler_tokens[0] > 0 and bpe.decode(case.answer).strip() == "71432"
    assert passkey_min_length(bpe, prefix) <= len(case.tokens) and bpe.eos_id not in case.tokens[1:]
    recall = make_recall_cases(bpe, 200, 2, 4, seed=0, prefix=prefix)
    assert all(len(c.tokens) <= 200 and len(c.answer) == 4 for c in recall)
    assert all(bpe.piece(v).startswith("\u2581") for c in recall for v in c.answer)


# ---- python -m train init_from=<dir>: refusals before DeepSpeed (in process) -------------------------


def _train_main(*overrides: str) -> int:
    from train.__main__ import main

    return main(["logger=none", *overrides])


@pytest.mark.parametrize("case", ["model_type", "longrope", "attention_bias", "missing"])
def test_train_refuses_an_unsupported_directory_in_one_line(llama_plain, tmp_path, capsys, case):
    bad = tmp_path / case
    shutil.copytree(llama_plain, bad)
    if case == "missing":
        (bad / "model.safetensors").unlink()
        needle = "holds config.json but no model.safetensors"
    else:
        change, needle = REFUSALS[case]
        (bad / "config.json").write_text(json.dumps({**json.loads((bad / "config.json").read_text()), **change}))
    code = _train_main(f"init_from={bad}", f"run_dir={tmp_path / 'run'}")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not (tmp_path / "run").exists()


def test_train_refuses_a_shape_override_that_disagrees_exit_2(llama_plain, tmp_path, capsys):
    code = _train_main(f"init_from={llama_plain}", "model.n_head=8", f"run_dir={tmp_path / 'run'}")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"error: model.n_head=8 disagrees with {llama_plain / 'config.json'}, whose weights fix "
                      "model.n_head=4: drop the override")


def test_a_shape_change_through_init_from_exits_2_from_a_run_as_from_a_directory(micro_run, llama_plain, tmp_path,
                                                                                 capsys):
    """The same mistake, one exit status (errors.py: a value given that disagrees is usage): a run
    checkpoint's shape, like a directory's, refused in one line before DeepSpeed starts."""
    codes = [_train_main("experiment=micro", f"init_from={micro_run}", "model.n_layer=3",
                         f"run_dir={tmp_path / 'from_run'}"),
             _train_main(f"init_from={llama_plain}", "model.n_layer=3", f"run_dir={tmp_path / 'from_dir'}")]
    err = capsys.readouterr().err.strip().splitlines()
    assert codes == [2, 2] and len(err) == 2, err
    assert "has model.n_layer=1, this run has model.n_layer=3" in err[0] and "model.n_layer=3 disagrees" in err[1]
    assert not (tmp_path / "from_run").exists() and not (tmp_path / "from_dir").exists()


# ---- python -m train init_from=<dir>, resume, eval (subprocesses) -----------------------------------------


RUN = ["logger=none", "logger.progress=false", "logger.log_every=1", "batch_size=4", "micro_batch_size=4",
       f"model.max_seq_len={L0}", "data.num_workers=0", "data.shuffle_buffer=16", "eval_every=4", "eval_batches=2",
       "ckpt_every=2", "optim.decay=constant", "optim.warmup_steps=1", "optim.lr=3e-3", "debug.log_blocks=true"]


def train(run_dir: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "train", *RUN, f"run_dir={run_dir}", f"data.cache_dir={cache}", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module", params=["neox-tokenizer.json", "llama-tokenizer.model"])
def hf_model(request, tmp_path_factory, bpe_dir, tok) -> Path:
    out = tmp_path_factory.mktemp("hf_model") / request.param
    return neox_dir(out, bpe_dir, std=0.05) if request.param.startswith("neox") else llama_dir(out, tok, std=0.05)


@pytest.mark.slow
def test_train_from_a_directory_with_its_tokenizer_resumes_exactly_and_evaluates(hf_model, tmp_path):
    """init_from=<dir>: the run's model is the directory's (the first loss is the directory's model
    on the first blocks, read by transformers), it trains with the directory's tokenizer, stored in
    the run and every checkpoint; a run stopped at step 2 and resumed with resume=auto (no
    init_from, no shape on the command line) repeats the uninterrupted run's losses, and refuses a
    disagreeing shape in one line (exit 2, nothing written); eval reads it; init_from that run
    takes its model and tokenizer without a word on the command line."""
    from transformers import AutoModelForCausalLM

    from train.load import load_model

    cache = tmp_path / "cache"
    full, part = tmp_path / "full", tmp_path / "part"
    ok(train(full, cache, f"init_from={hf_model}", "max_steps=4"))
    ok(train(part, cache, f"init_from={hf_model}", "max_steps=2"))
    stored = next(part / name for name in ("tokenizer.json", "tokenizer.model") if (part / name).is_file())
    kept = stored.read_bytes()
    stored.write_bytes(kept + b" ")  # edited by hand: the checkpoint's copy replaces it, and that is said
    resumed = ok(train(part, cache, "resume=auto", "max_steps=4"))
    assert "resumed from" in resumed.stderr and stored.read_bytes() == kept
    assert f"warning: {stored} differs from the tokenizer this run trains with (its checkpoint's copy)" \
        in resumed.stderr
    assert losses(part) == losses(full) and len(losses(full)) == 4
    before = {p: p.read_bytes() for p in part.rglob("*") if p.is_file()}
    refused = train(part, cache, "resume=auto", "max_steps=6", "model.n_layer=3")
    assert refused.returncode == 2 and "model.n_layer=3 disagrees with checkpoint" in error_line(refused)
    assert {p: p.read_bytes() for p in part.rglob("*") if p.is_file()} == before

    first = json.loads((full / "blocks_rank0.jsonl").read_text().splitlines()[0])
    batch = torch.tensor(first["tokens"])
    assert batch.shape == (4, L0 + 1)
    hf = AutoModelForCausalLM.from_pretrained(hf_model).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch[:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert losses(full)[1] == pytest.approx(expected, rel=1e-5)

    directory_tokenizer = load_tokenizer(hf_model)
    ckpt = full / "checkpoints" / "step_00000004"
    for where in (full, ckpt):
        for name, content in directory_tokenizer.files().items():
            assert (where / name).read_bytes() == content
        assert json.loads((where / "hf_origin.json").read_text())["hf_dir"] == str(hf_model)
    model, cfg, tokenizer = load_model(str(full))
    assert type(tokenizer) is type(directory_tokenizer) and tokenizer.files() == directory_tokenizer.files()
    assert (cfg.init_from, cfg.model.vocab_size, cfg.model.max_seq_len) == (str(hf_model), model.cfg.vocab_size, L0)
    text = "def main():\n    return 0\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text

    from eval.__main__ import main as eval_main

    code = eval_main([f"run={part}", f"out_dir={tmp_path / 'eval'}", "progress=false", "wandb.mode=disabled",
                      "task=ppl", f"ppl.lengths=[{L0}]", "ppl.n_docs=1"])
    assert code == 0 and (tmp_path / "eval" / "ppl.json").is_file()
    again = tmp_path / "again"  # init_from a run that started from a directory: its model and tokenizer again
    ok(train(again, cache, f"init_from={part}", "max_steps=1"))
    assert load_model(str(again))[2].files() == directory_tokenizer.files()
    assert (again / "hf_origin.json").read_bytes() == (ckpt / "hf_origin.json").read_bytes()
