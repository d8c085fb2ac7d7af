"""PNG figures of the evaluation (matplotlib, no display needed).

Each `*_figure` function builds a Figure, so that tests can inspect it; `save` writes one. The
conventions that make figures comparable at a glance:
- one colour per design in every figure (`design_color`); seeds or heads of one design are shades
  of its colour, scalings sharing an axes differ by line style;
- several scalings or runs are laid out as a grid of at most three columns (`grid`), one panel
  per scaling, with one legend for the figure, outside the panels;
- accuracy axes run from 0 to 1 whatever the values.
"""

from __future__ import annotations

import io
import math
import re
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import to_hex, to_rgb  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogFormatter  # noqa: E402
from PIL import Image  # noqa: E402

from model.designs import DESIGNS  # noqa: E402

Series = Mapping[str, tuple[Sequence[int], Sequence[float]]]

DESIGN_COLORS = {
    **{key: design.colour for key, design in DESIGNS.items()},  # the registry's
    "text": "#7f7f7f",
    # the extension experiment's arms (conf/study/extension.yaml): one colour each, no fallback clash
    "continue_origin": "#8c564b",
    "dropin_coca": "#e377c2",
    "extend_pi": "#9467bd",
    "extend_yarn": "#bcbd22",
    "extend_abf": "#17becf",
}
FALLBACK_COLORS = ("#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#393b79", "#637939")
# a design's result label (`coca-slack`) and its label with an underscore name its key (`coca`)
DESIGN_ALIASES = {alias: key for key, d in DESIGNS.items() for alias in {d.label, d.label.replace("-", "_")} - {key}}
LINESTYLES = ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)))
SCALING_NAMES = {"linear": "linear (PI)", "ntk": "NTK", "dynamic": "dynamic NTK", "yarn": "YaRN"}
MAX_COLUMNS = 3
PANEL = (5.0, 3.6)  # inches per panel of a length plot
DPI = 120


# ----------------------------------------------------------------------------- names and colours


def design_of(label: str) -> str:
    """The design a label belongs to: `origin_s1 (origin) + dynamic:4` -> `origin`, `coca-slack` -> `coca`."""
    model = label.partition(" + ")[0]
    match = re.fullmatch(r"(.+?)_s\d+(?: \(.*\))?", model)
    name = match.group(1) if match else model
    return DESIGN_ALIASES.get(name, name)


def scaling_of(label: str) -> str:
    return label.partition(" + ")[2] or "none"


def design_color(design: str) -> str:
    """The design's colour in every figure; other names get a fallback colour fixed by the name."""
    design = DESIGN_ALIASES.get(design, design)
    if design in DESIGN_COLORS:
        return DESIGN_COLORS[design]
    return FALLBACK_COLORS[zlib.crc32(design.encode()) % len(FALLBACK_COLORS)]


def shade(color: str, i: int, n: int) -> str:
    """The i-th of n shades of a colour: the colour itself first, then up to half-way to white."""
    if n <= 1 or i == 0:
        return to_hex(color)
    mix = 0.55 * i / (n - 1)
    return to_hex(tuple(c + (1.0 - c) * mix for c in to_rgb(color)))


def scaling_title(scaling: str) -> str:
    """`none` -> `as trained`, `dynamic:8` -> `dynamic NTK x8`, `dynamic:8+temp` -> `dynamic NTK x8 +
    length temperature`."""
    rope, plus, _ = scaling.partition("+")
    kind, _, factor = rope.partition(":")
    title = "as trained" if rope == "none" else f"{SCALING_NAMES.get(kind, kind)} x{factor}" if factor else rope
    return title + (" + length temperature" if plus else "")


def scaling_styles(scalings: Sequence[str]) -> dict[str, str | tuple]:
    """Solid for `none`, then one dash pattern per further scaling, in order."""
    others = [s for s in dict.fromkeys(scalings) if s != "none"]
    return {"none": "-", **{s: LINESTYLES[i % len(LINESTYLES)] for i, s in enumerate(others)}}


