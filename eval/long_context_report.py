"""Tables and figures of RULER (`ruler.json`) and the per-position loss (`position_loss.json`), for
one run (`python -m eval`: `<run>/eval/`) and across runs (`python -m eval.report`): CSV, a
Markdown file of their own (`long_context.md`, `compare_long_context.md`) and PNG figures, and
RULER's summary numbers (`eval.ruler.summary`: the average per length, the effective length) in
that Markdown and in `ruler_summary.json` (`compare_ruler_summary.json`).

Labels follow `eval.report`: a run's own results are labelled by scaling; across runs by the
run's design label (with its folder name where two runs share one), then ` + scaling`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eval import plots
from eval.position_loss import log_bins
from eval.results import RESULT_LISTS, load_result, result_file, save_json, write_csv
from eval.ruler import summary as ruler_summary
from eval.ruler.score import summary
from eval.tables import markdown

FILES = {task: (f"{task}.json", RESULT_LISTS[task]) for task in ("ruler", "position_loss")}


def load(eval_dir: Path) -> dict[str, dict]:
    """The RULER and position-loss results in an eval directory (plain or published), or a
    `DataError` naming a bad file."""
    found = {task: result_file(eval_dir, name) for task, (name, _) in FILES.items()}
    return {task: load_result(path, task) for task, path in found.items() if path is not None}


def _label(prefix: str, scaling: str) -> str:
    return scaling if not prefix else (prefix if scaling == "none" else f"{prefix} + {scaling}")


def _labelled(results: dict[str, dict], prefix: str) -> dict[str, dict]:
    out = {}
    for task, r in results.items():
        r = dict(r)
        key = FILES[task][1]
        r[key] = [{"label": _label(prefix, x["scaling"]), **x} for x in r[key]]
        if "curves" in r:
            r["curves"] = {_label(prefix, k): v for k, v in r["curves"].items()}
        r["train_lens"] = {x["label"]: r["meta"].get("train_len") for x in r[key]}
        out[task] = r
    return out


def _merge(parts: Sequence[dict[str, dict]]) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for results in parts:
        for task, r in results.items():
            m = merged.setdefault(task, {**r, FILES[task][1]: [], "curves": {}, "notes": [], "train_lens": {}})
            m[FILES[task][1]] += r[FILES[task][1]]
            m["curves"].update(r.get("curves", {}))
            m["train_lens"].update(r["train_lens"])
            m["notes"] += r.get("notes", [])
    return merged


def render(results: dict[str, dict], out_dir: Path, stem: str, train_len: int | None,
           design: str | None) -> dict[str, list[Path]]:
    """Write the tables and figures of labelled results; returns the files by task."""
    written: dict[str, list[Path]] = {}
    md: list[str] = []
    if "ruler" in results:
        r = results["ruler"]
        rows = summary(r["cases"])
        summaries = ruler_summary.summarize(rows, r["train_lens"])
        md += ruler_markdown(rows, r, summaries)
        written["ruler"] = [
            write_csv(out_dir / f"{stem}ruler.csv", rows),
            write_csv(out_dir / f"{stem}ruler_cases.csv",
                      [{k: (" | ".join(map(str, v)) if isinstance(v, list) else v) for k, v in c.items()}
                       for c in r["cases"]]),
            plots.save(ruler_figure(rows, train_len, design), out_dir / f"{stem}ruler.png"),
            save_json(out_dir / f"{stem}ruler_summary.json",
                      {"threshold": ruler_summary.THRESHOLD, "margin": ruler_summary.MARGIN, "models": summaries}),
        ]
    if "position_loss" in results:
        p = results["position_loss"]
        md += position_markdown(p)
        written["position_loss"] = [
            write_csv(out_dir / f"{stem}position_loss.csv", p["rows"]),
            plots.save(position_figure(p["curves"], train_len, design), out_dir / f"{stem}position_loss.png"),
        ]
    if md:
        path = out_dir / f"{stem}long_context.md"
        path.write_text("\n".join(md))
        written["long_context"] = [path]
    return written


def render_run(eval_dir: Path) -> dict[str, list[Path]]:
    """One run's RULER and position-loss tables and figures, beside its results."""
    results = load(eval_dir)
    if not results:
        return {}
    meta = next(iter(results.values()))["meta"]
    return render(_labelled(results, ""), eval_dir, "", meta.get("train_len"), meta["label"])


