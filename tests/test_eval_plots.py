"""The evaluation's figures read at a glance, checked through matplotlib's objects: accuracy axes
at 0..1, accuracy bands inside [0, 1], a legend, axis labels and unclipped titles on every figure,
comparisons in a grid of at most three columns, one colour per design across figures."""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from eval import aggregate, plots

LENGTHS = [256, 512, 1024, 2048]
RUNS = ["origin_s1 (origin)", "alibi_s1 (alibi)", "coca_s1 (coca-slack)", "coca_strict_s1 (coca-strict)"]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _series(labels, value: float) -> dict:
    return {label: (LENGTHS, [value] * len(LENGTHS)) for label in labels}


def _compare_labels() -> list[str]:
    """Four runs, each as trained; all but ALiBi also with dynamic NTK 4: 7 settings."""
    return [
        r if s == "none" else f"{r} + {s}"
        for r in RUNS
        for s in ("none", "dynamic:4")
        if s == "none" or "alibi" not in r
    ]


def _cells(groups: dict[str, list[list[float]]], scaling: str = "none") -> list[dict]:
    """`eval.aggregate.summarise` rows of passkey accuracy, from per-seed lists of case outcomes (0/1)."""
    runs = [
        (
            name,
            {
                "passkey": {
                    "modes": ["teacher"],
                    "cases": [
                        {"scaling": scaling, "length": length, "teacher_correct": bool(hit)}
                        for length in LENGTHS
                        for hit in seed
                    ],
                }
            },
        )
        for name, seeds in groups.items()
        for seed in seeds
    ]
    cells = aggregate.collect(runs)
    return [
        r for r in aggregate.summarise(cells, aggregate.Bootstraps(cells, 2000)) if r["metric"] == "passkey"
    ]


def _profiles(labels, layers=(1,)) -> dict:
    rng = np.random.default_rng(0)
    return {label: {layer: rng.normal(size=(4, 1024)) for layer in layers} for label in labels}


def _pilot_labels() -> list[str]:
    """The pilot's comparison: 13 runs, all but ALiBi's with dynamic NTK 2, 4 and 8: 40 settings."""
    runs = [
        f"{d}_s{s} ({label})"
        for d, label in [
            ("alibi", "alibi"),
            ("coca", "coca-slack"),
            ("coca_strict", "coca-strict"),
            ("origin", "origin"),
        ]
        for s in (1, 2, 3)
    ] + ["text_s1 (origin)"]
    return [
        r if s == "none" else f"{r} + {s}"
        for r in runs
        for s in ("none", "dynamic:2", "dynamic:4", "dynamic:8")
        if s == "none" or "alibi" not in r
    ]


def _figures() -> dict[str, Figure]:
    """One of each figure the report makes, from small made-up data."""
    mixed = {label: (LENGTHS, [1.0, 0.5, 0.25, 0.0]) for label in _compare_labels()}
    return {
        "compare passkey": plots.passkey_figure(mixed, train_len=256),
        "pilot passkey": plots.passkey_figure(_series(_pilot_labels(), 0.5), 256),
        "pilot seeds": plots.bands_figure(
            [
                c
                for scaling in ("none", "dynamic:2", "dynamic:4", "dynamic:8")
                for c in _cells({d: [[1, 0]] * 2 for d in ("origin", "coca", "coca_strict", "text")}, scaling)
            ]
            + _cells({"alibi": [[1, 0]] * 2}),
            "Perplexity / perplexity at the training length",
            "perplexity ratio",
            256,
        ),
        "forty runs": plots.passkey_figure(_series([f"d{i}_s1 (d{i})" for i in range(40)], 0.5), 256),
        "compare ppl": plots.ppl_figure({k: (LENGTHS, [10.0, 12.0, 15.0, np.inf]) for k in mixed}, 256),
        "one run recall": plots.recall_figure(_series(["none", "dynamic:4"], 0.0), 256, design="origin"),
        "seeds passkey": plots.bands_figure(
            _cells({"origin": [[1, 0], [0, 0]], "coca": [[1, 1], [1, 0]]}),
            "Passkey accuracy",
            "passkey accuracy",
            256,
            unit_range=True,
        ),
        "attention": plots.attention_figure(_profiles(_compare_labels()), 256),
        "one run attention": plots.attention_figure(_profiles(["none"], (1, 2)), 256, design="coca-slack"),
        "depth": plots.depth_figure(
            {label: (LENGTHS, [0.1, 0.5, 0.9], np.full((3, 4), 0.5)) for label in RUNS}
        ),
    }


def _data_axes(fig: Figure) -> list:
    """The panels that show data (not colour bars, not hidden cells)."""
    return [
        ax
        for ax in fig.axes
        if ax.get_visible() and (ax.lines or ax.images or ax.collections) and ax.get_label() != "<colorbar>"
    ]


def _legend_colors(fig: Figure) -> dict[str, str]:
    """Legend label -> colour of its line, from the figure's legends and each panel's."""
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return {
        text.get_text(): to_hex(handle.get_color())
        for legend in legends
        for text, handle in zip(legend.get_texts(), legend.legend_handles)
        if hasattr(handle, "get_color")
    }


