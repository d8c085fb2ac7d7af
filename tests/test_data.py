"""data/: tokenizer, sources, packing, sharding, exact resume, mixtures, long documents, prepare."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from data.config import DataConfig, SourceConfig, TokenizerConfig
from data.documents import count_long_documents, long_documents
from data.loader import build_loader
from data.prepare import prepare
from data.sources import open_source, source_files, split_of, text_of
from data.tokenizer import Tokenizer, get_tokenizer
from data.tokenizer import main as tokenizer_cli
from run_checks import clean_env

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def _doc(rng: random.Random, name: str, words: int) -> str:
    return f"<{name}> " + " ".join(rng.choice(WORDS) for _ in range(words)) + f" </{name}>"


def _write_corpus(root: Path, files: dict[str, int], docs_per_file: int,
                  words: tuple[int, int]) -> dict[str, list[str]]:
    """jsonl files under root/{split}/; every document is unique and names itself."""
    rng = random.Random(0)
    texts: dict[str, list[str]] = {}
    for split, n_files in files.items():
        (root / split).mkdir(parents=True)
        for f in range(n_files):
            docs = [_doc(rng, f"{split}-{f}-{k}", rng.randint(*words)) for k in range(docs_per_file)]
            (root / split / f"part-{f:02d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
            texts.setdefault(split, []).extend(docs)
    return texts


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    root = tmp_path_factory.mktemp("corpus")
    # train: short documents so epochs end quickly; val: documents longer than two blocks of 16.
    texts = _write_corpus(root, {"train": 8}, docs_per_file=3, words=(5, 40))
    texts.update(_write_corpus(root, {"val": 8}, docs_per_file=4, words=(30, 80)))
    return root, texts


def _cfg(root: Path, **kw) -> DataConfig:
    kw.setdefault("num_workers", 0)
    kw.setdefault("shuffle_buffer", 0)
    return DataConfig(sources=[SourceConfig(kind="files", path=str(root / "{split}" / "*.jsonl"))], **kw)


def _take(loader, n: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _roundtrip(state: dict) -> dict:
    """Through a checkpoint file as DeepSpeed client state would go (torch.save, safe torch.load)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# --- config -------------------------------------------------------------------------------------
def test_config_errors_name_field_and_allowed_values():
    with pytest.raises(ValueError, match=r"data.sources.kind='foo' is not one of stdlib, files, hub, tokens"):
        SourceConfig(kind="foo")
    with pytest.raises(ValueError, match="data.sources.path is required"):
        SourceConfig(kind="files")
    with pytest.raises(ValueError, match="data.tokenizer.vocab_size=100"):
        TokenizerConfig(vocab_size=100)
    with pytest.raises(ValueError, match="split='dev' is not one of train, val, test"):
        build_loader(DataConfig(), None, split="dev", seq_len=8, batch_size=1)


def test_split_by_hash_is_deterministic_and_proportional():
    keys = [f"dir/file_{i}.py" for i in range(20000)]
    splits = [split_of(k, 0.05, 0.1) for k in keys]
    assert splits == [split_of(k, 0.05, 0.1) for k in keys]
    frac = {s: splits.count(s) / len(keys) for s in ("train", "val", "test")}
    assert abs(frac["test"] - 0.1) < 0.01 and abs(frac["val"] - 0.05) < 0.01


def test_files_without_split_placeholder_are_split_by_document(tmp_path, monkeypatch):
    """txt files are one document each: split as whole files (more in tests/test_data_local.py)."""
    for i in range(60):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}")
    cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "*.txt"))])
    src = cfg.sources[0]
    splits = {s: sorted(text_of(e, src) for e in open_source(src, s, cfg, seed=0)) for s in ("train", "val", "test")}
    assert sorted(sum(splits.values(), [])) == sorted(f"document {i}" for i in range(60))  # a partition
    assert all(splits.values())
    assert source_files(src, "val", cfg) == source_files(src, "train", cfg)  # every split reads every file
    monkeypatch.chdir(tmp_path.parent)  # the assignment does not depend on the working directory
    assert {s: sorted(text_of(e, src) for e in open_source(src, s, cfg, seed=0)) for s in splits} == splits


