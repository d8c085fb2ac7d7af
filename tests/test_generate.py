"""`generate`: nucleus / top-k filtering, seeded sampling over the KV cache, streaming of partial UTF-8,
and `python -m generate` on a run trained here (fixed seed, fixed text; bad input, one line)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from generate import sample
from generate.__main__ import Printer, main
from model import GPT, ModelConfig
from model.sampling import filter_logits
from run_checks import clean_env
from train.load import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

REPO = Path(__file__).resolve().parents[1]


def random_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, max_seq_len=16,
                            attention="coca")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.tensor([0.6, 0.3, 0.1, 0.0]).log()
    kept = lambda out: torch.isfinite(out).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, 2, None)) == [0, 1]
    assert kept(filter_logits(logits, None, 0.5)) == [0]
    assert kept(filter_logits(logits, None, 0.85)) == [0, 1]
    assert kept(filter_logits(logits, None, 0.95)) == [0, 1, 2]
    assert kept(filter_logits(logits, 1, 1.0)) == [0]


def test_greedy_sampling_equals_model_generate_past_the_training_length():
    model = random_model()
    prompt = [5, 9, 2, 33, 7]
    ours = list(sample(model, prompt, 30, greedy=True))
    assert ours == model.generate(torch.tensor([prompt]), 30, greedy=True)[0, len(prompt):].tolist()


def test_seed_fixes_the_sample_and_stop_ends_it():
    model = random_model()
    first = list(sample(model, [1, 2, 3], 40, temperature=1.5, top_p=0.9, seed=7))
    assert first == list(sample(model, [1, 2, 3], 40, temperature=1.5, top_p=0.9, seed=7))
    assert first != list(sample(model, [1, 2, 3], 40, temperature=1.5, top_p=0.9, seed=8))
    stopped = list(sample(model, [1, 2, 3], 40, temperature=1.5, top_p=0.9, seed=7, stop=first[5]))
    assert stopped == first[: first.index(first[5]) + 1]


class ByteTokenizer:
    """ids are UTF-8 bytes: one character can take several tokens, as with byte fallback."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_printer_holds_back_a_partial_character():
    out = io.StringIO()
    printer = Printer(ByteTokenizer(), out)
    writes = []
    for b in "aé🙂".encode():
        printer.add(b)
        writes.append(out.getvalue())
    assert writes == ["a", "a", "aé", "aé", "aé", "aé", "aé🙂"]


@pytest.mark.parametrize("argv, expected, code", [
    (["prompt=x"], "run= is required", 2),
    (["run=/no/such/run", "prompt=x"], "run or checkpoint not found: /no/such/run", 1),  # a missing file
    (["run=r", "top_p=0"], "top_p=0.0 must be in (0, 1]", 2),
    (["run=r", "max_new_tokens=many"], "max_new_tokens='many' is not a valid int", 2),
    (["run=r", "greedy=yes"], "greedy='yes' is not a valid bool", 2),
    (["run=r", "colour=red"], "unknown argument 'colour=red'", 2),
    (["run=r", "rope_scaling=cubic:2", "prompt=x"], "type 'cubic' is not one of", 2),
])
def test_bad_input_is_one_line(argv, expected, code, capsys):
    assert main(argv) == code
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and expected in err


# ---- slow: the command on a trained run ------------------------------------------------------------


_env = clean_env  # the one scrubber (tests/run_checks.py)


@pytest.fixture(scope="module")
def run(micro_run) -> Path:
    return micro_run  # the session's trained micro run (tests/conftest.py)


def generate(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "generate", *args], cwd=REPO, env=_env(), input=stdin,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_fixed_seed_fixed_text_and_greedy_equals_ours(run):
    args = (f"run={run}", "max_new_tokens=24", "temperature=1.0", "top_k=50", "top_p=0.95", "stop_at_eos=false")
    first = generate(*args, "prompt=def ", "seed=3")
    assert first.returncode == 0 and first.stderr == "", first.stderr
    assert first.stdout.startswith("def ") and first.stdout.strip() != "def"
    assert generate(*args, "seed=3", stdin="def ").stdout == first.stdout  # prompt from stdin
    assert generate(*args, "prompt=def ", "seed=4").stdout != first.stdout
    greedy = generate(f"run={run}", "prompt=import os", "greedy=true", "max_new_tokens=16", "stop_at_eos=false",
                      "rope_scaling=dynamic:4")
    model, _, tok = load_model(str(run))
    model.set_rope_scaling("dynamic", 4.0)
    prompt = [tok.eos_id] + tok.encode("import os")
    want = tok.decode(model.generate(torch.tensor([prompt]), 16, greedy=True)[0, len(prompt):].tolist())
    assert greedy.stdout == "import os" + want + "\n"  # the prompt, then its continuation


@pytest.mark.slow
def test_cli_bad_run_is_one_line_on_stderr(tmp_path):
    done = generate(f"run={tmp_path}", "prompt=x")
    assert done.returncode == 1 and done.stdout == ""  # a bad checkpoint: unusable input
    assert done.stderr.strip().splitlines() == [f"error: no complete checkpoint found in {tmp_path}"]
