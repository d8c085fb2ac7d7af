"""SentencePiece BPE tokenizer: train on a corpus sample (cached by a hash of the spec) or load.

The model is trained for exact round trips: identity normalization, no dummy prefix, whitespace
kept, byte fallback (every string encodes, no <unk>). SentencePiece writes spaces as U+2581
("▁"), so a literal U+2581 in the input is encoded through its byte pieces instead.

    python -m data.tokenizer train [--vocab-size N] [--out FILE] [key=value ...]
    python -m data.tokenizer encode --model FILE "some text"
    python -m data.tokenizer decode --model FILE 17 42 7
    python -m data.tokenizer info --model FILE

Overrides are train's `data.*` keys without the prefix, in train's syntax (`data.cli`), e.g.
`'sources=[{kind:files,path:"books/*.jsonl"}]' tokenizer.sample_docs=200`.

A Hugging Face tokenizer (`tokenizer.json`, the `tokenizers` library) loads as `HFTokenizer`, with
the same interface; `load_tokenizer(path)` reads whichever a directory or a file holds (a model
directory, a run's checkpoint, or `data.tokenizer.model_path`). Both kinds live here, past 500
lines, on purpose: they share the role ids, the file rules and the one loader every command reads
a tokenizer with.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Optional

import sentencepiece as spm

from data.cli import OneLineParser, data_config, fail
from data.config import DataConfig, DataError, check_dir
from data.sources import by_document, check_sources, open_source, stdlib_fingerprint, text_of

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
_SPACE_PIECE = "\u2581"
_CACHE_VERSION = 1
# The names a tokenizer file goes by in a directory (a model directory, a checkpoint), in the order
# `load_tokenizer` looks for them: a Hugging Face directory's fast tokenizer first, as AutoTokenizer.
HF_TOKENIZER_FILE, SP_TOKENIZER_FILE = "tokenizer.json", "tokenizer.model"
TOKENIZER_FILES = (HF_TOKENIZER_FILE, SP_TOKENIZER_FILE)
HF_ROLES_FILE = "tokenizer_config.json"  # which tokens are EOS, BOS, pad and unk (transformers' file)
# A Hugging Face tokenizer's other files, carried as they are from its directory into a run and its
# export: the special tokens (transformers 4's file) and the chat template (transformers 5's file).
HF_CARRIED_FILES = ("special_tokens_map.json", "chat_template.jinja")
_ROLES = ("eos", "bos", "pad", "unk")


class Tokenizer:
    """A loaded SentencePiece model with exact `encode`/`decode`; picklable for dataloader workers."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not Path(self.path).is_file():
            raise FileNotFoundError(f"tokenizer model {self.path!r} does not exist (or is not a file)")
        self._proto = Path(self.path).read_bytes()
        self._load()

    def _load(self) -> None:
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
        except RuntimeError:
            self._sp = None
        if self._sp is None or self._sp.get_piece_size() <= EOS_ID or self._sp.eos_id() < 0:
            raise DataError(f"{self.path} is not a SentencePiece tokenizer model; use a .model file written by "
                            "`python -m data.tokenizer train` (or a run's tokenizer.model)")
        self.vocab_size: int = self._sp.get_piece_size()
        self.pad_id: int = self._sp.pad_id()
        self.unk_id: int = self._sp.unk_id()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        space_bytes = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _SPACE_PIECE.encode()]
        self._space_ids = space_bytes if self.unk_id not in space_bytes else None

    def __getstate__(self) -> dict:
        return {"path": self.path, "_proto": self._proto}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._proto).hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS added)."""
        if _SPACE_PIECE not in text or self._space_ids is None:
            return self._sp.encode(text)
        ids: list[int] = []
        for i, part in enumerate(text.split(_SPACE_PIECE)):
            if i:
                ids += self._space_ids
            ids += self._sp.encode(part)
        return ids

    def piece(self, token_id: int) -> str:
        """The vocabulary entry of an id (`▁` marks a leading space)."""
        return self._sp.id_to_piece(token_id)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; an id outside the vocabulary is a `ValueError` naming it."""
        ids = [int(i) for i in ids]
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is out of range: this tokenizer ({self.path}) "
                             f"has ids 0..{self.vocab_size - 1}")
        return self._sp.decode(ids)

    def files(self) -> dict[str, bytes]:
        """What a run stores to load this tokenizer again (`load_tokenizer` on that directory)."""
        return {SP_TOKENIZER_FILE: self._proto}

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (a printable character per byte), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _byte_decoder()


