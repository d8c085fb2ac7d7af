"""`python -m eval task=ruler` and `task=position_loss`, and their report (`eval.long_context_report`
through `python -m eval.report`): the per-position loss against the model's own token losses, bad
input as one line (exit 2), and the commands end to end on a trained micro run, an imported
Llama-3-shaped Hugging Face directory and its export."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from eval import long_context_report, report
from eval import results as result_files
from eval.__main__ import main
from eval.position_loss import log_bins, position_losses, span_rows, spans
from model import GPT, flavor


def check_one_line_error(capsys, args: list[str], message: str) -> None:
    assert main([*args, "progress=false", "wandb.mode=disabled"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err


@pytest.mark.parametrize("overrides, message", [
    (["ruler.tasks=[niah_single_9]"], "ruler.tasks: 'niah_single_9' is not one of niah_single_1,"),
    (["ruler.tasks=[qa_1]"], "RULER's qa tasks need SQuAD / HotpotQA downloads"),
    (["ruler.cases=0"], "ruler.cases=0 must be >= 1"),
    (["ruler.budget=0"], "ruler.budget=0 must be >= 1"),
    (["position_loss.length=1"], "position_loss.length=1 must be >= 2"),
])
def test_bad_ruler_settings_are_one_line(tmp_path, capsys, overrides, message):
    check_one_line_error(capsys, [f"run={tmp_path}", "task=ruler", *overrides], message)


def test_position_losses_are_the_models_token_losses_averaged(single_thread):
    torch.manual_seed(0)
    model = GPT(flavor("tiny", n_layer=1, n_embd=32, n_head=2, ffn_hidden=64, vocab_size=64, max_seq_len=16)).eval()
    docs = [torch.randint(0, 64, (70,)).tolist() for _ in range(3)]
    curve = position_losses(model, docs, 40)
    by_hand = []
    for d in docs:
        with torch.no_grad():
            logits = model(torch.tensor([d[:40]]))[0].double()
        by_hand.append(torch.nn.functional.cross_entropy(logits, torch.tensor(d[1:41]), reduction="none").numpy())
    np.testing.assert_allclose(curve, np.mean(by_hand, axis=0), rtol=1e-5)
    with pytest.raises(ValueError, match="cannot give 80 positions"):
        position_losses(model, docs, 80)


def test_spans_double_from_the_training_length_and_bins_cover_every_position():
    assert spans(256, 2048) == [(0, 256), (256, 512), (512, 1024), (1024, 2048)]
    assert spans(256, 600) == [(0, 256), (256, 512), (512, 600)]
    rows = span_rows(np.arange(600, dtype=float), 256)
    assert rows[0] == {"start": 0, "length": 256, "loss": 127.5}
    centres, means = log_bins(np.ones(1000))
    assert np.all(means == 1) and centres[0] == 1 and np.all(np.diff(centres) > 0) and centres[-1] < 1000


def _ruler_result(label: str, scores: dict[tuple[str, int], list[float]], scaling: str = "none") -> dict:
    cases = [{"scaling": scaling, "task": t, "length": n, "tokens": n - 8, "haystack": 3, "answers": ["1234567"],
              "prediction": "x", "score": s} for (t, n), ss in scores.items() for s in ss]
    return {"meta": {"label": label, "train_len": 256, "run": label}, "cases": cases, "tasks": ["vt"],
            "budget": 8, "hops": 2, "chains": 1, "fewshot": False, "essay": None, "notes": []}


def test_report_tables_and_figures_across_runs_from_ruler_results_alone(tmp_path):
    runs = []
    for name, label, hits in (("a_s1", "origin", 9), ("b_s1", "alibi", 3)):
        eval_dir = tmp_path / name / "eval"
        result_files.save_json(eval_dir / "ruler.json", _ruler_result(label, {
            ("vt", 256): [1.0] * hits + [0.0] * (10 - hits), ("vt", 512): [0.5] * 10}))
        runs.append(tmp_path / name)
    out = tmp_path / "cmp"
    assert report.main([*map(str, runs), "--out", str(out)]) == 0  # RULER results only: no other task needed
    md = (out / "compare_long_context.md").read_text()
    assert "| origin | vt | 0.90 [" in md and "| alibi | vt | 0.30 [" in md
    assert "| origin | 0.900 (1) | 0.500 (1) |" in md
    rows = list(long_context_report.load(runs[0] / "eval").values())[0]["cases"]
    assert len(rows) == 20
    assert (out / "compare_ruler.png").stat().st_size > 0 and (out / "compare_ruler.csv").read_text().count("\n") == 5


def _scored(label: str, train_len: int, scores: dict[int, dict[str, float]], scaling: str = "none") -> dict:
    """A ruler.json whose cells (task, length) each hold two cases averaging the given score."""
    cases = [{"scaling": scaling, "task": t, "length": n, "tokens": n - 8, "haystack": 3, "depth": [], "answers": ["x"],
              "prediction": "x", "score": s} for n, cells in scores.items() for t, v in cells.items()
             for s in (min(1.0, 2 * v), max(0.0, 2 * v - 1.0))]
    result = _ruler_result(label, {})
    result["meta"]["train_len"] = train_len
    return {**result, "cases": cases}


def test_rulers_average_per_length_and_effective_length_in_the_report_and_its_json(tmp_path):
    """The average over the tasks at each length (with their count), the 1x average (at the training
    length), the bar max(85.6%, 1x - margin) and the effective length (every length up to it at or
    above the bar), each worked out here from the cell scores."""
    from eval.ruler.summary import MARGIN, THRESHOLD

    strong = {256: {"vt": 1.0, "cwe": 0.9, "fwe": 0.95}, 512: {"vt": 0.9, "cwe": 0.85, "fwe": 0.9},
              1024: {"vt": 0.95, "cwe": 0.95, "fwe": 0.95}, 2048: {"vt": 0.5, "fwe": 0.4}}
    weak = {128: {"vt": 0.8, "fwe": 0.8}, 256: {"vt": 0.9, "fwe": 0.9}, 512: {"vt": 0.9, "fwe": 0.95}}
    runs = {"strong_s1": ("strong", 256, strong), "weak_s1": ("weak", 256, weak)}
    for name, (label, train_len, scores) in runs.items():
        result_files.save_json(tmp_path / name / "eval" / "ruler.json", _scored(label, train_len, scores))
    for name in runs:
        long_context_report.render_run(tmp_path / name / "eval")
    assert report.main([str(tmp_path / n) for n in runs] + ["--out", str(tmp_path / "cmp")]) == 0
    for path, (label, train_len, scores) in [(tmp_path / n / "eval" / "ruler_summary.json", runs[n]) for n in runs] + [
            (tmp_path / "cmp" / "compare_ruler_summary.json", runs["strong_s1"])]:
        saved = json.loads(path.read_text())
        assert (saved["threshold"], saved["margin"]) == (THRESHOLD, MARGIN) == (0.856, MARGIN)
        model = next(m for m in saved["models"] if m["label"] in ("none", label))
        averages = {n: sum(cells.values()) / len(cells) for n, cells in scores.items()}
        assert [(p["length"], p["tasks"]) for p in model["lengths"]] == [(n, len(c)) for n, c in scores.items()]
        np.testing.assert_allclose([p["average"] for p in model["lengths"]], list(averages.values()), atol=1e-12)
        bar = max(0.856, averages[train_len] - MARGIN)
        assert model["base_length"] == train_len and model["bar"] == pytest.approx(bar)
        passing = 0
        for n in sorted(averages):
            if averages[n] < bar:
                break
            passing = n
        assert model["effective_length"] == (passing or None)
    strong_model = json.loads((tmp_path / "strong_s1" / "eval" / "ruler_summary.json").read_text())["models"][0]
    assert strong_model["effective_length"] == 256  # 512's 0.883 passes RULER's 0.856 but not 0.95 - 0.05
    weak_model = json.loads((tmp_path / "weak_s1" / "eval" / "ruler_summary.json").read_text())["models"][0]
    assert weak_model["effective_length"] is None and weak_model["bar"] == 0.856  # 0.9 - 0.05 < 0.856; 128 under it
    md = (tmp_path / "strong_s1" / "eval" / "long_context.md").read_text()
    assert "| none | 0.950 (3) | 0.883 (3) | 0.950 (3) | 0.450 (2) | 0.950 at 256 | 0.900 | 256 |" in md
    assert "- Averages over different tasks at different lengths (none)" in md
    assert "| weak | 0.800 (2) | 0.900 (2) | 0.925 (2) |  |  | 0.900 at 256 | 0.856 | < 128 |" in (
        tmp_path / "cmp" / "compare_long_context.md").read_text()


@pytest.mark.slow
def test_ruler_and_position_loss_end_to_end_on_a_trained_run(micro_run, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main([f"run={micro_run}", f"out_dir={out}", "progress=false", "wandb.mode=disabled", "task=ruler",
                 "ruler.tasks=[niah_multikey_2,vt,fwe,niah_single_2]", "ruler.lengths=[700,1400]", "ruler.cases=2",
                 "ruler.budget=24", "ruler.hops=2", "ruler.fewshot=false", "scalings=[none,dynamic:4]"])
    assert code == 0
    result = json.loads((out / "ruler.json").read_text())
    cells = {(c["scaling"], c["task"], c["length"]) for c in result["cases"]}
    assert len(cells) == 2 * 4 * 2 and len(result["cases"]) == 2 * len(cells)
    assert all(c["tokens"] == c["length"] - 24 and 0 <= c["score"] <= 1 for c in result["cases"])
    assert all(len(c["depth"]) == (c["task"].startswith("niah")) for c in result["cases"])
    summary = json.loads((out / "ruler_summary.json").read_text())
    assert {m["label"]: [(p["length"], p["tasks"]) for p in m["lengths"]] for m in summary["models"]} == {
        s: [(700, 4), (1400, 4)] for s in ("none", "dynamic:4")}
    assert "| 1x | bar | effective length |" in (out / "long_context.md").read_text()
    assert result["meta"]["prompt_stream"] == "eval" and result["essay"] == "stdlib (test)"
    assert main([f"run={micro_run}", f"out_dir={out}", "progress=false", "wandb.mode=disabled",
                 "task=position_loss", "position_loss.length=256", "position_loss.n_docs=2"]) == 0
    loss = json.loads((out / "position_loss.json").read_text())
    assert [r["length"] for r in loss["rows"]] == [32, 64, 128, 256] and len(loss["curves"]["none"]) == 256
    for name in ("ruler.png", "ruler.csv", "position_loss.png", "long_context.md"):
        assert (out / name).stat().st_size > 0
    twin = tmp_path / "twin"  # a second evaluated run to compare with (one run given twice is refused)
    shutil.copytree(out, twin)
    assert report.main([str(out), str(twin), "--out", str(tmp_path / "cmp")]) == 0
    assert "| eval (origin) + dynamic:4 | vt |" in (tmp_path / "cmp" / "compare_long_context.md").read_text()

    capsys.readouterr()
    base = [f"run={micro_run}", f"out_dir={tmp_path / 'bad'}", "task=ruler"]
    check_one_line_error(capsys, [*base, "ruler.tasks=[vt]", "ruler.lengths=[100]"],
                         "ruler.lengths: vt at length 100: its prompt without haystack")
    check_one_line_error(capsys, [*base, "ruler.tasks=[vt]", "ruler.lengths=[1400]", "ruler.budget=2"],
                         "ruler.budget=2 is shorter than vt's answers at length 1400")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("A short essay. It has few words.")
    check_one_line_error(capsys, [*base, "ruler.tasks=[niah_single_2]", "ruler.lengths=[2000]",
                                  f'sources=[{{kind:files,path:"{tiny}"}}]'],
                         "the essay haystack needs 2000 words of text")


@pytest.mark.slow
def test_ruler_on_a_llama3_directory_and_on_an_export_in_one_command(tmp_path):
    """`python -m eval run=<dir>` on a Hugging Face directory (imported on the fly: Llama 3's shape,
    tokenizer and llama3 RoPE) and on this project's export of a run started from it."""
    from test_hf_journey import RUN, _run, llama_dir

    source = llama_dir(tmp_path / "model")
    run, export = tmp_path / "run", tmp_path / "export"
    _run("-m", "train", *RUN, "max_steps=1", "ckpt_every=1", "eval_every=1", f"init_from={source}",
         f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}")
    _run("-m", "train.export_hf", f"run={run}", f"out={export}")
    for directory in (source, export):
        out = tmp_path / f"eval_{directory.name}"
        _run("-m", "eval", f"run={directory}", f"out_dir={out}", "task=ruler", "ruler.tasks=[niah_single_1,vt]",
             "ruler.lengths=[768]", "ruler.cases=2", "ruler.budget=32", "scalings=[none,dynamic:2]",
             "progress=false", "wandb.mode=disabled")
        result = json.loads((out / "ruler.json").read_text())
        assert result["meta"]["trained_scaling"] == "llama3:4" and result["meta"]["run"] == str(directory)
        assert {c["scaling"] for c in result["cases"]} == {"none", "dynamic:2"} and len(result["cases"]) == 8
        assert all(c["tokens"] == 768 - 32 for c in result["cases"])
