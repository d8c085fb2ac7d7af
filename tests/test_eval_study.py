"""Recall scoring, and the seed report of `eval.report` (seed means, bootstrap intervals, the
pre-registered family, exploratory permutation tests) against hand computations."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from data.config import DataConfig, TokenizerConfig
from data.tasks import make_recall_cases
from data.tokenizer import get_tokenizer
from eval import aggregate, bar, report, seeds
from eval import results as result_files
from eval.recall import recall_accuracy, score_recall

VOCAB = 1024


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    cache = tmp_path_factory.mktemp("study_cache")
    return get_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=VOCAB, sample_docs=60), cache_dir=str(cache)))


class Oracle(torch.nn.Module):
    """Knows every case: its logits put the true next token first (or always `always`, if set)."""

    def __init__(self, cases, always: int | None = None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.next = {tuple(c.tokens[:-1]): c.tokens[1:] for c in cases}
        self.always = always

    def forward(self, idx: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        rows = []
        for sequence in idx.tolist():  # one row per case of the batch
            nxt = self.next[tuple(sequence)]
            target = [self.always] * len(nxt) if self.always is not None else nxt
            rows.append(torch.nn.functional.one_hot(torch.tensor(target), VOCAB).float())
        logits = torch.stack(rows)
        return logits[:, -logits_to_keep:] if logits_to_keep else logits


def test_recall_oracle_scores_one_and_a_silent_model_zero(tok):
    cases = make_recall_cases(tok, 300, 4, 5, seed=0, prefix=[tok.eos_id]) + make_recall_cases(tok, 500, 3, 5, seed=0)
    assert all(c.n_pairs >= 5 and len(c.tokens) <= c.length for c in cases)
    perfect = score_recall(Oracle(cases), cases, progress=False)
    assert recall_accuracy(perfect) == 1.0 and all(r["correct"] == r["queries"] == 5 for r in perfect)
    silent = score_recall(Oracle(cases, always=tok.eos_id), cases, progress=False)
    assert recall_accuracy(silent) == 0.0


def test_recall_cases_depend_on_seed_and_length_only(tok):
    a = make_recall_cases(tok, 400, 3, 4, seed=1)
    assert [c.tokens for c in a] == [c.tokens for c in make_recall_cases(tok, 400, 3, 4, seed=1)]
    assert [c.tokens for c in a] != [c.tokens for c in make_recall_cases(tok, 400, 3, 4, seed=2)]
    with pytest.raises(ValueError, match="shorter than 4 pairs and queries"):
        make_recall_cases(tok, 30, 1, 4, seed=1)


# ----------------------------------------------------------------------------- the seed report


def _seed_run(root: Path, name: str, label: str, config_id: str, seed: int, ppl_2x: float, passkey_hits: int,
              recall_right: int) -> Path:
    """A run's eval folder: ppl at 64 (10) and 128, 4 passkey cases at 64, recall 10 queries at 64."""
    meta = {"run": str(root / name), "label": label, "train_len": 64, "step": 10, "source": "stdlib",
            "seed": seed, "config_id": config_id}
    out = root / name / "eval"
    ppl = [{"scaling": "none", "length": n, "stride": 64, "nll": 1.0, "tokens": 1, "documents": 1, "loss": 1.0,
            "ppl": p} for n, p in [(64, 10.0), (128, ppl_2x)]]
    result_files.save_json(out / "ppl.json", {"meta": meta, "rows": ppl, "notes": []})
    cases = [{"scaling": "none", "length": 64, "tokens": 64, "depth": 0.5, "key": "1",
              "teacher_correct": i < passkey_hits, "teacher_pred": [1]} for i in range(4)]
    result_files.save_json(out / "passkey.json", {"meta": meta, "cases": cases, "modes": ["teacher"]})
    recall = [{"scaling": "none", "length": 64, "tokens": 64, "pairs": 9, "queries": 5, "correct": c, "pred": []}
              for c in (min(5, recall_right), max(0, recall_right - 5))]
    result_files.save_json(out / "recall.json", {"meta": meta, "cases": recall, "queries": 5})
    attention = [{"scaling": "none", "layer": 1, "max_score": float(seed), "min_score": -1.0, "std_score": 1.0,
                  "outlier_ratio": 0.0, "max_zscore": 2.0, "local_mass": 0.5}]
    result_files.save_json(out / "attention.json", {"meta": meta, "rows": attention, "length": 128, "sigma": 6.0,
                                              "window": 16})
    return root / name


