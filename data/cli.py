"""What the command lines of data/ and eval/ share: train's override syntax and one-line errors.

Overrides are parsed by the same Hydra composition `python -m train` uses (`train.config.compose`):
`sources=[{kind:files,path:"x/{split}.jsonl"}]` here is `data.sources=...` there, and group
options (`data=pg19`, `experiment=micro`) work too. Every error is one `error: ...` line; the
exit status says whose turn it is:

- 2, usage: the command line is wrong (an unknown key or bad value, a path that is missing or a
  file where a directory is expected, an unavailable device);
- 1, runtime: an input it names is unusable (`DataError`: an empty or binary corpus, no documents
  for a split, a file that is not a tokenizer model, malformed results JSON, a corpus file that
  does not parse).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from omegaconf.errors import OmegaConfBaseException

from data.config import DataConfig, DataError

USAGE, RUNTIME = 2, 1
_GROUPS = ("data", "experiment")  # train config groups that may select data settings


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error:` line (exit 2) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"error: {message} (see {self.prog} --help)\n")


def data_config(overrides: list[str]) -> DataConfig:
    """A DataConfig from `key=value` overrides of its keys, parsed and type-checked as train's.

    Raises `ValueError` with train's one-line message on a bad override.
    """
    from train.config import ConfigError, compose, to_train_config  # the one parser (lazy: Hydra)

    def scoped(item: str) -> str:
        key = item.split("=", 1)[0].lstrip("+~")
        return item if key in _GROUPS or key.startswith("data.") else f"data.{item}"

    try:
        return to_train_config(compose([scoped(o) for o in overrides])).data
    except ConfigError as e:
        raise ValueError(str(e)) from None


def exit_code(error: BaseException) -> int | None:
    """RUNTIME for unusable inputs, USAGE for other expected errors, None for a bug (re-raise)."""
    import pyarrow as pa

    if isinstance(error, (DataError, pa.ArrowInvalid)):  # ArrowInvalid: `datasets` could not parse a file
        return RUNTIME
    if isinstance(error, (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                          OmegaConfBaseException)):
        return USAGE
    return None


def fail(error: BaseException) -> NoReturn:
    """Exit with `error` as one line and its exit status; re-raise what is not an input error."""
    from train.config import one_line

    code = exit_code(error)
    if code is None:
        raise error
    print(f"error: {one_line(error)}", file=sys.stderr)
    raise SystemExit(code)
