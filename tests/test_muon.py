"""`optim=muon` (`train.optim`): which parameters Muon takes (every design of the registry), the
combined optimizer against torch's own Muon and AdamW, the one schedule over both groups, the
one-line refusals, and real runs: kill -9 then resume bitwise, two ranks under ZeRO 1 and 2."""

from __future__ import annotations

import copy
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import GPT, ModelConfig
from model.designs import DESIGNS
from run_checks import clean_env, losses, ok
from train.checkpoint import complete_checkpoints
from train.config import OptimConfig, TrainConfig
from train.optim import MuonAdamW, param_groups
from train.schedule import Schedule, lr_at

REPO = Path(__file__).resolve().parents[1]
HIDDEN = re.compile(r"h\.\d+\.(attn\.(qkv|q|k|v|proj)|mlp\.(fc|proj|gate|up|down))\.weight")
SMALL = dict(n_layer=2, n_head=4, n_embd=32, ffn_hidden=64, vocab_size=64, max_seq_len=16)
LLAMA = dict(arch="llama", parallel_residual=False, n_kv_head=2)


def _cfg(model: ModelConfig, **optim) -> TrainConfig:
    return TrainConfig(model=model, optim=OptimConfig(name="muon", **optim))


@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["neox", "llama"])
@pytest.mark.parametrize("key", list(DESIGNS))
def test_muon_takes_the_hidden_matrices_and_adamw_every_design_parameter(key, arch):
    """Muon's groups hold exactly the attention and MLP projection weights; every other parameter
    (embedding, head, norms, biases, the design's own, sinks and SSMax) is in one AdamW group."""
    design = DESIGNS[key]
    modifiers = dict(sinks=True, ssmax=True) if design.softmax else {}
    model = GPT(ModelConfig(**SMALL, **arch, **design.settings(), **modifiers))
    groups = param_groups(model, _cfg(model.cfg))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [names[id(p)] for g in groups if g["use_muon"] for p in g["params"]]
    adamw = [names[id(p)] for g in groups if not g["use_muon"] for p in g["params"]]
    assert sorted(muon + adamw) == sorted(names.values())  # each parameter exactly once
    assert sorted(muon) == sorted(n for n in names.values() if HIDDEN.fullmatch(n))
    own = [n for n in names.values() if re.search(r"score_bias|qk_transform|attend|\.pro\.|sinks|ssmax", n)]
    assert set(own) <= set(adamw) and (own or not modifiers)


def _train(model: GPT, optimizers: list[torch.optim.Optimizer], steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 17), generator=gen)
        for opt in optimizers:
            opt.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        for opt in optimizers:
            opt.step()