def test_file_formats_and_text_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "train").mkdir()
    pq.write_table(pa.table({"content": ["a doc", "another doc"], "n": [1, 2]}), tmp_path / "train" / "x.parquet")
    (tmp_path / "train" / "y.json").write_text(json.dumps([{"content": "j1"}, {"content": "j2"}]))
    (tmp_path / "train" / "z.txt").write_text("one whole\nfile\n")
    expected = {"parquet": ["a doc", "another doc"], "json": ["j1", "j2"], "txt": ["one whole\nfile\n"]}
    for ext, texts in expected.items():
        src = SourceConfig(kind="files", path=str(tmp_path / "{split}" / f"*.{ext}"),
                           text_field="text" if ext == "txt" else "content")
        cfg = DataConfig(sources=[src])
        assert [text_of(e, src) for e in open_source(src, "train", cfg, seed=0)] == texts


# --- tokenizer ----------------------------------------------------------------------------------
def test_tokenizer_special_ids(tok):
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 512


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200) | st.sampled_from(["▁", " ▁ a▁▁b ", "\n\t  x", ""]))
def test_tokenizer_round_trip_arbitrary_unicode(tok, text):
    ids = tok.encode(text)
    assert tok.unk_id not in ids
    assert tok.decode(ids) == text


def test_tokenizer_compresses_python(tok):
    text = Path(json.__file__).read_text()
    assert len(tok.encode(text)) < len(text.encode()) / 1.5  # merges, not bytes (vocab 512)


def test_tokenizer_is_cached_by_spec(tok, tmp_path):
    cfg = DataConfig(tokenizer=TokenizerConfig(vocab_size=512, sample_docs=30),
                     cache_dir=str(Path(tok.path).parents[1]))
    trained = Path(tok.path).stat().st_mtime_ns
    again = get_tokenizer(cfg)
    assert again.path == tok.path and Path(tok.path).stat().st_mtime_ns == trained  # found, not retrained
    other = get_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=400, sample_docs=30),
                                     cache_dir=str(tmp_path)))
    assert other.path != tok.path and other.vocab_size == 400
    loaded = get_tokenizer(DataConfig(tokenizer=TokenizerConfig(model_path=other.path)))
    assert loaded.encode("def f(): pass") == other.encode("def f(): pass")


def test_tokenizer_training_is_deterministic(tmp_path):
    """Nodes without a shared cache train their own: they must get the same model."""
    def cfg(d: str) -> DataConfig:
        return DataConfig(tokenizer=TokenizerConfig(vocab_size=400, sample_docs=20, max_sentences=3000),
                          cache_dir=str(tmp_path / d))

    assert get_tokenizer(cfg("a")).sha256 == get_tokenizer(cfg("b")).sha256


@pytest.mark.parametrize("group, pieces", [(2, ["71", "43", "2"]), (3, ["714", "32"])])
def test_tokenizer_digit_group(tok, tmp_path, group, pieces):
    """Numbers are cut left to right into the longest digit groups; the default splits every digit."""
    grouped = get_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=1600, sample_docs=20, digit_group=group),
                                       cache_dir=str(tmp_path)))
    def as_pieces(t: Tokenizer, text: str) -> list[str]:
        return [t.piece(i) for i in t.encode(text)]

    assert as_pieces(grouped, "key 71432.")[-len(pieces) - 1:] == pieces + ["."]
    assert as_pieces(tok, "key 71432.")[-6:] == ["7", "1", "4", "3", "2", "."]
    assert grouped.decode(grouped.encode("x = 1000001")) == "x = 1000001"


def test_tokenizer_pickles(tok):
    import pickle

    copy = pickle.loads(pickle.dumps(tok))
    assert copy.encode("x = 1  # ▁") == tok.encode("x = 1  # ▁")


def test_tokenizer_cli(tok, capsys):
    tokenizer_cli(["encode", "--model", tok.path, "return x ▁"])
    ids = capsys.readouterr().out.split()
    tokenizer_cli(["decode", "--model", tok.path, *ids])
    assert capsys.readouterr().out == "return x ▁"
    tokenizer_cli(["info", "--model", tok.path])
    assert json.loads(capsys.readouterr().out)["eos_id"] == 3


