"""Publish a run's results into a results folder (the launchers' step that fills docs/results):

    python -m eval.publish docs/results/study/origin_s1 runs/study/origin_s1/eval/*.json \\
        runs/study/origin_s1/config.yaml

Each `.json` (and a training log's `.jsonl`) is written gzip-compressed (`eval.results.publish`:
bytes fixed by the content), every other file copied as it is; the readers (`eval.report`, `eval.dose`,
`eval.replicate`) load either form. Exit 0; 1 (one `error:` line) for a file that cannot be read or written.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from data.cli import OneLineParser
from errors import report_error
from eval.results import publish


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m eval.publish", description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="the published run's folder (created if missing)")
    parser.add_argument("files", nargs="+", type=Path, help="the run's result files and config")
    args = parser.parse_args(argv)
    try:
        publish(args.files, args.dest)
    except OSError as e:
        return report_error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