def _csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


FAMILY = """metric: passkey
lengths: [64]
comparisons:
  - {a: coca, b: origin, scaling: none}
alpha: 0.05
adjust: holm
interval: cluster_bootstrap
bootstrap_resamples: 2000
test: exact_permutation_over_seeds
"""


def test_report_aggregates_runs_differing_only_in_seed(tmp_path):
    """5 seeds each, the two designs fully separated on every metric: the exact permutation p of 5
    vs 5 is then 2 / C(10, 5) = 2 / 252 (the observed labelling and its mirror)."""
    origin = [(11.0, 4, 10), (12.0, 3, 9), (13.0, 4, 8), (14.0, 4, 10), (15.0, 4, 9)]
    coca = [(16.0, 1, 2), (17.0, 0, 3), (18.0, 1, 1), (19.0, 1, 2), (20.0, 0, 3)]
    runs = [_seed_run(tmp_path, f"origin_s{s}", "origin", "A", s, *v) for s, v in enumerate(origin, 1)]
    runs += [_seed_run(tmp_path, f"coca_s{s}", "coca-slack", "B", s, *v) for s, v in enumerate(coca, 1)]
    family = tmp_path / "family.yaml"
    family.write_text(FAMILY)
    out = tmp_path / "report"
    assert report.main([str(r) for r in runs] + ["--out", str(out), "--family", str(family)]) == 0

    summary = {(r["metric"], r["label"], int(r["length"])): r for r in _csv(out / "seeds_summary.csv")}
    # origin ppl ratio at 2x: 1.1 .. 1.5 -> mean 1.3, sample sd sqrt(0.1 / 4) = 0.158
    cell = summary[("ppl_ratio", "origin", 128)]  # designs named by folder without _s<seed>
    assert float(cell["mean"]) == pytest.approx(1.3) and int(cell["n"]) == 5
    assert float(cell["sd"]) == pytest.approx(math.sqrt(0.1 / 4))
    assert 1.1 <= float(cell["low"]) < 1.3 < float(cell["high"]) <= 1.5  # a bootstrap mean of these seeds
    # passkey: 4/4, 3/4, 4/4, 4/4, 4/4 -> mean 0.95; recall 1, .9, .8, 1, .9 -> 0.92
    passkey = summary[("passkey", "origin", 64)]
    assert float(passkey["mean"]) == pytest.approx(0.95) and float(passkey["high"]) <= 1.0
    assert float(summary[("recall", "origin", 64)]["mean"]) == pytest.approx(0.92)
    assert float(summary[("ppl_ratio", "origin", 64)]["mean"]) == 1.0

    family_rows = _csv(out / "seeds_family.csv")
    assert len(family_rows) == 1 and (family_rows[0]["a"], family_rows[0]["b"]) == ("coca", "origin")
    # coca 0.25, 0, .25, .25, 0 -> 0.15; effect 0.15 - 0.95; Holm over a family of one leaves p
    assert float(family_rows[0]["diff"]) == pytest.approx(-0.8)
    assert float(family_rows[0]["p"]) == pytest.approx(2 / 252) == float(family_rows[0]["p_holm"])
    assert family_rows[0]["significant"] == "True"

    tests = {(r["metric"], int(r["length"])): r for r in _csv(out / "seeds_significance.csv")}
    assert ("passkey", 64) not in tests  # the family's cell is not repeated as exploratory
    ppl_test = tests[("ppl_ratio", 128)]  # replaces the Welch p: the exact permutation p
    assert {ppl_test["a"], ppl_test["b"]} == {"origin", "coca"}
    assert float(ppl_test["p"]) == pytest.approx(2 / 252) and ppl_test["significant"] == "True"
    assert float(tests[("recall", 64)]["p"]) == pytest.approx(2 / 252)

    values = _csv(out / "seeds_values.csv")
    assert {v["seed"] for v in values} == {"1", "2", "3", "4", "5"} and len({v["run"] for v in values}) == 10
    md = (out / "seeds_report.md").read_text()
    assert md.index("## Pre-registered comparisons") < md.index("## Exploratory")
    assert "| coca | origin | none | 64 | 5 | 5 | 0.15 | 0.95 | -0.800 [" in md
    assert "- 128: origin beats coca (-0.500 [" in md  # lower perplexity ratio is better
    assert "| 0.007937 | 0.007937 | yes |" in md
    assert "coca beats" not in md
    assert "| origin | 1 | 5 | 3 ± 1.6 |" in md  # attention max score 1 .. 5: sample SD 1.58
    for metric in aggregate.METRICS:
        assert (out / f"seeds_{metric}.png").stat().st_size > 0