# --- bad input ----------------------------------------------------------------------------------
def test_missing_path_names_source(tok, tmp_path):
    cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "nope" / "*.jsonl"))])
    with pytest.raises(FileNotFoundError, match=r"source files:.*nope.*no file matches"):
        build_loader(cfg, tok, split="train", seq_len=8, batch_size=1)
    with pytest.raises(FileNotFoundError, match="data.tokenizer.model_path"):
        get_tokenizer(DataConfig(tokenizer=TokenizerConfig(model_path=str(tmp_path / "x.model"))))


def test_empty_corpus_names_source(tok, tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "{split}" / "*.jsonl"))])
    with pytest.raises(ValueError, match=r"source files:.*empty corpus"):
        build_loader(cfg, tok, split="train", seq_len=8, batch_size=1)
    with pytest.raises(ValueError, match=r"source files:.*empty corpus"):
        get_tokenizer(cfg)  # found by the sources' check, before any tokenizer training


def test_missing_text_field_names_source_and_fields(tok, tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.jsonl").write_text(json.dumps({"body": "hello", "id": 1}) + "\n")
    cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "{split}" / "*.jsonl"))])
    with pytest.raises(ValueError, match=r"source files:.*no text field 'text' \(fields: body, id\)"):
        build_loader(cfg, tok, split="train", seq_len=8, batch_size=1)
    cfg.sources[0].text_field = "body"
    assert build_loader(cfg, tok, split="train", seq_len=4, batch_size=1) is not None


def test_vocabulary_too_large_for_corpus(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.txt").write_text("tiny corpus of few words")
    cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "{split}" / "*.txt"))],
                     tokenizer=TokenizerConfig(vocab_size=5000), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"vocab_size=5000 is too large for the corpus sample of sources files:"):
        get_tokenizer(cfg, splits=("train",))


def test_invalid_utf8_is_replaced_not_fatal(tok, tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.txt").write_bytes(b"good text \xff\xfe then more " * 20)
    (tmp_path / "train" / "b.jsonl").write_bytes(b'{"text": "ok \xff\xfe bad"}\n{"text": "fine"}\n')
    for ext in ("txt", "jsonl"):
        cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "{split}" / f"*.{ext}"))])
        texts = [e["text"] for e in open_source(cfg.sources[0], "train", cfg, seed=0)]
        assert texts == {"txt": ["good text \ufffd\ufffd then more " * 20],
                         "jsonl": ["ok \ufffd\ufffd bad", "fine"]}[ext]
        batch = _take(build_loader(cfg, tok, split="train", seq_len=4, batch_size=2), 1)[0]
        assert batch.shape == (2, 5)


@pytest.mark.parametrize("ext, line, text", [("jsonl", '{"text": "local words"}\n', "local words"),
                                             ("txt", "local words\n", "local words\n")], ids=["jsonl", "txt"])
def test_local_files_open_without_a_network_request(tmp_path, monkeypatch, ext, line, text):
    """`datasets` pinged the Hub (a download count) on every load of a local json/text file, and a
    source reopens each epoch: no connection is attempted now, and the counter is left as it was."""
    import socket

    import datasets

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:1])
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / f"a.{ext}").write_text(line)
    cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "{split}" / f"*.{ext}"))])
    for epoch in range(2):
        assert [e["text"] for e in open_source(cfg.sources[0], "train", cfg, seed=0, epoch=epoch)] == [text]
    assert attempts == [] and datasets.config.HF_UPDATE_DOWNLOAD_COUNTS is True


def test_too_few_shards_for_workers(tok, tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "one.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "{split}" / "*.jsonl"))], num_workers=2)
    with pytest.raises(ValueError, match=r"source files:.*1 shard\(s\) for rank 0, fewer than data.num_workers=2"):
        build_loader(cfg, tok, split="train", seq_len=8, batch_size=1)


def test_state_from_other_setup_is_refused(tok, corpus):
    root, _ = corpus
    loader = build_loader(_cfg(root), tok, split="train", seq_len=15, batch_size=2)
    _take(loader, 2)
    other = build_loader(_cfg(root), tok, split="train", seq_len=31, batch_size=2)
    other.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="seq_len: saved 15, now 31"):
        _take(other, 1)


