"""Pre-tokenize a corpus once into memory-mapped token shards, for corpora where tokenizing on
the fly would cost more than reading.

    python -m data.prepare --out data_bin [--splits train,val,test] [--shard-tokens N] [key=value ...]

(overrides: train's `data.*` keys without the prefix, in train's syntax; see `data.cli`)

writes `data_bin/{split}_{i:05d}.bin` (documents + EOS, concatenated, uint16 when the vocabulary
fits, else uint32), `data_bin/tokenizer.model` and `data_bin/meta.json`. Train on it with
`data.sources=[{kind: tokens, path: data_bin}]`: same loader, same resume contract.

A tokens source is cut into blocks of the concatenated split; consumer c of C (rank x worker)
takes every C-th block of the epoch order, which for `train` is a fresh two-level permutation
per epoch (chunks of blocks, then blocks within a chunk: a global shuffle in bounded memory).
Its state is just (epoch, blocks taken), and after a resume on another world size, until that
epoch ends, where the new consumers started and the blocks the old ones left (`TokenCursor`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from data.cli import OneLineParser, fail
from data.config import SPLITS, DataConfig, SourceConfig, check_dir, check_split
from data.sources import open_source, text_of
from data.tokenizer import Tokenizer, config_from_overrides, get_tokenizer

META = "meta.json"
CHUNK = 4096  # blocks per chunk of the two-level shuffle


def prepare(cfg: DataConfig, out: str | Path, *, splits: tuple[str, ...] = SPLITS,
            shard_tokens: int = 100_000_000) -> dict:
    """Tokenize every text source's documents of each split into shards under `out`.

    Everything that can be checked cheaply is checked before the tokenizer (and `out`) is made:
    the arguments, `out` being a directory, every source having documents for every split.
    """
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens={shard_tokens} must be >= 1 (tokens per shard file)")
    for split in splits:
        check_split(split)
    for src in cfg.sources:
        if not src.is_text:
            raise ValueError(f"source {src.describe()} is not a text corpus: prepare text sources only")
    out = Path(out)
    check_dir(out, "--out")
    tok = get_tokenizer(cfg, splits=tuple(dict.fromkeys(("train", *splits))))  # checks the sources first
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    shutil.copyfile(tok.path, out / "tokenizer.model")
    meta = {"tokenizer_sha256": tok.sha256, "dtype": np.dtype(dtype).name, "eos_id": tok.eos_id,
            "vocab_size": tok.vocab_size, "splits": {}}
    for split in splits:
        check_split(split)
        meta["splits"][split] = _write_split(cfg, tok, split, out, dtype, shard_tokens)
    (out / META).write_text(json.dumps(meta, indent=1))
    return meta


def _write_split(cfg: DataConfig, tok: Tokenizer, split: str, out: Path, dtype: type,
                 shard_tokens: int) -> dict:
    """Write one split's shards of at least `shard_tokens` tokens (the last may be short); its meta entry."""
    shards, buf, n_buf, docs = [], [], 0, 0

    def flush() -> None:
        nonlocal buf, n_buf
        if n_buf:
            name = f"{split}_{len(shards):05d}.bin"
            np.concatenate(buf).astype(dtype).tofile(out / name)
            shards.append({"file": name, "tokens": n_buf})
            buf, n_buf = [], 0

    for src in cfg.sources:
        for example in open_source(src, split, cfg, seed=cfg.seed):
            ids = tok.encode(text_of(example, src))
            ids.append(tok.eos_id)
            buf.append(np.asarray(ids, dtype=np.int64))
            n_buf += len(ids)
            docs += 1
            if n_buf >= shard_tokens:
                flush()
    flush()
    return {"shards": shards, "documents": docs}


