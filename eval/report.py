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

import csv
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.cli import OneLineParser, exit_code
from data.config import DataError, check_dir
from errors import UserError, report_error
from eval import aggregate, long_context_report, plots, stats
from eval.bar import BAR, PROGRESS_FILE, BarProgress, read_progress

TASKS = ("ppl", "passkey", "recall", "attention")
PROFILES_FILE = "attention_profiles.npz"


# ----------------------------------------------------------------------------- files


def save_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, allow_nan=True))
    tmp.replace(path)
    return path


RESULT_LISTS = {"ppl": "rows", "passkey": "cases", "recall": "cases", "attention": "rows"}


def load_result(path: Path, task: str) -> dict:
    """One task's results, or a `DataError` naming the file when it is not what `python -m eval` writes."""
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); "
                        "delete it and rerun `python -m eval` for that run") from None
    except UnicodeDecodeError:
        raise DataError(f"{path} is not a text file; delete it and rerun `python -m eval` for that run") from None
    key = RESULT_LISTS[task]
    if not (isinstance(result, dict) and isinstance(result.get("meta"), dict) and "label" in result["meta"]
            and isinstance(result.get(key), list)):
        raise DataError(f"{path} is not a `python -m eval` {task} result (needs meta.label and a {key} list); "
                        "delete it and rerun `python -m eval` for that run")
    return result


def load_results(eval_dir: Path) -> dict[str, dict]:
    """The task results present in an eval directory, by task name."""
    return {t: load_result(eval_dir / f"{t}.json", t) for t in TASKS if (eval_dir / f"{t}.json").exists()}


def save_profiles(path: Path, profiles: dict[str, dict[int, np.ndarray]]) -> Path:
    np.savez_compressed(path, **{f"{label}|{layer}": a for label, p in profiles.items() for layer, a in p.items()})
    return path


def load_profiles(path: Path) -> dict[str, dict[int, np.ndarray]]:
    out: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    with np.load(path) as data:
        for key in data.files:
            label, layer = key.rsplit("|", 1)
            out[label][int(layer)] = data[key]
    return dict(out)


def write_csv(path: Path, rows: Sequence[dict]) -> Path:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


# ----------------------------------------------------------------------------- tables


def fmt(x) -> str:
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"
    return str(x)


