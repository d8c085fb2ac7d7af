"""End-to-end runs of `python -m train` (and `deepspeed --module train`) as a user starts them.

All runs use `experiment=micro` (one 32-wide layer, 32 tokens, 30 steps): seconds each on a CPU.
One uninterrupted reference run is shared; resumed runs must reproduce its per-step losses
bitwise and its data blocks exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from model import GPT
from run_checks import clean_env, error_line, losses, ok, records, val_losses
from train.checkpoint import complete_checkpoints, step_dir
from train.config import to_train_config
from train.engine import param_groups
from train.load import load_model
from train.schedule import lr_at
from wandb_records import history as wandb_history

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MICRO = ["experiment=micro", "logger=none", "logger.progress=false", "ckpt_every=5", "debug.log_blocks=true"]
TIMEOUT = 300


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _command(run_dir: Path, cache: Path, overrides: tuple[str, ...]) -> list[str]:
    return [*MICRO, f"run_dir={run_dir}", f"data.cache_dir={cache}", *overrides]


def train(run_dir: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", *_command(run_dir, cache, overrides)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)


def start(run_dir: Path, cache: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "train", *_command(run_dir, cache, overrides)], cwd=REPO,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def blocks(run_dir: Path) -> list[str]:
    return (run_dir / "blocks_rank0.jsonl").read_text().splitlines()


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"run never reached step {step}: {proc.communicate()[1][-2000:]}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> Path:
    """An uninterrupted 30-step run with W&B offline (the baseline every resume must reproduce)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = ok(train(run_dir, cache, "logger.wandb=offline"))
    (run_dir.parent / "train.stderr").write_text(result.stderr)
    return run_dir


def test_a_finished_run_says_what_it_did_and_a_resume_of_it_that_it_is_complete(reference, cache):
    stderr = (reference.parent / "train.stderr").read_text()
    newest = complete_checkpoints(reference)[-1]
    assert "done: 30 steps, 3,840 tokens in " in stderr
    assert f"final val_loss {val_losses(reference)[30]:.4f}; checkpoint {newest}" in stderr
    assert f"next: python -m eval run={reference}" in stderr
    before = {p: p.stat().st_mtime_ns for p in reference.rglob("*")}
    result = ok(train(reference, cache, "resume=auto", "logger.progress=true"))
    assert result.stderr.strip().splitlines() == [
        f"run {reference} is complete (step_00000030, max_steps=30): nothing to train; raise max_steps to "
        f"continue it, or evaluate it: python -m eval run={reference}"]
    assert {p: p.stat().st_mtime_ns for p in reference.rglob("*")} == before


