"""DeepSpeed's CPU communication op: its first-start build is announced only when it will happen,
and a missing or broken C++ compiler is one line that says what to install. Each `python -m train`
here uses its own empty torch extension cache (TORCH_EXTENSIONS_DIR), so the op is really not
cached for it, whatever this machine's own cache holds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import ninja
import pytest
import torch

from run_checks import clean_env, error_line
from train.distributed import BUILD_NOTICE, extension_up_to_date

ROOT = Path(__file__).resolve().parents[1]
MICRO = ["experiment=micro", "logger=none", "logger.progress=false", "max_steps=1", "eval_every=1"]
NOTICE = BUILD_NOTICE.split(",")[0]  # "building DeepSpeed's CPU communication op"


@pytest.fixture(scope="module", autouse=True)
def jit_built():
    """These starts build the op only where DeepSpeed installed it unbuilt (the pip wheel)."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get("deepspeed_shm_comm", False):
        pytest.skip("this DeepSpeed was installed with its CPU communication op prebuilt")


def _train(tmp_path: Path, path: str, extensions: Path) -> subprocess.CompletedProcess:
    """`python -m train` on the CPU accelerator (whose op this is), with this PATH and extension cache."""
    env = clean_env(PATH=path, TORCH_EXTENSIONS_DIR=str(extensions), DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, "-m", "train", *MICRO, f"run_dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _bin_with_ninja(tmp_path: Path) -> Path:
    """A PATH folder holding ninja (the pip package's, which torch's loader runs) and nothing else."""
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "ninja").symlink_to(Path(ninja.BIN_DIR) / "ninja")
    return folder


def test_up_to_date_is_what_ninja_says(tmp_path):
    """A library ninja built is up to date until a source changes (the real ninja, a copy rule)."""
    (tmp_path / "source.txt").write_text("one")
    (tmp_path / "build.ninja").write_text(
        f"rule copy\n  command = {shutil.which('cp')} $in $out\nbuild op.so: copy source.txt\n")
    assert not extension_up_to_date(tmp_path, "op")  # nothing built yet
    subprocess.run([shutil.which("ninja") or str(Path(ninja.BIN_DIR) / "ninja"), "-C", str(tmp_path)],
                   check=True, capture_output=True)
    assert extension_up_to_date(tmp_path, "op")
    later = (tmp_path / "op.so").stat().st_mtime + 10
    os.utime(tmp_path / "source.txt", (later, later))
    assert not extension_up_to_date(tmp_path, "op")


def test_no_compiler_is_one_line_saying_what_to_install(tmp_path):
    """PATH without a C++ compiler, the op not cached: one error line, no traceback, exit 1."""
    done = _train(tmp_path, str(_bin_with_ninja(tmp_path)), tmp_path / "extensions")
    assert done.returncode == 1, done.stderr[-3000:]
    line = error_line(done)
    assert "'c++' is not on PATH" in line and "apt-get install g++" in line, line
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_compiler_that_fails_is_one_line_with_its_error(tmp_path):
    """A `c++` that answers its version (the real one's) but fails every compile, as one without
    Python's headers does: the notice, then one error line quoting the compiler's error."""
    folder = _bin_with_ninja(tmp_path)
    real = shutil.which("c++")
    if real is None:
        pytest.skip("no C++ compiler on this machine to answer the version")
    (folder / "c++").write_text(
        "#!/bin/sh\n"
        f'case "$1" in -v|--version|-dumpfullversion) exec {real} "$@";; esac\n'
        'echo "shm.cpp:1:10: fatal error: Python.h: No such file or directory" >&2\nexit 1\n')
    (folder / "c++").chmod(0o755)
    done = _train(tmp_path, f"{folder}{os.pathsep}{os.environ['PATH']}", tmp_path / "extensions")
    assert done.returncode == 1, done.stderr[-3000:]
    line = error_line(done)
    assert "did not build" in line and "Python.h: No such file or directory" in line, line
    assert "apt-get install g++ python3-dev" in line
    assert done.stderr.count(NOTICE) == 1
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_the_build_is_announced_once_and_not_when_cached(tmp_path):
    """A first start into an empty cache builds the op (about 40 s) and says so on stderr; the next
    start finds it cached and says nothing. Stdout carries neither."""
    if torch.cuda.is_available():
        pytest.skip("training here runs on the GPU, whose accelerator has no such op")
    extensions = tmp_path / "extensions"
    first = _train(tmp_path, os.environ["PATH"], extensions)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count(NOTICE) == 1 and NOTICE not in first.stdout
    assert (extensions / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").is_file()
    shutil.rmtree(tmp_path / "run")
    second = _train(tmp_path, os.environ["PATH"], extensions)
    assert second.returncode == 0, second.stderr[-3000:]
    assert NOTICE not in second.stderr
