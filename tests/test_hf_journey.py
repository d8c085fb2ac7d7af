"""The README's "Start from a Hugging Face model", end to end, as a user runs it: a Pythia-shaped and a
Llama-shaped random-weight directory, each with its own byte-level BPE `tokenizer.json` (the Llama
one with a BOS post-processor, a chat template and Llama 3's RoPE scaling) -> `python -m train
init_from=<dir>` (a few steps, at a longer length with a RoPE scaling) -> `python -m eval task=ppl`
-> `python -m train.export_hf` -> in an interpreter that cannot import this project: AutoTokenizer's
ids are the run's, the logits ours, `generate` gives our greedy tokens, the chat template and the
tokenizer files are the imported ones; and lm-evaluation-harness runs the offline task on it. The
imported Llama converted to CoCA by `experiment=dropin_coca` takes the same road (remote code).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.sources import stdlib_files, stdlib_root
from run_checks import clean_env, ok
from train.load import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

REPO = Path(__file__).resolve().parents[1]
CHAT = "{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>{% endfor %}"
# Llama 3's RoPE from L0 = 64 (a head of 32 dims: pairs kept, ramped and divided), the directory
# saying max_position_embeddings 256 as Llama 3.2 says 131072.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
RUN = ["logger=none", "logger.progress=false", "batch_size=4", "micro_batch_size=4", "data.num_workers=0",
       "data.shuffle_buffer=16", "max_steps=3", "eval_every=3", "eval_batches=1", "ckpt_every=3"]


def _docs(n: int = 40) -> list[str]:
    files = stdlib_files()
    return [(stdlib_root() / f).read_text(errors="replace") for f in files[:: len(files) // n][:n]]


def byte_level_tokenizer(out: Path, specials: list[str], bos: str | None = None) -> int:
    """A byte-level BPE (GPT-2's kind, as Pythia's and Llama 3's) trained here into `out/tokenizer.json`,
    `specials` first; with `bos`, a post-processor that puts it before every text (as Llama 3's).
    Returns its size."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(_docs(), trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))])
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    return backend.get_vocab_size()


def _randomised(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.eval()


def pythia_dir(out: Path) -> Path:
    """Pythia's shape in small (GPT-NeoX, rotary_pct 0.25, parallel residual, untied, embeddings
    padded past the tokenizer), its tokenizer saved by transformers (EOS = BOS `<|endoftext|>`)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast

    size = byte_level_tokenizer(out, ["<|endoftext|>", "<|padding|>"])
    PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>", pad_token="<|padding|>").save_pretrained(out)
    cfg = GPTNeoXConfig(vocab_size=size + 16, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                        intermediate_size=64, rotary_pct=0.25, max_position_embeddings=64, use_parallel_residual=True,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    _randomised(GPTNeoXForCausalLM(cfg)).save_pretrained(out)
    return out


def llama_dir(out: Path) -> Path:
    """Llama 3's layout in small (grouped-query attention, tied, its llama3 RoPE scaling), shaped as
    the study's models (2 layers of width 128, MLP 1024) so that `experiment=dropin_coca` applies; its
    tokenizer files written as Llama 3's repositories hold them (transformers 4: the chat template in
    tokenizer_config.json, a special_tokens_map.json)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    size = byte_level_tokenizer(out, ["<|begin_of_text|>", "<|end_of_text|>", "<|start|>", "<|eot_id|>"],
                                bos="<|begin_of_text|>")
    roles = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (out / "tokenizer_config.json").write_text(json.dumps({
        **roles, "chat_template": CHAT, "clean_up_tokenization_spaces": True, "model_max_length": 256,
        "model_input_names": ["input_ids", "attention_mask"], "tokenizer_class": "PreTrainedTokenizerFast"}))
    (out / "special_tokens_map.json").write_text(json.dumps(roles))
    cfg = LlamaConfig(vocab_size=size, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, intermediate_size=1024, max_position_embeddings=256, rms_norm_eps=1e-5,
                      rope_parameters=LLAMA3, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    _randomised(LlamaForCausalLM(cfg)).save_pretrained(out)
    return out


JOURNEYS = {  # name -> (directory, train overrides, the class the export loads as)
    "pythia": (pythia_dir, ["model.max_seq_len=96", "model.rope_scaling.type=linear",
                            "model.rope_scaling.factor=2.0"], "GPTNeoXForCausalLM"),
    "llama": (llama_dir, ["model.max_seq_len=160"], "LlamaForCausalLM"),
    "llama-dropin-coca": (llama_dir, ["experiment=dropin_coca", "batch_size=4", "micro_batch_size=4",
                                      "max_steps=2", "eval_every=2", "ckpt_every=2"], "CocaLMForCausalLM"),
}

CHECK = r"""
import json, sys, torch
from pathlib import Path
repo, export, source, out = (Path(a) for a in sys.argv[1:5])
assert all(Path(p or ".").resolve() != repo for p in sys.path), sys.path
try:
    import train  # noqa: F401
    raise SystemExit("this project is importable")
except ModuleNotFoundError:
    pass
from transformers import AutoModelForCausalLM, AutoTokenizer
remote = (export / "modeling_coca_lm.py").exists()
tok = AutoTokenizer.from_pretrained(export, trust_remote_code=remote)
model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=remote).eval()
ids = tok(Path(json.__file__).with_name("decoder.py").read_text(), add_special_tokens=False)["input_ids"]
prompt = torch.tensor([[tok.eos_token_id] + ids[:95]])
with torch.no_grad():
    logits = model(prompt).logits
generated = model.generate(prompt[:, :12], max_new_tokens=16, do_sample=False, eos_token_id=None)
chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) if tok.chat_template else None
torch.save({"ids": ids, "logits": logits, "generated": generated, "class": type(model).__name__, "chat": chat,
            "roles": (tok.bos_token_id, tok.eos_token_id, model.config.bos_token_id, model.config.eos_token_id),
            "rope": getattr(model.config, "rope_parameters", None)}, out)
"""


def _run(*args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    return ok(subprocess.run([sys.executable, *args], cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
                             timeout=600))


@pytest.mark.slow
@pytest.mark.parametrize("journey", list(JOURNEYS))
def test_a_hugging_face_model_trains_evaluates_and_exports_back_with_its_tokenizer(journey, tmp_path):
    make, overrides, hf_class = JOURNEYS[journey]
    source = make(tmp_path / "model")
    run, out = tmp_path / "run", tmp_path / "export"
    _run("-m", "train", *RUN, f"init_from={source}", f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}",
         *overrides)
    _run("-m", "eval", f"run={run}", f"out_dir={tmp_path / 'eval'}", "task=ppl", "ppl.lengths=[64]", "ppl.n_docs=1",
         "progress=false", "wandb.mode=disabled")
    assert json.loads((tmp_path / "eval" / "ppl.json").read_text())
    done = _run("-m", "train.export_hf", f"run={run}", f"out={out}")
    assert done.stdout.count("\n") == 1 and f"to {out}: AutoModelForCausalLM" in done.stdout

    for name in ("tokenizer.json", "special_tokens_map.json"):  # the imported files, byte for byte
        assert (out / name).exists() == (source / name).exists()
        assert not (source / name).exists() or (out / name).read_bytes() == (source / name).read_bytes()
    exported, imported = (json.loads((d / "tokenizer_config.json").read_text()) for d in (out, source))
    assert {k: v for k, v in exported.items() if k in imported} == imported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [hf_class]

    result = tmp_path / "hf.pt"
    _run("-I", "-c", CHECK, str(REPO), str(out), str(source), str(result), cwd=tmp_path,
         HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
    got = torch.load(result)
    model, cfg, tokenizer = load_model(str(run))
    assert got["class"] == hf_class
    assert got["ids"] == tokenizer.encode(Path(json.__file__).with_name("decoder.py").read_text())
    assert got["roles"][1] == got["roles"][3] == tokenizer.eos_id and got["roles"][0] == got["roles"][2]
    prompt = torch.tensor([[tokenizer.eos_id] + got["ids"][:95]])
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], model(prompt), rtol=0, atol=1e-5)
    assert torch.equal(got["generated"], model.generate(prompt[:, :12], 16, greedy=True))
    s = cfg.model.rope_scaling
    if journey == "pythia":
        assert (cfg.model.max_seq_len, s.type, s.factor) == (96, "linear", 2.0)
        assert got["rope"]["rope_type"] == "linear" and got["rope"]["factor"] == 2.0
        assert got["chat"] is None
    else:
        assert (s.type, s.original_max_seq_len) == ("llama3", 64) and cfg.model.attention == config.get(
            "attention", "origin")
        assert {k: got["rope"][k] for k in LLAMA3} == LLAMA3
        assert got["chat"] == "<|start|>user\nhi<|eot_id|>"
        assert got["roles"][0] == 0  # Llama's BOS, not its EOS

    cmd = ["-m", "lm_eval", "--model", "hf", "--model_args",
           f"pretrained={out},trust_remote_code={(out / 'modeling_coca_lm.py').exists()}",
           "--include_path", str(REPO / "lm_eval_tasks"), "--tasks", "coca_lm_pycloze", "--device", "cpu",
           "--batch_size", "8", "--output_path", str(tmp_path / "results")]
    _run(*cmd, cwd=tmp_path, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    (path,) = (tmp_path / "results").rglob("results_*.json")
    results = json.loads(path.read_text())
    assert results["n-samples"]["coca_lm_pycloze"]["effective"] == 24
    assert 0.0 <= results["results"]["coca_lm_pycloze"]["acc,none"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("make", [pythia_dir, llama_dir], ids=["pythia", "llama"])
def test_a_directory_trained_without_moving_and_exported_gives_back_its_tensors(make, tmp_path):
    """The round trip as a user makes it: a random GPTNeoXForCausalLM (untied) or LlamaForCausalLM
    (tied) directory saved by transformers, `init_from` it, 3 steps at a learning rate too small to
    move an fp32 weight, `python -m train.export_hf`: the export holds exactly the source's tensor
    names (GPT-NeoX's head `embed_out.weight`, no head for the tied Llama) and its values, bitwise."""
    from safetensors.torch import load_file

    source = make(tmp_path / "model")
    run, out = tmp_path / "run", tmp_path / "export"
    _run("-m", "train", *RUN, f"init_from={source}", f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}",
         "optim.lr=1e-30", "optim.min_lr=0", "optim.warmup_steps=0", "deepspeed.precision=fp32")
    _run("-m", "train.export_hf", f"run={run}", f"out={out}")
    original, exported = load_file(str(source / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert ("embed_out.weight" in original) == (make is pythia_dir) and "lm_head.weight" not in original
    assert all(torch.equal(exported[name], original[name].float()) for name in original)
