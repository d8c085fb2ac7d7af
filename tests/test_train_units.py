"""Fast checks of the training components: config composition and errors, schedule, DeepSpeed JSON,
argument handling, checkpoint discovery, FLOPs accounting, W&B mode."""

from __future__ import annotations

import math
import os

import pytest
import torch

from model import GPT
from train.__main__ import main
from train.checkpoint import MARKER, CheckpointError, complete_checkpoints, find_checkpoint
from train.config import ConfigError, OptimConfig, compose, to_train_config
from train.distributed import strip_local_rank
from train.engine import check_precision_supported, deepspeed_config, precision_refusal
from train.flops import flops_per_token
from train.metrics import wandb_mode
from train.schedule import lr_at
from train.start import checkpoint_to_resume


def _cfg(*overrides: str):
    return to_train_config(compose(list(overrides)))


def test_default_config_composes_with_vocab_from_tokenizer():
    cfg = _cfg()
    assert cfg.model.n_layer == 4 and cfg.model.n_embd == 256  # the tiny flavor
    assert cfg.model.vocab_size == cfg.data.tokenizer.vocab_size
    assert cfg.run_dir == "runs/tiny"
    micro = _cfg("experiment=micro", "data.tokenizer.vocab_size=600")
    assert micro.model.vocab_size == 600 and micro.run_dir == "runs/micro"
    assert _cfg("model=350m").model.n_layer == 24


