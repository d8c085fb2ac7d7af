"""PNG figures of the evaluation (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogFormatter  # noqa: E402

Series = Mapping[str, tuple[Sequence[int], Sequence[float]]]


def _length_axis(ax, lengths: Sequence[int], train_len: int | None) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(lengths))
    ax.set_xticks(ticks)
    ax.set_xticklabels([_k(t) for t in ticks], rotation=45)
    ax.minorticks_off()
    if train_len:
        ax.axvline(train_len, color="grey", linestyle=":", linewidth=1, label="training length")
    ax.set_xlabel("evaluation length (tokens)")
    ax.grid(alpha=0.3)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


LINESTYLES = ("-", "--", ":", "-.")


def _line_styles(labels: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Colour by model, line style by scaling, for labels `model` or `model + scaling`."""
    models: dict[str, str] = {}
    scalings: dict[str, str] = {}
    styles = {}
    for label in labels:
        model, _, scaling = label.partition(" + ")
        color = models.setdefault(model, f"C{len(models) % 10}")
        style = scalings.setdefault(scaling, LINESTYLES[len(scalings) % len(LINESTYLES)])
        styles[label] = (color, style)
    return styles


def plot_lines(series: Series, path: Path, ylabel: str, title: str, train_len: int | None, log_y: bool) -> Path:
    """One line per label against length (log2 x-axis); non-finite values are x marks on the top edge."""
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    all_lengths: list[int] = []
    styles = _line_styles(list(series))
    for label, (lengths, values) in series.items():
        pts = [(x, y) for x, y in zip(lengths, values) if np.isfinite(y)]
        off = [x for x, y in zip(lengths, values) if not np.isfinite(y)]
        all_lengths += list(lengths)
        color, style = styles[label]
        line = (ax.plot(*zip(*pts), marker="o", color=color, linestyle=style, label=label) if pts
                else ax.plot([], [], color=color, linestyle=style, label=label))
        if off:  # inf / nan: an x on the top edge
            ax.plot(off, [1.0] * len(off), "x", color=line[0].get_color(), transform=ax.get_xaxis_transform(), clip_on=False)
    _length_axis(ax, all_lengths, train_len)
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_ppl(series: Series, path: Path, train_len: int | None = None) -> Path:
    return plot_lines(series, path, "perplexity", "Sliding-window perplexity", train_len, log_y=True)


def plot_passkey(series: Series, path: Path, train_len: int | None = None) -> Path:
    return plot_lines(series, path, "passkey accuracy", "Passkey retrieval", train_len, log_y=False)


def plot_recall(series: Series, path: Path, train_len: int | None = None) -> Path:
    return plot_lines(series, path, "recall accuracy", "Multi-query associative recall", train_len, log_y=False)


def plot_bands(cells: Sequence[dict], path: Path, ylabel: str, train_len: int | None, log_y: bool,
               unit_range: bool = False) -> Path:
    """Seed mean against length with its 95% cluster-bootstrap band, one line per `label` (rows of
    `eval.aggregate.summarise` for one metric: `mean`, `low`, `high`). `unit_range` fixes the
    y-axis at 0..1 (accuracies), so designs and figures compare at a glance."""
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    labels = list(dict.fromkeys(c["label"] for c in cells))
    styles = _line_styles(labels)
    lengths: list[int] = []
    for label in labels:
        rows = sorted((c for c in cells if c["label"] == label), key=lambda c: c["length"])
        x = [c["length"] for c in rows]
        lengths += x
        color, style = styles[label]
        n = max(c["n"] for c in rows)
        ax.plot(x, [c["mean"] for c in rows], marker="o", color=color, linestyle=style,
                label=f"{label} ({n} seed{'s' * (n > 1)})", clip_on=not unit_range)  # markers at 0, 1 whole
        ax.fill_between(x, [c["low"] for c in rows], [c["high"] for c in rows], color=color, alpha=0.12,
                        linewidth=0)
    _length_axis(ax, lengths, train_len)
    if log_y:
        ax.set_yscale("log")
    if unit_range:
        ax.set_ylim(0.0, 1.0)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel}\nseed mean, 95% cluster-bootstrap band (seeds, then cases)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_passkey_depth(grids: Mapping[str, tuple[list[int], list[float], np.ndarray]], path: Path) -> Path:
    """Accuracy heatmaps (depth rows x length columns), one panel per label."""
    n = len(grids)
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n + 1, 4), squeeze=False, layout="constrained")
    for ax, (label, (lengths, depths, acc)) in zip(axes[0], grids.items()):
        im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), [_k(x) for x in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
        ax.set_xlabel("length (tokens)")
        if ax is axes[0][0]:
            ax.set_ylabel("key depth")
        ax.set_title(label, fontsize=9)
        for (i, j), v in np.ndenumerate(acc):
            if np.isfinite(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=axes[0].tolist(), label="accuracy")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_attention_profiles(
    profiles: Mapping[str, Mapping[int, np.ndarray]], path: Path, train_len: int | None = None
) -> Path:
    """Figure 11 in spirit: last query's scores vs key position, layers as rows, settings as columns.

    Every head is a thin line; the black line is the maximum over heads.
    """
    labels = list(profiles)
    layers = sorted({layer for p in profiles.values() for layer in p})
    fig, axes = plt.subplots(len(layers), len(labels), figsize=(5 * len(labels), 2.3 * len(layers)), squeeze=False)
    for c, label in enumerate(labels):
        for r, layer in enumerate(layers):
            ax = axes[r][c]
            scores = profiles[label].get(layer)
            if scores is None:
                ax.set_visible(False)
                continue
            pos = np.arange(scores.shape[-1])
            for head in scores:
                ax.plot(pos, head, linewidth=0.5, alpha=0.5)
            ax.plot(pos, scores.max(axis=0), color="black", linewidth=0.8)
            if train_len:
                ax.axvline(scores.shape[-1] - train_len, color="grey", linestyle=":", linewidth=1)
            ax.set_title(f"{label}, layer {layer}", fontsize=9)
            ax.grid(alpha=0.3)
            if r == len(layers) - 1:
                ax.set_xlabel("key position (query = last token)")
            if c == 0:
                ax.set_ylabel("score")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
