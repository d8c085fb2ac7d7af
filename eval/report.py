"""Tables and figures from evaluation results, for one run or compared across runs.

Each task's results live in `<run>/eval/<task>.json` (written by `python -m eval`); this module
turns them into CSV and Markdown tables and PNG figures. Comparison across runs:

    python -m eval.report runs/a runs/b runs/c [--out eval_report]

writes one table and one figure per task with a line per run and scaling. Runs of one training
setup with different seeds are replicates: the seed report (`seeds_report.md`, `seeds_*.csv`,
`seeds_*.png`) then puts the pre-registered comparison family first (`--family`, default
conf/study/comparisons.yaml) and labels everything else exploratory.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from data.cli import OneLineParser, exit_code
from data.config import DataError, check_dir
from errors import report_error
from eval import aggregate, long_context_report, plots
from eval.bar import BAR, PROGRESS_FILE, read_progress
from eval.results import PROFILES_FILE, distinct_runs, load_profiles, load_results, write_csv
from eval.seeds import render_seeds, seed_groups
from eval.tables import depth_grid, markdown, passkey_summary, pivot, pivot_markdown, recall_summary

# ----------------------------------------------------------------------------- one run


def label_rows(rows: Sequence[dict], prefix: str = "") -> list[dict]:
    """Rows with a `label`: the scaling, after a run prefix when comparing runs."""
    out = []
    for r in rows:
        scaling = r["scaling"]
        label = scaling if not prefix else (prefix if scaling == "none" else f"{prefix} + {scaling}")
        out.append({"label": label, **r})
    return out


def render(results: dict[str, dict], out_dir: Path, prefix: str = "", stem: str = "") -> dict[str, list[Path]]:
    """Tables (CSV, Markdown) and figures for the given task results; returns written files by task.

    `results[task]["rows"]` may already hold rows from several runs (labelled with `label`).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[Path]] = {}
    md: list[str] = []
    train_len = _train_len(results)
    design = None if prefix else _design(results)  # one run: its labels are scalings of one design
    if "ppl" in results:
        rows = results["ppl"]["rows"]
        lengths, table = pivot(rows, "label", "ppl")
        md += ["## Perplexity (sliding window)", "", pivot_markdown(lengths, table, "model / scaling"), ""]
        md += _notes(results["ppl"])
        series = {k: (list(v), list(v.values())) for k, v in table.items()}
        written["ppl"] = [
            write_csv(out_dir / f"{stem}ppl.csv", rows),
            plots.save(plots.ppl_figure(series, train_len, design), out_dir / f"{stem}ppl.png"),
        ]
    if "passkey" in results:
        p = results["passkey"]
        modes = p["modes"]
        summary = passkey_summary(p["cases"], modes)
        lengths, table = pivot(summary, "label", f"{modes[0]}_accuracy")
        md += [f"## Passkey accuracy ({modes[0]})", "", pivot_markdown(lengths, table, "model / scaling"), ""]
        if len(modes) > 1:
            _, agree = pivot(summary, "label", "modes_agree")
            md += ["Fraction of cases where " + " and ".join(modes) + " agree:", "",
                   pivot_markdown(lengths, agree, "model / scaling"), ""]
        md += _notes(p)
        grids = {}
        for label in table:
            grids[label] = depth_grid([c for c in p["cases"] if c["label"] == label], modes[0])
        series = {k: (list(v), list(v.values())) for k, v in table.items()}
        written["passkey"] = [
            write_csv(out_dir / f"{stem}passkey.csv", summary),
            write_csv(out_dir / f"{stem}passkey_cases.csv", [_flat_case(c) for c in p["cases"]]),
            plots.save(plots.passkey_figure(series, train_len, design), out_dir / f"{stem}passkey.png"),
            plots.save(plots.depth_figure(grids), out_dir / f"{stem}passkey_depth.png"),
        ]
    if "recall" in results:
        r = results["recall"]
        summary = recall_summary(r["cases"])
        lengths, table = pivot(summary, "label", "accuracy")
        md += [f"## Recall accuracy ({r['queries']} queries per case)", "",
               pivot_markdown(lengths, table, "model / scaling"), ""]
        md += _notes(r)
        series = {k: (list(v), list(v.values())) for k, v in table.items()}
        written["recall"] = [
            write_csv(out_dir / f"{stem}recall.csv", summary),
            plots.save(plots.recall_figure(series, train_len, design), out_dir / f"{stem}recall.png"),
        ]
    if "attention" in results:
        a = results["attention"]
        keys = ["max_score", "min_score", "std_score", "outlier_ratio", "max_zscore", "local_mass"]
        md += [
            f"## Attention scores at {a['length']} tokens "
            f"(outliers: > row mean + {a['sigma']:g} std; local mass: nearest {a['window']} keys)",
            "",
            markdown(["model / scaling", "layer"] + keys,
                     [[r["label"], r["layer"]] + [r[k] for k in keys] for r in a["rows"]]),
            "",
        ]
        if a.get("heads"):
            md += ["## Sink share and entropy per layer, over heads (beyond: queries past the training length)", "",
                   markdown(["model / scaling", "length", "layer", "sink share", "max over heads", "beyond",
                             "entropy", "beyond"], head_summary(a["heads"])), ""]
        md += _notes(a)
        written["attention"] = [write_csv(out_dir / f"{stem}attention.csv", a["rows"])]
        if a.get("heads"):
            written["attention"].append(write_csv(out_dir / f"{stem}attention_heads.csv",
                                                  head_csv_rows(a["heads"], a["distance_bins"])))
        if a.get("profiles"):
            written["attention"].append(
                plots.save(plots.attention_figure(a["profiles"], train_len, design),
                           out_dir / f"{stem}attention_scores.png")
            )
    md_path = out_dir / f"{stem}report.md"
    md_path.write_text(_header(results, prefix) + "\n".join(md))
    written["markdown"] = [md_path]
    return written


