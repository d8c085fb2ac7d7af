"""Corpus sources: each (source, split, epoch) opens as a `datasets.IterableDataset` of records.

Sources are read with the `datasets` streaming machinery so that sharding by rank
(`split_dataset_by_node`) and by dataloader worker, and the resumable position
(`IterableDataset.state_dict`), are the library's. Documents are whole files for `stdlib`
and `txt` files, records for jsonl/json/parquet and hub datasets; `text_of` reads a record's
configured text field (directly: no `.map()` stage whose resume could skip, datasets#8145).

Splits (README, Data):
- `files` without `{split}` in the path: split **by document**, so one file is a whole corpus.
  Document i of a file (0-based, in file order) goes to test when u < test_fraction, else to val
  when u < test_fraction + val_fraction, else to train, with u = frac(h + i * 0.618...) and h a
  hash of the file's path relative to the glob's directory (`document_split`). The golden-ratio
  sequence spreads each file's documents evenly: every split's share holds to a document or two
  and a file of 34+ documents (default fractions) has documents in all three. It is fixed by the
  files alone (not by `data.seed`: replicate runs share their test documents), so resume and
  sharding see the same documents in every split. Each split reads every file.
- `files` with `{split}`: the path names each split's files (`books/{split}.jsonl`).
- `stdlib`: whole files by a hash of their path (a file is one document). Hub: their own splits.
- Evaluation may read a by-document source whole (`whole=True`: `python -m eval` with explicit
  `sources=`, which are the evaluation corpus whatever their split).

Corpus files are checked when listed: an empty file holds no documents and is skipped, a binary
one (NUL bytes, or mostly invalid UTF-8, in its first 8 KiB) is refused, naming it.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import logging
import os
import sys
import sysconfig
from collections.abc import Iterator
from itertools import takewhile
from pathlib import Path
from typing import Optional

import datasets
import numpy as np
import pyarrow as pa

from data.config import DataConfig, DataError, SourceConfig, check_split

TEXT_FEATURES = datasets.Features({"text": datasets.Value("string")})
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_GOLDEN = (5**0.5 - 1) / 2
_HEAD = 8192  # bytes of each text file looked at for the binary check


def _unit(key: str) -> float:
    """A uniform number in [0, 1) from a hash of `key`."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def _split_at(u: float, val_fraction: float, test_fraction: float) -> str:
    return "test" if u < test_fraction else "val" if u < test_fraction + val_fraction else "train"


def split_of(key: str, val_fraction: float, test_fraction: float) -> str:
    """Deterministic split of a stdlib file by a hash of its key (path)."""
    return _split_at(_unit(key), val_fraction, test_fraction)


def document_split(file_key: str, index: int, val_fraction: float, test_fraction: float) -> str:
    """Split of document `index` of a by-document file (module docstring): a golden-ratio
    sequence started at a hash of the file's key, so the fractions hold within every file."""
    return _split_at((_unit(file_key) + index * _GOLDEN) % 1.0, val_fraction, test_fraction)


def by_document(src: SourceConfig) -> bool:
    """Whether a source is split by document (a `files` path without `{split}`)."""
    return src.kind == "files" and "{split}" not in src.path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[str, ...]:
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        rel = Path(dirpath).relative_to(root)
        found += [str(rel / f) for f in filenames if f.endswith(".py")]
    return tuple(sorted(found))


def stdlib_files() -> list[str]:
    """Relative paths of this Python's standard-library .py files (site-packages excluded), sorted
    (walked once per process: the standard library does not change under a running program)."""
    return list(_stdlib_files())


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


@functools.lru_cache(maxsize=65536)
def _looks_binary(path: str, size: int, mtime_ns: int) -> bool:
    """NUL bytes, or mostly invalid UTF-8, in the first 8 KiB (cached per file version)."""
    with open(path, "rb") as f:
        head = f.read(_HEAD)
    if b"\0" in head:
        return True
    text = head.decode("utf-8", errors="replace")
    return text.count("\ufffd") > 0.3 * max(1, len(text) - 3)  # a cut multi-byte tail is not evidence


def _usable_files(src: SourceConfig, files: list[str]) -> list[str]:
    """Regular files only, empty ones dropped (no documents); a binary text-format file refused."""
    kept = []
    for f in files:
        st = os.stat(f) if os.path.isfile(f) else None
        if st is None or st.st_size == 0:
            continue
        if FILE_BUILDERS.get(Path(f).suffix) in ("json", "text") and _looks_binary(f, st.st_size, st.st_mtime_ns):
            raise DataError(
                f"source {src.describe()}: {f} is not UTF-8 text (binary bytes in its first {_HEAD // 1024} KiB); "
                "remove it from the path's glob or convert it to text"
            )
        kept.append(f)
    return kept