# --- packing ------------------------------------------------------------------------------------
def _packed(tok: Tokenizer, docs: list[str]) -> list[int]:
    return [t for d in docs for t in tok.encode(d) + [tok.eos_id]]


def _docs_of(tok: Tokenizer, stream: list[int], known: dict[str, str]) -> tuple[list[str], list[int]]:
    """Split a block stream at EOS into the names of its complete documents and the partial tail."""
    names, piece = [], []
    for t in stream:
        if t == tok.eos_id:
            text = tok.decode(piece)
            name = text.split(">")[0][1:]
            assert known[name] == text and tok.encode(text) == piece  # exact tokens of a real document
            names.append(name)
            piece = []
        else:
            piece.append(t)
    return names, piece


def test_val_loader_restarts_on_every_pass(tok, corpus):
    root, _ = corpus
    loader = build_loader(_cfg(root), tok, split="val", seq_len=15, batch_size=4)
    first = [b for _, b in zip(range(3), loader)]
    full, again = list(loader), list(loader)
    assert len(full) == len(again) > 3
    _assert_same(again, full)
    _assert_same(first, full[:3])


_REFUSED_STATE_SCRIPT = """
import sys
from data.config import DataConfig, TokenizerConfig
from data.loader import build_loader
from data.tokenizer import get_tokenizer

cfg = DataConfig(tokenizer=TokenizerConfig(vocab_size=512, sample_docs=30), cache_dir=sys.argv[1], num_workers=2)
tok = get_tokenizer(cfg)
first = build_loader(cfg, tok, split="train", seq_len=32, batch_size=2)
next(iter(first))
other = build_loader(cfg, tok, split="train", seq_len=64, batch_size=2)  # the state is refused here
other.load_state_dict(first.state_dict())
try:
    next(iter(other))
except ValueError:
    held = sys.exc_info()  # the traceback keeps the refused iterator, and its workers, to the end
    print("refused")
"""


