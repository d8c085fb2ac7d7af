"""Local corpora split by document: one file is a whole corpus, with exact resume and sharding."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from data.config import DataConfig, DataError, SourceConfig
from data.documents import long_documents
from data.loader import build_loader
from data.sources import document_split, open_source, text_of
from data.tokenizer import get_tokenizer
from tests.test_data import _assert_same, _resumed, _take

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
SPLITS = ("train", "val", "test")


def _books(path: Path, n: int, words: tuple[int, int] = (5, 40), seed: int = 0) -> list[str]:
    """A jsonl file of `n` unique documents, each naming itself: `<name> words </name>`."""
    rng = random.Random(seed)
    docs = [f"<{path.stem}-{k}> " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
            + f" </{path.stem}-{k}>"
            for k in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d, "id": k}) + "\n" for k, d in enumerate(docs)))
    return docs


def _cfg(path: str, **kw) -> DataConfig:
    kw.setdefault("num_workers", 0)
    kw.setdefault("shuffle_buffer", 0)
    return DataConfig(sources=[SourceConfig(kind="files", path=path)], **kw)


def _split_docs(cfg: DataConfig, split: str, **kw) -> list[str]:
    src = cfg.sources[0]
    return [text_of(e, src) for e in open_source(src, split, cfg, seed=cfg.seed, **kw)]


@pytest.fixture(scope="module")
def book(tmp_path_factory) -> tuple[Path, list[str]]:
    """One file named train.jsonl: its name means nothing, its documents are split."""
    path = tmp_path_factory.mktemp("books") / "books" / "train.jsonl"
    return path, _books(path, 400)


# --- the rule -----------------------------------------------------------------------------------
def test_document_split_fractions_hold_in_every_file():
    for f in range(200):
        key = f"dir/file_{f}.jsonl"
        splits = [document_split(key, i, 0.05, 0.1) for i in range(1000)]
        assert splits == [document_split(key, i, 0.05, 0.1) for i in range(1000)]
        assert abs(splits.count("test") - 100) <= 2 and abs(splits.count("val") - 50) <= 2
        assert set(splits[:34]) == set(SPLITS)  # the documented size for all three splits
    # index 0 is the file's hash alone: a one-document file (txt) is split as a whole file
    assert {document_split(f"f{i}.txt", 0, 0.05, 0.1) for i in range(100)} == set(SPLITS)


def test_one_file_is_split_by_document_and_partitioned(book, monkeypatch):
    path, docs = book
    cfg = _cfg(str(path))
    parts = {s: _split_docs(cfg, s) for s in SPLITS}
    assert sorted(sum(parts.values(), [])) == sorted(docs)  # every document once
    assert abs(len(parts["test"]) - 40) <= 2 and abs(len(parts["val"]) - 20) <= 2
    assert [d for d in docs if d in set(parts["val"])] == parts["val"]  # file order kept
    # the same documents whatever the working directory, the data seed or the file's directory
    monkeypatch.chdir(path.parent.parent)
    assert _split_docs(_cfg("books/train.jsonl", seed=7), "val") == parts["val"]
    moved = path.parent.parent / "elsewhere" / "train.jsonl"
    moved.parent.mkdir()
    moved.write_text(path.read_text())
    assert _split_docs(_cfg(str(moved)), "test") == parts["test"]
    assert sorted(_split_docs(cfg, "val", whole=True)) == sorted(docs)  # eval's explicit corpus: all of it


def test_the_readme_command_trains_and_validates(tok, book):
    """`data.sources=[{kind:files,path:"books/train.jsonl"}]` used to fail with "no file for split 'val'"."""
    path, docs = book
    cfg = _cfg(str(path))
    for split in ("train", "val"):
        batch = _take(build_loader(cfg, tok, split=split, seq_len=15, batch_size=4), 1)[0]
        assert batch.shape == (4, 16)
    val = torch.cat(list(build_loader(cfg, tok, split="val", seq_len=15, batch_size=4))).flatten().tolist()
    expected = [t for d in _split_docs(cfg, "val") for t in tok.encode(d) + [tok.eos_id]]
    assert val == expected[: len(expected) // 16 * 16]


def test_formats_split_by_document(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document number {i}" for i in range(60)]
    pq.write_table(pa.table({"content": texts}), tmp_path / "a.parquet")
    (tmp_path / "b.json").write_text(json.dumps([{"content": t} for t in texts]))
    for name in ("a.parquet", "b.json"):
        cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / name), text_field="content")])
        parts = {s: _split_docs(cfg, s) for s in SPLITS}
        assert sorted(sum(parts.values(), [])) == sorted(texts) and all(parts.values()), name


def test_placeholder_paths_keep_their_files(tmp_path):
    _books(tmp_path / "train.jsonl", 5)
    val = _books(tmp_path / "val.jsonl", 3, seed=1)
    cfg = _cfg(str(tmp_path / "{split}.jsonl"))
    assert _split_docs(cfg, "val") == val and len(_split_docs(cfg, "train")) == 5


# --- resume and sharding ------------------------------------------------------------------------
def test_resume_three_times_one_file(tok, tmp_path):
    path = tmp_path / "small.jsonl"
    _books(path, 20)  # about 2000 tokens of train documents: 120 batches of 3 x 16 cross epochs
    def make():
        return build_loader(_cfg(str(path), shuffle_buffer=5), tok, split="train", seq_len=15, batch_size=3)

    loader = make()
    ref = _take(loader, 120)
    assert loader.state_dict()["dataset_state"]["start"]["sources"][0]["epoch"] >= 1  # crosses an epoch
    _assert_same(_resumed(make, [7, 43, 101], 120), ref)


def test_ranks_partition_a_one_file_split(tok, book):
    """One file, 3 ranks: every 3rd document each; together the single-process split, once."""
    path, _ = book
    cfg = _cfg(str(path))
    single = _split_docs(cfg, "test")
    from datasets.distributed import split_dataset_by_node

    seen = []
    for rank in range(3):
        ds = split_dataset_by_node(open_source(cfg.sources[0], "test", cfg, seed=cfg.seed), rank=rank, world_size=3)
        mine = [e["text"] for e in ds]
        assert mine == single[rank::3]
        seen += mine
    assert sorted(seen) == sorted(single)
    def make():
        return build_loader(cfg, tok, split="train", seq_len=15, batch_size=2, rank=1, world_size=3)

    _assert_same(_resumed(make, [5, 19], 40), _take(make(), 40))


@pytest.mark.slow
@pytest.mark.parametrize("rank,world_size", [(0, 1), (1, 2)])
def test_resume_files_two_workers(tok, tmp_path, rank, world_size):
    """Workers take whole files (2 per rank here), ranks too when the count divides."""
    for name in "abcd":
        _books(tmp_path / f"{name}.jsonl", 40, seed=ord(name))

    def make():
        return build_loader(_cfg(str(tmp_path / "*.jsonl"), num_workers=2, shuffle_buffer=4), tok, split="train",
                            seq_len=15, batch_size=3, rank=rank, world_size=world_size)

    _assert_same(_resumed(make, [5, 18, 31], 60), _take(make(), 60))


# --- checked before the tokenizer is trained ----------------------------------------------------
def test_missing_split_file_fails_before_the_tokenizer_trains(tmp_path):
    _books(tmp_path / "train.jsonl", 50)
    cache = tmp_path / "cache"
    cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "{split}.jsonl"))], cache_dir=str(cache))
    with pytest.raises(FileNotFoundError, match=r"no file for split 'val' matches .*val\.jsonl"):
        get_tokenizer(cfg)
    assert not cache.exists()


def test_too_few_documents_for_a_split_fails_before_the_tokenizer_trains(tmp_path):
    _books(tmp_path / "tiny.jsonl", 3)
    cache = tmp_path / "cache"
    cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "tiny.jsonl"))], cache_dir=str(cache))
    with pytest.raises(DataError, match=r"split 'val' got none of the source's 3 non-empty documents"
                                        r".*raise data.val_fraction"):
        get_tokenizer(cfg)
    assert not cache.exists()


def test_long_documents_of_a_whole_file(tok, tmp_path):
    """Eval's explicit files: every long document, whatever its split (a 4-document file has none in test)."""
    path = tmp_path / "test.jsonl"
    docs = _books(path, 4, words=(200, 220))
    cfg = _cfg(str(path))
    assert len(_split_docs(cfg, "test")) < 4
    got = long_documents(cfg, tok, min_tokens=100, n_docs=4, whole=True)
    assert sorted(got) == sorted(tok.encode(d)[:100] for d in docs)
    with pytest.raises(ValueError, match="in all documents of sources files:"):
        long_documents(cfg, tok, min_tokens=100, n_docs=5, whole=True)
