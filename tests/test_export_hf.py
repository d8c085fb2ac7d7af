"""Hugging Face export (`hf.export`): the exported directory, loaded through `AutoTokenizer` and
`AutoModelForCausalLM`, gives our token ids, our logits (1e-5, fp32) and our greedy tokens, for
Origin (a plain GPTNeoXForCausalLM, or LlamaForCausalLM for arch=llama), ALiBi and CoCA slack /
strict (remote code), on both architectures (llama: grouped-query attention, tied and untied).

Fast tier: random-weight models of two layers at a training length of 32, compared at 1x and 8x.
Slow tier: a ZeRO-3 run trained here, exported by the CLI, loaded in a subprocess that cannot import
this project, and scored by lm-evaluation-harness on the local task in `lm_eval_tasks/`; arch=llama
micro runs (Origin and CoCA) exported by the CLI, with and without a RoPE scaling.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.sources import stdlib_files, stdlib_root
from data.tasks import make_cases, make_recall_cases
from data.tokenizer import Tokenizer, config_from_overrides, get_tokenizer
from hf.export import REMOTE_CODE, ExportError, export_hf
from model import GPT, ModelConfig
from model.config import RopeScaling
from model.designs import BY_LABEL
from run_checks import clean_env
from train.export_hf import main as export_main
from train.load import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

REPO = Path(__file__).resolve().parents[1]
L0 = 32
# Every design of the registry, by label; partial rotary and a sequential residual are exercised too.
# p-RoPE at p = 0.5: with llama's 4 rotary pairs the default 0.25 rotates only theta_0 = 1, which no
# scaling changes (the test checks that each scaling changes the logits).
EXTRAS = {"origin": dict(rotary_pct=0.5, parallel_residual=False), "coca-slack": dict(rotary_pct=0.5),
          "p-rope": dict(design_params={"prope": {"p": 0.5}}), "hybrid": dict(length_temperature=True),
          "pope": dict(design_params={"pope": {"phase_bias": True}})}
DESIGNS = {label: {**design.settings(), **EXTRAS.get(label, {})} for label, design in BY_LABEL.items()}
SAMPLE = (
    "The quick brown fox, naïve café owner, paid €12.50 for 3 crêpes.\n"
    "def área(r: float) -> float:\n\treturn 3.14159 * r ** 2  # π r²\n"
    "日本語のテキスト, Ελληνικά, русский, emoji 🙂🚀, tabs\t\tand  double  spaces\r\n"
    "literal specials </s> <s> <pad> <unk> stay text; rare: \u0bf5 \U0001f9ec\n"
)
VARIANTS = {  # arch=llama: 4 query heads sharing 2 key/value heads, untied and tied embeddings
    "neox": {},
    "llama": dict(arch="llama", n_head=4, n_kv_head=2),
    "llama-tied": dict(arch="llama", n_head=4, n_kv_head=2, tie_embeddings=True),
}
# What AutoModelForCausalLM loads: (arch, Origin?) -> class; only the custom ones need remote code.
HF_CLASS = {("neox", True): "GPTNeoXForCausalLM", ("llama", True): "LlamaForCausalLM",
            ("neox", False): "CocaLMForCausalLM", ("llama", False): "CocaLMForCausalLM"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    cache = tmp_path_factory.mktemp("hf_tokenizer")
    return get_tokenizer(config_from_overrides([f"cache_dir={cache}", "tokenizer.sample_docs=60"], 512))


def random_model(tokenizer: Tokenizer, design: str, variant: str = "neox", **overrides) -> GPT:
    """A 2-layer model with every parameter (biases and norms too) drawn at std 0.3: scores large
    enough that each RoPE scaling moves the logits at 8x by 0.04 or more, far beyond the 1e-5
    compared. arch=llama has its own block (sequential residual, full rotary) whatever the design."""
    shape = dict(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, max_seq_len=L0,
                 **DESIGNS[design])
    shape.update(**VARIANTS[variant], **overrides)
    if shape.get("arch") == "llama":
        shape.update(parallel_residual=False, rotary_pct=1.0)
    torch.manual_seed(0)
    model = GPT(ModelConfig(**shape)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def load_hf(path: Path, rope_override: dict | None = None):
    """The export through AutoConfig and AutoModelForCausalLM, with remote code only where it ships
    some (Origin: none); every weight in the file is one of the model's and none is missing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    remote = (path / "modeling_coca_lm.py").exists()
    config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
    if rope_override:
        config.rope_parameters = {**config.rope_parameters, **rope_override}
    model, info = AutoModelForCausalLM.from_pretrained(path, config=config, trust_remote_code=remote,
                                                       output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_name_map_is_one_to_one_onto_gpt_neox(tie):
    """`hf.names` maps every parameter of ours onto one of transformers' own GPTNeoXForCausalLM."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from hf.names import hf_names

    cfg = ModelConfig(vocab_size=64, n_layer=3, n_head=2, n_embd=16, ffn_hidden=32, tie_embeddings=tie)
    theirs = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=3,
                                              num_attention_heads=2, intermediate_size=32,
                                              tie_word_embeddings=tie))
    names = hf_names(cfg)
    assert set(names) == {name for name, _ in GPT(cfg).named_parameters()}
    assert sorted(names.values()) == sorted(name for name, _ in theirs.named_parameters())


def test_tokenizer_gives_our_ids_byte_fallback_included(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    export_hf(random_model(tokenizer, "origin"), tokenizer, tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ours = tokenizer.encode(SAMPLE)
    byte_ids = {tokenizer._sp.piece_to_id(f"<0x{b:02X}>") for b in range(256)}
    assert len(byte_ids & set(ours)) > 10  # the sample exercises byte fallback
    assert hf(SAMPLE)["input_ids"] == ours
    assert hf.decode(ours) == tokenizer.decode(ours) == SAMPLE
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) == (tokenizer.eos_id, tokenizer.eos_id, tokenizer.pad_id)
    # The one documented difference: a literal U+2581 is the space piece for HF, its 3 bytes for us.
    assert hf.encode("a\u2581b") == tokenizer.encode("a b") != tokenizer.encode("a\u2581b")


def _stdlib_sample(n_files: int = 300) -> list[str]:
    """Every k-th file of the sorted standard library (a fixed, spread-out sample), as text."""
    files = stdlib_files()
    sample = files[:: len(files) // n_files]
    return [(stdlib_root() / f).read_bytes().decode("utf-8", errors="replace") for f in sample]


@pytest.mark.parametrize("digit_group", [1, 2, 3])
def test_exported_tokenizer_encodes_like_ours_for_every_digit_group(digit_group, tmp_path):
    """The standard library and the evaluation's own passkey and recall prompts give the same ids
    through `AutoTokenizer` as through ours; with digit groups, numbers are cut into the same pieces."""
    from transformers import AutoTokenizer

    cache = tmp_path / "cache"
    tok = get_tokenizer(config_from_overrides([f"cache_dir={cache}", "tokenizer.sample_docs=200",
                                               f"tokenizer.digit_group={digit_group}"], 4096))
    export_hf(random_model(tok, "origin"), tok, tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    number = tok.encode("12345 007")
    assert [tok.piece(i) for i in number] == {1: list("12345") + ["\u2581"] + list("007"),
                                              2: ["12", "34", "5", "\u2581", "00", "7"],
                                              3: ["123", "45", "\u2581", "007"]}[digit_group]
    passkeys = [c.tokens for n in (128, 512, 2048) for c in make_cases(tok, n, 10, seed=0)]
    recalls = [c.tokens for n in (128, 512, 2048) for c in make_recall_cases(tok, n, 5, 4, seed=0)]
    prompts = [tok.decode(ids) for ids in passkeys + recalls]
    assert [tok.encode(p) for p in prompts[: len(passkeys)]] == passkeys  # as the evaluation sees them
    for text in _stdlib_sample() + prompts + [SAMPLE]:
        assert hf(text)["input_ids"] == tok.encode(text)
    assert hf.decode(number) == "12345 007"


def test_tokenizer_that_tokenizer_json_cannot_express_is_refused(tokenizer, tmp_path):
    """A SentencePiece model with a dummy prefix (say a `data.tokenizer.model_path` of another
    origin) would encode differently as exported: refused in one line, nothing written."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(tokenizer.path).read_bytes())
    proto.normalizer_spec.add_dummy_prefix = True
    (tmp_path / "prefix.model").write_bytes(proto.SerializeToString())
    other = Tokenizer(tmp_path / "prefix.model")
    assert other.encode("a") != tokenizer.encode("a")  # it does encode differently
    with pytest.raises(ExportError, match="add_dummy_prefix=true"):
        export_hf(random_model(other, "origin"), other, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefix.model"]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_overwrite_replaces_only_a_previous_export_and_a_failure_keeps_it(tokenizer, tmp_path, monkeypatch):
    """The export is written beside `out` and renamed in: a failure half-way leaves the previous
    export as it was (and no temporary folder); overwrite=true replaces an export, and only one
    that holds nothing but what the export wrote."""
    import hf.export as export_module

    out = tmp_path / "hf"
    export_hf(random_model(tokenizer, "origin"), tokenizer, out)
    first = _files(tmp_path)
    with pytest.raises(ExportError, match="a previous export .add overwrite=true"):
        export_hf(random_model(tokenizer, "alibi"), tokenizer, out)

    def disk_full(*_args):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(export_module, "save_tokenizer", disk_full)
        with pytest.raises(OSError, match="No space left"):
            export_hf(random_model(tokenizer, "alibi"), tokenizer, out, overwrite=True)
    assert _files(tmp_path) == first
    export_hf(random_model(tokenizer, "alibi"), tokenizer, out, overwrite=True)
    assert json.loads((out / "config.json").read_text())["attention"] == "alibi"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    (out / "my_notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="also holds my_notes.txt, which the export did not write"):
        export_hf(random_model(tokenizer, "origin"), tokenizer, out, overwrite=True)
    assert (out / "my_notes.txt").read_text() == "mine"


def _check_loaded(hf, model: GPT, design: str) -> None:
    """The class AutoModelForCausalLM chose and the shape it built: tying, key/value heads."""
    m = model.cfg
    assert type(hf).__name__ == HF_CLASS[(m.arch, BY_LABEL[design].native_hf)]
    assert hf.config.tie_word_embeddings == m.tie_embeddings
    assert (hf.get_output_embeddings().weight is hf.get_input_embeddings().weight) == m.tie_embeddings
    if m.arch == "llama":
        assert hf.config.num_key_value_heads == m.kv_heads < m.n_head
        assert hf.base_model.layers[0].self_attn.k_proj.weight.shape == (m.kv_heads * m.head_dim, m.n_embd)


def _check_rope(config, model: GPT) -> None:
    """The loaded config carries our RoPE scaling (the logits then show it acts)."""
    s, p = model.cfg.rope_scaling, config.rope_parameters
    assert p["rope_type"] == {"none": "default", "ntk": "default"}.get(s.type, s.type)
    assert p["rope_theta"] == pytest.approx(model.rope.base_at(1) if s.type == "ntk" else model.cfg.rope_base)
    if s.type in ("linear", "dynamic", "yarn", "llama3"):
        assert p["factor"] == s.factor
    train_len = s.original_max_seq_len or model.cfg.max_seq_len
    if s.type in ("yarn", "llama3"):
        assert p["original_max_position_embeddings"] == train_len
    if s.type == "llama3":
        assert (p["low_freq_factor"], p["high_freq_factor"]) == (s.low_freq_factor, s.high_freq_factor)
    assert config.max_position_embeddings == (train_len if s.type == "dynamic" else model.cfg.max_seq_len)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("design", list(DESIGNS))
def test_logits_and_greedy_tokens_match(design, variant, tokenizer, tmp_path):
    """Each RoPE scaling the exporter carries (set on our model, as its `rope_scaling=` does) comes
    back in the loaded config and gives our logits at 1x and 8x the training length, where it
    visibly changes them; greedy `generate` gives our tokens."""
    model = random_model(tokenizer, design, variant)
    idx = torch.randint(4, tokenizer.vocab_size, (2, 8 * L0), generator=torch.Generator().manual_seed(1))
    rope = BY_LABEL[design].rope
    scalings = [("none", 1.0)] if not rope else [("none", 1.0), ("dynamic", 4.0), ("linear", 4.0),
                                                            ("ntk", 4.0), ("yarn", 4.0), ("llama3", 4.0)]
    with torch.no_grad():
        unscaled = model(idx)
    for kind, factor in scalings:
        model.set_rope_scaling(kind, factor)
        out = export_hf(model, tokenizer, tmp_path / kind)
        assert (out / "modeling_coca_lm.py").exists() == (not BY_LABEL[design].native_hf)
        hf = load_hf(out)
        _check_loaded(hf, model, design)
        if rope:
            _check_rope(hf.config, model)
        with torch.no_grad():
            for length in (L0, 8 * L0):
                want = model(idx[:, :length])
                torch.testing.assert_close(hf(idx[:, :length]).logits, want, rtol=0, atol=1e-5)
                assert want.std() > 0.05
        assert kind == "none" or (want - unscaled).abs().max() > 1e-2
    model.set_rope_scaling("none", 1.0)
    hf = load_hf(tmp_path / "none")
    prompt = idx[:1, :20]
    ours = model.generate(prompt, 32, greedy=True)
    theirs = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None)
    assert torch.equal(theirs, ours)


MODIFIED = {"sinks+ssmax": dict(sinks=True, ssmax=True), "qk_norm": dict(qk_norm=True)}


@pytest.mark.parametrize("modifiers", MODIFIED)
@pytest.mark.parametrize("variant", ["neox", "llama"])
@pytest.mark.parametrize("design", ["origin", "nope", "fox", "hybrid"])
def test_softmax_modifiers_export_through_the_remote_code(design, variant, modifiers, tokenizer, tmp_path):
    """Sinks and SSMax (drawn at std 0.3 like every weight: sinks around 0, s of either sign), or
    QK-norm (its scales drawn so too; under llama k's norm spans the 2 kv heads), on a RoPE design
    (Origin, then remote code), NoPE (DroPE's model), a gated bias (FoX: its terms in the HF cache)
    and the windowed hybrid: the logits at L0 and 8 L0, and greedy generation over transformers' cache."""
    model = random_model(tokenizer, design, variant, **MODIFIED[modifiers])
    idx = torch.randint(4, tokenizer.vocab_size, (2, 8 * L0), generator=torch.Generator().manual_seed(1))
    out = export_hf(model, tokenizer, tmp_path / "export")
    assert (out / "modeling_coca_lm.py").exists()
    hf = load_hf(out)
    assert all(getattr(hf.config, name) == on for name, on in MODIFIED[modifiers].items())
    if "qk_norm" in modifiers:
        written = json.loads((out / "config.json").read_text())
        assert written["qk_norm"] is True and not written["sinks"]
        names = set(hf.state_dict())
        layers = "gpt_neox.layers.1.attention" if variant == "neox" else "model.layers.1.self_attn"
        assert {f"{layers}.q_norm.weight", f"{layers}.k_norm.weight"} <= names
    with torch.no_grad():
        for length in (L0, 8 * L0):
            want = model(idx[:, :length])
            torch.testing.assert_close(hf(idx[:, :length]).logits, want, rtol=0, atol=1e-5)
            assert want.std() > 0.05
    prompt = idx[:1, :20]
    theirs = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None)
    assert torch.equal(theirs, model.generate(prompt, 32, greedy=True))


@pytest.mark.parametrize("variant", ["neox", "llama"])
def test_hybrid_with_global_rope_layers_at_their_own_base_exports(variant, tokenizer, tmp_path):
    """Gemma 3's layout (local windowed RoPE, every second layer global RoPE at base 50): logits at
    L0 and 8 L0 under each scaling the export can carry, and greedy generation; a static NTK base,
    which only the model's rope_theta can carry, is refused in one line."""
    params = {"hybrid": {"nope_every": 2, "window": 5, "global_layers": "origin", "global_rope_base": 50.0}}
    model = random_model(tokenizer, "hybrid", variant, design_params=params, length_temperature=False)
    idx = torch.randint(4, tokenizer.vocab_size, (2, 8 * L0), generator=torch.Generator().manual_seed(1))
    for kind, factor in (("none", 1.0), ("dynamic", 4.0), ("yarn", 4.0)):
        model.set_rope_scaling(kind, factor)
        hf = load_hf(export_hf(model, tokenizer, tmp_path / kind))
        with torch.no_grad():
            for length in (L0, 8 * L0):
                torch.testing.assert_close(hf(idx[:, :length]).logits, model(idx[:, :length]), rtol=0, atol=1e-5)
    prompt = idx[:1, :20]
    theirs = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None)
    assert torch.equal(theirs, model.generate(prompt, 32, greedy=True))
    model.set_rope_scaling("ntk", 4.0)
    with pytest.raises(ExportError, match="rope_scaling ntk on a model whose layers have RoPE bases of their own"):
        export_hf(model, tokenizer, tmp_path / "ntk")