@pytest.mark.parametrize(
    "override, words",
    [
        ("foo=1", ["foo"]),
        ("+foo=1", ["foo"]),
        ("max_steps=abc", ["max_steps", "abc"]),
        ("model=huge", ["model/huge", "tiny"]),
        ("deepspeed=zero9", ["deepspeed/zero9", "zero3_offload"]),
        ("model.attention=foo", ["model.attention", "origin"]),
        ("optim.decay=step", ["optim.decay", "cosine"]),
        ("deepspeed.zero_stage=5", ["deepspeed.zero_stage"]),
        ("logger.wandb=maybe", ["logger.wandb", "offline"]),
        ("max_steps", ["max_steps", "key=value"]),
    ],
)
def test_bad_override_is_one_clear_line(override, words, capsys):
    with pytest.raises(ConfigError) as error:
        _cfg(override)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message
    assert main([override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1


def test_cfg_job_prints_the_composed_config(capsys):
    assert main(["--cfg", "job", "model=125m", "optim.lr=3e-4"]) == 0
    out = capsys.readouterr().out
    assert "n_embd: 768" in out and "lr: 0.0003" in out


def test_schedule_warmup_then_cosine_to_min():
    o = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, warmup_init_lr=1e-7, decay="cosine")
    assert lr_at(0, o, 110) == pytest.approx(1e-7 + (1e-3 - 1e-7) / 10)
    assert lr_at(9, o, 110) == pytest.approx(1e-3)
    assert lr_at(60, o, 110) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, o, 110) == pytest.approx(1e-4)
    lin = OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, decay="linear")
    assert lr_at(25, lin, 100) == pytest.approx(0.75e-3)
    values = [lr_at(s, o, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_deepspeed_json_derives_from_the_one_config():
    cfg = _cfg("batch_size=32", "micro_batch_size=4", "deepspeed=zero3_offload", "deepspeed.precision=bf16",
               "optim.grad_clip=0.5")
    ds = deepspeed_config(cfg, world_size=2)
    assert ds["train_batch_size"] == 32
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert deepspeed_config(_cfg("deepspeed.precision=fp16"), 1)["fp16"]["enabled"]
    with pytest.raises(ValueError, match="not divisible"):
        deepspeed_config(cfg, world_size=3)
    with pytest.raises(ConfigError, match="offload_param"):
        _cfg("deepspeed=zero2", "deepspeed.offload_param=true")


def test_local_rank_argument_is_removed(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert strip_local_rank(["--local_rank=3", "max_steps=5"]) == ["max_steps=5"]
    assert os.environ["LOCAL_RANK"] == "3"
    assert strip_local_rank(["a=1", "--local-rank", "1", "b=2"]) == ["a=1", "b=2"]


def test_incomplete_checkpoints_are_invisible(tmp_path):
    root = tmp_path / "checkpoints"
    for step, complete in [(10, True), (20, True), (30, False)]:
        d = root / f"step_{step:08d}"
        d.mkdir(parents=True)
        if complete:
            (d / MARKER).write_text("{}")
    (root / ".tmp_step_00000040").mkdir()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000010", "step_00000020"]
    assert find_checkpoint(tmp_path).name == "step_00000020"
    with pytest.raises(CheckpointError, match="incomplete"):
        find_checkpoint(root / "step_00000030")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find_checkpoint(tmp_path / "elsewhere")


def test_flops_per_token_counts_every_matmul_weight():
    cfg = _cfg("experiment=micro").model
    model = GPT(cfg)
    matmul = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("wte."))
    expected = 6 * matmul + 12 * cfg.n_layer * cfg.n_embd * cfg.max_seq_len
    assert flops_per_token(cfg, cfg.max_seq_len) == expected


def test_wandb_mode_follows_credentials(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"
    assert wandb_mode("disabled") == "disabled"


def test_wandb_falling_back_to_offline_says_so_once(monkeypatch, tmp_path, capsys):
    from train.config import LoggerConfig
    from train.metrics import Reporter

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for wandb, says in (("auto", True), ("offline", False)):
        run_dir = tmp_path / wandb
        run_dir.mkdir()
        reporter = Reporter(LoggerConfig(wandb=wandb, progress=False), run_dir, "r", {}, enabled=True,
                            resumed_step=0, kept_records=[], max_steps=1)
        reporter.close()
        notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("W&B offline")]
        assert len(notices) == int(says), notices
        assert (run_dir / "wandb").is_dir()


def test_fresh_run_refuses_to_overwrite_a_run(tmp_path):
    run_dir = tmp_path / "run"
    assert checkpoint_to_resume(_cfg(f"run_dir={run_dir}")) is None
    assert checkpoint_to_resume(_cfg(f"run_dir={run_dir}", "resume=auto")) is None  # nothing yet: fresh start
    done = run_dir / "checkpoints" / "step_00000005"
    done.mkdir(parents=True)
    (done / MARKER).write_text("{}")
    with pytest.raises(CheckpointError, match="resume=auto"):
        checkpoint_to_resume(_cfg(f"run_dir={run_dir}"))
    assert checkpoint_to_resume(_cfg(f"run_dir={run_dir}", "resume=auto")) == done
    assert checkpoint_to_resume(_cfg(f"run_dir={run_dir}", f"resume={done}")) == done


@pytest.mark.parametrize(
    "precision, device, has_bf16, refused",
    [
        ("fp16", "cpu", False, True),  # whatever DeepSpeed says of this CPU (AVX-512 FP16 or not)
        ("fp16", "cuda", True, False),
        ("bf16", "cpu", False, False),  # bf16 runs on every CPU
        ("bf16", "cuda", False, True),  # an accelerator without bf16 (V100)
        ("bf16", "cuda", True, False),
        ("fp32", "cpu", False, False),
        ("fp32", "cuda", False, False),
    ],
)
def test_precision_policy_is_the_projects_not_the_hosts(precision, device, has_bf16, refused):
    assert (precision_refusal(precision, device, has_bf16) is not None) == refused


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU half of the policy")
def test_fp16_is_refused_on_every_cpu_and_bf16_accepted():
    with pytest.raises(ConfigError, match=r"deepspeed.precision=fp16 is not supported on this device \(cpu\)"):
        check_precision_supported("fp16")
    check_precision_supported("bf16")
    check_precision_supported("fp32")


def test_run_dir_that_cannot_be_written_is_one_line(tmp_path):
    from data.config import check_dir

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=r"run_dir='.*afile' is a file, not a directory"):
        check_dir(afile, "run_dir")
    with pytest.raises(ValueError, match=r"run_dir='.*afile/run/deeper' is under .*afile, which is a file"):
        check_dir(afile / "run" / "deeper", "run_dir")
    check_dir(tmp_path / "new" / "run", "run_dir")  # creatable
    check_dir(tmp_path, "run_dir")  # exists, writable
    assert not (tmp_path / "new").exists()  # the check writes nothing


def test_read_only_run_dir_and_parent_are_one_line(tmp_path):
    """As a user without write permission: root ignores permission bits, so a root test runs the
    check without the capabilities that let it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH)."""
    import shutil
    import subprocess
    import sys

    locked = tmp_path / "locked"
    (locked / "run").mkdir(parents=True)
    locked.chmod(0o555)
    (locked / "run").chmod(0o555)
    tmp_path.chmod(0o755)
    code = ("import sys; from data.config import check_dir\n"
            "for path in sys.argv[1:]:\n"
            "    try: check_dir(path, 'run_dir'); print('ok')\n"
            "    except ValueError as error: print(error)\n")
    command = [sys.executable, "-c", code, str(locked / "run"), str(locked / "new" / "run")]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
        caps = "-dac_override,-dac_read_search"
        command = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", *command]
    result = subprocess.run(command, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"run_dir='{locked / 'run'}': {locked / 'run'} is not writable: give run_dir a writable directory",
        f"run_dir='{locked / 'new' / 'run'}': {locked} is not writable: give run_dir a writable directory",
    ]


@pytest.mark.parametrize("preset", ["extend_pi", "extend_abf", "extend_yarn", "dropin_coca", "continue_origin"])
def test_continuation_presets_refuse_to_start_without_init_from_or_resume(preset, capsys):
    """Without a trained model to continue, these presets would silently train a new one from scratch."""
    from train.__main__ import main

    assert main([f"experiment={preset}", "logger=none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {preset} continues a trained model: give init_from=<run, checkpoint or Hugging Face "
                   "directory> (or resume=auto to continue this run)"]
    assert _cfg(f"experiment={preset}", "resume=auto").continues


@pytest.mark.parametrize("preset, base, scaling", [("extend_pi", 10000.0, ("linear", 4.0, 256)),
                                                   ("extend_yarn", 10000.0, ("yarn", 4.0, 256)),
                                                   ("extend_abf", 500000.0, ("none", 1.0, None))])
def test_extension_presets_continue_the_study_model_at_1024(preset, base, scaling):
    """The extend_* presets: the study model's shape at 1024 tokens, one RoPE recipe each, the
    study's tokens per step, a short re-warmup."""
    study, cfg = _cfg("experiment=study_origin"), _cfg(f"experiment={preset}", "init_from=runs/study/origin_s1")
    s = cfg.model.rope_scaling
    assert (cfg.model.max_seq_len, cfg.model.rope_base) == (1024, base)
    assert (s.type, s.factor, s.original_max_seq_len) == scaling
    for field in ("n_layer", "n_head", "n_embd", "ffn_hidden", "tie_embeddings", "attention"):
        assert getattr(cfg.model, field) == getattr(study.model, field)
    assert cfg.batch_size * cfg.model.max_seq_len == study.batch_size * study.model.max_seq_len
    assert cfg.optim.warmup_steps < cfg.max_steps < study.max_steps and cfg.data.sources == study.data.sources