def _check_formats(src: SourceConfig, files: list[str]) -> None:
    exts = {Path(f).suffix for f in files}
    unknown = exts - FILE_BUILDERS.keys()
    if unknown or len({FILE_BUILDERS[e] for e in exts}) != 1:
        raise ValueError(
            f"source {src.describe()}: files must share one format of {', '.join(FILE_BUILDERS)}; found {sorted(exts)}"
        )


def _example_glob(directory: str) -> str:
    """A glob of the corpus files in `directory`: its most common readable extension (else .jsonl)."""
    exts = [Path(f).suffix for f in os.listdir(directory) if Path(f).suffix in FILE_BUILDERS]
    ext = max(sorted(set(exts)), key=exts.count) if exts else ".jsonl"
    return os.path.join(directory, f"*{ext}")


def _match_files(src: SourceConfig, split: Optional[str]) -> list[str]:
    """The files of a `files` source: of `split` for a `{split}` path, else all of them."""
    pattern = os.path.expanduser(src.path)
    if "{split}" in pattern:
        if split is None:
            raise ValueError(f"source {src.describe()}: a '{{split}}' path has no whole-corpus view; name a split")
        where = pattern.replace("{split}", split)
        matched = sorted(glob.glob(where, recursive=True))
        if not matched:
            raise FileNotFoundError(
                f"source {src.describe()}: no file for split {split!r} matches {where!r}; "
                "add that split's files, or drop '{split}' from the path to split documents instead"
            )
    else:
        where = pattern
        matched = sorted(glob.glob(pattern, recursive=True))
        if not matched:
            raise FileNotFoundError(f"source {src.describe()}: no file matches {pattern!r}; check data.sources[].path")
    files = _usable_files(src, matched)
    if not files and all(os.path.isdir(m) for m in matched):
        raise ValueError(f"source {src.describe()}: {where!r} is a directory, not corpus files; give a glob "
                         f"of its files, e.g. path: \"{_example_glob(matched[0])}\"")
    if not files:
        raise DataError(
            f"source {src.describe()}: every file matching {where!r} is empty or not a file "
            f"({len(matched)} matched); point data.sources[].path at the corpus files"
        )
    _check_formats(src, files)
    return files


def source_files(src: SourceConfig, split: str, cfg: DataConfig) -> list[str]:
    """The files (shards) a stdlib or files source reads for a split, in their fixed order
    (all of them for a by-document source: its documents are filtered, not its files)."""
    check_split(split)
    if src.kind == "stdlib":
        files = list(_stdlib_split(split, cfg.val_fraction, cfg.test_fraction))
        if not files:
            raise ValueError(f"source stdlib: no .py files for split {split!r} under {stdlib_root()}")
        return files
    if src.kind == "files":
        return _match_files(src, None if by_document(src) else split)
    raise ValueError(f"source {src.describe()} has no local files")


@functools.lru_cache(maxsize=8)
def _stdlib_split(split: str, val_fraction: float, test_fraction: float) -> tuple[str, ...]:
    root = str(stdlib_root())
    return tuple(os.path.join(root, f) for f in _stdlib_files() if split_of(f, val_fraction, test_fraction) == split)


def _field(record: object, field: str, where: str, src_name: str) -> str:
    if isinstance(record, dict) and isinstance(record.get(field), str):
        return record[field]
    fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
    raise DataError(
        f"source {src_name}: {where} has no text field {field!r} (fields: {fields or 'none'}); "
        "set data.sources[].text_field"
    )