def run_colors(labels: Sequence[str]) -> dict[str, str]:
    """One colour per run (the label without its scaling): its design's colour, seeds as shades."""
    runs = list(dict.fromkeys(label.partition(" + ")[0] for label in labels))
    by_design: dict[str, list[str]] = {}
    for run in runs:
        by_design.setdefault(design_of(run), []).append(run)
    return {
        run: shade(design_color(d), i, len(group))
        for d, group in by_design.items()
        for i, run in enumerate(group)
    }


# ----------------------------------------------------------------------------- layout


def grid(
    n: int, panel: tuple[float, float], legend_width: float = 0.0, cols: int | None = None
) -> tuple[Figure, list[Axes]]:
    """A figure of n panels in `cols` columns (default: at most MAX_COLUMNS, 2 x 2 for four), filled
    row by row, unused cells removed."""
    cols = min(cols or (2 if n == 4 else MAX_COLUMNS), n, MAX_COLUMNS)
    rows = math.ceil(n / cols)
    fig = plt.figure(figsize=(panel[0] * cols + legend_width, panel[1] * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.remove()
    return fig, axes[:n]


def _length_axis(ax: Axes, lengths: Sequence[int], train_len: int | None) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(lengths))
    ax.set_xticks(ticks, [_k(t) for t in ticks])
    ax.minorticks_off()
    if train_len:
        ax.axvline(train_len, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("evaluation length (tokens)")
    ax.grid(alpha=0.3)


def _value_axis(ax: Axes, ylabel: str, log_y: bool, unit_range: bool) -> None:
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))
    if unit_range:
        ax.set_ylim(0.0, 1.0)
    ax.set_ylabel(ylabel)


def _train_len_handle(train_len: int | None) -> list[Line2D]:
    if not train_len:
        return []
    return [Line2D([], [], color="grey", linestyle=":", linewidth=1, label=f"training length ({train_len})")]


def _figure_legend(fig: Figure, handles: Sequence, title: str | None = None) -> None:
    """One legend for the figure, right of the panels, in as many columns as its height needs."""
    per_column = max(4, int(fig.get_figheight() * 72 / 14) - 2)  # rows of 8-point text, about 14 points
    fig.legend(
        handles=list(handles),
        loc="outside right upper",
        fontsize=8,
        title=title,
        title_fontsize=8,
        ncols=math.ceil(len(handles) / per_column),
    )


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _by_scaling(labels: Sequence[str]) -> dict[str, list[str]]:
    """Labels grouped by scaling, `none` (as trained) first."""
    groups: dict[str, list[str]] = {"none": []}
    for label in labels:
        groups.setdefault(scaling_of(label), []).append(label)
    return {s: g for s, g in groups.items() if g}


# ----------------------------------------------------------------------------- figures


