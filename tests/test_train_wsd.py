"""Warmup-stable-decay and cooldown branches (`optim.decay=wsd`, `branch_from`).

A branch from a checkpoint of a WSD run's stable phase must be the run its own, shorter schedule
would have trained from scratch: the same learning rate at every step, the same losses bitwise, and
a kill -9 in the branch resumes it bitwise. Real DeepSpeed, `experiment=micro`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from run_checks import clean_env, error_line, losses, ok, records
from train import checkpoint, resume
from train.checkpoint import CheckpointError
from train.config import compose, to_train_config
from train.schedule import lr_at

REPO = Path(__file__).resolve().parents[1]
WSD = ["experiment=micro", "optim.decay=wsd", "optim.decay_fraction=0.5", "logger.progress=false",
       "logger.wandb=disabled", "ckpt_every=5", "keep_last=10"]


def _cfg(*overrides: str):
    return to_train_config(compose(list(overrides)))


def _wsd_definition(step: int, lr: float, min_lr: float, warmup: int, init_lr: float, total: int,
                     fraction: float) -> float:
    """The schedule as stated: linear warm-up over `warmup` steps (step s ends at s+1 / warmup of
    the way), lr until the last `fraction` of `total` steps, then linear towards min_lr."""
    decay_steps = round(fraction * total)
    if step < warmup:
        return init_lr + (lr - init_lr) * (step + 1) / warmup
    if step < total - decay_steps:
        return lr
    return lr - (lr - min_lr) * (step - (total - decay_steps)) / decay_steps


@pytest.mark.parametrize("total, fraction", [(30, 0.5), (750, 0.2), (3000, 0.2), (101, 0.33)])
def test_wsd_learning_rate_is_the_stated_schedule(total, fraction):
    cfg = _cfg("experiment=micro", "optim.decay=wsd", f"optim.decay_fraction={fraction}", f"max_steps={total}")
    o = cfg.optim
    for step in range(total):
        want = _wsd_definition(step, o.lr, o.min_lr, o.warmup_steps, o.warmup_init_lr, total, fraction)
        assert lr_at(step, o, total) == pytest.approx(want, rel=1e-12, abs=1e-15), step


def test_a_shorter_wsd_schedule_shares_the_stable_phase():
    long, short = _cfg(*WSD, "max_steps=3000"), _cfg(*WSD, "max_steps=750")
    stable_end = 750 - round(0.5 * 750)
    assert all(lr_at(s, long.optim, 3000) == lr_at(s, short.optim, 750) for s in range(stable_end))
    assert lr_at(stable_end, short.optim, 750) == long.optim.lr
    assert lr_at(stable_end + 1, short.optim, 750) < long.optim.lr


@pytest.mark.parametrize("overrides, message", [
    (["optim.decay_fraction=0"], "optim.decay_fraction=0.0 must be in (0, 1]"),
    (["optim.decay=wsd", "optim.decay_fraction=1.0"], "would start inside the 3-step warm-up"),
    (["branch_from=somewhere", "init_from=elsewhere"], "branch_from starts a run from a checkpoint's whole state"),
    (["branch_from=somewhere", "resume=runs/x"], "branch_from starts a run from a checkpoint's whole state"),
])
def test_bad_schedule_or_branch_settings_are_one_line(overrides, message, tmp_path):
    result = subprocess.run([sys.executable, "-m", "train", "experiment=micro", f"run_dir={tmp_path}/run", *overrides],
                            cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in error_line(result)
    assert "Traceback" not in result.stderr


def _fake_checkpoint(run_dir: Path, step: int, overrides: list[str]) -> Path:
    from omegaconf import OmegaConf

    path = checkpoint.step_dir(run_dir, step)
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(_cfg(*overrides))))
    (path / checkpoint.MARKER).write_text(json.dumps({"step": step, "world_size": 1}))
    return path


@pytest.mark.parametrize("source, accepted", [
    (["optim.decay=wsd", "optim.decay_fraction=0.5", "max_steps=30"], True),     # step 10 is in its stable phase
    (["optim.decay=wsd", "optim.decay_fraction=0.8", "max_steps=30"], False),    # its decay began at step 6
    (["optim.decay=cosine", "max_steps=30"], False),
    (["optim.decay=wsd", "optim.decay_fraction=0.5", "max_steps=30", "optim.lr=1e-3"], False),
])
def test_a_branch_must_share_its_sources_schedule_up_to_the_branch_point(tmp_path, source, accepted):
    ckpt = _fake_checkpoint(tmp_path / "source", 10, ["experiment=micro", *source])
    cfg = _cfg(*WSD, "max_steps=20", f"branch_from={ckpt}", f"run_dir={tmp_path / 'branch'}")
    if accepted:
        assert "max_steps 30 -> 20" in resume.check(ckpt, cfg)
    else:
        with pytest.raises(CheckpointError, match=r"a branch must share its source's schedule up to step 10"):
            resume.check(ckpt, cfg)


# ---------------------------------------------------------------- end to end


def _train(run_dir: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", *WSD, f"run_dir={run_dir}", f"data.cache_dir={cache}",
                           *overrides], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_cooldown_branch_is_the_shorter_run_and_resumes_bitwise_after_kill_9(tmp_path):
    """A 30-step WSD run (stable to step 15) and a branch from its step-10 checkpoint to 20 steps:
    the branch logs its own schedule's learning rate at every step, its losses are bitwise those of
    a 20-step WSD run from scratch, and a branch killed (-9) while saving step 20 resumes from its
    own step 15 to the same losses bitwise."""
    cache = tmp_path / "cache"
    main, independent = tmp_path / "main", tmp_path / "independent"
    ok(_train(main, cache, "max_steps=30"))
    ok(_train(independent, cache, "max_steps=20"))
    source = checkpoint.step_dir(main, 10)

    branch = tmp_path / "branch"
    ok(_train(branch, cache, "max_steps=20", f"branch_from={source}", "resume=auto"))
    cfg = _cfg(*WSD, "max_steps=20")
    logged = {r["step"]: r["lr"] for r in records(branch) if "loss" in r}
    assert sorted(logged) == list(range(11, 21))
    for step, lr in logged.items():
        assert lr == lr_at(step - 1, cfg.optim, 20), (step, lr)
    assert logged[20] < logged[11] == cfg.optim.lr  # it decays from the branch point
    want = {s: v for s, v in losses(independent).items() if s > 10}
    assert losses(branch) == want
    assert {s: v for s, v in losses(main).items() if s <= 10} == {s: v for s, v in losses(independent).items()
                                                                  if s <= 10}

    killed_dir = tmp_path / "killed"
    killed = _train(killed_dir, cache, "max_steps=20", f"branch_from={source}", "resume=auto",
                    "debug.kill_in_checkpoint_at_step=20")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [p.name for p in checkpoint.complete_checkpoints(killed_dir)] == ["step_00000015"]
    resumed = ok(_train(killed_dir, cache, "max_steps=20", f"branch_from={source}", "resume=auto"))
    assert "step_00000015" in next(line for line in resumed.stderr.splitlines() if line.startswith("resumed from"))
    assert losses(killed_dir) == want