def test_a_process_whose_loader_workers_outlive_an_error_still_exits(tok):
    """The workers ignore SIGTERM (a scheduler's signal to the process group must not kill them),
    which multiprocessing's exit handler sends before it joins them: without `data.loader`'s own
    exit handler, a process holding a refused iterator never exits (it hung until killed)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", _REFUSED_STATE_SCRIPT, str(Path(tok.path).parents[1])],
                            cwd=repo, env={**clean_env(), "PYTHONPATH": str(repo)}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["refused"], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "killed by signal" not in result.stderr, result.stderr[-2000:]


def test_stream_pickles_for_spawned_workers(tok, corpus):
    import pickle

    root, _ = corpus
    stream = build_loader(_cfg(root), tok, split="train", seq_len=15, batch_size=1).dataset
    copy = pickle.loads(pickle.dumps(stream))
    assert torch.equal(next(iter(copy)), next(iter(stream)))


def test_blocks_pack_documents_with_eos_exactly(tok, corpus):
    root, texts = corpus
    batches = list(build_loader(_cfg(root), tok, split="val", seq_len=15, batch_size=4))
    assert all(b.dtype == torch.long and b.shape[1] == 16 for b in batches)
    stream = torch.cat(batches).flatten().tolist()
    cfg = _cfg(root)
    order = [e["text"] for e in open_source(cfg.sources[0], "val", cfg, seed=cfg.seed)]
    assert sorted(order) == sorted(texts["val"])
    expected = _packed(tok, order)
    # one pass: every full block, in document order; the tail shorter than a block is dropped
    assert stream == expected[: len(expected) // 16 * 16]
    assert len(batches) == -(-(len(expected) // 16) // 4) and len(stream) > len(expected) - 16


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])  # 8 shards: split by shard (2), by document (3)
def test_ranks_times_two_workers_disjoint_and_cover_single_process_stream(tok, corpus, world_size):
    root, texts = corpus
    known = {d.split(">")[0][1:]: d for d in texts["val"]}
    single = torch.cat(list(build_loader(_cfg(root), tok, split="val", seq_len=15, batch_size=1))).flatten().tolist()
    cfg = _cfg(root)
    order = [e["text"].split(">")[0][1:] for e in open_source(cfg.sources[0], "val", cfg, seed=cfg.seed)]
    single_names, _ = _docs_of(tok, single, known)
    assert single_names == order[: len(single_names)]
    seen: dict[str, tuple[int, int]] = {}
    for rank in range(world_size):
        loader = build_loader(_cfg(root, num_workers=2), tok, split="val", seq_len=15, batch_size=1, rank=rank,
                              world_size=world_size)
        per_worker: dict[int, list[int]] = {0: [], 1: []}
        for b in loader:
            per_worker[loader.state_dict()["_snapshot"]["_last_yielded_worker_id"]] += b.flatten().tolist()
        for worker, stream in per_worker.items():
            names, tail = _docs_of(tok, stream, known)
            if tail:  # the stream ends inside its last document (documents are longer than a block)
                text = tok.decode(tail)
                last = text.split(">")[0][1:]
                assert tok.encode(known[last])[: len(tail)] == tail
                names.append(last)
            assert stream == _packed(tok, [known[n] for n in names])[: len(stream)]
            assert names == sorted(names, key=order.index)  # a consumer keeps the single-process order
            for n in names:
                assert n not in seen, f"document {n} on {(rank, worker)} and {seen[n]}"
                seen[n] = (rank, worker)
    assert set(seen) == set(known) >= set(single_names)
    assert len(set(seen.values())) == 2 * world_size  # every consumer had work


# --- resume -------------------------------------------------------------------------------------
def _resumed(make, cuts: list[int], total: int) -> list[torch.Tensor]:
    """Batches from loaders rebuilt from a checkpointed state after each cut."""
    out, state = [], None
    bounds = [0, *cuts, total]
    for a, b in zip(bounds, bounds[1:]):
        loader = make()
        if state is not None:
            loader.load_state_dict(_roundtrip(state))
        out += _take(loader, b - a)
        state = loader.state_dict()
    return out


def _assert_same(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert torch.equal(g, r), f"batch {i} differs"


def test_resume_three_times_single_process(tok, corpus):
    root, _ = corpus
    def make():
        return build_loader(_cfg(root, shuffle_buffer=5), tok, split="train", seq_len=15, batch_size=3)

    loader = make()
    ref = _take(loader, 100)
    assert loader.state_dict()["dataset_state"]["start"]["sources"][0]["epoch"] >= 1  # crosses an epoch
    _assert_same(_resumed(make, [7, 43, 71], 100), ref)


def test_resume_inside_files_of_many_records(tok, tmp_path):
    """Arrow-backed json reading: resuming mid-file must not skip a read chunk (datasets#8145)."""
    (tmp_path / "train").mkdir()
    for f in range(2):
        lines = [json.dumps({"body": f"record {f}-{i}", "id": i}) for i in range(3000)]
        (tmp_path / "train" / f"{f}.jsonl").write_text("\n".join(lines))
    cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "{split}" / "*.jsonl"),
                                           text_field="body")],
                     num_workers=0, shuffle_buffer=0)

    def make():
        return build_loader(cfg, tok, split="train", seq_len=63, batch_size=4)

    _assert_same(_resumed(make, [40, 95, 170], 260), _take(make(), 260))


def test_train_stream_shuffles_and_reorders_epochs(tok, corpus):
    root, _ = corpus
    plain = torch.cat(_take(build_loader(_cfg(root), tok, split="train", seq_len=15, batch_size=5), 40))
    shuffled = torch.cat(_take(build_loader(_cfg(root, shuffle_buffer=5), tok, split="train", seq_len=15,
                                            batch_size=5), 40))
    assert not torch.equal(plain, shuffled)
    # windows of 5 blocks are permutations of the unshuffled windows
    for w in range(0, 200, 5):
        assert sorted(map(tuple, plain[w : w + 5].tolist())) == sorted(map(tuple, shuffled[w : w + 5].tolist()))
    seed2 = torch.cat(_take(build_loader(_cfg(root, seed=7), tok, split="train", seq_len=15, batch_size=5), 40))
    assert not torch.equal(plain, seed2)
    again = torch.cat(_take(build_loader(_cfg(root), tok, split="train", seq_len=15, batch_size=5), 40))
    assert torch.equal(plain, again)