def lines_figure(
    series: Series,
    ylabel: str,
    title: str,
    train_len: int | None,
    log_y: bool = False,
    unit_range: bool = False,
    design: str | None = None,
) -> Figure:
    """Value against length (log2 x-axis), one line per label; non-finite values are x marks on the
    top edge. With `design`, the labels are that one run's scalings: one panel, the design's colour,
    a line style per scaling. Otherwise labels are `run` or `run + scaling`: one panel per scaling,
    one colour per run."""
    labels = list(series)
    if design is not None:
        panels = {"": labels}
        styles = scaling_styles(labels)
        color = design_color(design)
        look = {label: (color, styles[label], label if label != "none" else "as trained") for label in labels}
    else:
        panels = _by_scaling(labels)
        colors = run_colors(labels)
        look = {
            label: (colors[label.partition(" + ")[0]], "-", label.partition(" + ")[0]) for label in labels
        }
    fig, axes = grid(len(panels), PANEL, legend_width=2.6)
    handles: dict[str, Line2D] = {}
    for ax, (scaling, group) in zip(axes, panels.items()):
        lengths: list[int] = []
        for label in group:
            xs, ys = series[label]
            lengths += list(xs)
            color, style, name = look[label]
            pts = [(x, y) for x, y in zip(xs, ys) if np.isfinite(y)]
            off = [x for x, y in zip(xs, ys) if not np.isfinite(y)]
            if pts:
                ax.plot(
                    *zip(*pts), marker="o", markersize=4, color=color, linestyle=style, clip_on=not unit_range
                )
            if off:  # inf / nan: an x on the top edge
                ax.plot(
                    off, [1.0] * len(off), "x", color=color, transform=ax.get_xaxis_transform(), clip_on=False
                )
            handles.setdefault(
                name, Line2D([], [], marker="o", markersize=4, color=color, linestyle=style, label=name)
            )
        _length_axis(ax, lengths, train_len)
        _value_axis(ax, ylabel, log_y, unit_range)
        if scaling:
            ax.set_title(scaling_title(scaling), fontsize=10)
    extra = (
        [Line2D([], [], marker="x", color="black", linestyle="", label="not finite (top edge)")]
        if any(not np.isfinite(y) for _, ys in series.values() for y in ys)
        else []
    )
    _figure_legend(
        fig,
        list(handles.values()) + _train_len_handle(train_len) + extra,
        title=design if design is not None else None,
    )
    fig.suptitle(title)
    return fig


def ppl_figure(series: Series, train_len: int | None = None, design: str | None = None) -> Figure:
    return lines_figure(
        series, "perplexity", "Sliding-window perplexity", train_len, log_y=True, design=design
    )


def passkey_figure(series: Series, train_len: int | None = None, design: str | None = None) -> Figure:
    return lines_figure(
        series, "passkey accuracy", "Passkey retrieval", train_len, unit_range=True, design=design
    )


def recall_figure(series: Series, train_len: int | None = None, design: str | None = None) -> Figure:
    return lines_figure(
        series, "recall accuracy", "Multi-query associative recall", train_len, unit_range=True, design=design
    )


# The CoCA paper's Table 1 (350M models trained at 512 tokens, PG-19) as perplexity ratios to the
# 512-token value, at 1x, 2x, 4x, ... the training length; per panel (scaling) and design. Origin's
# ratios (21 at 2x, then over 150) and the paper's infinities leave any axis these studies need.
PAPER_PPL_RATIOS: dict[str, dict[str, list[float]]] = {
    "none": {"alibi": [1.0, 21.27 / 18.69, 28.20 / 18.69, 35.66 / 18.69, 37.03 / 18.69],
             "origin": [1.0, 411.50 / 19.66, 3276 / 19.66, 3026 / 19.66, 3028 / 19.66],
             "coca": [1.0, 33.47 / 20.11, 69.06 / 20.11, 113.19 / 20.11, 157.38 / 20.11, 141.00 / 20.11,
                      171.63 / 20.11]},
    "dynamic": {"origin": [1.0, 22.30 / 19.66, 38.00 / 19.66, 75.75 / 19.66, 138.13 / 19.66, 370.75 / 19.66,
                           380.75 / 19.66],
                "coca": [1.0, 20.81 / 20.11, 25.88 / 20.11, 34.16 / 20.11, 55.75 / 20.11, 89.31 / 20.11,
                         101.13 / 20.11]},
}

REFERENCE_TOP = 8.0  # a figure with a reference shows ratios up to at least this (log axis)


