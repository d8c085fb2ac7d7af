"""Long documents for length-extrapolation evaluation (perplexity at 8K, 16K, ... tokens)."""

from __future__ import annotations

from data.config import DataConfig, check_split
from data.sources import by_document, open_source, text_of
from data.tokenizer import Tokenizer


def long_documents(cfg: DataConfig, tokenizer: Tokenizer, *, min_tokens: int, n_docs: int,
                   split: str = "test", seed: int = 0, whole: bool = False) -> list[list[int]]:
    """The first `n_docs` documents with >= `min_tokens` tokens, each truncated to `min_tokens`.

    Sources are read in config order, each in its seeded document order, so the result is a
    function of (corpus, tokenizer, split, seed). Ids are the raw document tokens: no BOS/EOS
    (training streams put EOS between documents; prepend `tokenizer.eos_id` to mimic that).
    `whole`: by-document `files` sources give all their documents, not just `split`'s
    (`data.sources.open_source`; how `python -m eval` reads explicitly named files).
    """
    check_split(split)
    if min_tokens < 1 or n_docs < 1:
        raise ValueError(f"min_tokens={min_tokens} and n_docs={n_docs} must be >= 1")
    found: list[list[int]] = []
    for src in cfg.sources:
        if not src.is_text:
            continue
        for example in open_source(src, split, cfg, seed=seed, whole=whole):
            text = text_of(example, src)
            if len(text.encode("utf-8", errors="replace")) < min_tokens:
                continue  # a token is at least one byte: cannot reach min_tokens
            ids = tokenizer.encode(text)
            if len(ids) >= min_tokens:
                found.append(ids[:min_tokens])
                if len(found) == n_docs:
                    return found
    names = ", ".join(s.describe() for s in cfg.sources)
    where = "all documents" if whole and any(by_document(s) for s in cfg.sources) else f"split {split!r}"
    raise ValueError(
        f"only {len(found)} documents with >= {min_tokens} tokens in {where} of sources {names}; "
        f"asked for {n_docs}"
    )


def count_long_documents(cfg: DataConfig, tokenizer: Tokenizer, thresholds: list[int],
                         split: str = "test") -> dict[int, int]:
    """How many documents of a split reach each token count (text sources)."""
    check_split(split)
    lengths = [len(tokenizer.encode(text_of(e, src))) for src in cfg.sources if src.is_text
               for e in open_source(src, split, cfg, seed=0)]
    return {t: sum(n >= t for n in lengths) for t in thresholds}


def main(argv: list[str] | None = None) -> None:
    """`python -m data.documents [split] [key=value ...]`: long-document counts of a data config."""
    from data.cli import OneLineParser, fail
    from data.tokenizer import config_from_overrides, get_tokenizer

    parser = OneLineParser(prog="python -m data.documents", description=main.__doc__.split(": ")[1])
    parser.add_argument("split", nargs="?", default="test", help="train | val | test (default: test)")
    parser.add_argument("overrides", nargs="*", help="data overrides in train's syntax, e.g. tokenizer.vocab_size=8192")
    args = parser.parse_args(argv)
    if "=" in args.split:  # no split given: the first argument is an override
        args.overrides.insert(0, args.split)
        args.split = "test"
    try:
        cfg = config_from_overrides(args.overrides, None)
        check_split(args.split)
        tokenizer = get_tokenizer(cfg, splits=tuple(dict.fromkeys(("train", args.split))))
        counts = count_long_documents(cfg, tokenizer, [4096, 8192, 16384, 32768, 65536], args.split)
    except Exception as e:  # noqa: BLE001 -- input errors become one line, anything else re-raises
        fail(e)
    for t, n in counts.items():
        print(f"{args.split}: {n} documents with >= {t} tokens")


if __name__ == "__main__":
    main()
