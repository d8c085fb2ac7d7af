"""Resuming a run: settings changed on resume (honoured or refused, `train.resume`), crash-safe
checkpoint pruning, a corrupt newest checkpoint, and W&B history after a hard kill.

Real DeepSpeed and real W&B (offline): the end-to-end runs use `experiment=micro` (one 32-wide
layer, 32 tokens), seconds each on a free CPU.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from run_checks import clean_env, error_line, losses, ok, records
from train import checkpoint, resume
from train.checkpoint import MARKER, CheckpointError, complete_checkpoints
from train.config import TrainConfig, compose, to_train_config
from train.schedule import lr_at
from wandb_records import history as wandb_history

REPO = Path(__file__).resolve().parents[1]
MICRO = ["experiment=micro", "logger.progress=false", "ckpt_every=5"]
TIMEOUT = 900


def _cfg(*overrides: str) -> TrainConfig:
    return to_train_config(compose(list(overrides)))


# ---------------------------------------------------------------- the per-key table


def test_every_config_key_has_a_rule_and_the_design_doc_lists_them():
    keys = resume.leaves(OmegaConf.to_container(OmegaConf.structured(TrainConfig)))
    unruled = [key for key in keys if resume.rule(key)[1] == "no rule says a resume may change it"]
    assert not unruled
    assert resume.rule("data.tokenizer.vocab_size")[0] == resume.REFUSE  # the longest prefix decides
    assert resume.rule("data.tokenizer.model_path")[0] == resume.HONOUR
    design = (REPO / "docs" / "DESIGN.md").read_text()
    missing = [key for key in resume.RULES if f"`{key}`" not in design]
    assert not missing, f"docs/DESIGN.md does not list {missing}"


def _fake_checkpoint(run_dir: Path, step: int, cfg: TrainConfig, **marker) -> Path:
    """A checkpoint directory holding only what `resume.check` reads (config and marker)."""
    path = checkpoint.step_dir(run_dir, step)
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    (path / MARKER).write_text(json.dumps({"step": step, "world_size": 1, **marker}))
    return path


def test_resume_check_honours_schedule_keys_and_refuses_the_rest_in_one_line(tmp_path):
    base = ("experiment=micro", f"run_dir={tmp_path}")
    ckpt = _fake_checkpoint(tmp_path, 20, _cfg(*base))
    assert resume.check(ckpt, _cfg(*base, "resume=auto")) == []
    changed = resume.check(ckpt, _cfg(*base, "optim.lr=1e-2", "max_steps=40", "eval_every=5", "logger.wandb=offline"))
    assert changed == ["eval_every 10 -> 5", "logger.wandb auto -> offline", "max_steps 30 -> 40",
                       "optim.lr 0.003 -> 0.01"]
    for override, old, new in [("data.num_workers=1", "data.num_workers=0", "data.num_workers=1"),
                               ("model.max_seq_len=64", "model.max_seq_len=32", "model.max_seq_len=64"),
                               ("seed=7", "seed=42", "seed=7"),
                               ("deepspeed=zero1", "deepspeed.zero_stage=0", "deepspeed.zero_stage=1"),
                               ("deepspeed.precision=bf16", "deepspeed.precision=fp32", "deepspeed.precision=bf16")]:
        with pytest.raises(CheckpointError) as error:
            resume.check(ckpt, _cfg(*base, override))
        message = str(error.value)
        assert "\n" not in message and f"has {old}" in message and f"this run has {new}" in message, message
        assert f"init_from={ckpt}" in message
    with pytest.raises(CheckpointError, match=r"has data.num_workers=0, micro_batch_size=4, "
                                              r"this run has data.num_workers=2, micro_batch_size=2"):
        resume.check(ckpt, _cfg(*base, "data.num_workers=2", "micro_batch_size=2"))
    with pytest.raises(CheckpointError, match="max_steps=10 is below the step of checkpoint .* set max_steps >= 20"):
        resume.check(ckpt, _cfg(*base, "max_steps=10"))
    with pytest.raises(ValueError, match=r"batch_size=4 is not divisible by micro_batch_size=4 x world size 2: "
                                         r"run on a number of ranks that divides 1, or change batch_size"):
        _cfg(*base).grad_accum(2)


def test_precision_is_compared_as_trained(tmp_path):
    """`auto` is compared by what it resolved to when the checkpoint was written (its marker)."""
    ckpt = _fake_checkpoint(tmp_path, 5, _cfg("experiment=micro"), precision="bf16")
    with pytest.raises(CheckpointError, match="has deepspeed.precision=bf16, this run has deepspeed.precision=fp32"):
        resume.check(ckpt, _cfg("experiment=micro"))  # auto is fp32 on this CPU
    assert resume.check(ckpt, _cfg("experiment=micro", "deepspeed.precision=bf16")) == []


def test_null_kv_heads_and_n_head_are_one_shape(tmp_path):
    """`model.n_kv_head: null` means one kv head per query head: a resume that spells it out (or
    drops it) continues; another number of kv heads is refused, naming the heads used."""
    base = ("experiment=micro", f"run_dir={tmp_path}", "model.arch=llama", "model.parallel_residual=false")
    ckpt = _fake_checkpoint(tmp_path, 5, _cfg(*base))
    assert resume.check(ckpt, _cfg(*base, "model.n_kv_head=2")) == []
    checkpoint.check_compatible(ckpt, _cfg(*base, "model.n_kv_head=2").model)
    with pytest.raises(CheckpointError, match="has model.n_kv_head=2, this run has model.n_kv_head=1"):
        resume.check(ckpt, _cfg(*base, "model.n_kv_head=1"))
    with pytest.raises(CheckpointError, match="has model.n_kv_head=2, this run has model.n_kv_head=1"):
        checkpoint.check_compatible(ckpt, _cfg(*base, "model.n_kv_head=1").model)
    explicit = _fake_checkpoint(tmp_path / "explicit", 5, _cfg(*base, "model.n_kv_head=2"))
    assert resume.check(explicit, _cfg(*base)) == []


# ---------------------------------------------------------------- the optimizer really uses the new settings


@pytest.mark.parametrize("stage", [0, 1])
def test_optimizer_param_groups_follow_the_new_config_after_load(process_group, tmp_path, stage, single_thread):
    """Read from the optimizer itself: after a checkpoint of an lr=3e-3 run is loaded into an engine
    built with other lr, warm-up, max_steps, betas, eps and weight decay, every param group holds the
    new config's values at the saved step, and keeps following the new schedule (under ZeRO the
    optimizer state is loaded after the scheduler, so this is checked for stage 0 and 1)."""
    from model import GPT
    from train.engine import build_engine

    def engine_for(cfg: TrainConfig):
        torch.manual_seed(0)
        return build_engine(GPT(cfg.model), cfg, 1)

    def train_step(engine) -> None:
        tokens = torch.randint(0, 512, (4, 33))
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()

    old = _cfg("experiment=micro", f"deepspeed=zero{stage}")
    engine = engine_for(old)
    for _ in range(3):
        train_step(engine)
    saved = checkpoint.save(engine, tmp_path, 3, {"step": 3}, {}, keep_last=2)
    new = _cfg("experiment=micro", f"deepspeed=zero{stage}", "optim.lr=1e-2", "optim.min_lr=1e-3", "max_steps=40",
               "optim.warmup_steps=5", "optim.beta2=0.99", "optim.eps=1e-6", "optim.weight_decay=0.05")
    engine = engine_for(new)
    checkpoint.load(engine, saved)
    assert checkpoint.client_state(saved, 0)["step"] == 3
    assert engine.lr_scheduler.last_epoch == 3
    moments = [state["exp_avg"] for state in engine.optimizer.state.values()]
    assert moments and all(m.abs().sum() > 0 for m in moments)  # the saved Adam moments, not fresh ones
    for step in (3, 4):
        groups = engine.optimizer.param_groups
        assert [g["lr"] for g in groups] == [lr_at(step, new.optim, 40)] * 2
        assert engine.get_lr() == [lr_at(step, new.optim, 40)] * 2  # what the loop logs
        assert [tuple(g["betas"]) for g in groups] == [(0.9, 0.99)] * 2
        assert [g["eps"] for g in groups] == [1e-6] * 2
        assert [g["weight_decay"] for g in groups] == [0.05, 0.0]  # matrices decay, norms and biases do not
        train_step(engine)
    assert lr_at(3, new.optim, 40) != lr_at(3, old.optim, old.max_steps)


# ---------------------------------------------------------------- checkpoint lifecycle (no training)


def _complete(run_dir: Path, step: int, files: dict[str, bytes] | None = None) -> Path:
    path = checkpoint.step_dir(run_dir, step)
    path.mkdir(parents=True)
    files = files or {"weights.pt": b"x" * 10}
    for name, content in files.items():
        (path / name).write_bytes(content)
    (path / MARKER).write_text(json.dumps({"step": step, "world_size": 1,
                                           "files": {name: len(content) for name, content in files.items()}}))
    return path


def test_prune_renames_before_deleting_and_cleans_every_leftover(tmp_path):
    for step in (5, 10, 15, 20):
        _complete(tmp_path, step)
    root = tmp_path / "checkpoints"
    (root / "step_00000001").mkdir()  # what an interrupted prune of earlier versions left: no marker
    (root / "step_00000001" / "config.yaml").write_text("x")
    (root / ".tmp_step_00000025").mkdir()  # an interrupted write

    class Killed(Exception):
        pass

    def kill() -> None:
        raise Killed

    with pytest.raises(Killed):  # "killed" right after the oldest checkpoint was renamed
        checkpoint._prune(tmp_path, keep_last=2, step=15, in_prune=kill)
    names = sorted(p.name for p in root.iterdir())
    assert ".trash_step_00000005" in names and "step_00000005" not in names
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000010", "step_00000015", "step_00000020"]

    checkpoint._prune(tmp_path, keep_last=2, step=15)
    # step 20 is newer than the step just saved: a history abandoned by a resume from step 15 or older
    assert sorted(p.name for p in root.iterdir()) == ["step_00000010", "step_00000015"]


def test_corrupt_checkpoint_names_the_older_sound_one(tmp_path):
    older = _complete(tmp_path, 10)
    broken_older = _complete(tmp_path, 15)
    newest = _complete(tmp_path, 20)
    (broken_older / "weights.pt").write_bytes(b"x")
    checkpoint.verify(older)
    (newest / "weights.pt").write_bytes(b"x" * 3)
    with pytest.raises(CheckpointError) as error:
        checkpoint.verify(newest)
    assert str(error.value) == (
        f"checkpoint {newest} is corrupt: weights.pt has 3 bytes, 10 were written; "
        f"resume={older} continues from step 10 (newer checkpoints are then replaced)"
    )
    (older / "weights.pt").unlink()
    with pytest.raises(CheckpointError, match="weights.pt is missing; there is no older complete checkpoint"):
        checkpoint.verify(older)


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _args(run_dir: Path, cache: Path, overrides: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "train", *MICRO, f"run_dir={run_dir}", f"data.cache_dir={cache}", *overrides]


def train(run_dir: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(_args(run_dir, cache, overrides), cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> Path:
    """An uninterrupted 30-step run (checkpoints every 5 steps, the newest two kept), W&B offline."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    ok(train(run_dir, cache, "logger.wandb=offline"))
    return run_dir


