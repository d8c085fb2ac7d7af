"""The published seed reports (docs/results/*/seeds_*) regenerate, byte for byte, from the
per-run files committed beside them, with the run order the reproduction scripts give
`eval.report`; and each pre-registered table docs/RESULTS.md quotes is the report's own.

The figures are built but not drawn, and left out of the byte comparison (their bytes follow
the matplotlib version)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from matplotlib import pyplot
from matplotlib.figure import Figure

from eval import aggregate, plots, report
from model.designs.registry import DESIGNS

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
FILES = ("seeds_report.md", "seeds_family.csv", "seeds_power.csv", "seeds_summary.csv", "seeds_values.csv",
         "seeds_significance.csv", "seeds_attention.csv", "seeds_bar.csv")


def _study_runs(folder: Path, designs: tuple[str, ...]) -> list[Path]:
    """launch/reproduce_study.sh's order: seed by seed, designs in their order, then text_s1."""
    runs = sorted((p for d in designs for p in folder.glob(f"{d}_s*") if re.fullmatch(rf"{d}_s\d+", p.name)),
                  key=lambda p: (int(p.name.rsplit("_s", 1)[1]), designs.index(p.name.rsplit("_s", 1)[0])))
    return runs + ([folder / "text_s1"] if (folder / "text_s1").is_dir() else [])


def _extension_runs() -> list[Path]:
    """launch/reproduce_extension.sh's order: per seed, the five arms, then the study's Origin and CoCA."""
    arms = ("extend_pi", "extend_yarn", "extend_abf", "dropin_coca", "continue_origin")
    return [folder / f"{name}_s{seed}" for seed in range(1, 6)
            for folder, names in ((RESULTS / "extension", arms), (RESULTS / "study", ("origin", "coca")))
            for name in names]


def _study() -> list[Path]:
    return _study_runs(RESULTS / "study", ("origin", "coca", "coca_strict", "alibi"))


def _designs() -> list[Path]:
    """launch/reproduce_designs.sh's order (its DESIGNS)."""
    return _study_runs(RESULTS / "designs", ("origin", "nope", "prope", "hybrid", "kerple", "fire", "fox"))


def _field_retrieval() -> list[Path]:
    return _study_runs(RESULTS / "field_retrieval", ("origin", "pope", "stick_breaking", "fox_pro", "origin_recal",
                                                     "drope"))


def _muon() -> list[Path]:
    """launch/reproduce_perplexity.sh's order with PUBLISHED (conf/study/muon.yaml's command): seed by
    seed, the perplexity study's AdamW Origin and CoCA runs, then the Muon runs published here."""
    return [folder / f"{name}_s{seed}" for seed in range(1, 11)
            for folder, name in ((RESULTS / "perplexity", "origin"), (RESULTS / "perplexity", "coca"),
                                 (RESULTS / "muon", "origin_muon"), (RESULTS / "muon", "coca_muon"))
            if (folder / f"{name}_s{seed}").is_dir()]


def _qk_clip() -> list[Path]:
    """conf/study/qk_clip.yaml's command: seed by seed, the AdamW Origin and CoCA runs (perplexity
    study), the Muon runs (Muon study), then the clipped runs published here."""
    names = ("origin", "coca", "origin_muon", "coca_muon", "origin_muon_clip", "coca_muon_clip")
    folders = (RESULTS / "qk_clip", RESULTS / "muon", RESULTS / "perplexity")  # RESULTS, then PUBLISHED
    return [next(f / f"{name}_s{seed}" for f in folders if (f / f"{name}_s{seed}").is_dir())
            for seed in range(1, 11) for name in names
            if any((f / f"{name}_s{seed}").is_dir() for f in folders)]


REPORTS = {
    "pilot": (lambda: sorted(RESULTS.joinpath("pilot").glob("*_s?")), aggregate.FAMILY_FILE),
    "perplexity/pilot": (lambda: _study_runs(RESULTS / "perplexity" / "pilot", ("origin",)),
                         aggregate.FAMILY_FILE.with_name("perplexity.yaml")),
    "perplexity": (lambda: _study_runs(RESULTS / "perplexity", tuple(DESIGNS)),
                   aggregate.FAMILY_FILE.with_name("perplexity.yaml")),
    "extension": (_extension_runs, aggregate.FAMILY_FILE.with_name("extension.yaml")),
    "study": (_study, aggregate.FAMILY_FILE),
    "study/bar_only": (_study, aggregate.FAMILY_FILE),
    "designs": (_designs, aggregate.FAMILY_FILE.with_name("designs.yaml")),
    "designs/bar_only": (_designs, aggregate.FAMILY_FILE.with_name("designs.yaml")),
    "field_ppl": (lambda: _study_runs(RESULTS / "field_ppl", ("origin", "pope", "stick_breaking", "fox_pro",
                                                              "origin_sinks", "origin_ssmax", "origin_recal",
                                                              "drope")),
                  aggregate.FAMILY_FILE.with_name("field_ppl.yaml")),
    "field_retrieval": (_field_retrieval, aggregate.FAMILY_FILE.with_name("field_retrieval.yaml")),
    "field_retrieval/bar_only": (_field_retrieval, aggregate.FAMILY_FILE.with_name("field_retrieval.yaml")),
    "muon": (_muon, aggregate.FAMILY_FILE.with_name("muon.yaml")),
    "qk_clip": (_qk_clip, aggregate.FAMILY_FILE.with_name("qk_clip.yaml")),
}


