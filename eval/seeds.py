"""The seed report: runs of one training setup with different seeds are replicates, grouped by
setup (`setup_of`); `seeds_report.md`, `seeds_*.csv` and `seeds_*.png` put the pre-registered
comparison family first (its statistics: `eval.aggregate`, `eval.stats`) and label everything
else exploratory."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from errors import UserError
from eval import aggregate, plots, stats
from eval.bar import BAR, PROGRESS_FILE, BarProgress
from eval.results import write_csv
from eval.tables import fmt, markdown, pivot_markdown


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