@pytest.mark.slow
def test_changed_schedule_on_resume_is_used_and_logged_truthfully(reference, cache, tmp_path):
    """The issue's case: a finished run resumed with a longer schedule and a 3x higher lr. The lr
    logged for every step is the optimizer's (engine.get_lr() before the update) and equals the new
    schedule from the resumed step on; batch_size and eval cadence changes are honoured too."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    result = ok(train(run_dir, cache, "resume=auto", "max_steps=40", "optim.lr=1e-2", "optim.min_lr=1e-3",
                      "batch_size=8", "eval_every=5", "logger.wandb=disabled"))
    message = next(line for line in result.stderr.splitlines() if line.startswith("resumed from"))
    assert set(message.split(" with changed settings: ")[1].split(", ")) == {
        "batch_size 4 -> 8", "eval_every 10 -> 5", "logger.wandb offline -> disabled", "max_steps 30 -> 40",
        "optim.lr 0.003 -> 0.01", "optim.min_lr 0.0001 -> 0.001", f"run_dir {reference} -> {run_dir}"}
    old, new = _cfg("experiment=micro"), _cfg("experiment=micro", "optim.lr=1e-2", "optim.min_lr=1e-3")
    train_records = {r["step"]: r for r in records(run_dir) if "loss" in r}
    assert sorted(train_records) == list(range(1, 41))
    for step, record in train_records.items():
        want = lr_at(step - 1, old.optim, 30) if step <= 30 else lr_at(step - 1, new.optim, 40)
        assert record["lr"] == want, (step, record["lr"], want)
    assert train_records[40]["tokens_seen"] == 30 * 4 * 32 + 10 * 8 * 32
    assert sorted(r["step"] for r in records(run_dir) if "val_loss" in r) == [10, 20, 30, 35, 40]
    saved = OmegaConf.load(complete_checkpoints(run_dir)[-1] / "config.yaml")
    assert saved.optim.lr == 1e-2 and saved.max_steps == 40


@pytest.mark.slow
@pytest.mark.parametrize("override, key", [("data.num_workers=1", "data.num_workers"),
                                           ("model.max_seq_len=64", "model.max_seq_len")])
def test_refused_change_is_one_line_and_writes_nothing(reference, cache, tmp_path, override, key):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    result = train(run_dir, cache, "resume=auto", "max_steps=40", override)
    assert result.returncode == 1
    line = error_line(result)
    assert f"this run has {override}" in line and key in line and "init_from=" in line, line
    assert "Traceback" not in result.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_corrupt_newest_checkpoint_names_the_older_one_which_then_continues(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    older, newest = complete_checkpoints(run_dir)
    weights = newest / "mp_rank_00_model_states.pt"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = train(run_dir, cache, "resume=auto", "max_steps=40")
    assert result.returncode == 1
    assert error_line(result).endswith(f"; resume={older} continues from step 25 (newer checkpoints are then replaced)")
    assert "is corrupt: mp_rank_00_model_states.pt has" in error_line(result)

    ok(train(run_dir, cache, f"resume={older}", "logger.wandb=offline"))
    assert losses(run_dir) == losses(reference)  # steps 26-30 again, bitwise
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_00000025", "step_00000030"]
    checkpoint.verify(complete_checkpoints(run_dir)[-1])  # the corrupt one was replaced


@pytest.mark.slow
def test_kill_during_prune_then_resume_leaves_no_debris_and_wandb_holds_every_step(reference, cache, tmp_path):
    """kill -9 while the save of step 15 deletes step 5 (renamed, not yet removed): no directory that
    looks like a checkpoint is left half-deleted; the resumed run reproduces the reference bitwise,
    its next save removes the leftover, and W&B (offline, which lost the killed process's unflushed
    records) holds every step of metrics.jsonl in the resumed run's file."""
    run_dir = tmp_path / "run"
    killed = train(run_dir, cache, "logger.wandb=offline", "debug.kill_in_prune_at_step=15")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".trash_step_00000005", "step_00000010", "step_00000015"]
    assert (root / ".trash_step_00000005" / "mp_rank_00_model_states.pt").is_file()

    result = ok(train(run_dir, cache, "resume=auto", "logger.wandb=offline"))
    assert "resumed from" in result.stderr and "step_00000015" in result.stderr
    assert sorted(p.name for p in root.iterdir()) == ["step_00000025", "step_00000030"]
    assert losses(run_dir) == losses(reference)

    runs = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    assert len(runs) == 2 and len({p.name for p in runs}) == 1  # one W&B run id, resumed
    history = wandb_history(runs[-1])
    logged = records(run_dir)
    assert sorted(history) == sorted({r["step"] for r in logged}) == list(range(1, 31))
    for record in logged:
        for key, value in record.items():
            if key != "step":
                assert history[record["step"]][key] == value, (record["step"], key)


