"""Every bad input to the command lines of data/, eval/, generate/ and the exporter: one `error:`
line, its exit status (errors.py, the same for every command: 2 the command line is wrong, 1 an
input it names is missing or unusable), found before any expensive work and leaving everything as
it was; train's configuration errors once, off stdout. Plus train's override syntax in the data
command lines, composed below train as train composes it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.prepare import main as prepare_main
from data.tokenizer import Tokenizer
from data.tokenizer import main as tokenizer_main
from errors import UsageError
from eval.__main__ import main as eval_main
from eval.report import main as report_main
from run_checks import clean_env

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
    code = _exit_code(tokenizer_main, ["train", _files_source(tmp_path / "corpus.jsonl"),
                                       f"cache_dir={tmp_path / 'cache'}", "tokenizer.vocab_size=300"])
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


@pytest.mark.parametrize("value", ["2", "yes", "1", "maybe"])
def test_a_boolean_takes_only_true_or_false(value, tmp_path, capsys):
    """OmegaConf reads 2, "yes" and "1" as true: train and eval refuse them as they refuse "maybe"."""
    from train.__main__ import main as train_main

    code = train_main([f"model.doc_mask={value}", f"run_dir={tmp_path / 'run'}", "logger=none"])
    _one_error(capsys, code, 2, f"model.doc_mask={value} is not a boolean: write true or false")
    code = eval_main([f"run={tmp_path}", f"progress={value}", "wandb.mode=disabled"])
    _one_error(capsys, code, 2, f"progress={value} is not a boolean")
    assert list(tmp_path.iterdir()) == []


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


def test_data_overrides_compose_as_train_composes_them():
    """`data.cli` composes train's tree below train (a DataConfig view of its schema): the same data
    settings as `python -m train` for keys, groups and presets, the same one-line refusals."""
    from data.cli import data_config
    from train.config import ConfigError, compose, to_train_config

    same = [([], []), (["experiment=micro"], ["experiment=micro"]),
            (["experiment=paper_350m_coca"], ["experiment=paper_350m_coca"]),
            (["data=pg19", "seed=3"], ["data=pg19", "data.seed=3"]),
            (["tokenizer.vocab_size=300", 'sources=[{kind:files,path:"x/{split}.jsonl"}]'],
             ["data.tokenizer.vocab_size=300", 'data.sources=[{kind:files,path:"x/{split}.jsonl"}]'])]
    for ours, trains in same:
        assert data_config(ours) == to_train_config(compose(trains)).data, ours
    refused = [("tokenizer.vocab_sise=300", "data.tokenizer.vocab_sise=300"), ("+foo=1", "+data.foo=1"),
               ("tokenizer.vocab_size=many", "data.tokenizer.vocab_size=many"),
               ("sources=[{kind:files", "data.sources=[{kind:files"), ("data=nope", "data=nope"),
               ("tokenizer.character_coverage=2", "data.tokenizer.character_coverage=2")]
    for ours, trains in refused:
        with pytest.raises(ConfigError) as train_error:
            to_train_config(compose([trains]))
        with pytest.raises(UsageError) as data_error:
            data_config([ours])
        assert str(data_error.value) == str(train_error.value), ours


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
    _one_error(capsys, code, 1, "no file matches", "books/test.jsonl")  # a missing file
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


# --- one rule for every command (errors.py) ---------------------------------------------------
def test_every_command_exits_1_on_a_bad_checkpoint_and_2_on_an_unknown_key(tmp_path, capsys):
    """The four commands that read or write checkpoints on the same bad checkpoint (an interrupted
    write: no marker) and the same unknown key: one `error:` line each, the same exit status
    (errors.py: 1 unusable input, 2 bad usage). The checkpoint as processes, started together (each
    is mostly its imports); the key meanwhile in this one, by the `main` each process exits with."""
    from generate.__main__ import main as generate_main
    from run_checks import error_line
    from train.__main__ import main as train_main
    from train.export_hf import main as export_main

    bad = tmp_path / "runs" / "r" / "checkpoints" / "step_00000002"
    bad.mkdir(parents=True)
    (bad / "mp_rank_00_model_states.pt").write_bytes(b"cut off")
    commands = {"train": (train_main, [f"run_dir={tmp_path / 'new'}", f"resume={bad}", *MICRO]),
                "eval": (eval_main, [f"run={bad}", "wandb.mode=disabled"]),
                "generate": (generate_main, [f"run={bad}", "prompt=x"]),
                "train.export_hf": (export_main, [f"run={bad}", f"out={tmp_path / 'hf'}"])}
    started = {name: subprocess.Popen([sys.executable, "-m", name, *args], cwd=ROOT, env=clean_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, (_, args) in commands.items()}
    for main, args in commands.values():
        _one_error(capsys, main([*args, "nope=1"]), 2, "nope")
    for name, proc in started.items():
        out, err = proc.communicate(timeout=600)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        assert result.returncode == 1, (name, err[-2000:])
        assert f"checkpoint {bad} is incomplete" in error_line(result), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing written


# --- a trained run: the exporter, generate and eval on it; train under the launcher ----------------
def _sizes(root: Path) -> dict[str, int]:
    """Every file under root with its size: what a command must leave as it was."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