def _mentions_byte_level(node) -> bool:
    """Whether a tokenizer.json component (or a Sequence of them) is byte-level."""
    if isinstance(node, dict):
        return node.get("type") == "ByteLevel" or any(_mentions_byte_level(v) for v in node.values())
    if isinstance(node, list):
        return any(_mentions_byte_level(v) for v in node)
    return False


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` library) with `Tokenizer`'s interface;
    picklable for dataloader workers.

    `roles` gives the token of each of eos, bos, pad, unk, as its text or its id (None: the tokenizer
    has none, id -1, as SentencePiece says): `load_tokenizer` reads them from the model's files
    (`hf_roles`); they are kept as text, the form tokenizer_config.json stores. `config` is the
    directory's tokenizer_config.json and `carried` its `HF_CARRIED_FILES`: a run stores them and its
    export writes them back (`files`), so AutoTokenizer there is the imported one (its class, special
    tokens, chat template) with the roles the run trained with. EOS is required (the
    stream ends every document with it). `encode` adds no special token and never matches one in
    the text (transformers' `split_special_tokens`): "</s>" in a document is text, so EOS appears
    only where the stream puts it and `data.synthetic.document_ids` counts documents right; a
    tokenizer whose model still maps text to its EOS is refused at load. `piece` writes a leading
    space as "▁" (SentencePiece's mark) for byte-level vocabularies too (GPT-2's "Ġ").
    """

    def __init__(self, path: str | os.PathLike, roles: dict[str, str | int | None], config: dict | None = None,
                 carried: dict[str, bytes] | None = None):
        self.path = str(path)
        if not Path(self.path).is_file():
            raise FileNotFoundError(f"tokenizer {self.path!r} does not exist (or is not a file)")
        self._json = Path(self.path).read_bytes()
        self.roles = roles
        self.config = config or {}
        self.carried = carried or {}
        self._load()

    def _load(self) -> None:
        from tokenizers import Tokenizer as Backend

        try:
            spec = json.loads(self._json)
            self._backend = Backend.from_str(self._json.decode())
        except Exception as error:  # noqa: BLE001 - json and tokenizers raise several types for a bad file
            raise DataError(f"{self.path} is not a Hugging Face tokenizer.json ({type(error).__name__}: "
                            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''})") from None
        self._backend.encode_special_tokens = True  # special tokens in the text are text
        self._byte_level = _mentions_byte_level([spec.get("pre_tokenizer"), spec.get("decoder")])
        self.vocab_size: int = self._backend.get_vocab_size(with_added_tokens=True)
        ids, texts = {}, {}
        for role in _ROLES:
            given = self.roles.get(role)
            texts[role] = self._backend.id_to_token(given) if isinstance(given, int) else given
            ids[role] = -1 if given is None else self._backend.token_to_id(texts[role]) if texts[role] else None
            if ids[role] is None:
                raise DataError(f"tokenizer {self.path}: its {role} token {given!r} is not in its vocabulary")
        self.roles = texts
        if ids["eos"] < 0:
            raise DataError(f"tokenizer {self.path} has no EOS token (config.json eos_token_id, "
                            f"{HF_ROLES_FILE} eos_token): training ends every document with it")
        self.eos_id: int = ids["eos"]
        self.bos_id: int = ids["bos"]
        self.pad_id: int = ids["pad"]
        self.unk_id: int = ids["unk"]
        eos = self.roles["eos"]
        if any(self.eos_id in self.encode(text) for text in (eos, f"a {eos} b", f"a{eos}b")):
            raise DataError(f"tokenizer {self.path} encodes the text {eos!r} to its EOS id {self.eos_id} even "
                            "with special tokens split: EOS must mark document ends only")

    def __getstate__(self) -> dict:
        return {"path": self.path, "_json": self._json, "roles": self.roles, "config": self.config,
                "carried": self.carried}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._json).hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS added, none matched in it)."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def piece(self, token_id: int) -> str:
        """The vocabulary entry of an id, a leading space written as `▁`."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is out of range: tokenizer {self.path} "
                             f"has ids 0..{self.vocab_size - 1}")
        if self._byte_level:
            raw = b"".join(bytes([_BYTE_DECODER[c]]) if c in _BYTE_DECODER else c.encode() for c in token)
            token = raw.decode("utf-8", errors="replace")
            if token.startswith(" "):
                token = _SPACE_PIECE + token[1:]
        return token

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` (special tokens dropped, as SentencePiece drops its control pieces); an id
        outside the vocabulary is a `ValueError` naming it."""
        ids = [int(i) for i in ids]
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is out of range: this tokenizer ({self.path}) "
                             f"has ids 0..{self.vocab_size - 1}")
        return self._backend.decode(ids, skip_special_tokens=True)

    def files(self) -> dict[str, bytes]:
        """What a run stores to load this tokenizer again, and its export writes: the tokenizer.json
        and the carried files as they are, and the directory's tokenizer_config.json with the roles
        the run uses (token strings), a class AutoTokenizer reads the tokenizer.json with and no
        clean-up of decoded spaces (as `decode`) where it names none."""
        config = {**self.config, **{f"{role}_token": token for role, token in self.roles.items()}}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config.setdefault("clean_up_tokenization_spaces", False)
        return {HF_TOKENIZER_FILE: self._json, HF_ROLES_FILE: (json.dumps(config, indent=2) + "\n").encode(),
                **self.carried}

    def __repr__(self) -> str:
        return f"HFTokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


def _read_json(path: Path) -> dict:
    """A JSON object file, {} when absent; one `DataError` line when it does not parse."""
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise DataError(f"{path} is not readable JSON ({error})") from None
    if not isinstance(found, dict):
        raise DataError(f"{path} is not a JSON object")
    return found


def _token_text(value) -> Optional[str]:
    """A tokenizer_config.json token: a string, or transformers' AddedToken dict ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_id(config: dict, role: str, where: Path) -> Optional[int]:
    """config.json's `<role>_token_id` (the first of a list: the stream has one EOS), or None."""
    value = config.get(f"{role}_token_id")
    if isinstance(value, list):
        value = value[0] if value else None
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise DataError(f"{where}: {role}_token_id={value!r} is not a token id")
    return value


