"""Sequence parallelism (`parallel.sequence`, DeepSpeed-Ulysses) is exact: a step on two gloo ranks,
each holding half of every row, equals a one-process step on the whole rows.

One pair of ranks (`tests/sequence_parallel_steps.py`) runs every case: in float64 the trainer's
arithmetic for neox, llama with GQA (and MQA, whose one kv head is replicated) x every design x
{plain rows, packed documents crossing the shard boundary with `doc_positions`} x {as trained,
dynamic NTK stretching from half the row}, to 1e-10; then the DeepSpeed engine under ZeRO 0, 2
and 3 in fp32, to 1e-5. The batch makes the shortcuts fail: the shards count different targets
(local loss scale), dynamic NTK's base depends on the global length, positions and ALiBi slopes
differ per shard and head.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from sequence_parallel_steps import EOS, SEED, SEQ_LEN, VOCAB, model_config
from test_train_e2e import (
    _free_port,
    _logged_batches,
    _replay,
    deepspeed_command,
    train,
    train_two_ranks,
    wait_for_step,
)

from model import GPT
from model.designs import DESIGNS
from run_checks import clean_env, error_line, losses, ok, val_losses
from train.checkpoint import complete_checkpoints, step_dir
from train.config import ConfigError, compose, to_train_config
from train.inputs import model_inputs

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "sequence_parallel_steps.py"


def float64_cases() -> list[str]:
    cases = []
    for arch in ("neox", "llama"):
        for design in DESIGNS.values():
            for data in ("plain", "docs"):
                for scaling in ("none", "dynamic") if design.rope else ("none",):
                    cases.append(f"{arch}:{design.key}:{data}:{scaling}")
                if arch == "neox" and design.softmax:  # the length temperature, at global positions
                    cases.append(f"{arch}:{design.key}:{data}:temp")
    softmax = ["neox:origin:docs:softmax", "llama:alibi:docs:softmax", "neox:hybrid:plain:softmax",
               "mqa:fox:docs:softmax", "llama:pope:docs:softmax"]  # sinks and SSMax
    return [*cases, "mqa:origin:docs:dynamic", "mqa:alibi:docs:none", "mqa:fox:docs:none", "mqa:fox_pro:docs:none",
            *softmax]


ENGINE_CASES = ["zero0:neox:alibi:docs:none", "zero2:llama:coca_strict:docs:dynamic",
                "zero3:llama:origin:docs:dynamic", "zero3:neox:coca:plain:none", "zero2:llama:fox:docs:temp",
                "zero3:neox:hybrid:docs:none", "zero3:llama:fire:plain:none", "zero3:llama:origin:docs:softmax",
                "zero2:neox:pope:plain:none", "zero3:llama:fox_pro:docs:none"]


def batch() -> torch.Tensor:
    """2 rows of 33 tokens. Row 0: documents start at 3, 12 (crossing the shard boundary at 16) and
    22, and the targets at 24-28 are not counted (so its shards count 16 and 11); row 1: documents
    at 0, 9 and 10 (one token each), 11, 15 (crossing) and 28."""
    rows = torch.randint(1, VOCAB, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    for row, starts in ((0, (3, 12, 22)), (1, (0, 9, 10, 11, 15, 28))):
        rows[row, list(starts)] = EOS
    rows[0, 25:30] = -rows[0, 25:30] - 1
    return rows


def reference(case: str, rows: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, whole rows, float64: the mean loss over counted targets and its gradients."""
    cfg = model_config(*case.split(":")[-4:])
    torch.manual_seed(SEED)
    model = GPT(cfg).double()
    loss = model(**model_inputs(rows, "cpu", EOS if cfg.doc_mask else None))
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def launched(ranks: int, rows: torch.Tensor, cases: list[str], tmp_path: Path) -> dict:
    """The script's results for `cases` on `ranks` gloo ranks (sequence groups of 2)."""
    path = tmp_path / "batch.pt"
    torch.save(rows, path)
    done = subprocess.run(["deepspeed", "--num_gpus", str(ranks), "--master_port", str(_free_port()), str(SCRIPT),
                           str(path), str(tmp_path / "out.pt"), *cases], cwd=REPO, env=clean_env(PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=600)
    ok(done)
    return torch.load(tmp_path / "out.pt")


def compare(cases: list[str], rows: torch.Tensor, results: dict) -> None:
    """Every case's loss and gradients against the one-process reference (1e-10; fp32 engine 1e-5)."""
    failed = []
    for case in cases:
        loss, grads = reference(case, rows)
        got = results[case]
        tol = 1e-5 if case.startswith("zero") else 1e-10
        worst = max(float((got["grads"][name].double() - grad).abs().max()) for name, grad in grads.items())
        if abs(got["loss"] - loss) > tol or worst > tol:
            failed.append(f"{case}: loss {got['loss']} vs {loss}, worst gradient difference {worst:.2e}")
    assert not failed, "\n".join(failed)


@pytest.mark.slow
def test_two_sequence_ranks_equal_one_process(tmp_path):
    rows = batch()
    shards = [model_inputs(rows, "cpu", None, (r, 2))["targets"] for r in (0, 1)]
    assert [int((t != -100).sum()) for t in shards] == [32, 27]  # a local count would scale each rank's loss
    cases = [*float64_cases(), *ENGINE_CASES]
    compare(cases, rows, launched(2, rows, cases, tmp_path))


@pytest.mark.slow
def test_two_sequence_groups_of_two_equal_one_process(tmp_path):
    """Four ranks: two data-parallel groups of two sequence ranks, one row each (groups, the
    data-parallel share of the rows and the averaging over all four ranks)."""
    cases = ["llama:alibi:docs:none", "neox:coca_strict:docs:dynamic", "zero3:llama:origin:docs:dynamic"]
    rows = batch()
    compare(cases, rows, launched(4, rows, cases, tmp_path))


@pytest.mark.parametrize(("overrides", "words"), [
    (["model.n_head=2", "parallel.sequence=4", "model.n_embd=32"],
     "model.n_head=2 is not divisible by parallel.sequence=4: use a P that divides 2"),
    (["model=llama_tiny", "model.n_head=6", "model.n_kv_head=3", "model.n_embd=48", "parallel.sequence=2"],
     "model.n_kv_head=3 neither divides nor is divisible by parallel.sequence=2"),
    (["model.max_seq_len=30", "parallel.sequence=4", "model.n_head=4", "model.n_embd=32"],
     "model.max_seq_len=30 is not divisible by parallel.sequence=4: each rank holds an equal share"),
    (["parallel.sequence=0"], "parallel.sequence=0 must be >= 1"),
])
def test_a_model_that_cannot_be_split_is_one_line(overrides, words):
    with pytest.raises(ConfigError, match=words):
        to_train_config(compose(["experiment=micro", *overrides]))


def test_sequence_ranks_must_divide_the_world_and_the_batch_the_data_parallel_ranks():
    from train.__main__ import check_world_size

    cfg = to_train_config(compose(["experiment=micro", "parallel.sequence=2", "batch_size=4", "micro_batch_size=2"]))
    with pytest.raises(ConfigError, match="parallel.sequence=2 does not divide the world size 3: launch a "
                                          "multiple of 2 ranks, or set parallel.sequence to a divisor of 3"):
        check_world_size(cfg, 3)
    check_world_size(cfg, 4)  # 2 data-parallel ranks x micro 2: the batch of 4, no accumulation
    with pytest.raises(ConfigError, match=r"x data-parallel size 4 \(world size 8 / parallel.sequence=2\): run "
                                          r"on parallel.sequence x a number that divides 2"):
        check_world_size(cfg, 8)


SP_RUN = ("deepspeed=zero2", "batch_size=4", "micro_batch_size=2", "max_steps=8", "eval_every=4", "ckpt_every=4",
          "model.attention=alibi", "model.n_head=4")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow
def test_a_deepspeed_run_with_two_sequence_ranks_logs_the_one_rank_losses_and_resumes(cache, tmp_path):
    """`deepspeed --num_gpus 2 --module train parallel.sequence=2` (ZeRO 2, accumulation 2, ALiBi
    with 4 heads: 2 per rank) logs the one-process run's losses and validation losses to 1e-5: one
    sequence group reads the one-rank run's rows. Killed (SIGKILL, the launcher's process group)
    after step 5 it resumes from step 4 to the uninterrupted run's losses, bit for bit, on the same
    blocks. Its step-4 checkpoint then continues on one rank with P=1 (another world size: ZeRO's
    state through the universal checkpoint, the data re-planned from the group's loader): a
    one-process replay of the logged global batches gives every logged loss to 1e-5."""
    one, two, killed, elastic = (tmp_path / name for name in ("one", "two", "killed", "elastic"))
    ok(train(one, cache, *SP_RUN))
    ok(train_two_ranks(two, cache, *SP_RUN, "parallel.sequence=2"))
    assert sorted(losses(two)) == list(range(1, 9)) and sorted(val_losses(two)) == [4, 8]
    for got, want in ((losses(two), losses(one)), (val_losses(two), val_losses(one))):
        for step in want:
            assert got[step] == pytest.approx(want[step], abs=1e-5), (step, got, want)
    assert (two / "blocks_rank0.jsonl").read_text() == (two / "blocks_rank1.jsonl").read_text()  # one group

    proc = subprocess.Popen(deepspeed_command(killed, cache, *SP_RUN, "parallel.sequence=2", "debug.step_sleep_s=0.5"),
                            cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for_step(proc, killed, 5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert complete_checkpoints(killed)[-1].name == "step_00000004"
    assert "step_00000004" in ok(train_two_ranks(killed, cache, *SP_RUN, "parallel.sequence=2", "resume=auto")).stderr
    assert losses(killed) == losses(two) and val_losses(killed) == val_losses(two)
    assert (killed / "blocks_rank0.jsonl").read_text() == (two / "blocks_rank0.jsonl").read_text()

    shutil.copytree(two, elastic)
    ok(train(elastic, cache, *SP_RUN, f"resume={step_dir(elastic, 4)}"))
    assert (step_dir(elastic, 4) / "universal").is_dir()
    cfg = to_train_config(OmegaConf.load(elastic / "config.yaml"))
    replayed, logged = _replay(cfg, _logged_batches(elastic, (0,), range(1, 9))), losses(elastic)
    assert sorted(logged) == list(range(1, 9))
    for step in logged:
        assert replayed[step] == pytest.approx(logged[step], abs=1e-5), (step, replayed, logged)


@pytest.mark.slow
def test_train_refuses_a_sequence_split_in_one_line(cache, tmp_path):
    """`python -m train` itself: a row length P does not divide (at composition) and one rank for
    P=2 (after the process group starts): one `error:` line each, exit 2, nothing written."""
    run_dir = tmp_path / "run"
    for overrides, words in ((["model.max_seq_len=33", "parallel.sequence=2"],
                              "model.max_seq_len=33 is not divisible by parallel.sequence=2"),
                             (["parallel.sequence=2"], "parallel.sequence=2 does not divide the world size 1")):
        done = train(run_dir, cache, *overrides)
        assert done.returncode == 2 and words in error_line(done), done.stderr[-2000:]
    assert not run_dir.exists()