def test_end_to_end_run_dir(reference):
    config = OmegaConf.load(reference / "config.yaml")
    assert config.name == "micro" and config.model.n_embd == 32
    assert [p.name for p in complete_checkpoints(reference)] == ["step_00000025", "step_00000030"]  # keep_last=2
    train_records = [r for r in records(reference) if "loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, 31))
    for r in train_records:
        assert r["tokens_seen"] == r["step"] * 4 * 32 and r["tokens_per_s"] > 0 and r["lr"] > 0
        assert r["grad_norm"] > 0
    loss = losses(reference)
    first, last = sum(loss[s] for s in range(1, 6)) / 5, sum(loss[s] for s in range(26, 31)) / 5
    assert last < first - 0.5, (first, last)
    val = val_losses(reference)
    assert sorted(val) == [10, 20, 30] and val[30] < val[10] - 0.2, val

    (log,) = reference.glob("wandb/offline-run-*/run-*.wandb")
    history = wandb_history(log)
    for step, value in loss.items():
        assert history[step]["loss"] == value
    assert history[30]["val_loss"] == val[30]

    model, cfg, tokenizer = load_model(str(reference))
    assert cfg.name == "micro" and not model.training
    ids = torch.tensor([tokenizer.encode("def main():\n    return os.path.join(root, name)\n")[:33]])
    with torch.no_grad():
        assert model(ids[:, :-1], ids[:, 1:]).item() < torch.log(torch.tensor(512.0)).item() - 0.5


def test_kill_then_resume_is_bitwise_identical(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, cache, "debug.step_sleep_s=0.2")
    wait_for_step(proc, run_dir, 12)
    proc.kill()
    proc.wait()
    assert complete_checkpoints(run_dir)[-1].name == "step_00000010"
    result = ok(train(run_dir, cache, "resume=auto"))
    assert "resumed from" in result.stderr and "step_00000010" in result.stderr
    assert losses(run_dir) == losses(reference)  # exact float equality, every step
    assert val_losses(run_dir) == val_losses(reference)
    assert blocks(run_dir) == blocks(reference)  # no data block repeated or skipped


def test_kill_during_checkpoint_write_then_resume(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    killed = train(run_dir, cache, "debug.kill_in_checkpoint_at_step=15")
    assert killed.returncode == -signal.SIGKILL
    partial = run_dir / "checkpoints" / ".tmp_step_00000015"
    assert (partial / "mp_rank_00_model_states.pt").is_file()
    assert complete_checkpoints(run_dir)[-1].name == "step_00000010"
    ok(train(run_dir, cache, "resume=auto"))
    assert losses(run_dir) == losses(reference)
    assert blocks(run_dir) == blocks(reference)
    assert not partial.exists()


def test_document_masking_trains_changes_the_loss_and_resumes_bitwise(cache, tmp_path):
    """`model.doc_mask=true` on a corpus of short documents (several per 32-token row): the run's
    losses differ from the unmasked run's from the first step (the document ids reach the model),
    and a run killed while writing step 15's checkpoint resumes from step 10 to the same losses,
    validation losses and blocks, bit for bit."""
    import json
    import random

    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 7))) for _ in range(300)]
    corpus = tmp_path / "short.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(3, 12)))}) + "\n"
                              for _ in range(400)))
    data = f"data.sources=[{{kind:files,path:'{corpus}'}}]", "data.tokenizer.sample_docs=300"
    masked = tmp_path / "masked"
    ok(train(masked, cache, *data, "model.doc_mask=true"))
    plain = tmp_path / "plain"
    ok(train(plain, cache, *data))
    assert losses(masked)[1] != losses(plain)[1]
    resumed = tmp_path / "resumed"
    assert train(resumed, cache, *data, "model.doc_mask=true",
                 "debug.kill_in_checkpoint_at_step=15").returncode == -signal.SIGKILL
    assert complete_checkpoints(resumed)[-1].name == "step_00000010"
    ok(train(resumed, cache, *data, "model.doc_mask=true", "resume=auto"))
    assert losses(resumed) == losses(masked)
    assert val_losses(resumed) == val_losses(masked)
    assert blocks(resumed) == blocks(masked)


def test_training_with_a_rope_scaling_is_saved_used_and_resumes_bitwise(reference, cache, tmp_path):
    """`model.rope_scaling` at training time (YaRN here, with its attention temperature): the
    forward is the scaled one from the first step, the run's config and the loaded model carry
    the scaling (the default of eval, generate and export), and a killed run resumes bit for bit."""
    scaled = ("model.rope_scaling.type=yarn", "model.rope_scaling.factor=4")
    full = tmp_path / "full"
    ok(train(full, cache, *scaled))
    assert losses(full)[1] != losses(reference)[1]
    model, cfg, _ = load_model(str(full))
    assert (cfg.model.rope_scaling.type, cfg.model.rope_scaling.factor) == ("yarn", 4.0)
    assert model.rope.scaling.type == "yarn" and model.rope.base_at(32) == model.rope.base
    resumed = tmp_path / "resumed"
    assert train(resumed, cache, *scaled, "debug.kill_in_checkpoint_at_step=15").returncode == -signal.SIGKILL
    ok(train(resumed, cache, *scaled, "resume=auto"))
    assert losses(resumed) == losses(full) and val_losses(resumed) == val_losses(full)