def _parquet_file(path: str, src_name: str):
    """`pyarrow.parquet.ParquetFile` of `path` (its footer read), or a `DataError` naming the file."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise _unreadable_parquet(path, src_name, error) from None


def _unreadable_parquet(path: str, src_name: str, error: BaseException) -> DataError:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return DataError(f"source {src_name}: {path} is not a readable parquet file ({reason}); replace or remove it")


def _file_documents(path: str, field: str, src_name: str) -> Iterator[str]:
    """The documents of one corpus file, in file order (txt: the whole file is one document)."""
    builder = FILE_BUILDERS[Path(path).suffix]
    if builder == "text":
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            yield f.read()
    elif builder == "parquet":

        pf = _parquet_file(path, src_name)
        if field not in pf.schema_arrow.names:
            raise DataError(f"source {src_name}: {path} has no text field {field!r} "
                            f"(fields: {', '.join(pf.schema_arrow.names)}); set data.sources[].text_field")
        try:
            for batch in pf.iter_batches(columns=[field]):
                for text in batch.column(0).to_pylist():
                    yield _field({field: text}, field, path, src_name)
        except (pa.ArrowException, OSError) as error:
            raise _unreadable_parquet(path, src_name, error) from None
    elif path.endswith(".jsonl"):
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"source {src_name}: {path} line {lineno} is not JSON ({e.msg}); "
                                    "fix or remove that line") from None
                yield _field(record, field, f"{path} line {lineno}", src_name)
    else:
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"source {src_name}: {path} is not JSON ({e.msg} at line {e.lineno}); "
                                "fix it, or use one record per line (.jsonl)") from None
        if not isinstance(records, list):
            raise DataError(f"source {src_name}: {path} holds a JSON {type(records).__name__}, "
                            "not a list of records; write [{...}, ...] or one record per line (.jsonl)")
        for i, record in enumerate(records):
            yield _field(record, field, f"{path} record {i}", src_name)


def _read_documents(paths: list[str], keys: list[str], *, field: str, split: Optional[str],
                    val_fraction: float, test_fraction: float, src_name: str) -> Iterator[dict]:
    """Generator for `from_generator` (one shard per file): a by-document source's documents of
    `split` (None: all), in file order. Indices count every record, empty ones too, so a
    document's split depends only on its file and position."""
    for path, key in zip(paths, keys):
        for index, text in enumerate(_file_documents(path, field, src_name)):
            if split is None or document_split(key, index, val_fraction, test_fraction) == split:
                yield {field: text}


def _by_document_kwargs(src: SourceConfig, split: str, cfg: DataConfig, *, seed: int, epoch: int,
                        whole: bool) -> dict:
    """`_read_documents`'s arguments: the files in this epoch's order, each with its split key."""
    files = source_files(src, split, cfg)
    base = _glob_base(os.path.expanduser(src.path))  # keys independent of the working directory
    order = _epoch_order(list(range(len(files))), seed, epoch)
    return {"paths": [files[i] for i in order], "keys": [os.path.relpath(files[i], base) for i in order],
            "field": "text" if FILE_BUILDERS[Path(files[0]).suffix] == "text" else src.text_field,
            "split": None if whole else split, "val_fraction": cfg.val_fraction,
            "test_fraction": cfg.test_fraction, "src_name": src.describe()}


def _open_by_document(src: SourceConfig, split: str, cfg: DataConfig, *, seed: int, epoch: int,
                      whole: bool) -> datasets.IterableDataset:
    kwargs = _by_document_kwargs(src, split, cfg, seed=seed, epoch=epoch, whole=whole)
    return datasets.IterableDataset.from_generator(
        _read_documents, features=datasets.Features({kwargs["field"]: datasets.Value("string")}), gen_kwargs=kwargs)


@contextlib.contextmanager
def _no_download_count() -> Iterator[None]:
    """`datasets` counts every load of its json/parquet/text builders with an HTTP request to the Hub,
    local files too (`datasets.load.increase_load_count`). A source reopens each epoch, so a small
    local corpus made one request per epoch: nothing leaves the machine for local files, and a machine
    without network no longer waits on each failed lookup (about 70 ms each here)."""
    counting = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counting


def open_source(src: SourceConfig, split: str, cfg: DataConfig, *, seed: int, epoch: int = 0,
                whole: bool = False) -> datasets.IterableDataset:
    """A fresh streaming dataset of records for one source and split.

    `whole`: a by-document source yields all its documents, whatever their split (evaluation of
    an explicitly named corpus); other sources ignore it.

    A fresh object per epoch (rather than `set_epoch`) because `datasets` keeps the epoch in
    shared memory across dataloader workers, which would couple the workers' epochs.
    """
    check_split(split)
    if src.kind == "stdlib":
        paths = _epoch_order(source_files(src, split, cfg), seed, epoch)
        return datasets.IterableDataset.from_generator(
            _read_text_files, features=TEXT_FEATURES, gen_kwargs={"paths": paths}
        )
    if by_document(src):
        return _open_by_document(src, split, cfg, seed=seed, epoch=epoch, whole=whole)
    if src.kind == "files":
        files = _epoch_order(source_files(src, split, cfg), seed, epoch)
        builder = FILE_BUILDERS[Path(files[0]).suffix]
        kwargs = {"text": {"sample_by": "document", "encoding_errors": "replace"},
                  # json re-decodes with `encoding_errors` only for an encoding other than "utf-8":
                  # "utf-8-sig" is UTF-8 (minus a BOM), so invalid bytes become U+FFFD, not a crash
                  "json": {"encoding": "utf-8-sig", "encoding_errors": "replace"}}.get(builder, {})
        with _no_download_count():
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
        raise DataError(
            f"source {src.describe()}: records have no text field {src.text_field!r} "
            f"(fields: {fields}); set data.sources[].text_field"
        )
    return text