@pytest.mark.parametrize("variant, design", [("neox", "origin"), ("llama", "origin"), ("llama", "coca-slack"),
                                             ("llama-tied", "coca-strict")])
@pytest.mark.parametrize("kind", ["dynamic", "yarn", "llama3"])
def test_scaling_from_an_original_length_is_where_transformers_reads_it(kind, variant, design, tokenizer, tmp_path):
    """A model continued past its pretraining length scales RoPE from that shorter length
    (`rope_scaling.original_max_seq_len`): the export carries it (yarn's and llama3's
    original_max_position_embeddings, dynamic's max_position_embeddings) and gives our logits,
    which differ from those of a scaling from the training length. (Heads of 16 rotary dims or more:
    with 8, YaRN's ramp is the same from 16 tokens as from 32.)"""
    scaling = RopeScaling(kind, 4.0, original_max_seq_len=L0 // 2)
    model = random_model(tokenizer, design, variant, n_embd=64, rope_scaling=scaling)
    hf = load_hf(export_hf(model, tokenizer, tmp_path))
    _check_rope(hf.config, model)
    idx = torch.randint(4, tokenizer.vocab_size, (1, 4 * L0), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(idx)
        torch.testing.assert_close(hf(idx).logits, want, rtol=0, atol=1e-5)
        plain = random_model(tokenizer, design, variant, n_embd=64, rope_scaling=RopeScaling(kind, 4.0))
        assert (plain(idx) - want).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["neox", "llama"])
@pytest.mark.parametrize("design", ["coca-slack", "coca-strict"])
def test_dynamic_ntk_set_at_load_time_generates_like_ours(design, variant, tokenizer, tmp_path):
    """The README's recipe (dynamic NTK chosen when loading); generation crosses the training length,
    where every new length has a new base: each step's logits equal a full forward of ours.
    (Origin's plain GPTNeoX and Llama keep their stale cache there, transformers' own convention.)"""
    model = random_model(tokenizer, design, variant)
    hf = load_hf(export_hf(model, tokenizer, tmp_path), {"rope_type": "dynamic", "factor": 4.0})
    model.set_rope_scaling("dynamic", 4.0)
    prompt = torch.randint(4, tokenizer.vocab_size, (1, L0 - 8), generator=torch.Generator().manual_seed(2))
    out = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None, output_logits=True,
                      return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(prompt, 32, greedy=True))
    with torch.no_grad():
        for step, logits in enumerate(out.logits):
            want = model(out.sequences[:, : prompt.shape[1] + step])[:, -1]
            torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)


