"""Corpus sources: each (source, split, epoch) opens as a `datasets.IterableDataset` of records.

Sources are read with the `datasets` streaming machinery so that sharding by rank
(`split_dataset_by_node`) and by dataloader worker, and the resumable position
(`IterableDataset.state_dict`), are the library's. Documents are whole files for `stdlib`
and `txt` files, records for jsonl/json/parquet and hub datasets; `text_of` reads a record's
configured text field (directly: no `.map()` stage whose resume could skip, datasets#8145).

Splits: `stdlib` and `files` sources assign each file to train/val/test by a hash of its
path (files are documents or shards, so no document is cut between splits); a `files` path
containing `{split}` names the files of each split instead. Hub sources use their own splits.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
from itertools import takewhile
from pathlib import Path
from typing import Iterator

import datasets
import numpy as np

from data.config import DataConfig, SourceConfig, check_split

TEXT_FEATURES = datasets.Features({"text": datasets.Value("string")})
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def split_of(key: str, val_fraction: float, test_fraction: float) -> str:
    """Deterministic split of a document or file by a hash of its key (path)."""
    u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return "test" if u < test_fraction else "val" if u < test_fraction + val_fraction else "train"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[str]:
    """Relative paths of this Python's standard-library .py files (site-packages excluded), sorted."""
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        rel = Path(dirpath).relative_to(root)
        found += [str(rel / f) for f in filenames if f.endswith(".py")]
    return sorted(found)


def stdlib_fingerprint() -> str:
    """Identifies the stdlib corpus (for the tokenizer cache key)."""
    return f"{sys.version}|{stdlib_root()}|{len(stdlib_files())}"


def _read_text_files(paths: list[str]) -> Iterator[dict]:
    """Generator for `from_generator`: one document per file; invalid UTF-8 bytes become U+FFFD."""
    for path in paths:
        with open(path, "rb") as f:
            yield {"text": f.read().decode("utf-8", errors="replace")}


def _epoch_order(items: list[str], seed: int, epoch: int) -> list[str]:
    """A fixed permutation per (seed, epoch): document order changes between epochs."""
    perm = np.random.default_rng([seed, epoch]).permutation(len(items))
    return [items[i] for i in perm]


def _glob_base(pattern: str) -> str:
    """The directory part of a glob before its first wildcard."""
    parts = Path(pattern).parts
    fixed = list(takewhile(lambda p: not glob.has_magic(p), parts))
    base = os.path.join(*fixed) if fixed else "."
    return base if os.path.isdir(base) else os.path.dirname(base) or "."


def _match_files(src: SourceConfig, split: str, cfg: DataConfig) -> list[str]:
    pattern = os.path.expanduser(src.path)
    if "{split}" in pattern:
        files = sorted(glob.glob(pattern.replace("{split}", split), recursive=True))
        where = pattern.replace("{split}", split)
    else:
        all_files = sorted(glob.glob(pattern, recursive=True))
        if not all_files:
            raise FileNotFoundError(f"source {src.describe()}: no file matches {pattern!r}")
        base = _glob_base(pattern)  # keys independent of the working directory
        files = [f for f in all_files
                 if split_of(os.path.relpath(f, base), cfg.val_fraction, cfg.test_fraction) == split]
        where = f"{pattern} ({len(all_files)} files, assigned to splits by a hash of their path)"
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise FileNotFoundError(
            f"source {src.describe()}: no file for split {split!r} in {where}; "
            "use more files or a '{split}' placeholder in the path"
        )
    exts = {Path(f).suffix for f in files}
    unknown = exts - FILE_BUILDERS.keys()
    if unknown or len({FILE_BUILDERS[e] for e in exts}) != 1:
        raise ValueError(
            f"source {src.describe()}: files must share one format of {', '.join(FILE_BUILDERS)}; found {sorted(exts)}"
        )
    return files


def source_files(src: SourceConfig, split: str, cfg: DataConfig) -> list[str]:
    """The files (shards) of a stdlib or files source for a split, in their fixed order."""
    check_split(split)
    if src.kind == "stdlib":
        root = stdlib_root()
        files = [str(root / f) for f in stdlib_files() if split_of(f, cfg.val_fraction, cfg.test_fraction) == split]
        if not files:
            raise ValueError(f"source stdlib: no .py files for split {split!r} under {root}")
        return files
    if src.kind == "files":
        return _match_files(src, split, cfg)
    raise ValueError(f"source {src.describe()} has no local files")


def open_source(src: SourceConfig, split: str, cfg: DataConfig, *, seed: int, epoch: int = 0) -> datasets.IterableDataset:
    """A fresh streaming dataset of {"text": ...} for one source and split.

    A fresh object per epoch (rather than `set_epoch`) because `datasets` keeps the epoch in
    shared memory across dataloader workers, which would couple the workers' epochs.
    """
    check_split(split)
    if src.kind == "stdlib":
        paths = _epoch_order(source_files(src, split, cfg), seed, epoch)
        return datasets.IterableDataset.from_generator(
            _read_text_files, features=TEXT_FEATURES, gen_kwargs={"paths": paths}
        )
    if src.kind == "files":
        files = _epoch_order(source_files(src, split, cfg), seed, epoch)
        builder = FILE_BUILDERS[Path(files[0]).suffix]
        kwargs = {"text": {"sample_by": "document", "encoding_errors": "replace"},
                  # json re-decodes with `encoding_errors` only for an encoding other than "utf-8":
                  # "utf-8-sig" is UTF-8 (minus a BOM), so invalid bytes become U+FFFD, not a crash
                  "json": {"encoding": "utf-8-sig", "encoding_errors": "replace"}}.get(builder, {})
        ds = datasets.load_dataset(builder, data_files={"train": files}, split="train", streaming=True, **kwargs)
    elif src.kind == "hub":
        hub_split = src.split.split(",")[("train", "val", "test").index(split)].strip()
        ds = datasets.load_dataset(src.name, src.subset, split=hub_split, streaming=True)
    else:
        raise ValueError(f"source {src.describe()}: kind {src.kind!r} holds tokens, not text")
    return ds


def text_of(example: dict, src: SourceConfig) -> str:
    """The document text of an example, or a clear error naming the source and the fields."""
    text = example.get(src.text_field)
    if not isinstance(text, str):
        fields = ", ".join(k for k in example) or "none"
        raise ValueError(
            f"source {src.describe()}: records have no text field {src.text_field!r} "
            f"(fields: {fields}); set data.sources[].text_field"
        )
    return text


def check_source(src: SourceConfig, split: str, cfg: DataConfig) -> None:
    """Fail early on a missing path, an empty corpus or a missing text field."""
    ds = open_source(src, split, cfg, seed=cfg.seed)
    for example in ds:
        if text_of(example, src):
            return
    raise ValueError(f"source {src.describe()}: split {split!r} has no non-empty documents (empty corpus)")
