"""Evaluation result files: each task's `<run>/eval/<task>.json` (written by `python -m eval`), its
attention profiles, and CSV tables; read back checked, one error naming the file."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

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


def load_result(path: Path, task: str) -> dict:
    """One task's results, or a `DataError` naming the file when it is not what `python -m eval` writes."""
    rerun = f"delete it and rerun `python -m eval` (task={task}) for that run"
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); {rerun}") from None
    except UnicodeDecodeError:
        raise DataError(f"{path} is not a text file; {rerun}") from None
    key = RESULT_LISTS[task]
    if not (isinstance(result, dict) and isinstance(result.get("meta"), dict) and "label" in result["meta"]
            and isinstance(result.get(key), list)):
        raise DataError(f"{path} is not a `python -m eval` {task} result (needs meta.label and a {key} list); "
                        f"{rerun}")
    return result


def load_results(eval_dir: Path) -> dict[str, dict]:
    """The task results present in an eval directory, by task name."""
    return {t: load_result(eval_dir / f"{t}.json", t) for t in TASKS if (eval_dir / f"{t}.json").exists()}


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