def test_the_remote_code_is_the_models_own_and_exactly_what_its_wrapper_imports(tokenizer, tmp_path):
    """The export ships the wrapper and the files transformers follows from it (its own
    `get_relative_import_files`), no more; each is this project's file byte for byte (our decoder,
    not a copy), imports only torch, the standard library and its siblings (the wrapper also
    transformers), and the loaded model runs our `GPT`."""
    import ast

    from transformers.dynamic_module_utils import get_relative_import_files

    out = export_hf(random_model(tokenizer, "fox", "llama"), tokenizer, tmp_path / "hf")
    code = {p.name for p in out.glob("*.py")}
    followed = {Path(f).name for f in get_relative_import_files(str(out / "modeling_coca_lm.py"))}
    assert code == set(REMOTE_CODE) == followed | {"modeling_coca_lm.py"}
    assert {"gpt.py", "attention.py", "hf_layout.py", "designs.py", "fox.py"} <= code
    for name, source in REMOTE_CODE.items():
        assert (out / name).read_bytes() == source.read_bytes(), name
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and f"{node.module}.py" in code, f"{name}: from .{node.module}"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                tops = {a.name.split(".")[0] for a in node.names} if isinstance(node, ast.Import) else \
                    {node.module.split(".")[0]}
                allowed = {"torch"} | ({"transformers"} if name == "modeling_coca_lm.py" else set())
                assert tops <= allowed | sys.stdlib_module_names, f"{name}: imports {tops}"
    assert type(load_hf(out).decoder).__name__ == "GPT"