@pytest.mark.slow
@pytest.mark.parametrize("rank,world_size", [(0, 2), (1, 2), (2, 3)])  # 8 shards: by shard, by document
def test_resume_three_times_two_workers_several_ranks(tok, corpus, rank, world_size):
    root, _ = corpus

    def make():
        return build_loader(_cfg(root, num_workers=2, shuffle_buffer=4), tok, split="train", seq_len=15,
                            batch_size=3, rank=rank, world_size=world_size)

    ref = _take(make(), 50)
    _assert_same(_resumed(make, [5, 18, 31], 50), ref)
    loader = make()
    _take(loader, 50)
    snaps = loader.state_dict()["_snapshot"]["_worker_snapshots"]
    assert max(s["dataset_state"]["start"]["sources"][0]["epoch"] for s in snaps.values()) >= 1


# --- mixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def two_sources(tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("mix")
    for name, word in (("a", "apple"), ("b", "banana")):
        (root / name / "train").mkdir(parents=True)
        for f in range(2):
            lines = [json.dumps({"text": " ".join([word] * (10 + k % 7))}) for k in range(30)]
            (root / name / "train" / f"{f}.jsonl").write_text("\n".join(lines))
    return DataConfig(
        sources=[SourceConfig(kind="files", path=str(root / "a" / "{split}" / "*.jsonl"), weight=3.0),
                 SourceConfig(kind="files", path=str(root / "b" / "{split}" / "*.jsonl"), weight=1.0)],
        num_workers=0, shuffle_buffer=0)


def _source_of(tok: Tokenizer, block: torch.Tensor) -> str:
    text = tok.decode(block.tolist())
    assert ("apple" in text) != ("banana" in text), "a block mixes sources"
    return "a" if "apple" in text else "b"


def test_mixture_proportions_and_determinism(tok, two_sources):
    blocks = torch.cat(_take(build_loader(two_sources, tok, split="train", seq_len=15, batch_size=50), 40))
    share_a = sum(_source_of(tok, b) == "a" for b in blocks) / len(blocks)
    sigma = (0.75 * 0.25 / len(blocks)) ** 0.5
    assert abs(share_a - 0.75) < 4 * sigma, share_a
    again = torch.cat(_take(build_loader(two_sources, tok, split="train", seq_len=15, batch_size=50), 40))
    assert torch.equal(blocks, again)
    two_sources.seed += 1
    other = torch.cat(_take(build_loader(two_sources, tok, split="train", seq_len=15, batch_size=50), 40))
    two_sources.seed -= 1
    assert not torch.equal(blocks, other)


def test_mixture_resumes_exactly(tok, two_sources):
    def make():
        return build_loader(two_sources, tok, split="train", seq_len=15, batch_size=4)

    _assert_same(_resumed(make, [3, 11, 12], 30), _take(make(), 30))


# --- long documents -----------------------------------------------------------------------------
def test_long_documents_stdlib(tok):
    cfg = DataConfig(tokenizer=TokenizerConfig(vocab_size=512, sample_docs=30))
    docs = long_documents(cfg, tok, min_tokens=8192, n_docs=4)
    assert len(docs) == 4 and all(len(d) == 8192 for d in docs)
    assert docs == long_documents(cfg, tok, min_tokens=8192, n_docs=4)
    assert docs != long_documents(cfg, tok, min_tokens=8192, n_docs=4, seed=1)
    # each is the start of a real test-split document
    starts = {tuple(tok.encode(e["text"])[:8192]) for e in open_source(cfg.sources[0], "test", cfg, seed=0)
              if len(e["text"]) >= 8192}
    assert all(tuple(d) in starts for d in docs)
    n = count_long_documents(cfg, tok, [8192])[8192]
    assert len(long_documents(cfg, tok, min_tokens=8192, n_docs=n)) == n
    with pytest.raises(ValueError, match=rf"only {n} documents with >= 8192 tokens in split 'test' of sources stdlib"):
        long_documents(cfg, tok, min_tokens=8192, n_docs=n + 1)


# --- pre-tokenized shards -----------------------------------------------------------------------
@pytest.fixture(scope="session")
def prepared(tok, corpus, tmp_path_factory) -> DataConfig:
    root, _ = corpus
    out = tmp_path_factory.mktemp("bin")
    cfg = _cfg(root)
    cfg.tokenizer = TokenizerConfig(model_path=tok.path)
    prepare(cfg, out, splits=("train", "val"), shard_tokens=300)
    return DataConfig(sources=[SourceConfig(kind="tokens", path=str(out))], num_workers=0, shuffle_buffer=0)


