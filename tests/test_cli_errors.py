"""Every bad input to data/ and eval/ command lines: one `error:` line, its exit status (2: the
command line is wrong, 1: an input it names is unusable), found before any expensive work and
leaving everything as it was. Plus train's override syntax in the data command lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.config import DataConfig, TokenizerConfig
from data.tokenizer import Tokenizer, get_tokenizer
from data.tokenizer import main as tokenizer_main
from data.prepare import main as prepare_main
from eval.__main__ import main as eval_main
from eval.report import main as report_main

ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def _corpus(path: Path, n: int = 120) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": " ".join(WORDS[(k + i) % len(WORDS)] for i in range(30))}) + "\n"
                            for k in range(n)))
    return path


def _files_source(path: Path) -> str:
    return f'sources=[{{kind:files,path:"{path}"}}]'


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root with its content: the test's proof that nothing was written or damaged."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_error(capsys, code: int, expected_code: int, *needles: str) -> str:
    err = capsys.readouterr().err
    assert code == expected_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _exit_code(fn, argv: list[str]) -> int:
    with pytest.raises(SystemExit) as done:
        fn(argv)
    return done.value.code


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    cache = tmp_path_factory.mktemp("cache")
    return get_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=512, sample_docs=30), cache_dir=str(cache)))


# --- data sources -------------------------------------------------------------------------------
def test_empty_jsonl_source(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    before = _snapshot(tmp_path)
    code = _exit_code(tokenizer_main, ["train", _files_source(tmp_path / "empty.jsonl"), f"cache_dir={tmp_path / 'c'}"])
    _one_error(capsys, code, 1, "empty.jsonl", "is empty", "data.sources[].path")
    assert _snapshot(tmp_path) == before and not (tmp_path / "c").exists()


def test_binary_file_in_a_files_source_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("plain words " * 50)
    (tmp_path / "photo.txt").write_bytes(bytes(range(256)) * 40)
    before = _snapshot(tmp_path)
    code = _exit_code(tokenizer_main, ["train", _files_source(tmp_path / "*.txt"), f"cache_dir={tmp_path / 'c'}"])
    _one_error(capsys, code, 1, str(tmp_path / "photo.txt"), "not UTF-8 text", "remove it")
    assert _snapshot(tmp_path) == before and not (tmp_path / "c").exists()


def test_cache_dir_that_is_a_file(tmp_path, capsys):
    _corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "cache").write_text("keep me")
    before = _snapshot(tmp_path)
    code = _exit_code(tokenizer_main, ["train", _files_source(tmp_path / "corpus.jsonl"), f"cache_dir={tmp_path / 'cache'}",
                                       "tokenizer.vocab_size=300"])
    _one_error(capsys, code, 2, "data.cache_dir=", "is a file, not a directory")
    assert _snapshot(tmp_path) == before


def test_garbage_tokenizer_model(tmp_path, capsys):
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(os.urandom(3000))
    _corpus(tmp_path / "corpus.jsonl")
    before = _snapshot(tmp_path)
    code = _exit_code(tokenizer_main, ["info", "--model", str(garbage)])
    _one_error(capsys, code, 1, str(garbage), "not a SentencePiece tokenizer model")
    code = _exit_code(prepare_main, ["--out", str(tmp_path / "bin"), _files_source(tmp_path / "corpus.jsonl"),
                                     f"tokenizer.model_path={garbage}"])
    _one_error(capsys, code, 1, "data.tokenizer.model_path", str(garbage))
    assert _snapshot(tmp_path) == before and not (tmp_path / "bin").exists()


def test_out_of_range_token_id(tok, capsys):
    with pytest.raises(ValueError, match=r"token id 512 is out of range: .* has ids 0\.\.511"):
        tok.decode([5, 512])
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        tok.decode([-1])
    code = _exit_code(tokenizer_main, ["decode", "--model", tok.path, "17", "99999"])
    _one_error(capsys, code, 2, "token id 99999 is out of range", "0..511")


def test_tokenizer_out_under_a_file(tmp_path, capsys):
    _corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "taken").write_text("a file")
    before = _snapshot(tmp_path)
    code = _exit_code(tokenizer_main, ["train", "--out", str(tmp_path / "taken" / "tok.model"),
                                       _files_source(tmp_path / "corpus.jsonl"), f"cache_dir={tmp_path / 'c'}"])
    _one_error(capsys, code, 2, "--out's directory", "a file, not a directory")
    assert _snapshot(tmp_path) == before and not (tmp_path / "c").exists()  # refused before training


def test_prepare_out_is_a_file_and_shard_tokens_zero(tmp_path, capsys):
    _corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "bin").write_text("a file")
    before = _snapshot(tmp_path)
    args = [_files_source(tmp_path / "corpus.jsonl"), f"cache_dir={tmp_path / 'c'}"]
    code = _exit_code(prepare_main, ["--out", str(tmp_path / "bin"), *args])
    _one_error(capsys, code, 2, "--out=", "is a file, not a directory")
    code = _exit_code(prepare_main, ["--out", str(tmp_path / "bin2"), "--shard-tokens", "0", *args])
    _one_error(capsys, code, 2, "--shard-tokens=0 must be >= 1")
    code = _exit_code(prepare_main, [*args])  # argparse's own errors are one line too
    _one_error(capsys, code, 2, "--out", "python -m data.prepare --help")
    assert _snapshot(tmp_path) == before and not (tmp_path / "c").exists()


def test_bad_override_is_one_line(tmp_path, capsys):
    code = _exit_code(tokenizer_main, ["train", "sources=[{kind:files", f"cache_dir={tmp_path}"])
    _one_error(capsys, code, 2, "write key=value")
    code = _exit_code(prepare_main, ["--out", str(tmp_path / "o"), "tokenizer.vocab_sise=300"])
    _one_error(capsys, code, 2, "vocab_sise")
    assert list(tmp_path.iterdir()) == []


def test_train_override_syntax_in_tokenizer_and_prepare(tmp_path, capsys):
    """The issue's command, `'sources=[{kind:files,path:"x/{split}.jsonl"}]'`, as train writes it."""
    for split in ("train", "val"):
        _corpus(tmp_path / "x" / f"{split}.jsonl")
    overrides = [f'sources=[{{kind:files,path:"{tmp_path}/x/{{split}}.jsonl",text_field:text}}]',
                 f"cache_dir={tmp_path / 'c'}", "tokenizer.vocab_size=300"]
    tokenizer_main(["train", "--out", str(tmp_path / "t" / "tok.model"), *overrides])
    assert Tokenizer(tmp_path / "t" / "tok.model").vocab_size == 300
    prepare_main(["--out", str(tmp_path / "bin"), "--splits", "train,val", *overrides])
    meta = json.loads((tmp_path / "bin" / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] == meta["splits"]["val"]["documents"] == 120
    capsys.readouterr()


def test_prepare_cli_process_one_line(tmp_path):
    """The real command line, in its own interpreter: exit status and a single stderr line."""
    done = subprocess.run([sys.executable, "-m", "data.prepare", "--out", str(tmp_path / "o"), "--shard-tokens", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --shard-tokens=0 must be >= 1 (tokens per shard file)"
    assert not (tmp_path / "o").exists()


# --- eval ---------------------------------------------------------------------------------------
def test_eval_out_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "out").write_text("results?")
    before = _snapshot(tmp_path)
    code = eval_main([f"run={tmp_path}", f"out_dir={tmp_path / 'out'}", "wandb.mode=disabled"])
    _one_error(capsys, code, 2, "out_dir=", "is a file, not a directory")
    assert _snapshot(tmp_path) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_eval_cuda_without_cuda(tmp_path, capsys):
    code = eval_main([f"run={tmp_path}", "device=cuda", "wandb.mode=disabled"])
    _one_error(capsys, code, 2, "device='cuda'", "no CUDA device", "use device=cpu")
    assert list(tmp_path.iterdir()) == []


def test_eval_explicit_source_missing(tmp_path, capsys):
    code = eval_main([f"run={tmp_path}", f"sources=[{{kind:files,path:\"{tmp_path}/books/test.jsonl\"}}]",
                      "wandb.mode=disabled"])
    _one_error(capsys, code, 2, "no file matches", "books/test.jsonl")
    assert list(tmp_path.iterdir()) == []


def test_report_malformed_json_and_out_file(tmp_path, capsys):
    run = tmp_path / "run" / "eval"
    run.mkdir(parents=True)
    (run / "ppl.json").write_text('{"meta": {"label": "x"}, "rows": [')
    (tmp_path / "taken").write_text("a file")
    before = _snapshot(tmp_path)
    code = report_main([str(tmp_path / "run"), "--out", str(tmp_path / "cmp")])
    _one_error(capsys, code, 1, str(run / "ppl.json"), "is not valid JSON", "rerun `python -m eval`")
    (run / "ppl.json").write_text('{"meta": {}, "rows": []}')
    code = report_main([str(tmp_path / "run"), "--out", str(tmp_path / "cmp")])
    _one_error(capsys, code, 1, "is not a `python -m eval` ppl result")
    (run / "ppl.json").write_text('{"meta": {"label": "x"}, "rows": [')
    before = _snapshot(tmp_path)
    code = report_main([str(tmp_path / "run"), "--out", str(tmp_path / "taken")])
    _one_error(capsys, code, 2, "--out=", "is a file, not a directory")
    assert _snapshot(tmp_path) == before and not (tmp_path / "cmp").exists()