def hf_roles(directory: Path) -> dict[str, str | int | None]:
    """The EOS, BOS, pad and unk tokens of the tokenizer in `directory`: the ids of the model's
    config.json (`eos_token_id`, `bos_token_id`, `pad_token_id`: what the weights were trained with)
    first, else the token strings of tokenizer_config.json and special_tokens_map.json."""
    config_path = directory / "config.json"
    config = _read_json(config_path)
    named = {**_read_json(directory / "special_tokens_map.json"), **_read_json(directory / HF_ROLES_FILE)}
    roles: dict[str, str | int | None] = {}
    for role in _ROLES:
        ident = _config_id(config, role, config_path) if role != "unk" else None
        roles[role] = ident if ident is not None else _token_text(named.get(f"{role}_token"))
    return roles


def load_tokenizer(path: str | os.PathLike) -> Tokenizer | HFTokenizer:
    """The tokenizer of a directory (a Hugging Face model directory, a run's checkpoint: its
    tokenizer.json, else its tokenizer.model) or of a file (a `.json` is a Hugging Face
    tokenizer.json, with the roles of the files beside it; anything else a SentencePiece model).

    A SentencePiece model beside a config.json must have that config's EOS (`eos_token_id`): the
    model's EOS is the stream's document end, and the `Tokenizer` class takes it from the model file.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        file = next((path / name for name in TOKENIZER_FILES if (path / name).is_file()), None)
        if file is None:
            raise FileNotFoundError(f"{path} holds no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    elif path.is_file():
        file = path
    else:
        raise FileNotFoundError(f"tokenizer {str(path)!r} does not exist")
    if file.suffix == ".json":
        carried = {name: (file.parent / name).read_bytes() for name in HF_CARRIED_FILES
                   if (file.parent / name).is_file()}
        return HFTokenizer(file, hf_roles(file.parent), _read_json(file.parent / HF_ROLES_FILE), carried)
    tok = Tokenizer(file)
    config_path = file.parent / "config.json"
    eos = _config_id(_read_json(config_path), "eos", config_path)
    if eos is not None and eos != tok.eos_id:
        raise DataError(f"{config_path} says eos_token_id={eos} but {file}'s EOS is {tok.eos_id}: the stream ends "
                        "documents with the tokenizer's EOS, which must be the model's")
    return tok


def _cache_key(cfg: DataConfig) -> str:
    tok = dataclasses.asdict(cfg.tokenizer)
    tok.pop("model_path")
    if tok["digit_group"] == 1:
        tok.pop("digit_group")  # keys of tokenizers cached before the option existed stay valid
    text = [s for s in cfg.sources if s.is_text]
    total = sum(s.weight for s in text)
    synthetic_only = ("task", "loss_on", "queries", "min_len")
    sources = [{k: v for k, v in dataclasses.asdict(s).items() if k not in synthetic_only}
               | {"weight": s.weight / total}
               | ({"split_rule": "document"} if by_document(s) else {})  # its train sample changed with the rule
               for s in text]  # the text sample alone defines the tokenizer, not the synthetic rows
    spec = {
        "version": _CACHE_VERSION,
        "sources": sources,
        "tokenizer": tok,
        "splits": [cfg.val_fraction, cfg.test_fraction],
        "stdlib": stdlib_fingerprint() if any(s.kind == "stdlib" for s in cfg.sources) else None,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def sample_documents(cfg: DataConfig) -> Iterator[str]:
    """The training sample: the first documents of each source's train split, shared by weight."""
    text_sources = [s for s in cfg.sources if s.is_text]
    total = sum(s.weight for s in text_sources)
    for src in text_sources:
        n = max(1, round(cfg.tokenizer.sample_docs * src.weight / total))
        for example in islice(open_source(src, "train", cfg, seed=0), n):
            yield text_of(example, src)


