"""The training bar: whether a run learned to retrieve at its training length at all.

Extrapolation is only measurable from a model that retrieves at the training length, so the study
scores every checkpoint of a run on passkey cases at that length (`bench.passkey_progress`, written
beside the run's results as `passkey_progress.md`) and calls a run past the bar once that score is
at least `BAR`. The seed report lists each run's first checkpoint at the bar and its final score;
`eval.report --bar-only` repeats the analysis on the runs whose final checkpoint passes it (a post
hoc subset: exploratory).

    python -m eval.bar runs/study/origin_s1/eval docs/results/study/coca_s2

prints, for each run's folder holding `passkey_progress.md` (or the file itself), its final score
and its first checkpoint at the bar.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from data.cli import OneLineParser
from data.config import DataError
from errors import report_error

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
    """The table `bench.passkey_progress` wrote, or None where the file is missing; a file that is
    not text or holds no row of the table (empty, cut off) is one `DataError` naming it."""
    if not path.is_file():
        return None
    try:
        text = path.read_text()
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not a text file ({error.reason} at byte {error.start})") from None
    rows = sorted((int(m.group(1)), float(m.group(2))) for m in map(_ROW.match, text.splitlines()) if m)
    if not rows:
        raise DataError(f"{path} holds no row of the passkey progress table (empty or cut off): write it again "
                        "with `python -m bench.passkey_progress`")
    return BarProgress(tuple(step for step, _ in rows), tuple(score for _, score in rows))


def main(argv: Sequence[str] | None = None) -> int:
    """One line per run: its final passkey score at the training length and its first step at the
    bar; exit 1 (one `error:` line) for a run without a readable table."""
    parser = OneLineParser(prog="python -m eval.bar", description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+",
                        help=f"a run's results folder holding {PROGRESS_FILE}, or the file itself")
    args = parser.parse_args(argv)
    lines = []
    try:
        for run in args.runs:
            path = run if run.is_file() else run / PROGRESS_FILE
            progress = read_progress(path)
            if progress is None:
                raise DataError(f"{path}: no passkey progress table (write it with `python -m bench.passkey_progress`)")
            first = progress.first_at_bar
            at_bar = f"first at the bar at step {first}" if first is not None else "never at the bar"
            lines.append(f"{run}: final {progress.final:.2f} ({'passes' if progress.passes else 'below'} the bar "
                         f"{BAR}), {at_bar}")
    except DataError as error:
        return report_error(error)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