@contextlib.contextmanager
def _located_file_errors(src: SourceConfig, split: str, cfg: DataConfig) -> Iterator[None]:
    """A JSON or parquet file that `datasets` cannot parse, as a `DataError` naming the file (and
    the line, for JSON).

    `datasets` reports only a row or pyarrow's reason (and logs the file on a line of its own): the
    split's files are read again with this module's reader, which names them, and the library's
    log lines are held back.
    """
    logs = [logging.getLogger(f"datasets.packaged_modules.{name}.{name}") for name in ("json", "parquet")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    except (pa.ArrowInvalid, DataError) as error:
        builder = FILE_BUILDERS[Path(source_files(src, split, cfg)[0]).suffix] if src.kind == "files" else None
        if isinstance(error, DataError) or builder not in ("json", "parquet"):
            raise
        for path in source_files(src, split, cfg):
            if builder == "parquet":
                _parquet_file(path, src.describe())
            for _ in _file_documents(path, src.text_field, src.describe()):
                pass
        what = "valid JSON" if builder == "json" else "readable parquet"
        fix = "fix it, or use one record per line (.jsonl)" if builder == "json" else "replace or remove it"
        raise DataError(f"source {src.describe()}: a file of split {split!r} is not {what} ({error}); {fix}") from None
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def check_source(src: SourceConfig, split: str, cfg: DataConfig) -> None:
    """Fail early, with one line naming the source and what to do, on a missing path, an empty
    corpus, a split without documents or a missing text field. Reads the files directly (no
    `datasets` pipeline to build) up to the first document of the split."""
    if src.kind == "stdlib":
        source_files(src, split, cfg)  # standard-library files are never all empty
        return
    with _located_file_errors(src, split, cfg):
        if by_document(src):
            docs = (text_of(e, src) for e in _read_documents(**_by_document_kwargs(src, split, cfg, seed=0, epoch=0,
                                                                                    whole=False)))
        else:
            docs = (text_of(e, src) for e in open_source(src, split, cfg, seed=cfg.seed))
        if any(docs):
            return
    if by_document(src):
        kwargs = _by_document_kwargs(src, split, cfg, seed=0, epoch=0, whole=True)
        sizes = [len(text_of(e, src)) > 0 for e in _read_documents(**kwargs)]
        if any(sizes):
            share = {"train": 1 - cfg.val_fraction - cfg.test_fraction, "val": cfg.val_fraction,
                     "test": cfg.test_fraction}[split]
            fix = ("lower data.val_fraction and data.test_fraction" if split == "train"
                   else f"raise data.{split}_fraction")
            raise DataError(
                f"source {src.describe()}: split {split!r} got none of the source's {sum(sizes)} non-empty "
                f"documents ({share:g} of each file's documents go to {split}); add documents, {fix}, "
                "or name per-split files with '{split}' in the path"
            )
    raise DataError(
        f"source {src.describe()}: no non-empty documents"
        + ("" if by_document(src) else f" for split {split!r}")
        + f" in field {src.text_field!r} (empty corpus); check the files and data.sources[].text_field"
    )


def check_sources(cfg: DataConfig, splits: tuple[str, ...] = ("train", "val")) -> None:
    """Every local text source has documents for each of `splits`; a tokens source has its
    tokenizer. Cheap (reads until a document of each split), so callers run it before any
    expensive work: training a tokenizer, building a model. Hub sources are checked when read."""
    for split in splits:
        check_split(split)
    for src in cfg.sources:
        if src.kind in ("stdlib", "files"):
            for split in splits:
                check_source(src, split, cfg)
        elif src.kind == "tokens" and not (Path(src.path).expanduser() / "tokenizer.model").is_file():
            raise FileNotFoundError(
                f"source {src.describe()}: no tokenizer.model there; write the directory with "
                f"`python -m data.prepare --out {src.path}`"
            )