def test_a_run_continued_at_a_longer_length_carries_the_weights_and_restarts_the_rest(reference, cache, tmp_path):
    """`init_from` a 32-token run, at 64 tokens with YaRN stretching from 32: the first step's loss is
    the source model's on that step's 64-token blocks under the scaling (the weights are carried),
    the schedule warms up again from step 1, the optimizer starts empty (Adam's step count is the
    new run's), and every block holds the new length."""
    import json

    run_dir = tmp_path / "continued"
    ok(train(run_dir, cache, f"init_from={reference}", "model.max_seq_len=64", "model.rope_scaling.type=yarn",
             "model.rope_scaling.factor=2", "model.rope_scaling.original_max_seq_len=32", "max_steps=5",
             "optim.warmup_steps=3", "eval_every=5", "ckpt_every=5"))
    first = json.loads(blocks(run_dir)[0])
    batch = torch.tensor(first["tokens"])
    assert first["step"] == 1 and batch.shape == (4, 65)
    source, _, _ = load_model(str(reference))
    source.set_rope_scaling("yarn", 2.0)  # its training length, 32, is the scaling's original length
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with torch.no_grad():
        expected = source(inputs, targets).item()
    assert losses(run_dir)[1] == pytest.approx(expected, rel=1e-5)
    train_records = [r for r in records(run_dir) if "loss" in r]
    config = to_train_config(OmegaConf.load(run_dir / "config.yaml"))
    assert [r["lr"] for r in train_records[:3]] == pytest.approx([lr_at(s, config.optim, 5) for s in range(3)])
    assert train_records[0]["lr"] < train_records[2]["lr"] and train_records[-1]["tokens_seen"] == 5 * 4 * 64
    state = torch.load(run_dir / "checkpoints" / "step_00000005" / "mp_rank_00_model_states.pt", weights_only=False)
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {5.0}


def test_init_from_an_origin_run_converts_it_to_coca_or_alibi(reference, cache, tmp_path):
    """init_from with another attention converts the weights (`model.convert`): the first step's
    loss is the converted model's on that step's blocks, for CoCA with T from K or fresh and for
    ALiBi; a conversion that cannot make sense (from CoCA) is one line, exit 2, nothing written."""
    import json

    from model.convert import convert

    source, source_cfg, _ = load_model(str(reference))
    first_losses = {}
    for attention, t_init in (("coca", "from_k"), ("coca", "fresh"), ("alibi", "from_k")):
        run_dir = tmp_path / f"{attention}_{t_init}"
        result = ok(train(run_dir, cache, f"init_from={reference}", f"model.attention={attention}",
                          f"model.design_params.coca.t_init={t_init}", "max_steps=2", "eval_every=2", "ckpt_every=2"))
        assert f"origin converted to {attention}" in result.stderr
        cfg = to_train_config(OmegaConf.load(run_dir / "config.yaml"))
        state, _ = convert(source.state_dict(), source_cfg.model, cfg.model, seed=cfg.seed)
        converted = GPT(cfg.model)
        converted.load_state_dict(state)
        batch = torch.tensor(json.loads(blocks(run_dir)[0])["tokens"])
        with torch.no_grad():
            expected = converted.eval()(batch[:, :-1], batch[:, 1:]).item()
        first_losses[attention, t_init] = losses(run_dir)[1]
        assert first_losses[attention, t_init] == pytest.approx(expected, rel=1e-5)
    assert first_losses["coca", "from_k"] != first_losses["coca", "fresh"]
    refused = train(tmp_path / "refused", cache, f"init_from={tmp_path / 'coca_from_k'}", "model.attention=alibi")
    assert refused.returncode == 2
    assert "cannot convert attention=coca into attention=alibi: only Origin (RoPE)" in error_line(refused)
    assert not (tmp_path / "refused").exists()