def test_muon_adamw_is_torch_muon_and_adamw_and_its_state_round_trips(single_thread):
    """The combined optimizer steps exactly as torch's Muon (Nesterov off, 3 Newton-Schulz steps, the
    RMS-matching adjustment: the options reach it) on the hidden matrices plus torch's AdamW on the
    rest; its state_dict (momentum buffers and Adam moments) restores a run that then continues bitwise."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**SMALL))
    twin = copy.deepcopy(model)
    cfg = _cfg(model.cfg, muon_nesterov=False, muon_ns_steps=3, muon_adjust_lr="match_rms_adamw", muon_lr=0.05)
    combined = MuonAdamW(param_groups(model, cfg), cfg)
    split = param_groups(twin, cfg)
    muon = torch.optim.Muon([p for g in split if g["use_muon"] for p in g["params"]], lr=0.05, nesterov=False,
                            ns_steps=3, adjust_lr_fn="match_rms_adamw", weight_decay=0.1)
    adamw = torch.optim.AdamW([{k: v for k, v in g.items() if k != "use_muon"} for g in split if not g["use_muon"]],
                              lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8)
    _train(model, [combined], 3)
    _train(twin, [muon, adamw], 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    kinds = {frozenset(state) for state in combined.state.values()}
    assert kinds == {frozenset({"momentum_buffer"}), frozenset({"step", "exp_avg", "exp_avg_sq"})}

    saved, resumed_model = copy.deepcopy(combined.state_dict()), copy.deepcopy(model)
    resumed = MuonAdamW(param_groups(resumed_model, cfg), cfg)
    resumed.load_state_dict(saved)
    _train(model, [combined], 2, seed=1)
    _train(resumed_model, [resumed], 2, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True))


@pytest.mark.parametrize("decay", ["cosine", "wsd"])
def test_muon_one_schedule_drives_both_groups_at_their_peaks(decay):
    model = GPT(ModelConfig(**SMALL))
    cfg = _cfg(model.cfg, decay=decay, lr=1e-3, min_lr=1e-4, warmup_steps=2, muon_lr=0.02)
    optimizer = MuonAdamW(param_groups(model, cfg), cfg)
    schedule = Schedule(optimizer, cfg.optim, 10)
    for step in range(10):
        lr = lr_at(step, cfg.optim, 10)
        assert sorted({g["lr"] for g in optimizer.param_groups}) == sorted({lr, lr * 20.0})
        assert all(g["lr"] == (lr * 20.0 if g["use_muon"] else lr) for g in optimizer.param_groups)
        optimizer.step()
        schedule.step()


@pytest.mark.parametrize("overrides, words", [
    (["optim=muon", "deepspeed=zero3"], "zero_stage=3 is not supported"),
    (["optim=muon", "deepspeed=zero1", "optim.muon_ns_steps=3"], "5 Newton-Schulz steps"),
    (["optim=muon", "deepspeed=zero1", "deepspeed.offload_optimizer=true"], "Adam only"),
    (["optim=muon", "optim.qk_clip=10", "deepspeed=zero2"], "master copy"),
])
def test_muon_settings_a_zero_stage_cannot_train_are_refused_in_one_line(overrides, words, capsys):
    from train.__main__ import main as train_main

    code = train_main(["experiment=micro", *overrides])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines


# ---------------------------------------------------------------- real runs

MICRO = ["experiment=micro", "optim=muon", "logger.progress=false", "logger.wandb=disabled", "ckpt_every=5"]


def _run(run_dir: Path, cache: Path, *overrides: str, launcher: list[str] | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [*(launcher or [sys.executable, "-m", "train"]), *MICRO, f"run_dir={run_dir}",
               f"data.cache_dir={cache}", *overrides]
    return subprocess.run(command, cwd=REPO, env=clean_env(**(env or {})), capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_muon_trains_and_resumes_bitwise_after_kill_9(tmp_path):
    """`experiment=micro optim=muon`: the loss falls; a run SIGKILLed while writing step 15's
    checkpoint resumes from step 10 (Muon's momentum buffers restored from the checkpoint) to the
    uninterrupted run's losses, bit for bit."""
    cache = tmp_path / "cache"
    reference = tmp_path / "reference"
    ok(_run(reference, cache))
    first, last = losses(reference)[1], losses(reference)[30]
    assert last < first - 0.5
    run_dir = tmp_path / "run"
    assert _run(run_dir, cache, "debug.kill_in_checkpoint_at_step=15").returncode == -signal.SIGKILL
    assert complete_checkpoints(run_dir)[-1].name == "step_00000010"
    saved = torch.load(run_dir / "checkpoints" / "step_00000010" / "mp_rank_00_model_states.pt", weights_only=False)
    assert any("momentum_buffer" in state for state in saved["optimizer"]["state"].values())
    ok(_run(run_dir, cache, "resume=auto"))
    assert losses(run_dir) == losses(reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_muon_two_ranks_under_zero(stage, tmp_path):
    """Two CPU ranks over gloo under the DeepSpeed launcher with DeepSpeed's ZeRO Muon: the run
    trains (the loss falls) and writes its checkpoints. Its resume on one rank is refused in one
    line before anything is converted: DeepSpeed's universal-checkpoint conversion drops Muon's
    momentum buffers (it raised KeyError 'exp_avg' halfway). DeepSpeed compiles its Muon update with
    torch.compile; on a CPU that costs minutes per shape, so the test runs it eagerly
    (TORCHDYNAMO_DISABLE, the same function)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run_dir = tmp_path / "run"
    ok(_run(run_dir, tmp_path / "cache", f"deepspeed=zero{stage}", "batch_size=4", "micro_batch_size=2",
            "max_steps=12", "eval_every=12", "ckpt_every=6",
            launcher=["deepspeed", "--num_gpus", "2", "--master_port", str(port), "--module", "train"],
            env={"TORCHDYNAMO_DISABLE": "1"}))
    seen = losses(run_dir)
    assert sorted(seen) == list(range(1, 13)) and seen[12] < seen[1] - 0.3
    assert complete_checkpoints(run_dir)[-1].name == "step_00000012"
    one_rank = _run(run_dir, tmp_path / "cache", f"deepspeed=zero{stage}", "batch_size=4", "micro_batch_size=2",
                    "max_steps=14", "eval_every=14", "ckpt_every=6", "resume=auto", env={"TORCHDYNAMO_DISABLE": "1"})
    assert one_rank.returncode == 1 and one_rank.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {run_dir}/checkpoints/step_00000012: written by 2 ranks under ZeRO {stage} with Muon, "
        "and DeepSpeed's universal-checkpoint conversion keeps Adam's moments but not Muon's momentum buffers: "
        "resume it with 2 ranks")
    assert not list((run_dir / "checkpoints" / "step_00000012").glob("*universal*"))
