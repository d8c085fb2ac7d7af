"""`python -m eval` and `python -m eval.report` on a tiny checkpoint trained here by `python -m train`."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from data.documents import long_documents
from data.tasks import make_cases
from eval import report
from eval import results as result_files
from eval.__main__ import compose_config, main
from train.load import load_model

ROOT = Path(__file__).resolve().parents[1]
L0 = 32  # the micro experiment's training length


@pytest.fixture(scope="module")
def run(micro_run) -> Path:
    return micro_run  # the session's trained micro run (tests/conftest.py)


def evaluate(run: Path, out: Path, *overrides: str) -> dict:
    code = main([f"run={run}", f"out_dir={out}", "progress=false", "wandb.mode=disabled", *overrides])
    assert code == 0
    return result_files.load_results(out)


def independent_ppl(run: Path, length: int, n_docs: int, total: int) -> float:
    """exp(mean token loss) of non-overlapping `length` windows over the first `total` predictions
    of each document (EOS first), from the plain logits in float64."""
    model, cfg, tok = load_model(str(run))
    docs = long_documents(cfg.data, tok, min_tokens=total, n_docs=n_docs, split="test", seed=0)
    losses = []
    for d in docs:
        ids = [tok.eos_id] + d
        for i in range(0, total, length):
            with torch.no_grad():
                logits = model(torch.tensor([ids[i : i + length]]))[0].double()
            losses.append(F.cross_entropy(logits, torch.tensor(ids[i + 1 : i + length + 1]), reduction="none"))
    return torch.cat(losses).mean().exp().item()


@pytest.mark.slow
def test_ppl_at_training_length_and_non_overlapping_stride(run, tmp_path):
    results = evaluate(run, tmp_path, "task=ppl", f"ppl.lengths=[{L0},{4 * L0}]", f"ppl.stride={L0}", "ppl.n_docs=2")
    rows = {r["length"]: r for r in results["ppl"]["rows"]}
    # at the training length, with stride = window: non-overlapping windows over 4 * L0 predictions
    assert rows[L0]["tokens"] == 2 * 4 * L0
    assert rows[L0]["ppl"] == pytest.approx(independent_ppl(run, L0, 2, 4 * L0), rel=1e-5)
    assert rows[4 * L0]["ppl"] == pytest.approx(independent_ppl(run, 4 * L0, 2, 4 * L0), rel=1e-5)
    assert results["ppl"]["meta"]["step"] == 20 and results["ppl"]["meta"]["train_len"] == L0
    assert 1 < rows[L0]["ppl"] < 512  # trained: better than uniform over the 512-token vocabulary


@pytest.mark.slow
def test_all_tasks_with_sweep_report_and_wandb_offline(run, tmp_path):
    out = tmp_path / "eval"
    code = main([f"run={run}", f"out_dir={out}", "progress=false", "wandb.mode=offline",
                 "scalings=[none,dynamic:4]", f"ppl.lengths=[{L0},{8 * L0}]", "ppl.n_docs=1",
                 "passkey.lengths=[200,400]", "passkey.n_cases=2", "passkey.depths=[0.2,0.8]",
                 "passkey.modes=[teacher,generate]", f"attention.length={4 * L0}"])
    assert code == 0
    results = result_files.load_results(out)
    assert {(r["scaling"], r["length"]) for r in results["ppl"]["rows"]} == {
        (s, n) for s in ("none", "dynamic:4") for n in (L0, 8 * L0)}
    cases = results["passkey"]["cases"]
    assert len(cases) == 2 * 2 * 2 * 2  # scalings x lengths x depths x cases
    assert all(c["teacher_correct"] == c["generate_correct"] for c in cases)
    assert all(len(c["teacher_pred"]) == len(c["generate_pred"]) >= 5 for c in cases)
    assert {r["scaling"] for r in results["attention"]["rows"]} == {"none", "dynamic:4"}
    for name in ["ppl.png", "passkey.png", "passkey_depth.png", "attention_scores.png", "report.md", "ppl.csv"]:
        assert (out / name).stat().st_size > 0
    offline = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0

    twin = tmp_path / "twin"  # a second evaluated run to compare with (one run given twice is refused)
    shutil.copytree(out, twin)
    assert report.main([str(out), str(twin), "--out", str(tmp_path / "cmp")]) == 0
    md = (tmp_path / "cmp" / "compare_report.md").read_text()
    assert "| eval (origin) + dynamic:4 |" in md


@pytest.mark.slow
def test_explicit_file_is_evaluated_whole_whatever_its_name(run, tmp_path):
    """`sources=[{kind:files,path:".../test.jsonl"}]`: both documents, though the by-document
    test split of a 2-document file holds fewer (the name means nothing, the file is the corpus)."""
    from data.sources import document_split

    books = tmp_path / "books" / "test.jsonl"
    books.parent.mkdir()
    docs = [" ".join(f"word{i * 7 % 13} of book {b}" for i in range(60)) for b in range(2)]
    books.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert [document_split("test.jsonl", i, 0.05, 0.1) for i in range(2)].count("test") < 2
    results = evaluate(run, tmp_path / "out", "task=ppl", f"ppl.lengths=[{L0}]", "ppl.n_docs=2",
                       f'sources=[{{kind:files,path:"{books}"}}]')
    assert results["ppl"]["rows"][0]["tokens"] == 2 * L0
    assert results["ppl"]["meta"]["source"] == f"files:{books} (whole files)"


def test_missing_run_exits_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "eval", f"run={tmp_path / 'nope'}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1  # a missing file: unusable input (errors.py)
    assert done.stderr.strip() == f"error: run or checkpoint not found: {tmp_path / 'nope'}"


def check_one_line_error(run: Path, out: Path, capsys, overrides: list[str], message: str) -> None:
    code = main([f"run={run}", f"out_dir={out}", "progress=false", "wandb.mode=disabled", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and message in err and "\n" not in err


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task=perplexity"],
         "task='perplexity' is not one of ppl, passkey, recall, attention, position_loss, ruler, all"),
        (["scalings=[dynamic]"], "write type:factor"),
        (["tsk=ppl"], "Key 'tsk' not in 'EvalConfig'"),
        (["ppl.lengths=[0]"], "ppl.lengths: 0 must be >= 1"),
        (["model.rope_scaling.type=dyn"], "model.rope_scaling: scaling 'dyn:1.0': type 'dyn' is not one of"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path, capsys, overrides, message):
    check_one_line_error(tmp_path, tmp_path, capsys, overrides, message)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task=ppl", "ppl.lengths=[100000000]"], "documents with >= 100000000 tokens"),
        (["task=passkey", "passkey.lengths=[40]"], "passkey length 40 is shorter than the prompt"),
        (["task=attention", "attention.layers=[9]"], "layer 9 > model.n_layer=1"),
    ],
)
def test_bad_input_for_a_run_is_one_clear_line(run, tmp_path, capsys, overrides, message):
    check_one_line_error(run, tmp_path, capsys, overrides, message)


def test_empty_run_dir_is_a_clear_error(tmp_path, capsys):
    assert main([f"run={tmp_path}"]) == 1  # a bad checkpoint: unusable input
    assert capsys.readouterr().err.strip() == f"error: no complete checkpoint found in {tmp_path}"


@pytest.mark.slow
def test_single_scaling_from_model_rope_scaling(run, tmp_path):
    results = evaluate(run, tmp_path, "task=ppl", f"ppl.lengths=[{L0},{4 * L0}]", "ppl.n_docs=1",
                       "model.rope_scaling.type=dynamic", "model.rope_scaling.factor=4")
    rows = json.loads((tmp_path / "ppl.json").read_text())["rows"]
    assert [(r["scaling"], r["length"], r["stride"]) for r in rows] == [("dynamic:4", L0, L0),
                                                                       ("dynamic:4", 4 * L0, L0)]
    assert all(math.isfinite(r["ppl"]) for r in results["ppl"]["rows"])


def test_rope_scaling_override_composes():
    cfg = OmegaConf.to_object(compose_config(["run=x", "model.rope_scaling.type=yarn", "model.rope_scaling.factor=8"]))
    assert (cfg.model.rope_scaling.type, cfg.model.rope_scaling.factor) == ("yarn", 8.0)
    assert OmegaConf.to_object(compose_config(["run=x"])).model.rope_scaling.type is None


@pytest.mark.slow
@pytest.mark.parametrize("prompt_seed", ["run", "5", "fixed"])
def test_prompts_come_from_the_stream_recorded_in_meta(run, tmp_path, prompt_seed):
    """`prompt_seed=run` scores the run's own stream (its training seed), N seed N's, `fixed` the
    shared set; the JSON's meta says which, and the cases are exactly that stream's."""
    _, train_cfg, tok = load_model(str(run))
    results = evaluate(run, tmp_path, "task=passkey", "passkey.lengths=[200]", "passkey.n_cases=3",
                       f"prompt_seed={prompt_seed}")
    meta = results["passkey"]["meta"]
    expected = {"run": ("eval", train_cfg.seed), "5": ("eval", 5), "fixed": ("fixed", 0)}[prompt_seed]
    assert (meta["prompt_stream"], meta["prompt_seed"]) == expected
    cases = make_cases(tok, 200, 3, expected[1], prefix=[tok.eos_id], stream=expected[0])
    assert [(c["key"], c["depth"], c["tokens"]) for c in results["passkey"]["cases"]] == [
        (c.key, c.depth, len(c.tokens)) for c in cases]


def test_prompt_seed_must_be_run_fixed_or_a_seed(tmp_path, capsys):
    assert main([f"run={tmp_path}", "prompt_seed=first"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: prompt_seed='first' is not run, fixed or a non-negative integer")


def test_eval_composes_like_train_an_added_key_is_one_line(capsys):
    """The one composition (`data.cli.compose_tree` + `validated`): `+key` is rejected as train
    rejects it, before anything is loaded."""
    assert main(["run=x", "+passkey.n_case=5"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "n_case" in lines[0], lines


@pytest.fixture(scope="module")
def nope_run(micro_run, tmp_path_factory) -> Path:
    """The micro run read as NoPE (the same parameters, no rotation): a run whose design has no RoPE."""
    run = tmp_path_factory.mktemp("nope") / "micro"
    shutil.copytree(micro_run, run)
    for path in run.rglob("config.yaml"):
        # 'nope' quoted has as many bytes as origin: the checkpoint's recorded sizes still hold
        path.write_text(path.read_text().replace("attention: origin", "attention: 'nope'"))
    return run


@pytest.mark.slow
def test_a_rope_scaling_a_design_cannot_take_is_refused_as_generate_refuses_it(nope_run, tmp_path, capsys):
    from generate.__main__ import main as generate_main

    message = "model.rope_scaling.type='dynamic' with model.attention='nope': NoPE has no RoPE to scale"
    check_one_line_error(nope_run, tmp_path, capsys, ["model.rope_scaling.type=dynamic"], message)
    assert not (tmp_path / "ppl.json").exists()
    assert generate_main([f"run={nope_run}", "prompt=x", "rope_scaling=dynamic:4"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_sweep_keeps_the_temperature_where_the_design_has_no_rope(nope_run, tmp_path):
    """`dynamic:8+temp` on NoPE is evaluated as `+temp` (the temperature without the scaling), and
    `+temp` alone is that setting too: each once, the dropped RoPE part in a note."""
    evaluate(nope_run, tmp_path, "task=ppl", f"ppl.lengths=[{L0},{4 * L0}]", "ppl.n_docs=1",
             "scalings=[none,dynamic:8+temp,+temp]")
    ppl = json.loads((tmp_path / "ppl.json").read_text())
    assert [r["scaling"] for r in ppl["rows"]] == ["none", "none", "none+temp", "none+temp"]
    assert ppl["notes"] == ["NoPE has no RoPE: scaling dynamic:8+temp skipped"]
    by = {(r["scaling"], r["length"]): r["ppl"] for r in ppl["rows"]}
    assert by["none+temp", L0] == by["none", L0] and by["none+temp", 4 * L0] != by["none", 4 * L0]