def _sentences(docs: Iterable[str], max_chars: int = 4096) -> Iterator[str]:
    """Lines of the documents (SentencePiece trains on sentences); newlines are byte pieces."""
    for doc in docs:
        for line in doc.split("\n"):
            for i in range(0, len(line), max_chars):
                if line[i : i + max_chars].strip():
                    yield line[i : i + max_chars]


def digit_pieces(group: int) -> list[str]:
    """Every digit string of length 2 .. `group`: SentencePiece matches these longest first."""
    return [str(i).zfill(n) for n in range(2, group + 1) for i in range(10**n)]


def train_tokenizer(cfg: DataConfig, out: str | os.PathLike) -> Tokenizer:
    """Train a BPE model on `sample_documents(cfg)` and write it to `out` (a .model file)."""
    tok = cfg.tokenizer
    names = ", ".join(s.describe() for s in cfg.sources)
    docs = list(sample_documents(cfg))
    if not any(d.strip() for d in docs):
        raise ValueError(f"cannot train a tokenizer: sources {names} gave no text (empty corpus)")
    proto = tempfile.SpooledTemporaryFile()
    spm.set_random_generator_seed(0)  # same corpus + settings -> same model on every node
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(docs),
            model_writer=proto,
            model_type="bpe",
            vocab_size=tok.vocab_size,
            character_coverage=tok.character_coverage,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            user_defined_symbols=digit_pieces(tok.digit_group),
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            input_sentence_size=tok.max_sentences,
            shuffle_input_sentence=True,
            max_sentence_length=16384,
            num_threads=min(4, os.cpu_count() or 1),
            minloglevel=2,
        )
    except RuntimeError as e:
        limit = re.search(r"Vocabulary size too high .*<= (\d+)", str(e))
        if limit:
            raise ValueError(
                f"data.tokenizer.vocab_size={tok.vocab_size} is too large for the corpus sample of "
                f"sources {names} ({len(docs)} documents supports at most {limit.group(1)}); "
                "lower vocab_size or raise sample_docs"
            ) from None
        small = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(e))
        if small:
            raise ValueError(
                f"data.tokenizer.vocab_size={tok.vocab_size} is too small: the characters of sources {names} "
                f"and the special pieces need {small.group(2)}; raise vocab_size"
            ) from None
        raise
    proto.seek(0)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(proto.read())
    os.replace(tmp, out)  # atomic: concurrent readers see a complete model or none
    return Tokenizer(out)