def test_the_remote_code_takes_right_padding_and_refuses_what_it_cannot_compute(tokenizer, tmp_path):
    """Right padding without a cache leaves the real tokens' logits ours; right padding continued over
    a cache, inputs_embeds and positions other than the ones counted are refused in one line (left
    padding: `tests/test_export_padded.py`)."""
    model = random_model(tokenizer, "kerple")
    hf = load_hf(export_hf(model, tokenizer, tmp_path / "hf"))
    idx = torch.randint(4, tokenizer.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))
    right = torch.ones_like(idx)
    right[1, 9:] = 0
    with torch.no_grad():
        want = model(idx)
        torch.testing.assert_close(hf(idx, attention_mask=right).logits[1, :9], want[1, :9], rtol=0, atol=1e-5)
        torch.testing.assert_close(hf(idx, attention_mask=torch.ones_like(idx),
                                      position_ids=torch.arange(12)[None].expand(2, 12)).logits, want,
                                   rtol=0, atol=1e-5)
        refusals = [(dict(position_ids=torch.arange(1, 13)[None]), "position_ids must count from"),
                    (dict(input_ids=None, inputs_embeds=torch.zeros(2, 12, 32)), "not inputs_embeds")]
        for kwargs, needle in refusals:
            with pytest.raises(ValueError, match=needle) as error:
                hf(**{"input_ids": idx, **kwargs})
            assert "\n" not in str(error.value)
        with pytest.raises(ValueError, match="nor right padding continued over a cache"):
            hf.generate(idx, attention_mask=right, max_new_tokens=2, do_sample=False, eos_token_id=None)