def _built_not_drawn(fig: Figure, path: Path) -> Path:
    """plots.save without drawing: the figures are built (their code runs) but not rendered."""
    pyplot.close(fig)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", REPORTS)
def test_published_seed_report_regenerates_from_the_committed_runs(name, tmp_path, monkeypatch):
    published = RESULTS / name
    runs, family = REPORTS[name]
    monkeypatch.chdir(REPO)  # the reports name runs by their path from the repository root
    monkeypatch.setattr(plots, "save", _built_not_drawn)  # drawing is most of a report's time
    report.compare([run.relative_to(REPO) for run in runs()], tmp_path, family, bar_only=name.endswith("bar_only"))
    for file in FILES:
        assert (tmp_path / file).exists() == (published / file).exists(), f"docs/results/{name}/{file}"
        if (published / file).exists():
            assert (tmp_path / file).read_bytes() == (published / file).read_bytes(), f"docs/results/{name}/{file}"


SEEDS_FAMILY_HEADER = "| a | b | scaling | length | seeds a |"
DOSE_FAMILY_HEADER = "| test | a | b | dose |"


def _family_rows(markdown: str, header: str = SEEDS_FAMILY_HEADER) -> list[str]:
    """The rows of every Markdown table whose header starts with `header` (a family table's)."""
    rows, inside = [], False
    for line in markdown.splitlines():
        if line.startswith(header):
            inside = True
        elif inside and line.startswith("|") and not line.startswith("|---"):
            rows.append(line)
        elif not line.startswith("|"):
            inside = False
    return rows


def test_results_doc_quotes_the_family_tables_of_the_published_reports():
    """Every pre-registered row docs/RESULTS.md shows is a row of a published seeds_report.md."""
    quoted = _family_rows((REPO / "docs" / "RESULTS.md").read_text())
    published = {row for name in REPORTS for row in _family_rows((RESULTS / name / "seeds_report.md").read_text())}
    assert quoted, "docs/RESULTS.md quotes no family table"
    missing = [row for row in quoted if row not in published]
    assert not missing, f"docs/RESULTS.md rows not in any published seeds_report.md: {missing}"


def test_results_doc_quotes_the_dose_family_of_the_published_report():
    """The dose-response family RESULTS.md shows is, row for row, the published dose_report.md's."""
    quoted = _family_rows((REPO / "docs" / "RESULTS.md").read_text(), DOSE_FAMILY_HEADER)
    published = _family_rows((RESULTS / "dose" / "dose_report.md").read_text(), DOSE_FAMILY_HEADER)
    assert quoted, "docs/RESULTS.md quotes no dose family table"
    assert quoted == published


def test_published_dose_report_regenerates_from_the_committed_runs(tmp_path):
    """docs/results/dose/*: `python -m eval.dose` over the published `<design>_d<steps>_s<seed>`
    runs writes the committed tables and report byte for byte (the figure aside): the pilot's
    without a family, the study's (docs/results/dose itself) with its registration and the
    perplexity study's cosine runs of its designs as reference, as launch/reproduce_dose.sh writes it;
    and docs/results/dose_extension's with its registration and the fit to the paper's 165 tokens per
    parameter, once it has a report."""
    from eval import dose

    reports = sorted(RESULTS.joinpath("dose").glob("**/dose_report.md"))
    assert reports  # the pilot's, at least
    extension = RESULTS / "dose_extension" / "dose_report.md"  # issue 60's study, as its runs arrive
    for published in reports + [extension] * extension.is_file():
        folder = published.parent
        runs = [dose.load_run(p) for p in sorted(folder.glob("*_d*_s*")) if p.is_dir()]
        family, reference, fit_to = None, [], None
        if folder == RESULTS / "dose_extension":
            family, fit_to = dose.load_family(REPO / "conf" / "study" / "dose_extension.yaml"), 165.0
        if folder == RESULTS / "dose":
            family = dose.load_family(REPO / "conf" / "study" / "dose.yaml")
            designs = {r.design for r in runs}
            reference = [r for r in (dose.load_run(p, dose.REFERENCE_NAME)
                                     for p in sorted(RESULTS.joinpath("perplexity").glob("*_s*"))
                                     if re.fullmatch(r"(origin|coca|alibi|fire)_s\d+", p.name)) if r.design in designs]
        out = tmp_path / folder.name
        dose.write(runs, out, family, reference, 4096, 256, fit_to)
        pyplot.close("all")
        for file in sorted(folder.glob("dose_*")):
            if file.suffix != ".png":
                assert (out / file.name).read_bytes() == file.read_bytes(), file