def head_summary(heads: Sequence[dict]) -> list[list]:
    """Per model / scaling, length and layer: the sink share's mean and largest over heads, its mean
    beyond the training length, and the entropy's means (blank where no query is beyond)."""
    groups: dict[tuple, list[dict]] = {}
    for r in heads:
        groups.setdefault((r["label"], r["length"], r["layer"]), []).append(r)

    def mean(rows: list[dict], key: str) -> float | str:
        values = [r[key] for r in rows if r[key] is not None]
        return sum(values) / len(values) if values else ""

    return [[*key, mean(rows, "sink_share"), max(r["sink_share"] for r in rows), mean(rows, "sink_share_beyond"),
             mean(rows, "entropy"), mean(rows, "entropy_beyond")] for key, rows in groups.items()]


def head_csv_rows(heads: Sequence[dict], bins: Sequence[Sequence[int]]) -> list[dict]:
    """One CSV row per head: its largest logit in a column per distance bin (`max_logit_d<first>-<last>`)."""
    names = [f"max_logit_d{first}-{last}" for first, last in bins]
    return [{**{k: v for k, v in r.items() if k != "max_logit"}, **dict(zip(names, r["max_logit"]))} for r in heads]


def _flat_case(case: dict) -> dict:
    return {k: (" ".join(map(str, v)) if isinstance(v, list) else v) for k, v in case.items()}


def _notes(result: dict) -> list[str]:
    return [f"- {n}" for n in result.get("notes", [])] + ([""] if result.get("notes") else [])


def _train_len(results: dict[str, dict]) -> int | None:
    lens = {r["meta"]["train_len"] for r in results.values() if "meta" in r}
    return lens.pop() if len(lens) == 1 else None


def _design(results: dict[str, dict]) -> str | None:
    """The design of a single run's results (its meta label), for the figures' colours."""
    labels = {r["meta"]["label"] for r in results.values() if "meta" in r}
    return labels.pop() if len(labels) == 1 else None


def _header(results: dict[str, dict], prefix: str) -> str:
    metas = [r["meta"] for r in results.values() if "meta" in r]
    if not metas:
        return "# Evaluation report\n\n"
    m = metas[0]
    return (
        f"# Evaluation: {prefix or m['label']}\n\n"
        f"run `{m['run']}`, attention {m['label']}, training length {m['train_len'] or 'various'}, "
        f"step {m.get('step')}, evaluated on {m.get('source')}\n\n"
    )


def run_results(eval_dir: Path) -> dict[str, dict]:
    """A run's results with labelled rows (scaling only) and attention profiles loaded."""
    results = load_results(eval_dir)
    return {task: _labelled(task, r, eval_dir, "") for task, r in results.items()}


def _labelled(task: str, result: dict, eval_dir: Path, prefix: str) -> dict:
    result = dict(result)
    if task in ("passkey", "recall"):
        result["cases"] = label_rows(result["cases"], prefix)
    else:
        result["rows"] = label_rows(result["rows"], prefix)
    if "heads" in result:
        result["heads"] = label_rows(result["heads"], prefix)
    if task == "attention" and (eval_dir / PROFILES_FILE).exists():
        result["profiles"] = {
            (k if not prefix else (prefix if k == "none" else f"{prefix} + {k}")): v
            for k, v in load_profiles(eval_dir / PROFILES_FILE).items()
        }
    return result


# ----------------------------------------------------------------------------- comparison