# ---------------------------------------------------------------- a torn metrics log


def test_torn_last_metrics_line_is_dropped_with_a_warning_and_a_bad_middle_line_named(tmp_path):
    from train.metrics import records_up_to

    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    path.write_text("\n".join(rows) + '\n{"step": 4, "lo')  # a power loss mid-write
    kept, warning = records_up_to(path, 2)
    assert kept == rows[:2]
    assert warning is not None and str(path) in warning and "line 4" in warning and "\n" not in warning
    assert records_up_to(path, 3) == (rows, warning)
    path.write_text(rows[0] + '\n{"step": 2,\n' + rows[2] + "\n")
    with pytest.raises(CheckpointError, match=rf"{path} line 2 does not parse"):
        records_up_to(path, 3)
    path.write_text("\n".join(rows) + "\n")
    assert records_up_to(path, 3) == (rows, None)
    assert records_up_to(tmp_path / "absent.jsonl", 3) == ([], None)


@pytest.mark.slow
def test_resume_after_a_torn_metrics_line_continues_bitwise(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    older = complete_checkpoints(run_dir)[0]
    log = run_dir / "metrics.jsonl"
    torn_line = len(log.read_text().splitlines()) + 1
    with open(log, "a") as file:
        file.write('{"step": 31, "loss": 2.')
    result = ok(train(run_dir, cache, f"resume={older}", "logger.wandb=disabled"))
    assert f"warning: dropped the torn last line {torn_line} of {log}" in result.stderr
    assert losses(run_dir) == losses(reference)  # steps 26-30 again, bitwise; the torn row is gone
