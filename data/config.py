"""Typed data configuration (OmegaConf structured-config compatible: no Literal, checks in __post_init__)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from errors import EXIT_INPUT

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE_KINDS = ("stdlib", "files", "hub", "tokens", "synthetic")
TEXT_KINDS = ("stdlib", "files", "hub")
# RULER's tasks that need no download (its noise and needle haystacks: `data.ruler.tasks`)
RULER_DOWNLOAD_FREE = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
SYNTHETIC_TASKS = ("passkey", "recall") + RULER_DOWNLOAD_FREE
LOSS_ON = ("all", "answer")
SPLITS = ("train", "val", "test")


class DataError(ValueError):
    """An input exists but is unusable (an empty or binary corpus file, no documents for a split,
    a file that is not a tokenizer model, a folder that is not writable): command lines exit 1 on
    it (`exit_code`), and 2 on every other `ValueError` (the command line itself is wrong). A
    `ValueError`, so callers that catch those keep working."""

    exit_code = EXIT_INPUT


def check_dir(path: str | os.PathLike, key: str) -> None:
    """Refuse, before any work, a directory that cannot be created or written into: a file in the
    way (at `path` or above it) or no write permission. `key` names the setting in the message."""
    target = Path(path).expanduser().absolute()
    for p in (target, *target.parents):
        if p.exists():
            if not p.is_dir():
                what = "is" if p == target else f"is under {p}, which is"
                raise ValueError(f"{key}={str(path)!r} {what} a file, not a directory: give {key} a directory path")
            if not os.access(p, os.W_OK | os.X_OK):
                raise DataError(f"{key}={str(path)!r}: {p} is not writable: give {key} a writable directory")
            return


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")


@dataclass
class SourceConfig:
    """One corpus source.

    kind: `stdlib` (this Python's standard-library .py files, no download), `files` (local
    jsonl/json/txt/parquet; `path` is a glob; without `{split}` its documents are split by
    document, see `data.sources`; with `{split}` it names each split's files),
    `hub` (Hugging Face dataset `name`, streamed), `tokens` (a directory written by
    `python -m data.prepare`), `synthetic` (generated retrieval rows, `data.synthetic`).
    split: hub split names for train,val,test (comma separated); unused by other kinds.
    weight: share of the training blocks drawn from this source in a mixture.
    task: for `synthetic`: `passkey` (the evaluation's prompt, random key, depth and length),
      `recall` (multi-query associative recall, `queries` queries per row), or one of RULER's
      download-free tasks (`data.ruler`: niah_single_1, niah_multikey_2, niah_multikey_3, vt, cwe,
      fwe; the prompt filled to the row's length, then a right answer, without one-shot examples).
    hops, chains: for `synthetic` task `vt`: the chains of assignments (RULER's vt: 4 hops, 1 chain).
    loss_on: for `synthetic`: `all` tokens of a row are trained on, or only the `answer` tokens.
    min_len: for `synthetic`: shortest row in tokens; 0: the shortest prompt. Rows are drawn
      uniformly between it and the block length, one per block (the rest is untrained padding).
    """

    kind: str = "stdlib"
    path: str = ""
    name: str = ""
    subset: Optional[str] = None
    split: str = "train,validation,test"
    text_field: str = "text"
    weight: float = 1.0
    task: str = "passkey"
    loss_on: str = "all"
    queries: int = 8
    min_len: int = 0
    hops: int = 4
    chains: int = 1

    def __post_init__(self) -> None:
        _check_choice("data.sources.kind", self.kind, SOURCE_KINDS)
        _check_choice("data.sources.task", self.task, SYNTHETIC_TASKS)
        _check_choice("data.sources.loss_on", self.loss_on, LOSS_ON)
        if self.queries < 1 or self.min_len < 0:
            raise ValueError(f"data.sources.queries={self.queries} must be >= 1 and min_len={self.min_len} >= 0")
        if self.hops < 1 or self.chains < 1:
            raise ValueError(f"data.sources.hops={self.hops} and chains={self.chains} must be >= 1")
        if self.kind in ("files", "tokens") and not self.path:
            raise ValueError(f"data.sources.path is required for kind={self.kind!r}")
        if self.kind == "hub" and not self.name:
            raise ValueError("data.sources.name is required for kind='hub' (e.g. deepmind/pg19)")
        if len(self.split.split(",")) != 3:
            raise ValueError(f"data.sources.split={self.split!r} must name 3 hub splits: train,val,test")
        if not self.weight > 0:
            raise ValueError(f"data.sources.weight={self.weight} must be > 0")

    @property
    def is_text(self) -> bool:
        """Read from documents (and so part of the tokenizer's sample and of evaluation corpora)."""
        return self.kind in TEXT_KINDS

    def describe(self) -> str:
        """Short name used in error messages, e.g. `files:data/*.jsonl`."""
        if self.kind == "synthetic":
            return f"synthetic:{self.task}"
        return {"stdlib": "stdlib", "hub": f"hub:{self.name}"}.get(self.kind, f"{self.kind}:{self.path}")


@dataclass
class TokenizerConfig:
    """SentencePiece BPE with byte fallback, trained on a sample of the train split (or loaded).

    model_path: an existing `.model` file; when empty one is trained and cached under cache_dir.
    sample_docs: documents of the train split used for training (drawn across sources by weight).
    digit_group: numbers are cut left to right into pieces of up to this many digits (1: one
      piece per digit; 2 or 3: every 2- and 3-digit string is a piece, "71432" -> 714 32 with 3).
      A small model retrieves a number by content far more easily when each of its pieces is the
      only piece of its length in the prompt: a 5-digit passkey with 3 is a triple and a pair.
    """

    vocab_size: int = 4096
    model_path: str = ""
    character_coverage: float = 0.9995
    sample_docs: int = 400
    max_sentences: int = 200_000
    digit_group: int = 1

    def __post_init__(self) -> None:
        if self.vocab_size < 300:
            raise ValueError(
                f"data.tokenizer.vocab_size={self.vocab_size} must be >= 300 (256 byte pieces + specials)"
            )
        if not 0.9 <= self.character_coverage <= 1.0:
            raise ValueError(f"data.tokenizer.character_coverage={self.character_coverage} must be in [0.9, 1]")
        if self.digit_group not in (1, 2, 3):
            raise ValueError(f"data.tokenizer.digit_group={self.digit_group} must be 1, 2 or 3")
        if self.sample_docs < 1:
            raise ValueError(f"data.tokenizer.sample_docs={self.sample_docs} must be >= 1")


@dataclass
class DataConfig:
    """The corpus, its tokenizer and the stream settings.

    shuffle_buffer: blocks shuffled together in the train split (0 or 1: no shuffle).
    val_fraction/test_fraction: share of documents in val/test: stdlib files by a hash of their
      path, documents of `files` sources (without `{split}`) by a hashed sequence per file
      (`data.sources.document_split`); not used by `{split}` paths, hub or tokens sources.
    cache_dir: tokenizer cache (relative paths are relative to the repository root).
    """

    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shuffle_buffer: int = 256
    num_workers: int = 1
    seed: int = 1234
    val_fraction: float = 0.05
    test_fraction: float = 0.1
    cache_dir: str = ".cache"

    def __post_init__(self) -> None:
        # OmegaConf hands nested configs over as DictConfig; accept plain dicts too.
        self.sources = [s if isinstance(s, SourceConfig) else SourceConfig(**s) for s in self.sources]
        if not isinstance(self.tokenizer, TokenizerConfig):
            self.tokenizer = TokenizerConfig(**self.tokenizer)
        if not self.sources:
            raise ValueError("data.sources is empty: configure at least one source")
        if self.shuffle_buffer < 0:
            raise ValueError(f"data.shuffle_buffer={self.shuffle_buffer} must be >= 0")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers} must be >= 0")
        in_range = 0 < self.val_fraction < 1 and 0 < self.test_fraction < 1
        if not (in_range and self.val_fraction + self.test_fraction < 1):
            raise ValueError(
                f"data.val_fraction={self.val_fraction} and data.test_fraction={self.test_fraction} "
                "must be in (0, 1) with a sum below 1"
            )

    @property
    def cache_path(self) -> Path:
        path = Path(self.cache_dir).expanduser()
        return path if path.is_absolute() else REPO_ROOT / path


def check_split(split: str) -> None:
    _check_choice("split", split, SPLITS)