def test_remote_config_refuses_a_shape_it_cannot_build(tokenizer, tmp_path):
    """The modeling file's config refuses key/value heads that GPT-NeoX's fused qkv cannot have or
    that do not divide the query heads, and an unknown arch."""
    from transformers import AutoConfig

    path = export_hf(random_model(tokenizer, "coca-slack", "llama"), tokenizer, tmp_path / "hf")
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert (config.arch, config.num_key_value_heads, config.num_attention_heads) == ("llama", 2, 4)
    for bad in ({"arch": "neox"}, {"num_key_value_heads": 3}, {"arch": "mamba"}):
        with pytest.raises(ValueError, match="need neox.llama, and key/value heads dividing"):
            type(config)(**{**config.to_dict(), **bad})


def test_one_process_loads_both_architectures_from_one_modeling_file(tokenizer, tmp_path):
    """transformers caches remote code by folder name and content and maps its config class to one
    model class: a neox and a llama export of the same name, loaded in turn, are each their own."""
    for i, variant in enumerate(["neox", "llama", "neox"]):
        model = random_model(tokenizer, "coca-strict", variant)
        hf = load_hf(export_hf(model, tokenizer, tmp_path / str(i) / "hf"))
        assert hf.config.arch == model.cfg.arch
        idx = torch.randint(4, tokenizer.vocab_size, (1, L0), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            torch.testing.assert_close(hf(idx).logits, model(idx), rtol=0, atol=1e-5)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_exported_file_has_the_mode_the_umask_gives(umask, tokenizer, tmp_path):
    """model.safetensors too (safetensors writes it 0600 on its own): readable by whoever may read
    the export's other files."""
    previous = os.umask(umask)
    try:
        out = export_hf(random_model(tokenizer, "alibi"), tokenizer, tmp_path / "hf")
    finally:
        os.umask(previous)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in out.iterdir()}
    assert "model.safetensors" in modes and len(modes) >= 6
    assert modes == {name: oct(0o666 & ~umask) for name in modes}