def compare(run_dirs: Sequence[Path], out_dir: Path, family_path: Path = aggregate.FAMILY_FILE,
            bar_only: bool = False) -> dict[str, list[Path]]:
    """One table and one figure per task with a line per (run, scaling); with replicates, the seed
    report against the pre-registered family in `family_path`. `bar_only`: only the runs whose
    final checkpoint passes the training bar (`eval.bar`), a post hoc subset labelled so; nothing
    is written when none does."""
    family = aggregate.load_family(family_path)
    if bar_only:  # first: every table, RULER's and the loss by position's too, holds only these runs
        run_dirs = _past_the_bar(run_dirs)
        if not run_dirs:
            return {}
    extra, covered = long_context_report.compare(run_dirs, out_dir)  # RULER, loss by position
    loaded, progress = [], {}
    for run in run_dirs:
        eval_dir = run / "eval" if (run / "eval").is_dir() else run
        results = load_results(eval_dir)
        if not results and run in covered:
            continue
        if not results:
            raise FileNotFoundError(f"no evaluation results in {eval_dir} (run `python -m eval run={run}` first)")
        loaded.append((run, eval_dir, results))
        progress[run] = read_progress(eval_dir / PROGRESS_FILE)
    if not loaded:
        return extra
    labels = [next(iter(r.values()))["meta"]["label"] for _, _, r in loaded]
    if len(set(labels)) < len(labels):
        labels = [f"{run.name} ({label})" for (run, _, _), label in zip(loaded, labels)]
    merged: dict[str, dict] = {}
    for (_run, eval_dir, results), label in zip(loaded, labels):
        for task, result in results.items():
            r = _labelled(task, result, eval_dir, label)
            m = merged.setdefault(task, {"meta": r["meta"], "notes": [], "rows": [], "cases": [], "profiles": {},
                                         "heads": [], "distance_bins": []})
            m["rows"] += r.get("rows", [])
            m["heads"] += r.get("heads", [])
            m["distance_bins"] = max(m["distance_bins"], r.get("distance_bins", []), key=len)
            m["cases"] += r.get("cases", [])
            m["profiles"].update(r.get("profiles", {}))
            m["notes"] += [f"{label}: {n}" for n in r.get("notes", [])]
            for key in ("modes", "queries", "length", "sigma", "window"):
                if key in r:
                    m.setdefault(key, r[key])
    train_lens = {r["meta"]["train_len"] for _, _, results in loaded for r in results.values()}
    train_len = train_lens.pop() if len(train_lens) == 1 else None  # no single line to draw otherwise
    for m in merged.values():
        m["meta"] = {**m["meta"], "label": ", ".join(labels), "run": ", ".join(map(str, run_dirs)),
                     "train_len": train_len}
    written = {**render(merged, out_dir, prefix="comparison of " + ", ".join(labels), stem="compare_"), **extra}
    groups = seed_groups(loaded)
    if any(len(runs) > 1 for runs in groups.values()):
        written["seeds"] = render_seeds(groups, out_dir, family, progress, bar_only)
    return written


def _past_the_bar(run_dirs: Sequence[Path]) -> list[Path]:
    """The runs whose final checkpoint passes the bar; a `DataError` for a run without the table."""
    progress = {run: read_progress((run / "eval" if (run / "eval").is_dir() else run) / PROGRESS_FILE)
                for run in run_dirs}
    missing = [str(run) for run in run_dirs if progress[run] is None]
    if missing:
        raise DataError(f"--bar-only needs each run's {PROGRESS_FILE} (`python -m bench.passkey_progress`); "
                        f"missing for {', '.join(missing)}")
    return [run for run in run_dirs if progress[run].passes]


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0; errors.py's rule otherwise: 1 for an unusable input (a run without results, a
    malformed result file, an unwritable --out), 2 for a wrong command line (--out a file)."""
    parser = OneLineParser(prog="python -m eval.report", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or their eval/ folders)")
    parser.add_argument("--out", type=Path, default=Path("eval_report"), help="output folder")
    parser.add_argument("--family", type=Path, default=aggregate.FAMILY_FILE,
                        help="the pre-registered comparison family (default: conf/study/comparisons.yaml)")
    parser.add_argument("--bar-only", action="store_true",
                        help=f"only the runs whose {PROGRESS_FILE} ends at or above the bar ({BAR}): "
                             "a post hoc subset, reported as exploratory")
    args = parser.parse_args(argv)
    try:
        check_dir(args.out, "--out")
        distinct_runs(args.runs)
        written = compare(args.runs, args.out, args.family, args.bar_only)
    except (FileNotFoundError, ValueError) as e:
        return report_error(e, exit_code(e))
    if args.bar_only and not written:
        print(f"--bar-only: no run's final checkpoint reaches the bar ({BAR} in {PROGRESS_FILE}): nothing written")
    for task, paths in written.items():
        for p in paths:
            print(f"{task}: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