def test_report_with_a_bad_family_file_exits_1(tmp_path):
    runs = [_seed_run(tmp_path, f"origin_s{s}", "origin", "A", s, 11.0, 4, 10) for s in (1, 2)]
    bad = tmp_path / "family.yaml"
    bad.write_text(FAMILY.replace("adjust: holm", "adjust: bonferroni"))
    assert report.main([str(r) for r in runs] + ["--out", str(tmp_path / "r"), "--family", str(bad)]) == 1


def test_report_without_replicates_writes_no_seed_tables(tmp_path):
    a = _seed_run(tmp_path, "o1", "origin", "A", 1, 11.0, 4, 10)
    b = _seed_run(tmp_path, "c1", "coca-slack", "B", 1, 15.0, 1, 2)
    assert report.main([str(a), str(b), "--out", str(tmp_path / "r")]) == 0
    assert not (tmp_path / "r" / "seeds_summary.csv").exists()
    assert (tmp_path / "r" / "compare_recall.csv").exists()


def test_seed_groups_are_named_by_run_folder_without_the_seed_or_by_label():
    meta = {"label": "coca-slack", "seed": 3}
    assert seeds.design_name(Path("docs/results/coca_strict_s3"), meta) == "coca_strict"
    assert seeds.design_name(Path("runs/c1"), meta) == "coca-slack"
    assert seeds.design_name(Path("runs/coca_s2"), meta) == "coca-slack"  # suffix is not its seed


def test_significance_compares_a_scaling_with_every_setup_as_trained():
    """Same-scaling pairs as before, plus each setup with a scaling against every setup as trained
    (here Origin + dynamic:8 vs CoCA as trained and vs Origin itself); never two different scalings."""
    setups = {("origin", "none"): [0.0, 0.1, 0.2], ("origin", "dynamic:8"): [1.0, 0.9, 0.8],
              ("coca", "none"): [0.5, 0.6, 0.7], ("coca", "dynamic:4"): [0.9, 1.0, 1.0]}
    cells = {("passkey", 512): {k: [np.array([v]) for v in values] for k, values in setups.items()}}
    tests = aggregate.significance(cells, aggregate.Bootstraps(cells, 1000))
    pairs = {(t["a"], t["scaling"], t["b"], t["scaling_b"]): t for t in tests}
    assert set(pairs) == {("origin", "none", "coca", "none"), ("origin", "dynamic:8", "origin", "none"),
                          ("origin", "dynamic:8", "coca", "none"), ("coca", "dynamic:4", "origin", "none"),
                          ("coca", "dynamic:4", "coca", "none")}
    # 1.0, 0.9, 0.8 vs 0.5, 0.6, 0.7: fully separated, 3 vs 3: p = 2 / 20 (the smallest possible)
    cross = pairs[("origin", "dynamic:8", "coca", "none")]
    assert cross["p"] == pytest.approx(0.1) and cross["diff"] == pytest.approx(0.3)
    assert not cross["significant"]
    assert "- 512: origin + dynamic:8 beats coca as trained (+0.300 [" in "\n".join(
        seeds._orderings([cross], [512], lower_is_better=False))