def markdown(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pivot(rows: Sequence[dict], label_key: str, value_key: str) -> tuple[list[int], dict[str, dict[int, float]]]:
    """{label: {length: value}} and the sorted lengths, keeping the order labels first appear in."""
    table: dict[str, dict[int, float]] = {}
    for r in rows:
        table.setdefault(r[label_key], {})[r["length"]] = r[value_key]
    lengths = sorted({r["length"] for r in rows})
    return lengths, table


def pivot_markdown(lengths: list[int], table: dict[str, dict[int, float]], first: str) -> str:
    header = [first] + [plots._k(x) for x in lengths]
    return markdown(header, [[label] + [vals.get(x, "") for x in lengths] for label, vals in table.items()])


def passkey_summary(cases: Sequence[dict], modes: Sequence[str]) -> list[dict]:
    """Accuracy per (label, length) for each scoring mode, plus how often the modes agree."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for c in cases:
        groups[(c["label"], c["length"])].append(c)
    rows = []
    for (label, length), group in groups.items():
        row = {"label": label, "length": length, "n": len(group)}
        for mode in modes:
            row[f"{mode}_accuracy"] = sum(c[f"{mode}_correct"] for c in group) / len(group)
        if len(modes) > 1:
            row["modes_agree"] = sum(len({c[f"{m}_correct"] for m in modes}) == 1 for c in group) / len(group)
        rows.append(row)
    return rows


def recall_summary(cases: Sequence[dict]) -> list[dict]:
    """Accuracy per (label, length): right answers over all queries of its cases."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for c in cases:
        groups[(c["label"], c["length"])].append(c)
    return [{"label": label, "length": length, "n": len(group), "pairs": group[0]["pairs"],
             "accuracy": sum(c["correct"] for c in group) / sum(c["queries"] for c in group)}
            for (label, length), group in groups.items()]


def depth_bins(depths: Sequence[float]) -> list[float]:
    """The depths themselves for a sweep (few distinct values), otherwise 5 equal bins' centres."""
    distinct = sorted(set(depths))
    return distinct if len(distinct) <= 10 else [0.1, 0.3, 0.5, 0.7, 0.9]


def depth_grid(cases: Sequence[dict], mode: str) -> tuple[list[int], list[float], np.ndarray]:
    """Accuracy by depth x length (NaN where no case fell)."""
    lengths = sorted({c["length"] for c in cases})
    bins = depth_bins([c["depth"] for c in cases])
    hits = np.zeros((len(bins), len(lengths)))
    counts = np.zeros_like(hits)
    for c in cases:
        i = int(np.argmin([abs(c["depth"] - b) for b in bins]))
        j = lengths.index(c["length"])
        hits[i, j] += c[f"{mode}_correct"]
        counts[i, j] += 1
    with np.errstate(invalid="ignore"):
        return lengths, bins, hits / counts


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
        md += _notes(a)
        written["attention"] = [write_csv(out_dir / f"{stem}attention.csv", a["rows"])]
        if a.get("profiles"):
            written["attention"].append(
                plots.save(plots.attention_figure(a["profiles"], train_len, design),
                           out_dir / f"{stem}attention_scores.png")
            )
    md_path = out_dir / f"{stem}report.md"
    md_path.write_text(_header(results, prefix) + "\n".join(md))
    written["markdown"] = [md_path]
    return written


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
    if bar_only:
        loaded = _past_the_bar(loaded, progress)
        run_dirs = [run for run, _, _ in loaded]
        if not loaded:
            return {}
    labels = [next(iter(r.values()))["meta"]["label"] for _, _, r in loaded]
    if len(set(labels)) < len(labels):
        labels = [f"{run.name} ({label})" for (run, _, _), label in zip(loaded, labels)]
    merged: dict[str, dict] = {}
    for (_run, eval_dir, results), label in zip(loaded, labels):
        for task, result in results.items():
            r = _labelled(task, result, eval_dir, label)
            m = merged.setdefault(task, {"meta": r["meta"], "notes": [], "rows": [], "cases": [], "profiles": {}})
            m["rows"] += r.get("rows", [])
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


def _past_the_bar(loaded: list, progress: dict[Path, BarProgress | None]) -> list:
    """The loaded runs whose final checkpoint passes the bar; a `DataError` for a run without the
    table."""
    missing = [str(run) for run, _, _ in loaded if progress[run] is None]
    if missing:
        raise DataError(f"--bar-only needs each run's {PROGRESS_FILE} (`python -m bench.passkey_progress`); "
                        f"missing for {', '.join(missing)}")
    return [item for item in loaded if progress[item[0]].passes]


# ----------------------------------------------------------------------------- seeds


def design_name(run: Path, meta: dict) -> str:
    """The run folder's name without its `_s<seed>` suffix (`coca_strict_s3` -> `coca_strict`: the
    names conf/study/comparisons.yaml uses), or the design label where the folder has none."""
    match = re.fullmatch(rf"(.+)_s{meta.get('seed')}", run.name)
    return match.group(1) if match else meta["label"]


def setup_of(run: Path, meta: dict) -> str | None:
    """The run's training-setup id (`train.config.setup_id`) under this code's schema, from the
    config.yaml beside its results (a run directory, its eval/ folder's run, a published folder),
    so that runs evaluated before a schema change still group with later ones; else the id its
    evaluation stored."""
    from train.config import setup_id, to_train_config  # deferred: it imports torch

    for path in (run / "config.yaml", *([run.parent / "config.yaml"] if run.name == "eval" else [])):
        if path.is_file():
            try:
                return setup_id(to_train_config(OmegaConf.load(path)))
            except (UserError, OmegaConfBaseException, yaml.YAMLError):
                break  # a config this code cannot read: the stored id
    return meta.get("config_id")


def seed_groups(loaded: Sequence[tuple[Path, Path, dict]]) -> dict[str, list[tuple[Path, dict]]]:
    """Runs grouped by training setup (`setup_of`), named by `design_name` of their first run.

    Two setups with the same name are told apart by their first run's directory name. Runs of one
    setup that repeat a seed are not replicates: each then stands alone.
    """
    by_id: dict[str, list[tuple[Path, dict]]] = {}
    for i, (run, _, results) in enumerate(loaded):
        meta = next(iter(results.values()))["meta"]
        by_id.setdefault(setup_of(run, meta) or f"run {i}", []).append((run, results))
    groups = []
    for runs in by_id.values():
        seeds = [next(iter(r.values()))["meta"].get("seed") for _, r in runs]
        groups += [runs] if len(set(seeds)) == len(seeds) else [[run] for run in runs]
    names = [design_name(runs[0][0], next(iter(runs[0][1].values()))["meta"]) for runs in groups]
    return {(name if names.count(name) == 1 else f"{name} ({runs[0][0].name})"): runs
            for name, runs in zip(names, groups)}


SEED_TITLES = {"ppl_ratio": "Perplexity / perplexity at the training length",
               "passkey": "Passkey accuracy", "recall": "Recall accuracy"}
SEED_AXES = {"ppl_ratio": "perplexity ratio", "passkey": "passkey accuracy", "recall": "recall accuracy"}


def render_seeds(groups: dict[str, list[tuple[Path, dict]]], out_dir: Path, family: aggregate.Family,
                 progress: dict[Path, BarProgress | None] | None = None, bar_only: bool = False) -> list[Path]:
    """The seed report: the pre-registered family first (effect, interval, raw and Holm p), the
    smallest detectable differences and the training bar of every run, then everything else,
    labelled exploratory: CSV, Markdown, figures with bootstrap bands. `bar_only`: the runs are the
    post hoc subset past the bar, and the family's section says so."""
    rows, runs = [], []
    for name, group in groups.items():
        for run, results in group:
            seed = next(iter(results.values()))["meta"].get("seed")
            rows += aggregate.per_seed_values(name, seed, str(run), results)
            runs.append((name, results))
    cells = aggregate.collect(runs)
    boots = aggregate.Bootstraps(cells, family.resamples)
    summary = aggregate.summarise(cells, boots)
    registered = aggregate.family_tests(cells, boots, family)
    power = aggregate.detectable(registered, family)
    design_lens = {name: next(iter(group[0][1].values()))["meta"]["train_len"] for name, group in groups.items()}
    tests = aggregate.significance(cells, boots, family, design_lens)
    attention = aggregate.attention_summary(runs)
    train_lens = set(design_lens.values())
    train_len = train_lens.pop() if len(train_lens) == 1 else None
    seeds = ", ".join(f"{name}: {len(group)}" for name, group in groups.items())
    counts = ", ".join(f"{m} {c}" for m, c in _case_counts(rows).items() if m != "ppl_ratio")
    md = ["# Seed-aggregated comparison", "", f"Seeds per design: {seeds}. "
          + (f"Cases per seed and cell: {counts}; the" if counts else "The")
          + " perplexity ratio is one value per seed.", ""]
    md += _family_markdown(registered, power, family, bar_only)
    bar = _bar_rows(groups, progress or {})
    if bar:
        md += _bar_markdown(bar)
    md += ["## Exploratory (not pre-registered; unadjusted)", "",
           "Everything in this section is exploratory: no correction for the many comparisons, so a "
           "p < 0.05 here is a lead, not a finding. Cells: seed mean [95% cluster-bootstrap interval] "
           f"({family.resamples} resamples of seeds, then cases within seed). Pairs: difference of seed "
           "means (a - b) with its interval and the exact permutation p over seeds; every pair is in "
           "`seeds_significance.csv`.", ""]
    tables = {"values": rows, "summary": summary, "family": registered, "power": power, "significance": tests}
    if bar:
        tables["bar"] = bar
    written = [write_csv(out_dir / f"seeds_{name}.csv", table) for name, table in tables.items()]
    for metric in aggregate.METRICS:
        here = [r for r in summary if r["metric"] == metric]
        if not here:
            continue
        lengths = sorted({r["length"] for r in here})
        table: dict[str, dict[int, str]] = {}
        for r in here:
            table.setdefault(r["label"], {})[r["length"]] = _interval(r["mean"], r["low"], r["high"])
        md += [f"### {SEED_TITLES[metric]}", "", pivot_markdown(lengths, table, "model / scaling"), ""]
        pairs = [t for t in tests if t["metric"] == metric]
        md += [f"Exploratory differences at p < {aggregate.ALPHA} (exact permutation, unadjusted; "
               f"{len(pairs)} pairs tested, {_floor_note(pairs)}):", ""]
        md += _orderings([t for t in pairs if t["significant"]], lengths, metric in aggregate.LOWER_IS_BETTER)
        md += [""]
        reference = plots.PAPER_PPL_RATIOS if metric == family.metric == "ppl_ratio" else None  # its study
        figure = plots.bands_figure(here, SEED_TITLES[metric], SEED_AXES[metric], train_len,
                                    unit_range=metric != "ppl_ratio", reference=reference)
        written.append(plots.save(figure, out_dir / f"seeds_{metric}.png"))
    if attention:
        keys = list(aggregate.ATTENTION_STATS)
        md += ["### Attention statistics (mean ± sample SD over seeds)", "",
               markdown(["model / scaling", "layer", "seeds"] + keys,
                        [[r["label"], r["layer"], r["n"]] + [_mean_sd(r[k], r[f"{k}_sd"]) for k in keys]
                         for r in attention]), ""]
        written.append(write_csv(out_dir / "seeds_attention.csv", attention))
    md_path = out_dir / "seeds_report.md"
    md_path.write_text("\n".join(md))
    return written + [md_path]


def _family_markdown(rows: Sequence[dict], power: Sequence[dict], family: aggregate.Family,
                     bar_only: bool = False) -> list[str]:
    level = family.alpha / family.size
    if bar_only:
        md = [f"## The family's comparisons (`{_shown(family.path)}`) on the runs past the bar: exploratory", "",
              f"Only the runs whose final checkpoint reaches passkey {BAR} at the training length "
              "(`--bar-only`). The subset was chosen after the results, so nothing in this report is a "
              "pre-registered finding: the tests and Holm's adjustment are computed as for the "
              "family, for comparison with the full analysis.", ""]
    else:
        md = [f"## Pre-registered comparisons (`{_shown(family.path)}`)", ""]
    resampled = ("seeds within each design, each one value" if family.metric == "ppl_ratio"
                 else "seeds within each design, then cases within each drawn seed")
    md += [f"{SEED_TITLES[family.metric]}, a vs b (under one scaling, or a's vs b's), {family.size} tests. "
           "Effect: difference of seed means (a - b) with its 95% cluster-bootstrap interval "
           f"({family.resamples} resamples: {resampled}). "
           "p: exact two-sided permutation test over seeds. Holm: adjusted over the whole family "
           f"(cells not tested count as p = 1); significant: Holm p < {family.alpha}.", ""]
    body = []
    for r in rows:
        if r["tested"]:
            body.append([r["a"], r["b"], _scalings(r), plots._k(r["length"]), r["n_a"], r["n_b"], r["mean_a"],
                         r["mean_b"], _effect(r["diff"], r["low"], r["high"]), r["p"], r["p_holm"],
                         "yes" if r["significant"] else "no"])
        else:
            body.append([r["a"], r["b"], _scalings(r), plots._k(r["length"]), r["n_a"], r["n_b"], "", "", "",
                         "not tested", "", "no"])
    md += [markdown(["a", "b", "scaling", "length", "seeds a", "seeds b", "mean a", "mean b",
                     "effect [95% CI]", "p", "p (Holm)", "significant"], body), ""]
    md += ["### Smallest detectable difference", "",
           f"Per comparison and length: the difference of seed means detected with 80% power at the level "
           f"of Holm's first step ({family.alpha} / {family.size} = {level:.2g}, two-sided), by the normal "
           "approximation with that cell's pooled seed SD. Where the "
           "smallest p the exact test can give with these seeds is above that level, no difference of "
           "any size can be significant in this family.", ""]
    body = [[r["a"], r["b"], _scalings(r), plots._k(r["length"]), r.get("n_a", ""), r.get("n_b", ""),
             r.get("pooled_sd", ""),
             r.get("detectable", ""), r.get("smallest_p", ""),
             ("yes" if r["smallest_p"] <= level else "no") if "smallest_p" in r else ""] for r in power]
    md += [markdown(["a", "b", "scaling", "length", "seeds a", "seeds b", "pooled seed SD", "detectable difference",
                     "smallest possible p", f"can reach {level:.2g}"], body), ""]
    return md


def _bar_rows(groups: dict[str, list[tuple[Path, dict]]], progress: dict[Path, BarProgress | None]) -> list[dict]:
    """Per run with a bar table: its design, seed, first step at the bar and final bar score."""
    rows = []
    for name, group in groups.items():
        for run, results in group:
            bar = progress.get(run)
            if bar is not None:
                rows.append({"group": name, "seed": next(iter(results.values()))["meta"].get("seed"), "run": str(run),
                             "first_at_bar": bar.first_at_bar, "final_step": bar.steps[-1], "final": bar.final,
                             "passes": bar.passes})
    return rows


def _bar_markdown(rows: Sequence[dict]) -> list[str]:
    """The bar per design (runs past it at their final checkpoint) and per run."""
    designs = list(dict.fromkeys(r["group"] for r in rows))
    md = ["## The training bar", "",
          f"Passkey accuracy at the training length on the bar's own cases (`{PROGRESS_FILE}`, disjoint from "
          f"the evaluation's), per checkpoint: a run is past the bar when its final checkpoint scores at "
          f"least {BAR}. A run below it has not learned to retrieve at the training length, so its "
          "extrapolation cells measure that, not extrapolation.", ""]
    body = []
    for design in designs:
        here = [r for r in rows if r["group"] == design]
        below = ", ".join(f"seed {r['seed']} ({r['final']:.2f})" for r in here if not r["passes"])
        body.append([design, f"{sum(r['passes'] for r in here)} of {len(here)}", below or "-",
                     ", ".join(f"{r['seed']}: {r['first_at_bar'] or '-'}" for r in here)])
    md += [markdown(["design", "past the bar", "below it (final score)", "seed: first step at the bar"], body), ""]
    return md


def _scalings(row: dict) -> str:
    """A family row's scaling, or `a's vs b's` where the two sides differ."""
    return row["scaling"] if row["scaling"] == row["scaling_b"] else f"{row['scaling']} vs {row['scaling_b']}"


def _shown(path: Path) -> str:
    """A path relative to the working directory where it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _case_counts(rows: Sequence[dict]) -> dict[str, str]:
    """Per metric the case counts per seed and cell seen (`16`, or `16-100` where they vary)."""
    out = {}
    for metric in aggregate.METRICS:
        counts = {r["cases"] for r in rows if r["metric"] == metric}
        if counts:
            out[metric] = str(min(counts)) if len(counts) == 1 else f"{min(counts)}-{max(counts)}"
    return out


def _floor_note(pairs: Sequence[dict]) -> str:
    """How many of the pairs could reach p < ALPHA at all with their seed counts."""
    able = sum(stats.smallest_p(t["n_a"], t["n_b"]) < aggregate.ALPHA for t in pairs)
    return f"{able} of them with seeds enough to reach p < {aggregate.ALPHA} at all"


def _interval(mean: float, low: float, high: float) -> str:
    return fmt(mean) if math.isnan(low) else f"{mean:.3g} [{low:.3g}, {high:.3g}]"


def _effect(diff: float, low: float, high: float) -> str:
    return f"{diff:+.3f}" if math.isnan(low) else f"{diff:+.3f} [{low:+.3f}, {high:+.3f}]"


def _mean_sd(mean: float, sd: float) -> str:
    return fmt(mean) if math.isnan(sd) else f"{mean:.3g} ± {sd:.2g}"


def _orderings(tests: Sequence[dict], lengths: Sequence[int], lower_is_better: bool) -> list[str]:
    """One line per length: `a beats b (effect [interval], p)` for each pair given (under the same
    scaling, or a setup with a scaling against one as trained)."""
    lines = []
    for length in lengths:
        here = [t for t in tests if t["length"] == length]
        if not here:
            continue
        parts = []
        for t in here:
            a, b = t["a"], t["b"]
            scaling_b = t.get("scaling_b", t["scaling"])
            if scaling_b != t["scaling"]:
                a, b = f"{a} + {t['scaling']}", f"{b} as trained"
            better, worse = (a, b) if (t["diff"] < 0) == lower_is_better else (b, a)
            both = f" (both + {t['scaling']})" if scaling_b == t["scaling"] != "none" else ""
            effect = _effect(t["diff"], t["low"], t["high"])
            parts.append(f"{better} beats {worse}{both} ({effect}, p={t['p']:.2g})")
        lines.append(f"- {plots._k(length)}: " + "; ".join(parts))
    return lines or ["- none"]


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