def _design(legend_label: str) -> str:
    """`origin_s1 (origin)` or `origin (3 seeds)` -> `origin`."""
    label = re.sub(r" \(\d+ seeds?\)$", "", legend_label)
    return re.sub(r"_s\d+ \(.*\)$", "", label)


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_accuracy_axes_run_from_0_to_1_whatever_the_values(value):
    figures = [
        plots.passkey_figure(_series(_compare_labels(), value), 256),
        plots.recall_figure(_series(["none", "dynamic:4"], value), 256, design="origin"),
        plots.bands_figure(
            _cells({"origin": [[value] * 4] * 2}),
            "Passkey accuracy",
            "passkey accuracy",
            256,
            unit_range=True,
        ),
    ]
    for fig in figures:
        for ax in _data_axes(fig):
            assert ax.get_ylim() == (0.0, 1.0)


def test_every_figure_has_a_legend_axis_labels_and_titles():
    for name, fig in _figures().items():
        panels = _data_axes(fig)
        assert panels, name
        for ax in panels:
            assert ax.get_xlabel() and ax.get_ylabel(), (name, ax.get_title())
            assert ax.get_title() or fig.get_suptitle(), name
            assert ax.get_legend() is not None or fig.legends or name == "depth", name
        if name == "depth":  # a heat map's legend is its colour bar
            assert any(ax.get_label() == "<colorbar>" and ax.get_ylabel() for ax in fig.axes)


def test_titles_and_legends_lie_inside_the_figure():
    for name, fig in _figures().items():
        fig.canvas.draw()
        box = fig.bbox
        texts = (
            [fig._suptitle] + [ax.title for ax in fig.axes] + [t for legend in fig.legends for t in [legend]]
        )
        texts += [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        for artist in texts:
            if artist is None or (hasattr(artist, "get_text") and not artist.get_text()):
                continue
            extent = artist.get_window_extent()
            assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1, (name, artist)
            assert box.y0 - 1 <= extent.y0 and extent.y1 <= box.y1 + 1, (name, artist)


def _columns(fig: Figure) -> int:
    return _data_axes(fig)[0].get_subplotspec().get_gridspec().ncols


def _panels_readable(fig: Figure) -> None:
    """At most three columns; every panel at least 2.5 x 1.5 inches, neither a strip nor a column."""
    assert _columns(fig) <= 3
    width, height = fig.get_size_inches()
    fig.canvas.draw()
    for ax in _data_axes(fig):
        box = ax.get_position()
        w, h = box.width * width, box.height * height
        assert w >= 2.5 and h >= 1.5 and 0.8 <= w / h <= 2.5


def test_the_attention_comparison_of_four_runs_in_seven_panels_is_a_grid():
    fig = plots.attention_figure(_profiles(_compare_labels()), 256)
    assert len(_data_axes(fig)) == 7
    _panels_readable(fig)
    width, height = fig.get_size_inches()
    assert 0.5 <= width / height <= 2.5


def test_many_panels_stay_readable():
    """Seven settings x seven layers: a long page of panels of the usual size."""
    fig = plots.attention_figure(_profiles(_compare_labels(), range(1, 8)), 256)
    assert len(_data_axes(fig)) == 49
    _panels_readable(fig)


def test_a_comparison_of_runs_and_scalings_is_a_grid_of_panels():
    fig = plots.passkey_figure(_series(_compare_labels(), 0.5), 256)
    assert [ax.get_title() for ax in _data_axes(fig)] == ["as trained", "dynamic NTK x4"]
    _panels_readable(fig)


def test_a_design_has_the_same_colour_in_every_figure():
    seeds = plots.bands_figure(
        _cells({"origin": [[1, 0]] * 2, "coca": [[1, 1]] * 2}),
        "Passkey accuracy",
        "passkey accuracy",
        256,
        unit_range=True,
    )
    compare = plots.passkey_figure(_series(list(reversed(RUNS)) + ["text_s1 (origin)"], 0.5), 256)
    a = {_design(k): c for k, c in _legend_colors(seeds).items()}
    b = {_design(k): c for k, c in _legend_colors(compare).items()}
    assert a["origin"] == b["origin"] and a["coca"] == b["coca"]
    five = [b[d] for d in ("origin", "alibi", "coca", "coca_strict", "text")]
    assert len(set(five)) == 5  # distinct designs, distinct colours
    assert a["origin"] in {to_hex(line.get_color()) for ax in _data_axes(seeds) for line in ax.lines}


def test_accuracy_bands_stay_inside_0_1():
    """Seeds at 0, 1/2 and 1 with two cases each: a normal-theory band would leave [0, 1]."""
    fig = plots.bands_figure(
        _cells({"origin": [[0, 0], [1, 1], [1, 0]]}),
        "Passkey accuracy",
        "passkey accuracy",
        256,
        unit_range=True,
    )
    bands = [c for ax in _data_axes(fig) for c in ax.collections if isinstance(c, PolyCollection)]
    assert bands
    for band in bands:
        y = np.concatenate([path.vertices[:, 1] for path in band.get_paths()])
        assert y.min() >= 0.0 and y.max() <= 1.0
        assert y.max() - y.min() > 0.5  # a band, not a line


def test_every_design_of_the_two_families_has_its_own_colour():
    """The study's and the extension experiment's designs share figures: no two may look alike (a
    hashed fallback colour once gave dropin_coca and continue_origin the same pink)."""
    designs = set()
    for name in ("comparisons.yaml", "extension.yaml"):
        family = aggregate.load_family(aggregate.FAMILY_FILE.with_name(name))
        designs |= {d for a, _, b, _ in family.comparisons for d in (a, b)}
    designs |= {"coca_strict", "alibi"}
    colours = {design: plots.design_color(design) for design in designs}
    assert len(set(colours.values())) == len(colours), colours
