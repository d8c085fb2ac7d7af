"""Evaluation result files: each task's `<run>/eval/<task>.json` (written by `python -m eval`), its
attention profiles, and CSV tables; read back checked, one error naming the file.

A published run (docs/results) keeps each result as `<task>.json.gz` (`publish`): the same bytes,
gzip-compressed, since the raw cases are most of the repository's size. Every reader goes through
`result_file` and `read_json`, so a run's own `eval/` folder and a published one load alike."""

from __future__ import annotations

import csv
import gzip
import json
import shutil
import zlib
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data.config import DataError

TASKS = ("ppl", "passkey", "recall", "attention")
PROFILES_FILE = "attention_profiles.npz"


def save_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, allow_nan=True))
    tmp.replace(path)
    return path


RESULT_LISTS = {"ppl": "rows", "passkey": "cases", "recall": "cases", "attention": "rows",
                "ruler": "cases", "position_loss": "rows"}  # each task's list of results


GZ = ".gz"


def result_file(folder: Path, name: str) -> Path | None:
    """`folder/name` or its published form `folder/name.gz`, whichever is there (None: neither); a
    `DataError` when both are, since either could be the stale one."""
    found = [p for p in (folder / name, folder / f"{name}{GZ}") if p.is_file()]
    if len(found) == 2:
        raise DataError(f"{folder} holds both {name} and {name}{GZ}: keep the one that is current")
    return found[0] if found else None


def read_json(path: Path, fix: str) -> Any:
    """The JSON in `path` (gzip-decompressed when it ends in .gz), or a `DataError` naming the file,
    what is wrong with it and `fix`."""
    try:
        raw = path.read_bytes()
        return json.loads(gzip.decompress(raw) if path.suffix == GZ else raw)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); {fix}") from None
    except UnicodeDecodeError:
        raise DataError(f"{path} is not a text file; {fix}") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{path} is not a complete gzip file ({e}); {fix}") from None


def publish(files: Sequence[Path], dest: Path) -> list[Path]:
    """Copy `files` into `dest`, each `.json` and `.jsonl` (a training log) gzip-compressed (level 9,
    no name, mtime 0: the same result gives the same bytes); the written paths. A compressed file
    replaces a plain one there."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for file in files:
        if file.suffix not in (".json", ".jsonl"):
            written.append(Path(shutil.copy(file, dest / file.name)))
            continue
        out = dest / f"{file.name}{GZ}"
        tmp = out.with_name(f"{out.name}.tmp")
        tmp.write_bytes(gzip.compress(file.read_bytes(), compresslevel=9, mtime=0))
        tmp.replace(out)
        (dest / file.name).unlink(missing_ok=True)
        written.append(out)
    return written


def distinct_runs(paths: Sequence[Path]) -> None:
    """Refuse a run given twice (also by two paths to one folder, or as a run and its `eval/`): a
    report would count it as two seeds."""
    seen: dict[Path, Path] = {}
    for p in paths:
        key = (p / "eval" if (p / "eval").is_dir() else p).resolve()
        first = seen.get(key)
        if first is not None:
            same = "given twice" if str(first) == str(p) else f"and {first} are the same run"
            raise DataError(f"run {p} {same}: each run counts once")
        seen[key] = p


def load_result(path: Path, task: str) -> dict:
    """One task's results, or a `DataError` naming the file when it is not what `python -m eval` writes."""
    rerun = f"delete it and rerun `python -m eval` (task={task}) for that run"
    result = read_json(path, rerun)
    key = RESULT_LISTS[task]
    if not (isinstance(result, dict) and isinstance(result.get("meta"), dict) and "label" in result["meta"]
            and isinstance(result.get(key), list)):
        raise DataError(f"{path} is not a `python -m eval` {task} result (needs meta.label and a {key} list); "
                        f"{rerun}")
    return result


def load_results(eval_dir: Path) -> dict[str, dict]:
    """The task results present in an eval directory (plain or published), by task name."""
    found = {t: result_file(eval_dir, f"{t}.json") for t in TASKS}
    return {t: load_result(path, t) for t, path in found.items() if path is not None}


def save_profiles(path: Path, profiles: dict[str, dict[int, np.ndarray]]) -> Path:
    np.savez_compressed(path, **{f"{label}|{layer}": a for label, p in profiles.items() for layer, a in p.items()})
    return path


def load_profiles(path: Path) -> dict[str, dict[int, np.ndarray]]:
    out: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    with np.load(path) as data:
        for key in data.files:
            label, layer = key.rsplit("|", 1)
            out[label][int(layer)] = data[key]
    return dict(out)


def write_csv(path: Path, rows: Sequence[dict]) -> Path:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path
