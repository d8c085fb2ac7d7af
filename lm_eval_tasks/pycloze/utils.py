"""Loads the task's items from the JSON lines file beside this module (no network, any cwd)."""

import json
from pathlib import Path

import datasets

DATA = Path(__file__).with_name("pycloze.jsonl")


def load(**_: object) -> dict[str, datasets.Dataset]:
    """lm-eval's `custom_dataset` hook: the test split (it passes the task metadata, unused here)."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