def compare(run_dirs: Sequence[Path], out_dir: Path) -> tuple[dict[str, list[Path]], set[Path]]:
    """RULER and position-loss tables and figures across runs (a line per run and scaling); returns
    the files written and the runs that had such results."""
    found = [(run, load(run / "eval" if (run / "eval").is_dir() else run)) for run in run_dirs]
    found = [(run, results) for run, results in found if results]
    if not found:
        return {}, set()
    labels = [next(iter(r.values()))["meta"]["label"] for _, r in found]
    if len(set(labels)) < len(labels):
        labels = [f"{run.name} ({label})" for (run, _), label in zip(found, labels)]
    merged = _merge([_labelled(results, label) for (_, results), label in zip(found, labels)])
    lens = {r["meta"]["train_len"] for _, results in found for r in results.values()}
    out_dir.mkdir(parents=True, exist_ok=True)
    return render(merged, out_dir, "compare_", lens.pop() if len(lens) == 1 else None, None), {run for run, _ in found}


# ----------------------------------------------------------------------------- tables


def ruler_markdown(rows: Sequence[dict], result: dict, summaries: Sequence[dict]) -> list[str]:
    """Score per (label, task) and length with its interval, then RULER's summary per label: the
    average over tasks per length, the 1x average, the bar and the effective length."""
    lengths = sorted({r["length"] for r in rows})
    table: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
    for r in rows:
        table[(r["label"], r["task"])][r["length"]] = f"{r['score']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
    budget = "RULER's per task" if result.get("budget") is None else f"{result['budget']} tokens"
    md = ["## RULER (synthetic tasks)", "",
          f"Score: RULER's string match (`all`: the share of the expected strings the greedy answer holds), "
          f"mean over cases [95% bootstrap interval]. Length: prompt + answer budget ({budget}), in the model's "
          f"tokens. VT: {result.get('hops')} hops, {result.get('chains')} chain(s); one-shot examples "
          f"{'on' if result.get('fewshot') else 'off'}; essays from {result.get('essay') or '-'}.", "",
          markdown(["model / scaling", "task"] + [plots._k(x) for x in lengths],
                   [[label, task] + [cells.get(x, "") for x in lengths] for (label, task), cells in table.items()]),
          "", *summary_markdown(summaries, lengths)]
    return md + [f"- {n}" for n in dict.fromkeys(result.get("notes", []))] + [""]


def summary_markdown(summaries: Sequence[dict], lengths: Sequence[int]) -> list[str]:
    """RULER's summary table: the average per length (with its task count), then the effective length."""
    def effective(s: dict) -> str:
        if s["effective_length"] is None:
            return f"< {plots._k(s['lengths'][0]['length'])}"
        return (">= " if s["effective_length"] == s["longest"] else "") + plots._k(s["effective_length"])

    rows = []
    for s in summaries:
        cells = {p["length"]: f"{p['average']:.3f} ({p['tasks']})" for p in s["lengths"]}
        rows.append([s["label"]] + [cells.get(x, "") for x in lengths]
                    + [f"{s['base_average']:.3f} at {plots._k(s['base_length'])}", f"{s['bar']:.3f}", effective(s)])
    mixed = [s["label"] for s in summaries if not s["same_tasks"]]
    return ["RULER's summary: the average of the task scores at each length (how many tasks in brackets), "
            "and the effective length, the longest length up to which every average stays at or above the bar: "
            f"RULER's {ruler_summary.THRESHOLD:.1%} threshold, or the model's own 1x average less "
            f"{ruler_summary.MARGIN:.2f} where that is higher (RULER's effective length uses the threshold alone; "
            "its averages are over 13 tasks, QA included).", "",
            markdown(["model / scaling"] + [plots._k(x) for x in lengths] + ["1x", "bar", "effective length"], rows),
            ""] + ([f"- Averages over different tasks at different lengths ({', '.join(mixed)}): a task skipped "
                    "at some lengths moves the average there.", ""] if mixed else [])