def test_attention_summary_uses_the_sample_sd():
    rows = [{"scaling": "none", "layer": 1, "max_score": v, "std_score": 0.0, "max_zscore": 0.0, "local_mass": 0.0}
            for v in (1.0, 2.0, 3.0)]
    runs = [("origin", {"attention": {"rows": [row]}}) for row in rows]
    (row,) = aggregate.attention_summary(runs)
    assert row["max_score"] == 2.0 and row["max_score_sd"] == pytest.approx(1.0)  # population SD: 0.816


def test_runs_group_by_their_config_under_this_schema_not_the_id_stored_at_evaluation(tmp_path):
    """Two seeds evaluated before and after the schema gained a field (stored ids differ; the older
    config.yaml lacks the field) are replicates; a run with another model is not; a folder without
    config.yaml keeps its stored id."""
    from omegaconf import OmegaConf

    from train.config import TrainConfig

    def config(seed: int, n_layer: int = 2, drop_doc_mask: bool = False) -> dict:
        cfg = OmegaConf.to_container(OmegaConf.structured(TrainConfig(seed=seed)))
        cfg["model"]["n_layer"] = n_layer
        if drop_doc_mask:
            del cfg["model"]["doc_mask"]
        return cfg

    runs = [_seed_run(tmp_path, "origin_s1", "origin", "old", 1, 11.0, 4, 10),
            _seed_run(tmp_path, "origin_s2", "origin", "new", 2, 12.0, 3, 9),
            _seed_run(tmp_path, "deep_s1", "origin", "new", 1, 12.0, 3, 9)]
    for run, cfg in zip(runs, [config(1, drop_doc_mask=True), config(2), config(1, n_layer=4)]):
        OmegaConf.save(OmegaConf.create(cfg), run / "config.yaml")
    loaded = [(run, run / "eval", result_files.load_results(run / "eval")) for run in runs]
    groups = seeds.seed_groups(loaded)
    assert {name: [run.name for run, _ in group] for name, group in groups.items()} == {
        "origin": ["origin_s1", "origin_s2"], "deep": ["deep_s1"]}
    bare = _seed_run(tmp_path / "bare", "origin_s3", "origin", "stored", 3, 11.0, 4, 10)
    assert seeds.setup_of(bare, {"config_id": "stored"}) == "stored"
    assert seeds.setup_of(runs[0] / "eval", {}) == seeds.setup_of(runs[1], {})  # an eval/ folder: its run's


# ----------------------------------------------------------------------------- the training bar


def _progress(run: Path, scores: list[float]) -> None:
    """The run's passkey_progress.md as bench.passkey_progress writes it: checkpoints every 250 steps."""
    lines = bar.table_header(60, 64)
    lines += [bar.table_row(f"{run.name}/step_{250 * (i + 1):08d}", -1.0, 0.5, s) for i, s in enumerate(scores)]
    (run / "eval" / bar.PROGRESS_FILE).write_text("\n".join(lines) + "\n")


def test_bar_progress_reads_the_table_it_writes(tmp_path):
    run = _seed_run(tmp_path, "origin_s1", "origin", "A", 1, 11.0, 4, 10)
    _progress(run, [0.0, 0.35, 0.9, 0.85])
    progress = bar.read_progress(run / "eval" / bar.PROGRESS_FILE)
    assert progress.steps == (250, 500, 750, 1000) and progress.scores == (0.0, 0.35, 0.9, 0.85)
    assert progress.first_at_bar == 750 and progress.final == 0.85 and not progress.passes  # the last one decides
    assert bar.read_progress(tmp_path / "missing.md") is None