class TokenCursor:
    """Blocks of a prepared split for consumer `index` of `consumers` (see module docstring).

    A block is named by its (epoch, position in that epoch's order). The consumer's k-th block of
    an epoch is position `start + index + k * consumers`; a run resumed on another world size
    first shares out the positions the old consumers left behind (`pending`) and starts at
    `start`, the first position none of them reached (`data.stream.continuation`), so the epoch
    is read exactly once whatever the world sizes.
    """

    def __init__(self, src: SourceConfig, tokenizer: Tokenizer, *, split: str, seed: int,
                 index: int, consumers: int, infinite: bool):
        root = Path(src.path)
        if not (root / META).is_file():
            raise FileNotFoundError(f"source {src.describe()}: no {META}; run `python -m data.prepare --out {root}`")
        meta = json.loads((root / META).read_text())
        if meta["tokenizer_sha256"] != tokenizer.sha256:
            raise ValueError(f"source {src.describe()} was tokenized with another tokenizer "
                             f"({root / 'tokenizer.model'})")
        if split not in meta["splits"] or not meta["splits"][split]["shards"]:
            raise ValueError(f"source {src.describe()}: split {split!r} was not prepared or is empty")
        shards = meta["splits"][split]["shards"]
        self._maps = [np.memmap(root / s["file"], dtype=meta["dtype"], mode="r") for s in shards]
        self._starts = np.cumsum([0] + [s["tokens"] for s in shards])
        self.src, self.seed, self.index, self.consumers, self.infinite = src, seed, index, consumers, infinite
        self._chunks: dict[int, np.ndarray] = {}  # the chunk order of the epoch last read

    def reset(self, state: Optional[dict]) -> None:
        state = state or {}
        self.epoch, self.k = state.get("epoch", 0), state.get("k", 0)
        self.start = state.get("start", 0)
        self.pending = [tuple(item) for item in state.get("pending", [])]
        self._mine = self.pending[self.index :: self.consumers]
        self._n_blocks: Optional[int] = None
        self._order_key: tuple = ()

    def state(self) -> dict:
        state = {"epoch": self.epoch, "k": self.k}
        if self.start or self.pending:
            state.update(start=self.start, pending=[list(item) for item in self.pending])
        return state

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        """Global token range [start, stop) across shard boundaries."""
        parts = []
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self._starts[i + 1]))
            parts.append(self._maps[i][start - self._starts[i] : end - self._starts[i]])
            start, i = end, i + 1
        return np.concatenate(parts).astype(np.int64)

    def _block_at(self, epoch: int, p: int) -> int:
        """Block index at position p of the epoch's order."""
        if not self.infinite:
            return p
        full = self._n_blocks // CHUNK  # full chunks are permuted; the tail chunk stays last
        if epoch not in self._chunks:
            self._chunks = {epoch: np.random.default_rng([self.seed, epoch]).permutation(full)}
        slot = p // CHUNK
        chunk = int(self._chunks[epoch][slot]) if slot < full else slot
        if self._order_key != (epoch, chunk):
            size = min(CHUNK, self._n_blocks - chunk * CHUNK)
            self._within = np.random.default_rng([self.seed, epoch, chunk]).permutation(size)
            self._order_key = (epoch, chunk)
        return chunk * CHUNK + int(self._within[p % CHUNK])

    def next_position(self, n: int) -> Optional[tuple[int, int]]:
        """The (epoch, position) of this consumer's next block of n tokens (None at the end of a
        one-pass split); advances the cursor without reading tokens."""
        if self._n_blocks is None:
            self._n_blocks = int(self._starts[-1]) // n
            if self._n_blocks == 0:
                raise ValueError(f"source {self.src.describe()}: fewer tokens than one block of {n}")
        if self.k < len(self._mine):
            self.k += 1
            return self._mine[self.k - 1]
        p = self.start + self.index + (self.k - len(self._mine)) * self.consumers
        if p >= self._n_blocks:
            if not self.infinite:
                return None
            self.reset({"epoch": self.epoch + 1})
            self._n_blocks = int(self._starts[-1]) // n
            p = self.index
            if p >= self._n_blocks:
                raise RuntimeError(f"source {self.src.describe()}: fewer blocks than ranks x workers")
        self.k += 1
        return self.epoch, p

    def next_block(self, n: int) -> Optional[np.ndarray]:
        position = self.next_position(n)
        if position is None:
            return None
        b = self._block_at(*position)
        return self._tokens(b * n, (b + 1) * n)


def main(argv: Optional[list[str]] = None) -> None:
    parser = OneLineParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--splits", default=",".join(SPLITS))
    parser.add_argument("--shard-tokens", type=int, default=100_000_000)
    parser.add_argument("overrides", nargs="*", help="data overrides in train's syntax, e.g. tokenizer.vocab_size=8192")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_overrides(args.overrides, None)
        meta = prepare(cfg, args.out, splits=tuple(args.splits.split(",")), shard_tokens=args.shard_tokens)
    except Exception as e:  # noqa: BLE001 -- input errors become one line, anything else re-raises
        fail(e)
    for split, info in meta["splits"].items():
        tokens = sum(s["tokens"] for s in info["shards"])
        print(f"{split}: {info['documents']} documents, {tokens} tokens, {len(info['shards'])} shards", file=sys.stdout)


if __name__ == "__main__":
    main()
