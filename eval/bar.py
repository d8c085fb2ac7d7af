"""The training bar: whether a run learned to retrieve at its training length at all.

Extrapolation is only measurable from a model that retrieves at the training length, so the study
scores every checkpoint of a run on passkey cases at that length (`bench.passkey_progress`, written
beside the run's results as `passkey_progress.md`) and calls a run past the bar once that score is
at least `BAR`. The seed report lists each run's first checkpoint at the bar and its final score;
`eval.report --bar-only` repeats the analysis on the runs whose final checkpoint passes it (a post
hoc subset: exploratory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

BAR = 0.9  # passkey accuracy at the training length on the bar's cases
PROGRESS_FILE = "passkey_progress.md"
_ROW = re.compile(r"\|\s*[^|]*step_(\d+)\s*\|[^|]*\|[^|]*\|\s*([0-9.]+)\s*\|")


def table_header(n_cases: int, length: int) -> list[str]:
    """The first two lines of the progress table (`bench.passkey_progress` prints it)."""
    return [f"| checkpoint | key-token log-prob | key-token accuracy | passkey ({n_cases} cases at {length}) |",
            "|---|---|---|---|"]


def table_row(checkpoint: str, logp: float, token_acc: float, passkey: float) -> str:
    """One checkpoint's row; `checkpoint` ends in step_<step> (`<run>/step_00001500`)."""
    return f"| {checkpoint} | {logp:.2f} | {token_acc:.2f} | {passkey:.2f} |"


@dataclass(frozen=True)
class BarProgress:
    """One run's passkey accuracy at the training length per checkpoint step, in step order."""

    steps: tuple[int, ...]
    scores: tuple[float, ...]

    @property
    def final(self) -> float:
        return self.scores[-1]

    @property
    def first_at_bar(self) -> int | None:
        """The first step whose score is at least BAR (None: never)."""
        return next((step for step, score in zip(self.steps, self.scores) if score >= BAR), None)

    @property
    def passes(self) -> bool:
        return self.final >= BAR


def read_progress(path: Path) -> BarProgress | None:
    """The table `bench.passkey_progress` wrote, or None where the file is missing or holds no row."""
    if not path.is_file():
        return None
    rows = sorted((int(m.group(1)), float(m.group(2))) for m in map(_ROW.match, path.read_text().splitlines()) if m)
    if not rows:
        return None
    return BarProgress(tuple(step for step, _ in rows), tuple(score for _, score in rows))