def bands_figure(
    cells: Sequence[dict],
    title: str,
    ylabel: str,
    train_len: int | None,
    log_y: bool = False,
    unit_range: bool = False,
    reference: dict[str, dict[str, list[float]]] | None = None,
) -> Figure:
    """Seed mean against length with its 95% cluster-bootstrap band, one panel per scaling and one
    line per design (rows of `eval.aggregate.summarise` for one metric: `group`, `scaling`,
    `length`, `n`, `mean`, `low`, `high`). `unit_range` fixes the y-axis at 0..1 (accuracies); a
    percentile bootstrap of accuracies stays inside it. `reference` (e.g. `PAPER_PPL_RATIOS`):
    per scaling kind (`none`, `dynamic`), design -> values at 1x, 2x, 4x, ... `train_len`; the
    panels are then drawn twice: zoomed to the cells, and below, with the reference dashed in the
    design's colour up to the cells' longest length, on a log axis up to at least `REFERENCE_TOP`
    (the paper's Origin leaves it at 2x)."""
    panels: dict[str, list[dict]] = {"none": []}
    for c in cells:
        panels.setdefault(c["scaling"], []).append(c)
    panels = {s: rows for s, rows in panels.items() if rows}
    rows_of_panels = 2 if reference and train_len else 1
    fig, axes = grid(len(panels) * rows_of_panels, PANEL, legend_width=2.4,
                     cols=len(panels) if rows_of_panels == 2 else None)
    handles: dict[str, Line2D] = {}
    for row in range(rows_of_panels):
        shown = reference if row == 1 else None
        for ax, (scaling, rows) in zip(axes[row * len(panels):], panels.items()):
            _band_panel(ax, scaling, rows, handles, ylabel, train_len, log_y, unit_range, shown)
    band = Patch(color="grey", alpha=0.3, label="95% cluster-bootstrap\ninterval (seeds, then cases)")
    extra = [Line2D([], [], color="grey", linestyle="--", linewidth=1,
                    label="the paper's Table 1\n(350M, at 1x, 2x, ... its\ntraining length)")] if reference else []
    _figure_legend(fig, list(handles.values()) + [band] + extra + _train_len_handle(train_len))
    fig.suptitle(f"{title}: seed mean per design")
    return fig


def _band_panel(ax: Axes, scaling: str, rows: list[dict], handles: dict[str, Line2D], ylabel: str,
                train_len: int | None, log_y: bool, unit_range: bool,
                reference: dict[str, dict[str, list[float]]] | None) -> None:
    """One panel of `bands_figure`: each design's seed means and band under one scaling (and the
    reference, if given); adds each design's legend entry to `handles` once."""
    lengths: list[int] = []
    for design in dict.fromkeys(c["group"] for c in rows):
        here = sorted((c for c in rows if c["group"] == design), key=lambda c: c["length"])
        x = [c["length"] for c in here]
        lengths += x
        color = design_color(design)
        ax.fill_between(x, [c["low"] for c in here], [c["high"] for c in here], color=color, alpha=0.15, linewidth=0)
        ax.plot(x, [c["mean"] for c in here], marker="o", markersize=4, color=color, clip_on=not unit_range)
        n = max(c["n"] for c in here)
        handles.setdefault(design, Line2D([], [], marker="o", markersize=4, color=color,
                                          label=f"{design} ({n} seed{'s' * (n > 1)})"))
    if reference and train_len:
        longest = max(lengths) // train_len
        for design, values in reference.get(scaling.split(":")[0], {}).items():
            shown = values[:longest.bit_length()]  # 1x .. the longest length of the cells
            ax.plot([train_len * 2**i for i in range(len(shown))], shown, linestyle="--", linewidth=1,
                    color=design_color(design))
        ax.set_ylim(min(c["low"] if c["n"] > 1 else c["mean"] for c in rows) / 1.05,
                    max(REFERENCE_TOP, *(c["high"] if c["n"] > 1 else c["mean"] for c in rows)) * 1.05)
    _length_axis(ax, lengths, train_len)
    _value_axis(ax, ylabel, log_y or bool(reference), unit_range)
    title = scaling_title(scaling)
    ax.set_title(f"{title}, with the paper's Table 1" if reference else title, fontsize=10)