def test_prepared_shards_match_text_stream(tok, corpus, prepared):
    root, _ = corpus
    text_blocks = torch.cat(list(build_loader(_cfg(root), tok, split="val", seq_len=15, batch_size=4)))
    token_blocks = torch.cat(list(build_loader(prepared, tok, split="val", seq_len=15, batch_size=4)))
    assert torch.equal(text_blocks, token_blocks)
    assert get_tokenizer(prepared).sha256 == tok.sha256


def test_prepared_train_is_a_permutation_per_epoch_and_resumes(tok, prepared):
    def make():
        return build_loader(prepared, tok, split="train", seq_len=15, batch_size=4)

    ref = _take(make(), 60)
    n_blocks = int(sum(s["tokens"] for s in json.loads((Path(prepared.sources[0].path) / "meta.json").read_text())
                       ["splits"]["train"]["shards"]) // 16)
    epoch0 = torch.cat(ref)[:n_blocks]
    assert len({tuple(b) for b in epoch0.tolist()}) == len({tuple(b) for b in torch.cat(ref).tolist()})
    _assert_same(_resumed(make, [9, 10, 33], 60), ref)


@pytest.mark.slow
def test_prepared_two_ranks_two_workers_partition_blocks(tok, prepared):
    single = torch.cat(list(build_loader(prepared, tok, split="val", seq_len=15, batch_size=1)))
    prepared.num_workers = 2
    parts = [torch.cat(list(build_loader(prepared, tok, split="val", seq_len=15, batch_size=1, rank=r, world_size=2)))
             for r in range(2)]
    prepared.num_workers = 0
    together = sorted(map(tuple, torch.cat(parts).tolist()))
    assert together == sorted(map(tuple, single.tolist()))
    index = {tuple(b): i for i, b in enumerate(single.tolist())}
    assert len(index) == len(single)  # blocks are distinct, so the partition is checkable
    # rank 1 = consumers 2, 3 of 4 (rank * workers + worker)
    assert {index[tuple(b)] % 4 for b in parts[1].tolist()} == {2, 3}


def test_token_source_rejects_other_tokenizer(tok, prepared, tmp_path):
    other = get_tokenizer(DataConfig(tokenizer=TokenizerConfig(vocab_size=400, sample_docs=30),
                                     cache_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="tokenized with another tokenizer"):
        build_loader(prepared, other, split="train", seq_len=15, batch_size=2)
    missing = DataConfig(sources=[SourceConfig(kind="tokens", path=str(tmp_path / "none"))])
    with pytest.raises(FileNotFoundError, match=r"source tokens:.*none: no meta.json; run `python -m data.prepare"):
        build_loader(missing, tok, split="train", seq_len=15, batch_size=2)


def test_mixture_of_text_and_token_sources_resumes(tok, corpus, prepared):
    root, _ = corpus
    cfg = _cfg(root, shuffle_buffer=3)
    cfg.sources = [cfg.sources[0], SourceConfig(kind="tokens", path=prepared.sources[0].path, weight=0.5)]
    def make():
        return build_loader(cfg, tok, split="train", seq_len=15, batch_size=4)

    _assert_same(_resumed(make, [5, 6, 19], 40), _take(make(), 40))


def test_train_epochs_repeat_documents_in_a_new_order(tok, corpus):
    root, texts = corpus
    known = {d.split(">")[0][1:]: d for d in texts["train"]}
    loader = build_loader(_cfg(root), tok, split="train", seq_len=15, batch_size=10)
    stream = torch.cat(_take(loader, 40)).flatten().tolist()
    n_epoch = len(_packed(tok, texts["train"]))
    assert len(stream) > 2 * n_epoch
    epoch0, _ = _docs_of(tok, stream[:n_epoch], known)
    epoch1, _ = _docs_of(tok, stream[n_epoch : 2 * n_epoch], known)
    assert sorted(epoch0) == sorted(epoch1) == sorted(known)
    assert epoch0 != epoch1