MICRO = ["experiment=micro", "logger=none", "logger.progress=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """`runs/micro`: a real two-step run with a checkpoint at each step (the exporter would load it)."""
    root = tmp_path_factory.mktemp("runs_root")
    done = subprocess.run([sys.executable, "-m", "train", *MICRO, f"run_dir={root / 'runs' / 'micro'}",
                           f"data.cache_dir={root / 'cache'}", "max_steps=2", "ckpt_every=1", "eval_every=2",
                           "keep_last=2"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "runs"


@pytest.fixture
def run_copy(runs, tmp_path) -> Path:
    """A copy of the run that a test may damage."""
    import shutil

    return Path(shutil.copytree(runs / "micro", tmp_path / "runs" / "micro"))


def _dangerous_outs(run: Path, unrelated: Path) -> dict[str, Path]:
    return {"the run": run, "the folder of runs": run.parent,
            "a checkpoint": run / "checkpoints" / "step_00000001",
            "the checkpoints folder": run / "checkpoints",
            "a new folder inside the run": run / "hf", "an unrelated non-empty folder": unrelated}


@pytest.mark.parametrize("which", ["the run", "the folder of runs", "a checkpoint", "the checkpoints folder",
                                   "a new folder inside the run", "an unrelated non-empty folder"])
def test_export_never_deletes_what_it_did_not_write(which, run_copy, tmp_path, capsys):
    from train.export_hf import main as export_main

    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    (unrelated / "thesis.tex").write_text("years of work")
    out = _dangerous_outs(run_copy, unrelated)[which]
    before = _sizes(tmp_path)
    code = export_main([f"run={run_copy}", f"out={out}", "overwrite=true"])
    _one_error(capsys, code, 2, f"out={out}")
    assert _sizes(tmp_path) == before
    assert not [p for p in tmp_path.rglob("*export*")]  # no temporary sibling left either


def test_export_out_that_is_a_file_or_under_a_read_only_folder(run_copy, tmp_path, capsys):
    from train.export_hf import main as export_main

    (tmp_path / "taken").write_text("a file")
    locked = tmp_path / "locked"
    locked.mkdir()
    before = _sizes(tmp_path)
    code = export_main([f"run={run_copy}", f"out={tmp_path / 'taken'}"])
    _one_error(capsys, code, 2, "is a file, not a directory")
    code = export_main([f"run={run_copy}", f"out={tmp_path / 'taken' / 'hf'}"])
    _one_error(capsys, code, 2, "is a file, not a directory")
    if os.geteuid() != 0:  # root writes anywhere: the permission check cannot be seen as root
        locked.chmod(0o500)
        try:
            code = export_main([f"run={run_copy}", f"out={locked / 'hf'}"])
            _one_error(capsys, code, 1, "is not writable")  # unusable input (a DataError)
        finally:
            locked.chmod(0o700)
    assert _sizes(tmp_path) == before


def test_corrupt_newest_checkpoint_points_to_the_older_sound_one(run_copy, tmp_path, capsys):
    """eval, generate and the exporter name the older sound checkpoint, as train does (`run=` there)."""
    from generate.__main__ import main as generate_main
    from train.export_hf import main as export_main

    newest = run_copy / "checkpoints" / "step_00000002" / "mp_rank_00_model_states.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    older = run_copy / "checkpoints" / "step_00000001"
    before = _sizes(tmp_path)
    hint = f"run={older} loads step 1, the newest sound one before it"
    code = eval_main([f"run={run_copy}", "task=ppl", "wandb.mode=disabled"])
    _one_error(capsys, code, 1, "step_00000002 is corrupt", hint)
    code = generate_main([f"run={run_copy}", "prompt=x"])
    _one_error(capsys, code, 1, "step_00000002 is corrupt", hint)
    code = export_main([f"run={run_copy}", f"out={tmp_path / 'hf'}"])
    _one_error(capsys, code, 1, "step_00000002 is corrupt", hint)
    assert _sizes(tmp_path) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_cuda_without_cuda(runs, capsys):
    from generate.__main__ import main as generate_main

    before = _sizes(runs)
    code = generate_main([f"run={runs / 'micro'}", "prompt=x", "device=cuda"])
    _one_error(capsys, code, 2, "device='cuda'", "no CUDA device", "use device=cpu")
    assert _sizes(runs) == before


@pytest.mark.parametrize("device", ["bogus", "cuda:x", "gpu"])
def test_eval_and_generate_share_one_device_check(runs, device, capsys):
    """A device that is not cpu, cuda or cuda:N: the same line from both commands, exit 2, before
    anything loads (torch's own message, and a traceback from eval, before)."""
    from generate.__main__ import main as generate_main

    before = _sizes(runs)
    want = f"device={device!r} is not one of cpu, cuda, cuda:N"
    _one_error(capsys, generate_main([f"run={runs / 'micro'}", "prompt=x", f"device={device}"]), 2, want)
    code = eval_main([f"run={runs / 'micro'}", f"device={device}", "task=ppl", "wandb.mode=disabled"])
    _one_error(capsys, code, 2, want)
    assert _sizes(runs) == before


def test_generate_empty_stdin_and_greedy_at_temperature_zero(runs, capsys, monkeypatch):
    from generate.__main__ import main as generate_main

    before = _sizes(runs)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    code = generate_main([f"run={runs / 'micro'}", "max_new_tokens=4"])
    _one_error(capsys, code, 2, "no prompt: stdin was empty", 'prompt="..."')
    code = generate_main([f"run={runs / 'micro'}", "prompt=x", "temperature=0"])
    _one_error(capsys, code, 2, "temperature=0.0 must be > 0")
    greedy = [f"run={runs / 'micro'}", "prompt=x", "greedy=true", "temperature=0", "max_new_tokens=4",
              "stop_at_eos=false"]
    assert generate_main(greedy) == 0  # greedy takes the argmax: temperature plays no part
    done = capsys.readouterr()
    assert done.err == "" and done.out.endswith("\n")
    assert _sizes(runs) == before


def test_train_error_after_setup_keeps_stdout_clear(tmp_path):
    """A refusal found once DeepSpeed is up (fp16 on a CPU): one line on stderr, nothing on stdout
    (DeepSpeed prints its op-build banner there), nothing written."""
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "train", *MICRO, f"run_dir={run_dir}",
                           f"data.cache_dir={tmp_path}", "deepspeed.precision=fp16"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    if torch.cuda.is_available():
        pytest.skip("fp16 is allowed on a GPU")
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr[-2000:])  # a ConfigError
    assert len(done.stderr.strip().splitlines()) == 1 and "deepspeed.precision=fp16" in done.stderr
    assert not run_dir.exists()


@pytest.mark.slow
def test_world_size_error_under_the_deepspeed_launcher_is_one_line(tmp_path):
    """batch_size=4 of micro-batches of 4 cannot split over 2 ranks: rank 0 says so once, rank 1 is silent."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run_dir = tmp_path / "run"
    done = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(port), "--module", "train",
                           *MICRO, f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}",
                           "batch_size=4", "micro_batch_size=4"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 2  # a ConfigError: bad usage
    assert done.stderr.strip().splitlines() == [
        "error: batch_size=4 is not divisible by micro_batch_size=4 x world size 2: run on a number of ranks "
        "that divides 1, or change batch_size"], done.stderr[-3000:]
    assert "built successfully" not in done.stdout  # the launcher logs there; DeepSpeed's banner is gone
    assert not run_dir.exists()


def _deepspeed(ranks: int, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return subprocess.run(["deepspeed", "--num_gpus", str(ranks), "--master_port", str(port), "--module", "train",
                           *MICRO, f"run_dir={run_dir}", f"data.cache_dir={run_dir.parent / 'cache'}", *overrides],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_an_error_every_rank_meets_is_said_by_rank_0_alone(tmp_path):
    """A 2-rank run resumed on 3 ranks with a setting the resume refuses (found by every rank once
    DeepSpeed is up): one `error:` line, rank 0's, no rank prefix; the run is left as it was."""
    run_dir = tmp_path / "run"
    batch = ["batch_size=12", "micro_batch_size=2", "max_steps=2", "ckpt_every=2", "eval_every=2"]
    assert _deepspeed(2, run_dir, *batch).returncode == 0
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    done = _deepspeed(3, run_dir, *batch, "resume=auto", "max_steps=4", "model.max_seq_len=64")
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 1 and len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("error: ") and "this run has model.max_seq_len=64" in errors[0]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


# --- data sources: a directory, malformed JSON lines ----------------------------------------------
def test_directory_as_a_files_source_asks_for_a_glob(tmp_path, capsys):
    _corpus(tmp_path / "corpus" / "a.jsonl")
    before = _snapshot(tmp_path)
    code = _exit_code(tokenizer_main, ["train", _files_source(tmp_path / "corpus"),
                                       f"cache_dir={tmp_path / 'c'}"])
    example = tmp_path / "corpus" / "*.jsonl"
    _one_error(capsys, code, 2, "is a directory", f'give a glob of its files, e.g. path: "{example}"')
    assert _snapshot(tmp_path) == before and not (tmp_path / "c").exists()


def test_malformed_jsonl_names_file_and_line_and_exits_1(tmp_path, capsys):
    """Per-split files are read by `datasets`, whose error names neither file nor line (and which
    logs a line of its own); by-document files by our reader. Both: one line, file and line, exit 1."""
    for split in ("train", "val"):
        _corpus(tmp_path / "x" / f"{split}.jsonl", n=40)
    with open(tmp_path / "x" / "train.jsonl", "a") as f:
        f.write('{"text": "cut off\n')
    before = _snapshot(tmp_path)
    for path in (tmp_path / "x" / "{split}.jsonl", tmp_path / "x" / "train.jsonl"):
        code = _exit_code(tokenizer_main, ["train", _files_source(path), f"cache_dir={tmp_path / 'c'}"])
        _one_error(capsys, code, 1, f"{tmp_path / 'x' / 'train.jsonl'} line 41 is not JSON")
        code = _exit_code(prepare_main, ["--out", str(tmp_path / "bin"), _files_source(path),
                                         f"cache_dir={tmp_path / 'c'}"])
        _one_error(capsys, code, 1, f"{tmp_path / 'x' / 'train.jsonl'} line 41 is not JSON")
        if "{split}" in str(path):  # found by the checks (by-document: once the tokenizer's sample is read)
            assert _snapshot(tmp_path) == before
    assert {k: v for k, v in _snapshot(tmp_path).items() if not k.startswith("c/")} == before
    assert not (tmp_path / "bin").exists()


# --- what users trip on (issue 49) ------------------------------------------------------------------
@pytest.mark.parametrize("module, command", [("hf.export", "python -m train.export_hf run="),
                                             ("hf.imports", "python -m train init_from=")])
def test_the_hf_libraries_run_as_modules_name_the_command_to_use(module, command, tmp_path):
    done = subprocess.run([sys.executable, "-m", module, f"run={tmp_path}", f"out={tmp_path / 'hf'}"], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and command in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_a_parameter_of_a_design_not_selected_is_one_line(capsys):
    from train.__main__ import main as train_main

    code = train_main(["model.attention=origin", "model.design_params.prope.p=0.5"])
    _one_error(capsys, code, 2, "model.design_params.prope.p=0.5", "model.attention=origin does not read it")
    assert train_main(["model.attention=prope", "model.design_params.prope.p=0.5", "--cfg", "job"]) == 0


def _corrupt_parquet(folder: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    for split in ("train", "val"):
        pq.write_table(pa.table({"text": [f"document {i} " * 40 for i in range(40)]}), folder / f"{split}.parquet")
    data = (folder / "train.parquet").read_bytes()
    (folder / "train.parquet").write_bytes(data[: len(data) // 2])  # cut off: no footer
    return folder / "train.parquet"


def test_a_corrupt_parquet_file_is_named_per_split_and_by_document(tmp_path, capsys):
    bad = _corrupt_parquet(tmp_path / "x")
    for path in (tmp_path / "x" / "{split}.parquet", bad):
        for main, args in ((tokenizer_main, ["train"]), (prepare_main, ["--out", str(tmp_path / "bin")])):
            code = _exit_code(main, [*args, _files_source(path), f"cache_dir={tmp_path / 'c'}"])
            _one_error(capsys, code, 1, f"{bad} is not a readable parquet file")
    assert not (tmp_path / "bin").exists()


def test_an_empty_passkey_progress_file_is_not_called_missing(tmp_path, capsys):
    from eval import bar

    (tmp_path / bar.PROGRESS_FILE).write_text("")
    assert bar.main([str(tmp_path)]) == 1
    line = _one_error(capsys, 1, 1, f"{tmp_path / bar.PROGRESS_FILE} holds no row", "empty or cut off")
    assert "missing" not in line


def _launched(launcher: str, run_dir: Path, *overrides: str, ranks: int = 2) -> subprocess.CompletedProcess:
    """`python -m train` on `ranks` CPU ranks under `deepspeed` or launch/train_single_node.sh (torchrun)."""
    import socket

    args = [*MICRO, f"run_dir={run_dir}", f"data.cache_dir={run_dir.parent / 'cache'}", *overrides]
    if launcher == "torchrun":
        command, env = [str(ROOT / "launch" / "train_single_node.sh"), *args], clean_env(NUM_GPUS=str(ranks))
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        command = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(port), "--module", "train", *args]
        env = clean_env()
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_refused_setting_under_a_launcher_is_one_line_with_every_reason(launcher, tmp_path):
    """parallel.sequence=4 on 2 ranks of a 2-head model: rank 0 alone says both reasons in one line,
    torchrun's failure report is folded away, and the status is the refusal's (2)."""
    done = _launched(launcher, tmp_path / "run", "parallel.sequence=4")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "error: model.n_head=2 is not divisible by parallel.sequence=4: use a P that divides 2; parallel.sequence=4 "
        "does not divide the world size 2: launch a multiple of 4 ranks, or set parallel.sequence to a divisor of 2"]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_resuming_with_another_sequence_split_names_the_checkpoints(tmp_path):
    """A run trained with parallel.sequence=2 on 2 ranks (data-parallel size 1), resumed with P=1 on
    2 ranks, where its batch of one micro-batch cannot split: the line says to resume with P=2."""
    run_dir = tmp_path / "run"
    batch = ["batch_size=4", "micro_batch_size=4", "max_steps=2", "ckpt_every=2", "eval_every=2"]
    assert _launched("deepspeed", run_dir, *batch, "parallel.sequence=2").returncode == 0
    done = _launched("deepspeed", run_dir, *batch, "resume=auto", "max_steps=4")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: batch_size=4 is not divisible"), lines
    assert lines[0].endswith(f"checkpoint {run_dir / 'checkpoints' / 'step_00000002'} was trained with "
                             "parallel.sequence=2, which splits this batch over 2 ranks: resume with "
                             "parallel.sequence=2")