def depth_figure(grids: Mapping[str, tuple[list[int], list[float], np.ndarray]]) -> Figure:
    """Accuracy heatmaps (depth rows x length columns), one panel per label, in a grid."""
    fig, axes = grid(len(grids), (4.2, 3.4), legend_width=0.8)
    for ax, (label, (lengths, depths, acc)) in zip(axes, grids.items()):
        im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), [_k(x) for x in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel("key depth")
        ax.set_title(label, fontsize=9)
        for (i, j), v in np.ndenumerate(acc):
            if np.isfinite(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(
        im, ax=axes, label="passkey accuracy", shrink=min(1.0, 6 / len(axes)) if len(axes) > 6 else 1.0
    )
    fig.suptitle(
        "Passkey accuracy by key depth (0: key at the start of the prompt) and length; white: no case"
    )
    return fig


def attention_figure(
    profiles: Mapping[str, Mapping[int, np.ndarray]], train_len: int | None = None, design: str | None = None
) -> Figure:
    """Figure 11 in spirit: the last query's pre-softmax scores against key position, one panel per
    (setting, layer): a row per setting with two or three layers, else a grid. Heads are thin lines
    in shades of the design's colour, the black line is the maximum over heads, the dotted line
    the key whose distance from the query is the training length."""
    layers = sorted({layer for p in profiles.values() for layer in p})
    by_rows = 1 < len(layers) <= MAX_COLUMNS  # a row per setting, a column per layer
    panels = [
        (label, layer, profiles[label].get(layer))
        for label in profiles
        for layer in layers
        if by_rows or layer in profiles[label]
    ]
    fig, axes = grid(len(panels), (4.2, 3.0), legend_width=3.0, cols=len(layers) if by_rows else None)
    length = max(scores.shape[-1] for _, _, scores in panels if scores is not None)
    for ax, (label, layer, scores) in zip(axes, panels):
        if scores is None:  # a layer this setting did not record
            ax.set_visible(False)
            continue
        color = design_color(design if design is not None else design_of(label))
        pos = np.arange(scores.shape[-1])
        for h, head in enumerate(scores):
            ax.plot(pos, head, linewidth=0.5, alpha=0.8, color=shade(color, h, len(scores)))
        ax.plot(pos, scores.max(axis=0), color="black", linewidth=0.8)
        if train_len and train_len < scores.shape[-1]:
            ax.axvline(scores.shape[-1] - train_len, color="grey", linestyle=":", linewidth=1)
        name = label if design is None else (design if label == "none" else f"{design} + {label}")
        ax.set_title(f"{name}, layer {layer}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_xlabel("key position (query = last token)")
        ax.set_ylabel("pre-softmax score")
    handles = [
        Line2D([], [], color="grey", linewidth=0.8, label="one head (shades of the design's colour)"),
        Line2D([], [], color="black", linewidth=0.8, label="maximum over heads"),
    ]
    if train_len:
        handles.append(
            Line2D(
                [],
                [],
                color="grey",
                linestyle=":",
                linewidth=1,
                label=f"{train_len} keys before the query\n(training length): keys left of it\n"
                "are farther than in training",
            )
        )
    _figure_legend(fig, handles)
    fig.suptitle(f"Last query's attention scores at {length} tokens")
    return fig


PALETTE = 128  # colours of a saved figure: the same picture to the eye in a third of full colour's bytes


def save(fig: Figure, path: Path, dpi: int = DPI, tight: bool = True) -> Path:
    """Write the figure as a palette PNG and free it. `tight`: nothing clipped (legends outside the
    panels are kept). A palette because the published figures are committed: a repository that a
    GPU check can carry must stay small, and these plots hold far fewer colours than full colour
    pays for."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight" if tight else None)
    plt.close(fig)
    picture = Image.open(buffer).convert("RGB")
    picture.quantize(PALETTE, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)
    return path