def position_markdown(result: dict) -> list[str]:
    """Mean loss per span of positions, one row per label."""
    spans = sorted({(r["start"], r["length"]) for r in result["rows"]})
    table: dict[str, dict[tuple[int, int], float]] = defaultdict(dict)
    for r in result["rows"]:
        table[r["label"]][(r["start"], r["length"])] = r["loss"]
    header = ["model / scaling"] + [f"{plots._k(a)}-{plots._k(b)}" for a, b in spans]
    return ["## Loss by position", "",
            f"Mean loss of the tokens at positions [start, end), documents read whole from their first token "
            f"({result.get('n_docs')} documents of at least {result.get('length')} tokens):", "",
            markdown(header, [[label] + [v.get(s, "") for s in spans] for label, v in table.items()]), ""]


# ----------------------------------------------------------------------------- figures


def _looks(labels: Sequence[str], design: str | None) -> dict[str, tuple[str, object, str]]:
    """Colour, line style and legend name per label: one run's scalings (`design`) or runs' colours."""
    styles = plots.scaling_styles([plots.scaling_of(label) if design is None else label for label in labels])
    if design is not None:
        color = plots.design_color(design)
        return {label: (color, styles[label], label if label != "none" else "as trained") for label in labels}
    colors = plots.run_colors(labels)
    return {label: (colors[label.partition(" + ")[0]], styles[plots.scaling_of(label)], label) for label in labels}


def ruler_figure(rows: Sequence[dict], train_len: int | None, design: str | None):
    """Score against length, one panel per task, a line (with its interval as a band) per label."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    looks = _looks(labels, design)
    fig, axes = plots.grid(len(tasks), plots.PANEL, legend_width=2.6)
    for ax, task in zip(axes, tasks):
        here = [r for r in rows if r["task"] == task]
        for label in labels:
            line = sorted((r["length"], r["score"], r["low"], r["high"]) for r in here if r["label"] == label)
            if not line:
                continue
            xs, ys, lo, hi = zip(*line)
            color, style, _ = looks[label]
            ax.plot(xs, ys, marker="o", markersize=4, color=color, linestyle=style)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
        plots._length_axis(ax, [r["length"] for r in here], train_len)
        plots._value_axis(ax, "score", log_y=False, unit_range=True)
        ax.set_title(task, fontsize=10)
    handles = [plots.Line2D([], [], marker="o", markersize=4, color=c, linestyle=s, label=n)
               for c, s, n in looks.values()]
    plots._figure_legend(fig, handles + plots._train_len_handle(train_len), title=design)
    fig.suptitle("RULER synthetic tasks: score against length (95% bands)")
    return fig


def position_figure(curves: dict[str, list[float]], train_len: int | None, design: str | None):
    """Mean loss against position (log2 axis), averaged over 8 geometric bins per doubling."""
    looks = _looks(list(curves), design)
    fig, (ax,) = plots.grid(1, (7.0, 4.2), legend_width=2.6)
    for label, curve in curves.items():
        color, style, _ = looks[label]
        ax.plot(*log_bins(np.asarray(curve)), color=color, linestyle=style, linewidth=1.2)
    ax.set_xscale("log", base=2)
    if train_len:
        ax.axvline(train_len, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("token position")
    ax.set_ylabel("mean loss (nats)")
    ax.grid(alpha=0.3)
    handles = [plots.Line2D([], [], color=c, linestyle=s, label=n) for c, s, n in looks.values()]
    plots._figure_legend(fig, handles + plots._train_len_handle(train_len), title=design)
    fig.suptitle("Loss by position (mean over documents, 8 bins per doubling)")
    return fig
