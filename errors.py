"""User errors: the one type every command reports as a single `error:` line, and its exit codes.

This module sits at the bottom of the import graph (it imports nothing of the project), so any
layer can raise a `UserError` without importing the layer that reports it.

Exit codes, the same for every command: 0 done, 1 unusable input (a missing file, a bad
checkpoint, an unwritable folder), 2 bad usage (an unknown key, a wrong type, a bad flag).
Each error type carries its code (`exit_code`); `exit_code()` gives the code of the library types
the commands meet, `report_error` says the error and returns it.
"""

from __future__ import annotations

import sys

EXIT_INPUT = 1
EXIT_USAGE = 2


class UserError(Exception):
    """Something the user can fix; its message is one line that says what and how."""

    exit_code = EXIT_INPUT


class UsageError(UserError):
    """The command line itself is wrong: an unknown key or argument, a wrong type, a bad value."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """A bad configuration or override (every command's Hydra composition, train's checks); its
    message is one line naming the key."""


def exit_code(error: BaseException) -> int | None:
    """The exit code of an expected error: its type's own `exit_code` (every `UserError`), else
    EXIT_INPUT for an `OSError` (a file missing, unreadable or unwritable) and EXIT_USAGE for a
    `ValueError` (the project raises it for a bad value given); None for any other type: a bug."""
    code = getattr(type(error), "exit_code", None)
    if isinstance(code, int):
        return code
    if isinstance(error, OSError):
        return EXIT_INPUT
    if isinstance(error, ValueError):
        return EXIT_USAGE
    return None


def report_error(error: BaseException, code: int | None = None, prefix: str = "") -> int:
    """Say `error` as one `<prefix>error: ...` line on stderr and return its exit code: `code` when
    the caller knows the type better (`data.cli.exit_code`), else `exit_code(error)`. An error of
    no known kind is raised again: a bug keeps its traceback."""
    code = exit_code(error) if code is None else code
    if code is None:
        raise error
    print(f"{prefix}error: {one_line(error)}", file=sys.stderr)
    return code


def one_line(error: BaseException) -> str:
    """The first line of the root cause. Hydra and OmegaConf wrap errors and append hints; the
    offending key (OmegaConf's `full_key`) is kept in front when the message lacks it."""
    cause = error
    while cause.__cause__ is not None and type(cause).__module__.split(".")[0] in ("hydra", "omegaconf"):
        cause = cause.__cause__
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    message = lines[0] if lines else type(cause).__name__
    key = getattr(cause, "full_key", None)
    return f"{key}: {message}" if key and key not in message else message


def first_line(error: BaseException) -> str:
    """`Type: first line` of a library's exception, for a message that explains it (a corrupt file
    read by torch, DeepSpeed's converter failing)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
