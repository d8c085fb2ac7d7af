"""Shared test fixtures: one thread for tiny ops, the session's small tokenizer, and the one
trained micro run that the modules reading a trained run (evaluation, generation) share instead of
each training their own, and a one-rank process group for the modules that build engines in-process."""

import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from data.config import DataConfig, TokenizerConfig
from data.tokenizer import Tokenizer, get_tokenizer
from run_checks import clean_env

REPO = Path(__file__).resolve().parents[1]

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # pytest -n N: the cores are shared among N workers
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items) -> None:
    """The files with the most slow tests first, the rest in their order: pytest-xdist's workers take
    whole files (`--dist loadfile`) as they free up, so the long files start first and none is
    left running alone at the end while the other worker idles."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture
def single_thread():
    """One torch thread: for tiny ops, thread start-up costs more than it saves on a shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tok(tmp_path_factory) -> Tokenizer:
    """A small stdlib tokenizer (512 pieces), trained once for the session (about a second);
    modules that need another define their own `tok`."""
    cache = tmp_path_factory.mktemp("cache")
    return get_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=512, sample_docs=30), cache_dir=str(cache)))


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory) -> Path:
    """`experiment=micro` trained 20 steps (one checkpoint, at step 20; validated at 20), with the
    session's micro tokenizer cache (`<basetemp>/eval_tokenizer`, which tests/test_eval_passkey.py
    trains the same tokenizer into)."""
    run_dir = tmp_path_factory.mktemp("micro_run") / "micro"
    cmd = [sys.executable, "-m", "train", "experiment=micro", "logger=none", f"run_dir={run_dir}",
           "max_steps=20", "ckpt_every=20", "eval_every=20", "logger.progress=false",
           f"data.cache_dir={tmp_path_factory.getbasetemp() / 'eval_tokenizer'}"]
    done = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def process_group():
    """A one-rank gloo process group in this process, for the module (DeepSpeed caches its groups:
    a second group in one process is not usable), the environment restored afterwards."""
    from train import distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"}.items():
            patch.setenv(key, value)
        dist.init()
        yield
        dist.destroy()