def test_sigterm_saves_then_exits(cache, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, cache, "debug.step_sleep_s=0.2", "ckpt_every=100")
    wait_for_step(proc, run_dir, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    saved = complete_checkpoints(run_dir)
    assert len(saved) == 1 and int(saved[0].name[5:]) == max(losses(run_dir)) >= 3


def test_corrupt_checkpoint_is_a_clear_error(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    weights = complete_checkpoints(run_dir)[-1] / "mp_rank_00_model_states.pt"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = train(run_dir, cache, "resume=auto", "max_steps=40")
    assert result.returncode == 1
    assert "corrupt" in error_line(result) and "step_00000030" in error_line(result)


def test_shape_changed_resume_is_a_clear_error(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    result = train(run_dir, cache, "resume=auto", "max_steps=40", "model.n_embd=64")
    assert result.returncode == 1
    assert "model.n_embd=32" in error_line(result) and "model.n_embd=64" in error_line(result)


def test_forced_nan_stops_with_a_clear_error(cache, tmp_path):
    result = train(tmp_path / "run", cache, "debug.nan_at_step=3")
    assert result.returncode == 1
    assert "non-finite training loss at step 3" in error_line(result)


def test_forced_nan_is_skipped_when_configured(cache, tmp_path):
    run_dir = tmp_path / "run"
    result = ok(train(run_dir, cache, "debug.nan_at_step=3", "nonfinite=skip", "max_steps=5", "eval_every=5"))
    assert "skipped a batch with a non-finite loss at step 3" in result.stderr
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5]
    assert records(run_dir)[-2]["skipped"] == 1


def test_compiled_blocks_train_like_eager(reference, cache, tmp_path):
    """compile=true (with activation checkpointing) follows the eager run's losses: compiled
    kernels only reorder float operations, so steps agree to 1e-4 over 30 steps (and differ in
    inductor's generated kernels in the run's own cache show the compiled blocks ran: a check that
    holds on every CPU, where comparing the losses' last bits depends on the kernels inductor picks)."""
    run_dir, kernels = tmp_path / "run", tmp_path / "inductor"
    overrides = ("compile=true", "model.activation_checkpointing=true", "logger.wandb=disabled")
    command = [sys.executable, "-m", "train", *_command(run_dir, cache, overrides)]
    ok(subprocess.run(command, cwd=REPO, env=clean_env(TORCHINDUCTOR_CACHE_DIR=str(kernels)), capture_output=True,
                      text=True, timeout=TIMEOUT))
    want, got = losses(reference), losses(run_dir)
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-4), (step, got[step], want[step])
    assert list(kernels.rglob("*.py")), "no inductor kernels were generated: the blocks were not compiled"
    model, _, _ = load_model(str(run_dir))  # the checkpoint's names are the eager model's
    assert set(model.state_dict()) == set(load_model(str(reference))[0].state_dict())


def test_bf16_run_trains_and_exports_fp32(cache, tmp_path):
    run_dir = tmp_path / "run"
    ok(train(run_dir, cache, "deepspeed.precision=bf16", "logger.wandb=disabled", "max_steps=20", "eval_every=10"))
    loss = losses(run_dir)
    assert sum(loss[s] for s in range(16, 21)) / 5 < sum(loss[s] for s in range(1, 6)) / 5 - 0.3, loss
    assert json.loads((run_dir / "deepspeed.json").read_text())["bf16"]["enabled"]
    model, _, _ = load_model(str(run_dir))
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused only where the device lacks it (the CPU)")
def test_fp16_on_cpu_is_a_clear_error(cache, tmp_path):
    result = train(tmp_path / "run", cache, "deepspeed.precision=fp16", "logger.wandb=disabled")
    assert result.returncode == 2  # a ConfigError: bad usage
    assert "deepspeed.precision=fp16 is not supported on this device (cpu)" in error_line(result)


def test_bad_override_exits_with_one_line(cache, tmp_path):
    result = train(tmp_path / "run", cache, "optim.lr=fast")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [error_line(result)] and "optim.lr" in error_line(result)


def test_run_dir_that_is_a_file_is_one_line_before_anything_is_written(tmp_path):
    """Checked first: before the tokenizer is trained into the (empty) cache, before DeepSpeed."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    run_dir.write_text("not a folder")
    cache.mkdir()
    result = train(run_dir, cache)
    assert result.returncode == 2  # a file given where a folder is expected: a bad value
    assert error_line(result) == (f"error: run_dir='{run_dir}' is a file, not a directory: "
                                  "give run_dir a directory path")
    assert "Traceback" not in result.stderr
    assert list(cache.iterdir()) == [] and run_dir.read_text() == "not a folder"


def test_common_mistakes_fail_before_deepspeed_is_imported(tmp_path):
    """An existing run, a missing data file, a run_dir that is a file: one line each from
    `train.preflight`, before torch's process group or DeepSpeed start (seconds, not a minute)."""
    existing = tmp_path / "existing"
    (existing / "checkpoints" / "step_00000005").mkdir(parents=True)
    (existing / "checkpoints" / "step_00000005" / "COMPLETE").write_text("{}")
    (tmp_path / "afile").write_text("x")
    cases = {  # errors.py's rule: 1 for an unusable input, 2 for a file given where a directory is asked
        "already holds checkpoints": ([f"run_dir={existing}"], "1"),
        "no file matches": ([f"run_dir={tmp_path / 'new'}",
                             f"data.sources=[{{kind:files,path:{tmp_path}/none.jsonl}}]"], "1"),
        "is a file, not a directory": ([f"run_dir={tmp_path / 'afile'}"], "2"),
    }
    code = ("import sys; from train.__main__ import main; code = main(sys.argv[1:]); "
            "print('deepspeed' in sys.modules, code)")
    for words, (overrides, exit_code) in cases.items():
        result = subprocess.run([sys.executable, "-c", code, *MICRO, f"data.cache_dir={tmp_path / 'cache'}",
                                 *overrides], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                                timeout=TIMEOUT)
        assert result.stdout.split() == ["False", exit_code], (words, result.stdout, result.stderr[-2000:])
        assert words in error_line(result)
    assert not (tmp_path / "new").exists() and not (tmp_path / "cache").exists()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SHORT = ("batch_size=4", "max_steps=8", "eval_every=8", "ckpt_every=4")


def deepspeed_command(run_dir: Path, cache: Path, *overrides: str, port: int | None = None) -> list[str]:
    return ["deepspeed", "--num_gpus", "2", "--master_port", str(port or _free_port()), "--module", "train",
            *_command(run_dir, cache, overrides)]


def train_two_ranks(run_dir: Path, cache: Path, *overrides: str,
                    port: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(deepspeed_command(run_dir, cache, *overrides, port=port), cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)


TWO_RANK_PORTS: dict[int, int] = {}  # the `two_ranks` runs' MASTER_PORT, by ZeRO stage


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, cache) -> dict[int, Path]:
    """Uninterrupted 8-step runs on two ranks under ZeRO 0, 1, 2 (no accumulation) and 3 (accumulation 2)."""
    runs = {}
    for stage, micro in [(0, 2), (1, 2), (2, 1), (3, 2)]:
        runs[stage] = tmp_path_factory.mktemp(f"zero{stage}") / "run"
        TWO_RANK_PORTS[stage] = _free_port()
        ok(train_two_ranks(runs[stage], cache, f"deepspeed=zero{stage}", f"micro_batch_size={micro}", *SHORT,
                           port=TWO_RANK_PORTS[stage]))
    return runs


def test_two_rank_runs_leave_no_shared_memory(two_ranks):
    """DeepSpeed's CPU all-reduce gives each rank a 66 MB buffer in /dev/shm (RAM) and never removes
    it; `train.distributed.init` removes the names once every rank has mapped them, so nothing is
    left (the next test checks that the name is the one DeepSpeed's op creates)."""
    for port in TWO_RANK_PORTS.values():
        for rank in (0, 1):
            assert not (Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}").exists()


def test_one_rank_under_a_launcher_leaves_no_shared_memory():
    """One rank that a launcher started (LOCAL_SIZE=1) gets a buffer too: `init` removes it; and
    `train.distributed.shm_buffer` is the file DeepSpeed's CPU op creates (the op itself, in a second
    process: its state is per process)."""
    env = clean_env(LOCAL_SIZE="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(_free_port()))
    init = "from train.distributed import init, shm_buffer\ninit()\nprint(shm_buffer(0).exists())\n"
    op = ("from deepspeed.comm.torch import build_shm_op\nfrom train.distributed import shm_buffer\n"
          "build_shm_op().initialize(1, 0)\npath = shm_buffer(0)\nprint(path.exists())\npath.unlink(missing_ok=True)\n")
    runs = [ok(subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)) for code in (init, op)]
    assert [run.stdout.strip().splitlines()[-1] for run in runs] == ["False", "True"]


def test_two_ranks_zero_0_1_2_3_agree(two_ranks, cache, tmp_path):
    """ZeRO partitioning must not change the math: stages 0, 1, 2 and 3 on two ranks (stage 2 also
    with gradient accumulation) give the same losses to 1e-5. Each rank reads its own documents,
    so a one-process run with the same global batch sees other data: its losses agree only
    statistically, within 0.2 nats per step and 0.1 on average over the 8 steps."""
    ok(train(tmp_path / "single", cache, *SHORT))
    single = losses(tmp_path / "single")
    runs = {stage: losses(run_dir) for stage, run_dir in two_ranks.items()}
    for stage, run_dir in two_ranks.items():
        assert sorted(runs[stage]) == list(range(1, 9))
        assert [p.name for p in complete_checkpoints(run_dir)] == ["step_00000004", "step_00000008"]
    for stage in (0, 2, 3):
        for step in range(1, 9):
            assert runs[stage][step] == pytest.approx(runs[1][step], abs=1e-5), (stage, step)
    gaps = [abs(runs[1][step] - single[step]) for step in range(1, 9)]
    assert max(gaps) < 0.2 and sum(gaps) / len(gaps) < 0.1, (runs[1], single)
    model, _, _ = load_model(str(two_ranks[3]))  # ZeRO-3 partitions gathered back to fp32
    assert sum(p.numel() for p in model.parameters()) > 0


def _logged_batches(run_dir: Path, ranks: tuple[int, ...], steps: range) -> dict[int, list[list[int]]]:
    """Each step's global batch in `steps`: the blocks the given ranks logged for it."""
    batches: dict[int, list[list[int]]] = {}
    for rank in ranks:
        for line in (run_dir / f"blocks_rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["step"] in steps:
                batches.setdefault(record["step"], []).extend(record["tokens"])
    return batches


def _replay(cfg, batches: dict[int, list[list[int]]], max_steps: dict[int, int] | None = None) -> dict[int, float]:
    """The losses of a one-process model in plain PyTorch (same seed and init, AdamW with the run's
    groups, schedule and clipping) trained on the given global batches, step by step; `max_steps`
    gives the schedule's length per step where a resume changed it (default: the config's)."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).train()
    o = cfg.optim
    optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    replayed = {}
    for step in sorted(batches):
        batch = torch.tensor(batches[step])
        assert batch.shape[0] == cfg.batch_size, step
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, o, (max_steps or {}).get(step, cfg.max_steps))
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        replayed[step] = loss.item()
    return replayed


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_ranks_equal_one_process_on_the_same_global_batches(two_ranks, stage):
    """The exact check behind the statistical one above: replay each step's global batch (both
    ranks' blocks, from their logs) through a one-process model in plain PyTorch. Its losses equal
    the two-rank run's to 1e-5 at every step, for ZeRO 0, 1, 2 (gradient accumulation 2) and 3."""
    run_dir = two_ranks[stage]
    cfg = to_train_config(OmegaConf.load(run_dir / "config.yaml"))
    replayed = _replay(cfg, _logged_batches(run_dir, (0, 1), range(1, cfg.max_steps + 1)))
    logged = losses(run_dir)
    assert sorted(replayed) == sorted(logged) == list(range(1, 9))
    for step in logged:
        assert replayed[step] == pytest.approx(logged[step], abs=1e-5), (stage, step, replayed[step], logged[step])


def test_zero3_recomputes_qk_norms_projections_with_gathered_weights(cache, tmp_path):
    """`model.qk_norm` recomputes its projections and norms in backward (torch's checkpoint, to keep
    Origin's memory); under ZeRO-3 their partitioned weights must be gathered again there. The
    two-rank run equals a one-process replay of its global batches to 1e-5 at every step."""
    run_dir = tmp_path / "run"
    ok(train_two_ranks(run_dir, cache, "deepspeed=zero3", "micro_batch_size=2", "model.qk_norm=true", *SHORT))
    cfg = to_train_config(OmegaConf.load(run_dir / "config.yaml"))
    assert cfg.model.qk_norm
    replayed = _replay(cfg, _logged_batches(run_dir, (0, 1), range(1, cfg.max_steps + 1)))
    logged = losses(run_dir)
    assert sorted(replayed) == sorted(logged) == list(range(1, 9))
    for step in logged:
        assert replayed[step] == pytest.approx(logged[step], abs=1e-5), (step, replayed[step], logged[step])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_on_one_rank_then_on_two_again(two_ranks, cache, tmp_path, stage):
    """Elastic resume: the two-rank run's step-4 checkpoint continues on one process to step 6
    (under ZeRO 1-3 through a universal checkpoint converted once into the checkpoint; under ZeRO 0
    directly), whose step-6 checkpoint continues on two ranks to step 8. Weights, fp32 masters,
    Adam moments and schedule carry over: a one-process replay of the global batches each phase
    logged (two ranks, one, two) gives every logged loss to 1e-5. Under ZeRO 2 the first attempt
    is killed (SIGKILL) after the conversion and before its rename: nothing half-made is used."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_ranks[stage], run_dir)
    step4, step6 = (step_dir(run_dir, s) for s in (4, 6))
    overrides = (f"deepspeed=zero{stage}", f"micro_batch_size={2 if stage != 2 else 1}", *SHORT, "ckpt_every=2")
    if stage == 2:
        killed = train(run_dir, cache, *overrides, f"resume={step4}", "max_steps=6", "debug.kill_in_conversion=true")
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        assert [p.name for p in step4.glob(".universal_tmp_*")] and not (step4 / "universal").exists()
    ok(train(run_dir, cache, *overrides, f"resume={step4}", "max_steps=6"))
    assert (step4 / "universal").is_dir() == (stage > 0) and not list(step4.glob(".universal_tmp_*"))
    assert json.loads((step6 / "COMPLETE").read_text())["world_size"] == 1
    result = ok(train_two_ranks(run_dir, cache, *overrides, "resume=auto", "max_steps=8"))
    assert "step_00000006" in result.stderr
    assert (step6 / "universal").is_dir() == (stage > 0)

    cfg = to_train_config(OmegaConf.load(run_dir / "config.yaml"))
    batches = {**_logged_batches(run_dir, (0, 1), range(1, 5)), **_logged_batches(run_dir, (0,), range(5, 7)),
               **_logged_batches(run_dir, (0, 1), range(7, 9))}
    replayed, logged = _replay(cfg, batches, max_steps={5: 6, 6: 6}), losses(run_dir)  # phase 2 ran to 6
    assert sorted(replayed) == sorted(logged) == list(range(1, 9))
    for step in logged:
        assert replayed[step] == pytest.approx(logged[step], abs=1e-5), (stage, step, replayed[step], logged[step])
    assert losses(run_dir)[5] != losses(two_ranks[stage])[5]  # other data after the change: the check is not vacuous


def _rank_blocks(run_dir: Path) -> list[list[str]]:
    return [(run_dir / f"blocks_rank{rank}.jsonl").read_text().splitlines() for rank in (0, 1)]


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_kill_then_resume(two_ranks, cache, tmp_path, stage):
    """kill -9 of the launcher and both ranks after step 5, then resume=auto from step 4: the same
    per-step losses as the uninterrupted run (to 1e-6), and each rank reads the same blocks."""
    run_dir = tmp_path / "run"
    micro = {2: 1, 3: 2}[stage]
    overrides = (f"deepspeed=zero{stage}", f"micro_batch_size={micro}", *SHORT)
    proc = subprocess.Popen(deepspeed_command(run_dir, cache, *overrides, "debug.step_sleep_s=0.5"), cwd=REPO,
                            env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for_step(proc, run_dir, 5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert complete_checkpoints(run_dir)[-1].name == "step_00000004"
    result = ok(train_two_ranks(run_dir, cache, *overrides, "resume=auto"))
    assert "step_00000004" in result.stderr
    want, got = losses(two_ranks[stage]), losses(run_dir)
    assert sorted(got) == list(range(1, 9))
    for step in range(1, 9):
        assert got[step] == pytest.approx(want[step], abs=1e-6), (step, got, want)
    assert _rank_blocks(run_dir) == _rank_blocks(two_ranks[stage])


def test_nan_on_one_rank_is_skipped_by_all_under_zero3(two_ranks, cache, tmp_path):
    """Rank 0 alone sees a NaN at step 3: both ranks drop that micro-batch, ZeRO-3 carries on."""
    run_dir = tmp_path / "run"
    result = ok(train_two_ranks(run_dir, cache, "deepspeed=zero3", "micro_batch_size=2", *SHORT,
                                "debug.nan_at_step=3", "nonfinite=skip"))
    assert "skipped a batch with a non-finite loss at step 3" in result.stderr
    got, want = losses(run_dir), losses(two_ranks[3])
    assert sorted(got) == list(range(1, 9)) and all(np.isfinite(v) for v in got.values())
    assert got[1] == want[1] and got[2] == want[2]  # the same run until the skip
    assert records(run_dir)[-2]["skipped"] == 1
    assert np.isfinite(val_losses(run_dir)[8])
