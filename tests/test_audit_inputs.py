"""The reliability audit's bad inputs (issue 63): each one a single `error:` line with its exit code
(errors.py: 1 unusable input, 2 bad usage), or a start that says what it did, where they used to
give a traceback, a hang or an unclear outcome. Most are decided before any training (`plan_start`,
the config's checks, the import of a Hugging Face directory, the launchers' settings), so they are
tested in-process on checkpoints written here without DeepSpeed, or on launchers that refuse before
they train."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from errors import EXIT_INPUT, EXIT_USAGE, ConfigError, exit_code
from model import GPT, ModelConfig
from run_checks import clean_env
from train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig(n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, max_seq_len=32, vocab_size=512)


def _checkpoint(run_dir: Path, model: GPT, step: int = 2, max_steps: int = 2, **train) -> Path:
    """A complete ZeRO-0 fp32 checkpoint of `model` as a run writes it (its module's state, its config,
    the COMPLETE marker with every file's size), without DeepSpeed."""
    ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    torch.save({"module": model.state_dict()}, ckpt / "mp_rank_00_model_states.pt")
    cfg = TrainConfig(model=model.cfg, max_steps=max_steps, run_dir=str(run_dir), **train)
    (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    files = {p.name: p.stat().st_size for p in ckpt.iterdir()}
    (ckpt / "COMPLETE").write_text(json.dumps({"step": step, "world_size": 1, "sequence": 1, "precision": "fp32",
                                               "zero_stage": 0, "files": files}))
    return ckpt


def _logits(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    out = model.eval()(tokens)
    return out[0] if isinstance(out, tuple) else out


# --- init_from a model without the modifiers this run adds, or with ones it drops ----------------
@pytest.fixture(scope="module")
def origin_run(tmp_path_factory) -> Path:
    """A plain Origin run's checkpoint (random weights: what matters is that they are carried)."""
    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("origin") / "run"
    _checkpoint(run, GPT(TINY))
    return run


@pytest.mark.parametrize("modifiers, neutral", [(("sinks",), True), (("ssmax",), False), (("qk_norm",), False),
                                                (("sinks", "ssmax", "qk_norm"), False)])
def test_init_from_adds_modifiers_at_their_neutral_start(origin_run, modifiers, neutral, tmp_path, capsys):
    """`init_from=<plain Origin run> model.sinks=true ...` was a `Missing key(s)` traceback: the added
    parameters now start neutral and the start says how, in one line. Sinks alone are neutral (the
    source's logits, bitwise); SSMax is neutral for the first query (one key) only; QK-norm is not."""
    from train.start import plan_start
    from train.trainer import _initial_state

    target = replace(TINY, **{name: True for name in modifiers})
    start = plan_start(TrainConfig(model=target, init_from=str(origin_run), run_dir=str(tmp_path / "new")))
    model = GPT(target)
    model.load_state_dict(_initial_state(start, model))  # strict: every parameter given
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"init_from {origin_run}"), said
    assert all(f"model.{name}" in said[0] for name in modifiers)
    assert ("not neutral" in said[0]) == ("qk_norm" in modifiers)
    source = GPT(TINY)
    source.load_state_dict(torch.load(next(origin_run.glob("checkpoints/*/mp_rank_00_model_states.pt")))["module"])
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.max_seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = _logits(model, tokens), _logits(source, tokens)
    assert torch.equal(ours, theirs) == neutral
    if modifiers == ("ssmax",):  # a query that sees one key attends to it whatever its scale
        assert torch.equal(ours[:, 0], theirs[:, 0])
    for layer in range(TINY.n_layer):
        attn = model.h[layer].attn
        if "sinks" in modifiers:
            assert torch.all(attn.sinks == -20.0)
        if "ssmax" in modifiers:
            assert torch.equal(attn.ssmax.detach(), torch.full((2,), 1 / math.log(32)))
        if "qk_norm" in modifiers:
            assert torch.all(attn.q_norm.weight == 1) and torch.all(attn.k_norm.weight == 1)


def test_init_from_a_run_with_modifiers_into_a_model_without_them_is_refused(tmp_path):
    """The reverse (`Unexpected key(s)` before): refused before anything starts, naming the parameters."""
    from train.start import plan_start

    run = tmp_path / "sinks_run"
    _checkpoint(run, GPT(replace(TINY, sinks=True, qk_norm=True)))
    with pytest.raises(ConfigError) as refused:
        plan_start(TrainConfig(model=TINY, init_from=str(run), run_dir=str(tmp_path / "new")))
    message = str(refused.value)
    assert exit_code(refused.value) == EXIT_USAGE and "\n" not in message
    for needle in ("model.sinks=true", "model.qk_norm=true", "h.*.attn.sinks", "h.*.attn.q_norm."):
        assert needle in message, message


# --- branches and the WSD schedule -------------------------------------------------------------------
def _train_main(capsys, *overrides: str) -> tuple[int, str]:
    """`python -m train` in this process (it refuses before DeepSpeed starts): its exit code and stderr."""
    from train.__main__ import main

    code = main(["logger=none", "logger.progress=false", *overrides])
    return code, capsys.readouterr().err


def _one_line(code: int, err: str, expected: int, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert code == expected and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _wsd_source(root: Path) -> tuple[Path, Path]:
    """A WSD run's checkpoints at steps 4 and 6 (its stable phase), the newer one damaged: cut short."""
    torch.manual_seed(0)
    model = GPT(TINY)
    train = dict(optim=replace(TrainConfig().optim, decay="wsd", decay_fraction=0.5, warmup_steps=1))
    older = _checkpoint(root, model, step=4, max_steps=20, **train)
    newer = _checkpoint(root, model, step=6, max_steps=20, **train)
    weights = newer / "mp_rank_00_model_states.pt"
    weights.write_bytes(weights.read_bytes()[:100])
    return older, newer


def test_branch_from_a_damaged_checkpoint_names_the_sound_one_as_branch_from(tmp_path, capsys):
    """It used to suggest `resume=<older>`, which a branch refuses."""
    older, newer = _wsd_source(tmp_path / "source")
    code, err = _train_main(capsys, f"run_dir={tmp_path / 'branch'}", f"branch_from={newer}", "resume=auto",
                            "max_steps=10", "optim.decay=wsd", "optim.warmup_steps=1")
    line = _one_line(code, err, EXIT_INPUT, f"checkpoint {newer} is corrupt",
                     f"branch_from={older} branches from step 4")
    assert "resume=" not in line
    assert not (tmp_path / "branch").exists()


def test_branch_from_a_checkpoint_at_max_steps_is_refused(tmp_path, capsys):
    """It exited 0 saying `checkpoint None`, and suggested evaluating a run with no checkpoint."""
    older, _ = _wsd_source(tmp_path / "source")
    code, err = _train_main(capsys, f"run_dir={tmp_path / 'branch'}", f"branch_from={older}", "resume=auto",
                            "max_steps=4", "optim.decay=wsd", "optim.warmup_steps=1")
    _one_line(code, err, EXIT_USAGE, f"branch_from={older} is at step 4", "max_steps=4: nothing to train",
              "set max_steps > 4")
    assert not (tmp_path / "branch").exists()


@pytest.mark.parametrize("fraction, steps, refused", [(0.05, 10, True), (0.1, 10, False), (0.02, 25, True),
                                                      (0.04, 25, False)])
def test_a_wsd_decay_that_rounds_to_no_step_is_refused(fraction, steps, refused, tmp_path, capsys):
    """0.05 of 10 steps rounded to a 0-step decay: the run trained at a constant learning rate, silently."""
    from train.config import wsd_decay_start

    overrides = ["experiment=micro", "optim.decay=wsd", f"optim.decay_fraction={fraction}", f"max_steps={steps}",
                 "optim.warmup_steps=1", f"run_dir={tmp_path / 'run'}", "--cfg", "job"]
    code, err = _train_main(capsys, *overrides)
    if refused:
        _one_line(code, err, EXIT_USAGE, f"decay ({fraction:g} of max_steps={steps}) rounds to 0 steps",
                  f"optim.decay_fraction >= {1 / steps:g}")
        optim = replace(TrainConfig().optim, decay="wsd", decay_fraction=1 / steps)
        assert wsd_decay_start(optim, steps) == steps - 1  # the fraction it suggests decays one step
    else:
        assert code == 0 and err == "", err


# --- Hugging Face directories -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A Llama directory saved by transformers (2 layers, max_position_embeddings 64, untied)."""
    from test_hf_import import llama_dir

    return llama_dir(tmp_path_factory.mktemp("hf") / "llama")


@pytest.mark.parametrize("override, fixed", [("model.arch=neox", "model.arch=llama"),
                                             ("model.n_layer=4", "model.n_layer=2")])
def test_an_override_at_its_default_that_disagrees_with_a_directory_is_refused(llama, override, fixed, tmp_path,
                                                                               capsys):
    """`model.arch=neox` (the schema's default) on a Llama directory exited 0, the override dropped."""
    code, err = _train_main(capsys, f"init_from={llama}", override, f"run_dir={tmp_path / 'run'}")
    _one_line(code, err, EXIT_USAGE, f"{override} disagrees with {llama / 'config.json'}", f"fix {fixed}",
              "drop the override")
    assert not (tmp_path / "run").exists()


def test_a_tied_directory_with_a_separate_head_says_which_is_used(llama, tok, tmp_path, capsys):
    """tie_word_embeddings=true beside an lm_head.weight was taken without a word: eval and train say
    the embedding is the head and the separate tensor is not read (as transformers ties it)."""
    from test_hf_import import llama_dir

    from hf.imports import read
    from train.load import load_model
    from train.start import plan_start
    from train.trainer import source_notes

    tied = llama_dir(tmp_path / "tied", sp=tok)  # untied, saved with its lm_head.weight, then said to be tied
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    want = [f"{tied / 'config.json'} has tie_word_embeddings=true: the LM head is the input embedding "
            "(model.embed_tokens.weight), and the directory's separate lm_head.weight is not read (as transformers "
            "ties it)"]
    assert list(read(tied).notes) == want and read(llama).notes == ()
    capsys.readouterr()
    model, _, _ = load_model(str(tied))
    assert capsys.readouterr().err.strip().splitlines() == want
    assert torch.equal(model.lm_head.weight, model.wte.weight)
    start = plan_start(TrainConfig(init_from=str(tied), run_dir=str(tmp_path / "run")))
    assert source_notes(start) == want


def test_a_run_past_the_directorys_length_without_rope_scaling_is_warned(llama, tmp_path):
    """max_position_embeddings=64 trained at model.max_seq_len=256 with RoPE as it was: a warning."""
    from model.config import RopeScaling
    from train.start import plan_start
    from train.trainer import source_notes

    def notes(**model) -> list[str]:
        cfg = TrainConfig(model=replace(ModelConfig(), **model), init_from=str(llama), run_dir=str(tmp_path / "r"))
        return source_notes(plan_start(cfg))

    (warning,) = notes(max_seq_len=256)
    assert warning.startswith(f"warning: {llama / 'config.json'} has max_position_embeddings=64 and this run trains "
                              "at model.max_seq_len=256 with no model.rope_scaling"), warning
    assert notes(max_seq_len=64) == notes(max_seq_len=256, rope_base=500000.0) == []
    assert notes(max_seq_len=256, rope_scaling=RopeScaling(type="linear", factor=4.0)) == []


def test_a_directory_without_config_json_is_named_so(llama, tmp_path, capsys):
    """It was called a directory with "no complete checkpoint found"."""
    from eval.__main__ import main as eval_main

    bare = Path(shutil.copytree(llama, tmp_path / "bare"))
    (bare / "config.json").unlink()
    want = f"{bare} holds model.safetensors but no config.json: a Hugging Face model directory needs its config.json"
    code, err = _train_main(capsys, f"init_from={bare}", f"run_dir={tmp_path / 'run'}")
    _one_line(code, err, EXIT_INPUT, f"init_from={bare}: {want}")
    code = eval_main([f"run={bare}", "task=ppl", "wandb.mode=disabled", f"out_dir={tmp_path / 'eval'}"])
    _one_line(code, capsys.readouterr().err, EXIT_INPUT, want)
    assert not (tmp_path / "run").exists() and not (tmp_path / "eval").exists()


def test_eval_of_a_directory_whose_tokenizer_outgrows_its_model_is_one_line(tok, tmp_path, capsys):
    """A tokenizer with ids past the model's vocab_size: an IndexError in the embedding, mid-evaluation."""
    from test_hf_import import llama_dir

    from eval.__main__ import main as eval_main

    small = llama_dir(tmp_path / "small", sp=tok, vocab=tok.vocab_size - 12)
    capsys.readouterr()  # transformers' progress while saving it
    code = eval_main([f"run={small}", "task=ppl", "wandb.mode=disabled", f"out_dir={tmp_path / 'eval'}"])
    _one_line(code, capsys.readouterr().err, EXIT_INPUT, f"the tokenizer {small / 'tokenizer.model'} has "
              f"{tok.vocab_size} tokens, more than the model's vocab_size={tok.vocab_size - 12}")
    assert not (tmp_path / "eval").exists()


# --- the launchers: every setting checked before anything trains; a failure ends with its cause ------
def _launch(script: str, runs: Path, *args: str, timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    """A launcher under a time limit (a hang fails the test instead of stalling it)."""
    return subprocess.run(["bash", f"launch/{script}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=clean_env(RUNS=str(runs), WANDB_MODE="disabled", **env))


def _refused(done: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    for needle in needles:
        assert needle in lines[0], lines[0]


def _family_files(tmp: Path) -> None:
    (tmp / "bad.yaml").write_text("doses: [10, 20\nseeds: {origin: 1}\n")
    (tmp / "list.yaml").write_text("- 10\n- 20\n")
    (tmp / "noseeds.yaml").write_text("doses: [10, 20]\nseeds: {origin: 2}\ntop_only: [alibi]\ndecay_fraction: 0.2\n")


@pytest.mark.parametrize("env, code, needles", [
    ({"FAMILY": "{tmp}/missing.yaml"}, EXIT_INPUT, ["FAMILY={tmp}/missing.yaml", "No such file"]),
    ({"FAMILY": "{tmp}/bad.yaml"}, EXIT_INPUT, ["FAMILY={tmp}/bad.yaml is not YAML (line 2)"]),
    ({"DOSES": "abc", "SEEDS": "1"}, EXIT_USAGE, ["DOSES='abc': 'abc' is not a whole number >= 1"]),
    ({"FRACTION": "2", "SEEDS": "1"}, EXIT_USAGE, ["FRACTION=2: optim.decay_fraction=2.0 must be in (0, 1]"]),
    ({"LENGTH": "4k", "SEEDS": "1"}, EXIT_USAGE, ["LENGTH=4k is not a whole number >= 1"]),
    ({"FIT_TO": "1e2", "SEEDS": "1"}, EXIT_USAGE, ["FIT_TO=1e2 is not a whole number >= 1"]),
])
def test_the_dose_launcher_checks_its_settings_before_training(env, code, needles, tmp_path):
    """Tracebacks from its inline snippets before (FAMILY, DOSES), or training on after the error (FRACTION=2)."""
    _family_files(tmp_path)
    given = {key: value.format(tmp=tmp_path) for key, value in env.items()}
    done = _launch("reproduce_dose.sh", tmp_path / "runs", **given)
    _refused(done, code, *(needle.format(tmp=tmp_path) for needle in needles))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("env, code, needle", [
    ({"FAMILY": "{tmp}/list.yaml"}, EXIT_INPUT, "is not a YAML mapping"),
    ({"DOSES": "10 10", "SEEDS": "1"}, EXIT_USAGE, "names a dose twice"),
    ({"FRACTION": "x", "SEEDS": "1"}, EXIT_USAGE, "FRACTION=x: not a number"),
    ({"DOSES": "10", "FRACTION": "0.05", "SEEDS": "1"}, EXIT_USAGE, "gives 0 decay steps"),
    ({"SEEDS": "1 two"}, EXIT_USAGE, "'two' is not a whole number"),
    ({}, EXIT_USAGE, "set SEEDS (or FAMILY"),
    ({"DESIGNS": "nosuch", "SEEDS": "1"}, EXIT_USAGE, "DESIGNS: unknown design nosuch"),
    ({"FAMILY": "{tmp}/noseeds.yaml", "DESIGNS": "origin alibi"}, EXIT_USAGE, "design alibi has no number of seeds"),
])
def test_the_dose_plan_refuses_each_bad_setting(env, code, needle, tmp_path, monkeypatch):
    """launch/dose_plan.py, which the launcher runs first, in this process."""
    from launch.dose_plan import PlanError, plan

    _family_files(tmp_path)
    with pytest.raises(PlanError) as refused:
        plan({key: value.format(tmp=tmp_path) for key, value in env.items()})
    assert refused.value.code == code and needle in str(refused.value), str(refused.value)


def test_the_dose_plan_of_the_family_file():
    """The pre-registered plan: doses 750, 1500, 3000 branching where the lower doses' decays start
    (600, 1200), a checkpoint every 600 steps, all six of the top dose's kept; seeds from the file."""
    from launch.dose_plan import plan

    lines = plan({"FAMILY": str(ROOT / "conf" / "study" / "dose.yaml")})
    assert lines[:5] == ["DOSES=(750 1500 3000)", "STARTS=(600 1200 2400)", "EVERY=600", "KEEP=6", "FRACTION=0.2"]
    assert "SEEDS_OF[alibi]='1 2 3 4'" in lines and "SEEDS_OF[origin]='1 2 3 4 5 6 7 8 9 10'" in lines


def test_the_dose_extension_plan_trains_the_depth_arm_at_one_dose_with_attention_statistics(tmp_path):
    """conf/study/dose_extension.yaml: chains to 12000 steps (branches where each lower dose's decay
    starts), the 4-layer variants at 1500 steps alone (index 1 of the doses), the attention task's
    overrides; a one_dose outside the doses is refused in one line."""
    from launch.dose_plan import PlanError, plan

    family = ROOT / "conf" / "study" / "dose_extension.yaml"
    lines = plan({"FAMILY": str(family)})
    assert lines[:4] == ["DOSES=(750 1500 3000 6000 12000)", "STARTS=(600 1200 2400 4800 9600)", "EVERY=600", "KEEP=21"]
    assert "ONE_DOSE_OF[origin_l4]=1" in lines and "ONE_DOSE_OF[coca_l4]=1" in lines
    assert not any(line.startswith("ONE_DOSE_OF[origin]") for line in lines)
    assert "ATTENTION='attention.scalings=[none] attention.head_lengths=[256,1024,4096]'" in lines
    assert "SEEDS_OF[coca]='1 2 3 4 5 6'" in lines
    with pytest.raises(PlanError, match="one_dose: origin_l4's 1500 is not one of the doses"):
        plan({"FAMILY": str(family), "DOSES": "10 20", "SEEDS": "1"})
    assert any(line.startswith("DOSES=(10 20)") for line in plan({"FAMILY": str(family), "DOSES": "10 20",
                                                                   "SEEDS": "1", "DESIGNS": "origin"}))


@pytest.mark.parametrize("script", ["reproduce_dose.sh", "reproduce_study.sh", "reproduce_designs.sh",
                                    "reproduce_perplexity.sh", "reproduce_extension.sh"])
@pytest.mark.parametrize("jobs", ["0", "1.5"])
def test_every_launcher_refuses_a_job_count_below_one_at_once(script, jobs, tmp_path):
    """JOBS=0 spun forever in `wait -n`."""
    done = _launch(script, tmp_path / "runs", timeout=60, JOBS=jobs, SEEDS="1")
    _refused(done, EXIT_USAGE, f"JOBS={jobs} is not a whole number >= 1")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script, env", [("train_multi_node.sh", {"NNODES": "0"}),
                                         ("train_multi_node.sh", {"NPROC_PER_NODE": "x"}),
                                         ("train_single_node.sh", {"NUM_GPUS": "0"}),
                                         ("reproduce_paper.sh", {"NGPU": "-2"})])
def test_the_training_launchers_refuse_a_count_below_one(script, env, tmp_path):
    done = _launch(script, tmp_path / "runs", timeout=60, **env)
    (name, value), = env.items()
    _refused(done, EXIT_USAGE, f"{name}={value} is not a whole number >= 1")


@pytest.mark.slow
@pytest.mark.parametrize("script, args, env, unfinished", [
    ("reproduce_dose.sh", [], {"DESIGNS": "origin", "SEEDS": "1", "DOSES": "4 8", "TRAIN": "model.bogus=1"},
     "origin_d4_s1"),
    ("reproduce_study.sh", ["model.bogus=1"], {"DESIGNS": "origin", "SEEDS": "1", "TEXT_ONLY": "0"}, "origin_s1"),
])
def test_a_launcher_whose_runs_all_fail_ends_with_the_cause(script, args, env, unfinished, tmp_path):
    """It ended with eval.dose's `the following arguments are required: runs` (no run had finished)."""
    done = _launch(script, tmp_path / "runs", *args, timeout=600, JOBS="1", **env)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-2000:]
    assert last.startswith(f"error: {unfinished} did not finish: model.bogus: Key 'bogus' not in"), last
    assert "the following arguments are required" not in done.stderr + done.stdout
