"""The repository stays small enough to send: the lent GPU machine receives the working tree plus
the carried wheels, 64 MiB in all (docs/GPU.md), so the tracked tree is held to 20 MiB and the
documented check's payload to 60 MiB. The published raw results are the bulk: they are stored
gzip-compressed (`eval.results.publish`), and only the figures the docs show are committed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
TREE_LIMIT = 20 * MIB
PAYLOAD_LIMIT = 60 * MIB
WHEELS = REPO / ".whl"  # what docs/GPU.md's call carries (`bash bench/make_wheels.sh` writes it)
RECORD = REPO / "bench" / "gpu_wheels.tsv"  # its record: file name and bytes per wheel


def _files(*flags: str) -> list[Path]:
    """The repository's files that git lists with `flags`, those present in the working tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", *flags], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no tree to measure")
    return [p for p in (REPO / name for name in out.decode().split("\0") if name) if p.is_file()]


def _size(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files)


def wheels_size() -> int:
    """The carried wheels' bytes: the folder's where it was made here, else the sizes its record holds."""
    if WHEELS.is_dir():
        return _size([p for p in WHEELS.rglob("*") if p.is_file()])
    assert RECORD.is_file(), f"{RECORD.relative_to(REPO)} records the wheels the GPU check carries"
    rows = [line.split("\t") for line in RECORD.read_text().splitlines() if line and not line.startswith("#")]
    assert rows and all(len(r) == 2 and r[0].endswith(".whl") and r[1].isdigit() for r in rows), RECORD
    return sum(int(size) for _, size in rows)


def test_the_tracked_tree_is_at_most_20_mib():
    tracked = _files()
    size = _size(tracked)
    largest = ", ".join(f"{p.relative_to(REPO)} ({p.stat().st_size / MIB:.2f} MiB)"
                        for p in sorted(tracked, key=lambda p: p.stat().st_size)[-5:])
    assert size <= TREE_LIMIT, f"tracked tree {size / MIB:.1f} MiB > {TREE_LIMIT / MIB:.0f} MiB; largest: {largest}"


def test_the_gpu_checks_payload_is_at_most_60_mib():
    """What the documented call sends: every file the device copies (tracked, and untracked that git
    does not ignore) plus the carried wheels."""
    tree = _size(_files("--cached", "--others", "--exclude-standard"))
    wheels = wheels_size()
    assert tree + wheels <= PAYLOAD_LIMIT, (f"payload {(tree + wheels) / MIB:.1f} MiB > {PAYLOAD_LIMIT / MIB:.0f} MiB "
                                            f"(tree {tree / MIB:.1f}, wheels {wheels / MIB:.1f})")


FIGURE_LINK = re.compile(r"\(([^()\s]+\.png)\)")


def test_every_committed_figure_is_one_a_document_shows():
    """A results figure is committed only where a Markdown file links it (README, docs, a report)."""
    shown = {(md.parent / link).resolve() for md in _files("*.md") for link in FIGURE_LINK.findall(md.read_text())}
    figures = {p.resolve() for p in _files("docs/results") if p.suffix == ".png"}
    unshown = sorted(str(p.relative_to(REPO)) for p in figures - shown)
    assert not unshown, f"figures no document shows (drop them or link them): {unshown}"


def test_published_raw_results_are_compressed():
    """Every published evaluation result is `<task>.json.gz`: a plain copy would double the tree."""
    plain = [str(p.relative_to(REPO)) for p in _files("docs/results")
             if re.fullmatch(r"(ppl|passkey|recall|attention|position_loss|ruler)\.json", p.name)]
    assert not plain, f"publish these with `python -m eval.publish` (gzip): {plain[:5]}"