def test_alibi_export_refuses_a_rope_scaling_in_transformers(tokenizer, tmp_path):
    """ALiBi has no RoPE: a scaling set when loading (the README's recipe, a config keyword, or a
    static NTK base) is refused by the modeling file, as coca-lm refuses it, instead of loading a
    model whose logits it does not change. Unscaled, the export loads."""
    from transformers import AutoConfig

    path = export_hf(random_model(tokenizer, "alibi"), tokenizer, tmp_path / "alibi")
    for override in ({"rope_type": "dynamic", "factor": 4.0}, {"rope_type": "linear", "factor": 2.0},
                     {"rope_theta": 40000.0}):
        with pytest.raises(ValueError, match="ALiBi has no RoPE to scale"):
            load_hf(path, override)
    with pytest.raises(ValueError, match="ALiBi has no RoPE to scale"):
        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        type(config)(**{**config.to_dict(), "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    assert load_hf(path).config.attention == "alibi"


def test_export_cli_errors_are_one_line(tmp_path, capsys):
    assert export_main([f"run={tmp_path / 'missing'}", f"out={tmp_path / 'out'}"]) == 1  # a missing file
    assert export_main(["run=x"]) == 2
    assert export_main([f"run={tmp_path}", "out=y", "rope_scaling=cubic:2"]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert export_main([f"run={tmp_path}", f"out={tmp_path / 'full'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("error: ") for line in lines)
    assert "not found" in lines[0] and "out= is required" in lines[1]
    assert "cubic" in lines[2] and "not empty" in lines[3]


# ---- slow: a ZeRO-3 run, the CLI, a clean interpreter, lm-evaluation-harness ------------------------

LOADER = r"""
import sys, torch
from pathlib import Path
repo, model_dir, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
assert all(Path(p or ".").resolve() != repo for p in sys.path), sys.path
try:
    import train  # noqa: F401
    raise SystemExit("this project is importable")
except ModuleNotFoundError:
    pass
from transformers import AutoModelForCausalLM, AutoTokenizer
remote = Path(model_dir, "modeling_coca_lm.py").exists()  # Origin loads without remote code
tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=remote)
model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=remote).eval()
text = Path(sys.argv[4]).read_text()
ids = [tok.eos_token_id] + tok(text)["input_ids"][: 8 * 32 - 1]
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits
generated = model.generate(torch.tensor([ids[:20]]), max_new_tokens=32, do_sample=False, eos_token_id=None)
torch.save({"ids": ids, "logits": logits, "generated": generated, "class": type(model).__name__}, out)
"""


def _env(home: Path) -> dict[str, str]:
    return clean_env(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def _ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def zero3(tmp_path_factory) -> tuple[Path, Path]:
    """A CoCA-strict micro run trained under ZeRO-3, and its directory exported by the CLI."""
    root = tmp_path_factory.mktemp("hf_zero3")
    run, out = root / "run", root / "hf"
    _ok(subprocess.run([sys.executable, "-m", "train", "experiment=micro", "logger=none", "logger.progress=false",
                        f"run_dir={run}", f"data.cache_dir={root / 'cache'}", "deepspeed=zero3", "model.attention=coca",
                        "model.design_params.coca.form=strict", "max_steps=6", "ckpt_every=6", "eval_every=6"],
                       cwd=REPO, env=_env(root / "hf_home"), capture_output=True, text=True, timeout=600))
    done = _ok(subprocess.run([sys.executable, "-m", "train.export_hf", f"run={run}", f"out={out}"], cwd=REPO,
                              env=_env(root / "hf_home"), capture_output=True, text=True, timeout=600))
    assert done.stdout.strip().splitlines() == [
        f"exported coca-strict (no RoPE scaling) to {out}: AutoModelForCausalLM (trust_remote_code=True)"]
    return run, out


def _compare_outside_this_project(run: Path, out: Path, tmp_path: Path) -> str:
    """Load the export `out` in an interpreter that cannot import this project: the ids, logits
    (1e-5) and greedy tokens it gives are `run`'s. Returns the class AutoModelForCausalLM chose."""
    source = Path(json.__file__).with_name("decoder.py")  # any long text: the stdlib's own
    result = tmp_path / "hf.pt"
    _ok(subprocess.run([sys.executable, "-I", "-c", LOADER, str(REPO), str(out), str(result), str(source)],
                       cwd=tmp_path, env=_env(tmp_path / "hf_home"), capture_output=True, text=True, timeout=600))
    got = torch.load(result)
    model, _, tok = load_model(str(run))
    assert got["ids"] == [tok.eos_id] + tok.encode(source.read_text())[: 8 * L0 - 1]
    with torch.no_grad():
        want = model(torch.tensor([got["ids"]]))
    torch.testing.assert_close(got["logits"], want, rtol=0, atol=1e-5)
    assert torch.equal(got["generated"], model.generate(torch.tensor([got["ids"][:20]]), 32, greedy=True))
    return got["class"]


@pytest.mark.slow
def test_zero3_export_loads_without_this_project(zero3, tmp_path):
    run, out = zero3
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "coca_lm_export.json", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json", *REMOTE_CODE])
    assert _compare_outside_this_project(run, out, tmp_path) == "CocaLMForCausalLM"


@pytest.mark.slow
def test_zero3_export_eval_and_resume_say_only_their_own_lines(zero3, tmp_path):
    """DeepSpeed's progress (the ZeRO-3 merge's prints and bars, its accelerator notice, torch's
    deprecation warnings from its collectives) stays off a successful command's output."""
    import shutil

    run, _ = zero3
    env = _env(tmp_path / "hf_home")
    done = _ok(subprocess.run([sys.executable, "-m", "train.export_hf", f"run={run}", f"out={tmp_path / 'hf'}"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600))
    assert done.stderr == "" and done.stdout.count("\n") == 1
    done = _ok(subprocess.run([sys.executable, "-m", "eval", f"run={run}", "task=ppl", f"ppl.lengths=[{L0}]",
                               "ppl.n_docs=1", "progress=false", "wandb.mode=disabled", f"out_dir={tmp_path / 'eval'}"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600))
    assert done.stderr == "" and [line.split(":")[0] for line in done.stdout.splitlines()] == ["ppl", "markdown"]
    shutil.copytree(run, tmp_path / "run")
    resume = ["experiment=micro", "logger=none", "logger.progress=false", f"run_dir={tmp_path / 'run'}",
              f"data.cache_dir={tmp_path / 'cache'}", "deepspeed=zero3", "model.attention=coca",
              "model.design_params.coca.form=strict", "max_steps=8", "ckpt_every=8", "eval_every=8", "resume=auto"]
    done = _ok(subprocess.run([sys.executable, "-m", "train", *resume], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600))
    assert done.stdout == "" and done.stderr.splitlines()[0].startswith("resumed from"), done.stderr
    assert [line.split(" ")[0] for line in done.stderr.splitlines()] == ["resumed", "step", "saved", "done:", "next:"]


@pytest.mark.slow
def test_lm_eval_runs_the_local_task(zero3, tmp_path):
    _, out = zero3
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={out},trust_remote_code=True",
           "--include_path", str(REPO / "lm_eval_tasks"), "--tasks", "coca_lm_pycloze", "--device", "cpu",
           "--batch_size", "8", "--output_path", str(tmp_path / "results")]
    _ok(subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path / "hf_home"), capture_output=True, text=True, timeout=600))
    (path,) = (tmp_path / "results").rglob("results_*.json")
    results = json.loads(path.read_text())
    scores = results["results"]["coca_lm_pycloze"]
    assert 0.0 <= scores["acc,none"] <= 1.0 and 0.0 <= scores["acc_norm,none"] <= 1.0
    assert results["n-samples"]["coca_lm_pycloze"]["effective"] == 24


# ---- slow: arch=llama runs through the CLI ------------------------------------------------------------

# model=llama_tiny shrunk by experiment=micro (as tests/test_model_llama.py's run), with 2 layers and
# 4 query heads sharing 2 key/value heads; Origin with tied embeddings, CoCA slack untied.
LLAMA_RUNS = {"origin": ["model.tie_embeddings=true"], "coca-slack": ["model.attention=coca"]}


@pytest.fixture(scope="module", params=list(LLAMA_RUNS))
def llama_run(request, tmp_path_factory) -> tuple[Path, Path]:
    """An arch=llama micro run trained 6 steps, and its directory exported by the CLI."""
    root = tmp_path_factory.mktemp("hf_llama")
    run, out = root / "run", root / "hf"
    _ok(subprocess.run([sys.executable, "-m", "train", "experiment=micro", "model=llama_tiny", "model.n_layer=2",
                        "model.n_head=4", "model.n_kv_head=2", *LLAMA_RUNS[request.param], "logger=none",
                        "logger.progress=false", f"run_dir={run}", f"data.cache_dir={root / 'cache'}", "max_steps=6",
                        "ckpt_every=6", "eval_every=6"],
                       cwd=REPO, env=_env(root / "hf_home"), capture_output=True, text=True, timeout=600))
    done = _ok(subprocess.run([sys.executable, "-m", "train.export_hf", f"run={run}", f"out={out}"], cwd=REPO,
                              env=_env(root / "hf_home"), capture_output=True, text=True, timeout=600))
    code = "" if request.param == "origin" else " (trust_remote_code=True)"
    assert done.stdout.strip().splitlines() == [
        f"exported llama {request.param} (no RoPE scaling) to {out}: AutoModelForCausalLM{code}"]
    return run, out


@pytest.mark.slow
def test_llama_run_exports_loads_without_this_project_and_takes_a_rope_scaling(llama_run, tmp_path):
    """The trained run's export (Origin: a plain LlamaForCausalLM, no remote code) gives our ids,
    logits and greedy tokens in an interpreter without this project; exported again with
    `rope_scaling=dynamic:4`, its config carries the scaling and gives our scaled logits at 8x."""
    run, out = llama_run
    config = json.loads((out / "config.json").read_text())
    origin = config["architectures"] == ["LlamaForCausalLM"]
    assert origin == (not (out / "modeling_coca_lm.py").exists()) == (config.get("attention") is None)
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (2, 4, 2)
    assert config["tie_word_embeddings"] == origin
    assert _compare_outside_this_project(run, out, tmp_path) == config["architectures"][0]

    scaled = tmp_path / "dynamic"
    done = _ok(subprocess.run([sys.executable, "-m", "train.export_hf", f"run={run}", f"out={scaled}",
                               "rope_scaling=dynamic:4"], cwd=REPO, env=_env(tmp_path / "hf_home"),
                              capture_output=True, text=True, timeout=600))
    assert "(RoPE scaling dynamic:4)" in done.stdout
    model, _, tok = load_model(str(run))
    model.set_rope_scaling("dynamic", 4.0)
    hf = load_hf(scaled)
    _check_loaded(hf, model, "origin" if origin else "coca-slack")
    _check_rope(hf.config, model)
    idx = torch.randint(4, tok.vocab_size, (1, 8 * L0), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=0, atol=1e-5)