def test_bar_command_says_each_run_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    """`python -m eval.bar` is a command: each run's final score and first step at the bar; a run
    without the table, a binary table (exit 1) and an unknown flag (exit 2) are one line each."""
    run = _seed_run(tmp_path, "origin_s1", "origin", "A", 1, 11.0, 4, 10)
    _progress(run, [0.0, 0.35, 0.9, 0.85])
    assert bar.main([str(run / "eval")]) == 0
    assert capsys.readouterr().out == f"{run / 'eval'}: final 0.85 (below the bar 0.9), first at the bar at step 750\n"
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / bar.PROGRESS_FILE).write_bytes(b"\x80\xff binary")
    for args, needle in (([str(tmp_path)], "no passkey progress table"),
                         ([str(tmp_path / "binary")], "is not a text file")):
        assert bar.main(args) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    with pytest.raises(SystemExit) as usage:
        bar.main(["--bogus", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert usage.value.code == 2 and len(err) == 1 and "unrecognized arguments: --bogus" in err[0]


def test_bar_only_report_keeps_the_runs_past_the_bar_and_labels_itself_exploratory(tmp_path):
    """origin 5 seeds past the bar, coca seeds 1-4 past and seed 5 below: the full report lists the
    bar per design; --bar-only drops coca_s5 (5 vs 4 seeds) and titles its family section post hoc."""
    runs = [_seed_run(tmp_path, f"origin_s{s}", "origin", "A", s, 11.0, 4, 10) for s in range(1, 6)]
    runs += [_seed_run(tmp_path, f"coca_s{s}", "coca-slack", "B", s, 16.0, 1, 2) for s in range(1, 6)]
    for run in runs:
        _progress(run, [0.2, 0.95, 1.0] if run.name != "coca_s5" else [0.0, 0.1, 0.4])
    family = tmp_path / "family.yaml"
    family.write_text(FAMILY)
    args = [str(r) for r in runs] + ["--family", str(family)]
    assert report.main(args + ["--out", str(tmp_path / "all")]) == 0
    md = (tmp_path / "all" / "seeds_report.md").read_text()
    assert md.index("## Pre-registered comparisons") < md.index("## The training bar") < md.index("## Exploratory")
    assert "| origin | 5 of 5 | - | 1: 500, 2: 500, 3: 500, 4: 500, 5: 500 |" in md
    assert "| coca | 4 of 5 | seed 5 (0.40) | 1: 500, 2: 500, 3: 500, 4: 500, 5: - |" in md
    bar_rows = _csv(tmp_path / "all" / "seeds_bar.csv")
    assert [r["passes"] for r in bar_rows].count("False") == 1

    assert report.main(args + ["--out", str(tmp_path / "past"), "--bar-only"]) == 0
    md = (tmp_path / "past" / "seeds_report.md").read_text()
    assert "## Pre-registered comparisons" not in md and "on the runs past the bar: exploratory" in md
    (row,) = _csv(tmp_path / "past" / "seeds_family.csv")
    assert (row["n_a"], row["n_b"]) == ("4", "5")
    assert "coca_s5" not in (tmp_path / "past" / "seeds_values.csv").read_text()


def test_bar_only_without_the_progress_table_is_one_line_and_an_empty_subset_writes_nothing(tmp_path, capsys):
    runs = [_seed_run(tmp_path, f"origin_s{s}", "origin", "A", s, 11.0, 4, 10) for s in (1, 2)]
    _progress(runs[0], [1.0])
    assert report.main([str(r) for r in runs] + ["--out", str(tmp_path / "r"), "--bar-only"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "passkey_progress.md" in err and "origin_s2" in err
    _progress(runs[1], [0.5])
    _progress(runs[0], [0.5])  # an empty subset is a result, not an error: said, nothing written
    assert report.main([str(r) for r in runs] + ["--out", str(tmp_path / "r"), "--bar-only"]) == 0
    assert "no run's final checkpoint reaches the bar" in capsys.readouterr().out
    assert not list((tmp_path / "r").glob("*"))