def get_tokenizer(cfg: DataConfig, splits: tuple[str, ...] = ("train", "val")) -> Tokenizer | HFTokenizer:
    """Load `cfg.tokenizer.model_path` (a file or a directory: `load_tokenizer`), or the cached model
    for this spec, training it once.

    First, whatever the tokenizer's origin, the local sources are checked to have documents for
    `splits` (the splits the caller reads; training: train and val) and `cfg.cache_dir` to be
    usable, so a data error is one line before minutes of training, not after.
    Concurrent callers (several ranks) serialize on a file lock; the first trains, the rest load.
    """
    check_sources(cfg, splits)
    if cfg.tokenizer.model_path:
        path = Path(cfg.tokenizer.model_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data.tokenizer.model_path={str(path)!r} does not exist")
        try:
            return load_tokenizer(path)
        except (DataError, FileNotFoundError) as e:
            raise type(e)(f"data.tokenizer.model_path: {e}") from None
    if not any(s.is_text for s in cfg.sources):
        tokens = [s for s in cfg.sources if s.kind == "tokens"]
        if not tokens:
            raise ValueError("synthetic sources alone have no text to train a tokenizer on: add a text source "
                             "or set data.tokenizer.model_path")
        return Tokenizer(Path(tokens[0].path) / "tokenizer.model")
    check_dir(cfg.cache_path, "data.cache_dir")
    path = cfg.cache_path / "tokenizers" / f"{_cache_key(cfg)}.model"
    if path.is_file():
        return Tokenizer(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return Tokenizer(path)
        return train_tokenizer(cfg, path)


def config_from_overrides(overrides: list[str], vocab_size: Optional[int]) -> DataConfig:
    """A DataConfig from overrides in train's syntax (`data.cli.data_config`), `--vocab-size` last."""
    cfg = data_config(overrides)
    if vocab_size is not None:
        cfg.tokenizer = dataclasses.replace(cfg.tokenizer, vocab_size=vocab_size)
    return cfg


def _check_out(out: str) -> None:
    """`--out` is a file path whose directory can be created: refuse a directory or a file in the way."""
    if Path(out).is_dir():
        raise ValueError(f"--out={out!r} is a directory: give a file path, e.g. {Path(out) / 'tokenizer.model'}")
    check_dir(Path(out).parent, "--out's directory")


def main(argv: Optional[list[str]] = None) -> None:
    parser = OneLineParser(prog="python -m data.tokenizer", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    train = sub.add_parser("train", help="train (or reuse from the cache) for a data config")
    train.add_argument("--vocab-size", type=int)
    train.add_argument("--out", help="also copy the model to this file")
    train.add_argument("overrides", nargs="*", help="data overrides in train's syntax, e.g. tokenizer.sample_docs=200")
    for name, help_ in (("encode", "text to ids"), ("decode", "ids to text"), ("info", "model facts")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--model", help=".model or tokenizer.json file, or a directory holding one "
                       "(default: the cached one for the default config)")
        if name == "encode":
            p.add_argument("text", nargs="?", help="text (default: stdin)")
        if name == "decode":
            p.add_argument("ids", nargs="*", type=int, help="ids (default: stdin)")
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            cfg = config_from_overrides(args.overrides, args.vocab_size)
            if args.out:
                _check_out(args.out)
            tok = get_tokenizer(cfg, splits=("train",))
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_bytes(Path(tok.path).read_bytes())
            print(f"{tok.path} vocab_size={tok.vocab_size}")
            return
        tok = load_tokenizer(args.model) if args.model else get_tokenizer(DataConfig(), splits=("train",))
        if args.command == "encode":
            print(" ".join(map(str, tok.encode(args.text if args.text is not None else sys.stdin.read()))))
        elif args.command == "decode":
            if args.ids:
                ids = args.ids
            else:
                words = sys.stdin.read().split()
                bad = next((w for w in words if not w.lstrip("-").isdigit()), None)
                if bad is not None:
                    raise ValueError(f"stdin: {bad!r} is not a token id; give whole numbers separated by spaces")
                ids = [int(w) for w in words]
            sys.stdout.write(tok.decode(ids))
        else:
            print(json.dumps({"path": tok.path, "vocab_size": tok.vocab_size, "pad_id": tok.pad_id,
                              "unk_id": tok.unk_id, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
                              "sha256": tok.sha256}, indent=2))
    except Exception as e:  # noqa: BLE001 -- input errors become one line, anything else re-raises
        fail(e)


if __name__ == "__main__":
    main()
