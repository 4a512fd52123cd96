"""`--data` formats (issue #21 item 4): HF datasets files, pre-tokenized token files, the model's own
tokenizer, shard-by-shard tokenizing into a memory-mapped cache, and their bad inputs."""

from __future__ import annotations

import argparse
import json
import random
import sys
import tracemalloc

import numpy as np
import pytest
import torch

import trainplan.executor.data.corpus as corpus_mod
from trainplan.errors import DataError, MissingExtraError
from trainplan.executor.data.batches import TokenBatches, count_corpus_tokens, heldout_batches, load_corpus
from trainplan.executor.data.corpus import EOT, load_tokenizer, train_tokenizer
from trainplan.executor.data.selection import score_windows
from trainplan.executor.data.sources import DataOptions, add_data_flags
from trainplan.executor.data.token_files import FINGERPRINT_WHOLE_BYTES, file_fingerprint

pa = pytest.importorskip("pyarrow")  # installed with datasets (extra `data`)
pq = pytest.importorskip("pyarrow.parquet")

VOCAB = 300
WORDS = ["the", "king", "is", "dead", "long", "live", "queen", "now", "winter", "of", "our", "discontent",
         "made", "glorious", "summer", "by", "this", "sun", "york", "O", "Romeo,", "wherefore", "art", "thou?"]


def _doc(rng: random.Random, lines: int) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(lines))


@pytest.fixture
def docs() -> list[str]:
    rng = random.Random(0)
    return [_doc(rng, 20) for _ in range(40)]


def _write_formats(d, docs: list[str], column: str = "text") -> None:
    rows = [{column: t, "id": i} for i, t in enumerate(docs)]
    (d / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "c.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = pa.table({column: docs, "id": list(range(len(docs)))})
    pq.write_table(table, d / "c.parquet", row_group_size=7)  # several row groups, streamed
    with pa.OSFile(str(d / "c.arrow"), "wb") as f:  # an Arrow IPC stream, as datasets writes
        w = pa.ipc.new_stream(f, table.schema)
        w.write_table(table, max_chunksize=9)
        w.close()


@pytest.mark.parametrize("suffix", ["json", "parquet", "arrow"])
def test_datasets_formats_give_the_jsonl_token_stream(cache, tmp_path, docs, suffix):
    """Each HF datasets format gives today's .jsonl path's fingerprint, tokens and batches."""
    _write_formats(tmp_path, docs)
    ref = load_corpus([tmp_path / "c.jsonl"], vocab_size=VOCAB)
    c = load_corpus([tmp_path / f"c.{suffix}"], vocab_size=VOCAB)
    assert c.sha256 == ref.sha256 and c.tokenizer_path == ref.tokenizer_path  # the same cache entry
    assert np.array_equal(c.train_tokens, ref.train_tokens)
    assert np.array_equal(c.heldout_tokens, ref.heldout_tokens)
    x, y = TokenBatches(c.train_tokens, seq_len=32, micro_batch=4, seed=3).batch(5)
    rx, ry = TokenBatches(ref.train_tokens, seq_len=32, micro_batch=4, seed=3).batch(5)
    assert x.dtype == torch.int64 and torch.equal(x, rx) and torch.equal(y, ry)


def test_text_column_and_folder_of_formats(cache, tmp_path, docs):
    (tmp_path / "f").mkdir()
    _write_formats(tmp_path / "f", docs[:10], column="body")
    c = load_corpus([tmp_path / "f"], vocab_size=VOCAB, text_column="body", heldout_frac=0.0)
    tok = load_tokenizer(c.tokenizer_path)
    eot = tok.token_to_id(EOT)
    assert list(c.train_tokens).count(eot) == 40  # .arrow, .json, .jsonl, .parquet: 10 docs each


def test_large_txt_is_read_in_pieces_that_tokenize_as_the_whole(tmp_path, docs):
    """A .txt file larger than a shard is cut at `\\S\\n\\S`: same fingerprint, BPE and ids."""
    p = tmp_path / "big.txt"
    p.write_text("\n\n".join(docs) + "  \n\t trailing   \n")
    whole = load_corpus([p], vocab_size=VOCAB, cache_dir=tmp_path / "c1")
    pieces = list(corpus_mod.text_source([p], shard_bytes=500).pieces())
    assert len(pieces) > 20 and [e for _, e in pieces].count(True) == 1
    assert "".join(t for t, _ in pieces) == p.read_text()
    cut = load_corpus([p], vocab_size=VOCAB, cache_dir=tmp_path / "c2", shard_bytes=500)
    assert cut.sha256 == whole.sha256
    assert load_tokenizer(cut.tokenizer_path).to_str() == load_tokenizer(whole.tokenizer_path).to_str()
    assert np.array_equal(cut.train_tokens, whole.train_tokens)
    assert np.array_equal(cut.heldout_tokens, whole.heldout_tokens)


@pytest.mark.parametrize("suffix", ["txt", "jsonl"])
def test_tokenizing_memory_is_one_shard(tmp_path, suffix):
    """Tokenizing a corpus of 1.5 MB in 4 KiB shards allocates (Python/numpy, tracemalloc) a
    tenth of the corpus or less (about 80 KB; it scales with the shard, not the corpus): the
    text is streamed and the ids are appended to the cache file."""
    rng = random.Random(1)
    text_docs = [_doc(rng, 40) for _ in range(600)]
    p = tmp_path / f"big.{suffix}"
    if suffix == "txt":
        p.write_text("\n".join(text_docs))
    else:
        p.write_text("".join(json.dumps({"text": t}) + "\n" for t in text_docs))
    size = p.stat().st_size
    assert size > 1_500_000
    tok_path = tmp_path / "tok.json"
    train_tokenizer(text_docs[:20], VOCAB).save(str(tok_path))
    vocab = load_tokenizer(tok_path).get_vocab_size()
    tracemalloc.start()
    try:
        c = load_corpus([p], vocab_size=vocab, tokenizer=tok_path, cache_dir=tmp_path / "cache",
                        shard_bytes=2**12)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert c.n_train_tokens + c.n_heldout_tokens > size // 8  # the corpus was tokenized
    assert peak < size / 10, f"peak {peak:,} bytes for a corpus of {size:,}"


def test_models_own_tokenizer(tmp_path, docs, monkeypatch):
    """--tokenizer: ids are that tokenizer's, documents separated by its separator; no BPE
    is trained; the cache and the fingerprint are keyed by the tokenizer too."""
    tok_path = tmp_path / "tokenizer.json"
    tok = train_tokenizer(["some other text, the king is dead"] * 5 + docs[:3], VOCAB)
    tok.save(str(tok_path))
    vocab = tok.get_vocab_size()
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:5]))
    monkeypatch.setattr(corpus_mod, "train_tokenizer", lambda *a, **k: pytest.fail("trained a BPE"))
    c = load_corpus([tmp_path / "c.jsonl"], vocab_size=vocab, tokenizer=tok_path, heldout_frac=0.0,
                    cache_dir=tmp_path / "cache")
    monkeypatch.undo()
    assert c.vocab_size == vocab and c.tokenizer_path == str(tok_path)
    eot = tok.token_to_id(EOT)
    expect = [i for t in docs[:5] for i in [*tok.encode(t, add_special_tokens=False).ids, eot]]
    assert list(c.train_tokens) == expect
    bpe = load_corpus([tmp_path / "c.jsonl"], vocab_size=VOCAB, cache_dir=tmp_path / "cache")
    assert bpe.sha256 != c.sha256  # the same text under another tokenizer is another corpus


def _ids(n: int, top: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, top, n)


@pytest.mark.parametrize("kind, dtype", [("bin", "uint16"), ("bin", "uint32"), ("npy", "uint16"),
                                         ("npy", "uint32")])
def test_token_files_are_memory_mapped_as_is(tmp_path, kind, dtype):
    ids = _ids(20_000, 70_000 if dtype == "uint32" else VOCAB).astype(dtype)
    vocab = int(ids.max()) + 1
    p = tmp_path / f"train.{kind}"
    if kind == "bin":
        ids.tofile(p)  # nanoGPT's prepare.py: arr = np.memmap(..., dtype=np.uint16, mode="w+")
    else:
        np.save(p, ids)
    c = load_corpus([p], vocab_size=vocab, token_dtype=dtype, heldout_frac=0.1, min_heldout_tokens=0,
                    cache_dir=tmp_path / "cache")
    assert isinstance(c.train_tokens, np.memmap) and c.train_tokens.dtype == dtype
    assert np.array_equal(np.concatenate([c.train_tokens, c.heldout_tokens]), ids)
    assert c.name == str(p) and c.vocab_size == vocab and c.tokenizer_path == ""
    assert c.sha256 == file_fingerprint(p) and not (tmp_path / "cache").exists()  # nothing cached
    assert count_corpus_tokens([p], vocab_size=vocab, token_dtype=dtype, heldout_frac=0.1,
                               min_heldout_tokens=0) == c.n_train_tokens
    x, y = TokenBatches(c.train_tokens, seq_len=64, micro_batch=4, seed=1).batch(7)
    rx, ry = TokenBatches(torch.from_numpy(ids.astype(np.int64)[:c.n_train_tokens]), seq_len=64,
                          micro_batch=4, seed=1).batch(7)
    assert x.dtype == torch.int64 and torch.equal(x, rx) and torch.equal(y, ry)
    held = heldout_batches(c.heldout_tokens, seq_len=64, micro_batch=4, max_batches=2)
    assert held[0][0].dtype == torch.int64


def test_selection_scores_a_memory_mapped_corpus_as_its_int64_copy(tmp_path):
    """The scorers work on token windows, so token files support every data-selection method;
    a memmap and its int64 copy get the same scores and cache key."""
    ids = _ids(8_000, VOCAB).astype(np.uint16)
    np.save(tmp_path / "t.npy", ids)
    c = load_corpus([tmp_path / "t.npy"], vocab_size=VOCAB, heldout_frac=0.25, min_heldout_tokens=0)
    kw = dict(seq_len=32, method="dsir", cache_dir=tmp_path / "scores", use_cache=False)
    a = score_windows(c.train_tokens, target_tokens=c.heldout_tokens[:1000], **kw)
    b = score_windows(torch.from_numpy(np.asarray(c.train_tokens, dtype=np.int64)),
                      target_tokens=torch.from_numpy(np.asarray(c.heldout_tokens[:1000], dtype=np.int64)), **kw)
    assert a.key == b.key and np.array_equal(a.scores, b.scores)


def test_fingerprint_of_a_large_token_file_is_sampled(tmp_path, monkeypatch):
    import trainplan.executor.data.token_files as tf

    monkeypatch.setattr(tf, "FINGERPRINT_WHOLE_BYTES", 4096)
    monkeypatch.setattr(tf, "FINGERPRINT_BLOCK_BYTES", 64)
    p = tmp_path / "t.bin"
    data = bytearray(_ids(100_000, VOCAB).astype(np.uint16).tobytes())
    p.write_bytes(bytes(data))
    first = tf.file_fingerprint(p)
    data[0] ^= 1  # the first block is sampled
    p.write_bytes(bytes(data))
    assert tf.file_fingerprint(p) != first
    p.write_bytes(bytes(data) + b"\0\0")  # so is the size
    assert tf.file_fingerprint(p) != first
    assert FINGERPRINT_WHOLE_BYTES == 64 * 2**20


def test_bad_token_files_and_tokenizers(tmp_path, docs):
    ids = _ids(5_000, VOCAB).astype(np.uint16)
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t64.npy", ids.astype(np.int64))
    np.save(tmp_path / "t2d.npy", ids.reshape(50, 100))
    (tmp_path / "odd.bin").write_bytes(b"\0\0\0")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": docs[0]}) + "\n")
    tok_path = tmp_path / "tok.json"
    train_tokenizer(docs, VOCAB).save(str(tok_path))
    n_tok = load_tokenizer(tok_path).get_vocab_size()
    cases = [
        (dict(paths=[tmp_path / "t64.npy"]), ["t64.npy holds int64 ids", "valid: uint16, uint32"]),
        (dict(paths=[tmp_path / "t2d.npy"]), ["shape (50, 100)", "1-D"]),
        (dict(paths=[tmp_path / "t.bin"], token_dtype="int32"), ["--token-dtype 'int32'", "uint16, uint32"]),
        (dict(paths=[tmp_path / "odd.bin"], token_dtype="uint16"), ["3 bytes", "uint16"]),
        (dict(paths=[tmp_path / "t.bin"], vocab_size=100), [f"holds id {ids.max()}", "vocab_size=100",
                                                            "ids 0..99"]),
        (dict(paths=[tmp_path / "t.bin", tmp_path / "t64.npy"]), ["used alone"]),
        (dict(paths=[tmp_path / "t.bin"], tokenizer=tok_path), ["is for text data", "leave --tokenizer out"]),
        (dict(paths=[tmp_path / "c.jsonl"], tokenizer=tok_path, vocab_size=8192),
         [f"vocabulary of {n_tok} tokens", "vocab_size=8192"]),
        (dict(paths=[tmp_path / "c.jsonl"], tokenizer=tmp_path / "t.bin"), ["cannot load tokenizer", "t.bin"]),
        (dict(paths=[tmp_path / "c.jsonl"], text_column="body"), ['no "body" field', "--text-column"]),
    ]
    for kw, needles in cases:
        paths = kw.pop("paths")
        kw.setdefault("vocab_size", VOCAB)
        with pytest.raises(DataError) as e:
            load_corpus(paths, cache_dir=tmp_path / "cache", **kw)
        for needle in needles:
            assert needle in str(e.value), (needle, str(e.value))


def test_tokenizer_without_a_document_separator(tmp_path, docs):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "c.txt").write_text(docs[0])
    with pytest.raises(DataError, match="has no document separator.*<\\|endoftext\\|>"):
        load_corpus([tmp_path / "c.txt"], vocab_size=tok.get_vocab_size(), tokenizer=tmp_path / "tok.json",
                    cache_dir=tmp_path / "cache")


def test_datasets_formats_need_the_data_extra(tmp_path, monkeypatch, docs):
    _write_formats(tmp_path, docs[:2])
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingExtraError, match=r"reading \.parquet corpora needs datasets.*trainplan\[data\]"):
        load_corpus([tmp_path / "c.parquet"], vocab_size=VOCAB, cache_dir=tmp_path / "cache")


def test_data_options_travel_to_the_worker():
    opts = DataOptions(tokenizer="tok.json", token_dtype="uint32")
    assert opts.argv() == ["--tokenizer", "tok.json", "--token-dtype", "uint32"]
    assert DataOptions().argv() == []
    ap = argparse.ArgumentParser()
    add_data_flags(ap)
    assert DataOptions.from_args(ap.parse_args(opts.argv())) == opts
    assert opts.kwargs() == {"tokenizer": "tok.json", "token_dtype": "uint32", "text_column": "text"}


def test_unreadable_datasets_file_is_one_typed_error(tmp_path, capsys):
    (tmp_path / "bad.parquet").write_bytes(b"garbage")
    (tmp_path / "ints.json").write_text('{"text": 1}\n{"text": 2}\n')
    with pytest.raises(DataError, match=r"cannot read corpus file .*bad\.parquet as parquet: Parquet file"):
        load_corpus([tmp_path / "bad.parquet"], vocab_size=VOCAB, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="column 'text' holds int values, expected strings"):
        load_corpus([tmp_path / "ints.json"], vocab_size=VOCAB, cache_dir=tmp_path / "cache")
    assert capsys.readouterr().err == ""  # datasets' own error log is kept quiet


def test_uint32_bin_read_as_uint16_is_refused(tmp_path):
    """uint32 ids read with the default uint16 (every second value 0, a high half) are refused;
    real uint16 corpora, of small or large vocabularies, are not."""
    p = tmp_path / "t.bin"
    for top in (300, 50_000, 128_256):  # high halves all 0, or 0/1 (Llama 3's vocabulary)
        _ids(5_000, top).astype(np.uint32).tofile(p)
        with pytest.raises(DataError, match=r"looks like uint32 ids.*pass --token-dtype uint32"):
            load_corpus([p], vocab_size=130_000)
        c = load_corpus([p], vocab_size=top, token_dtype="uint32", heldout_frac=0.0)
        assert c.n_train_tokens == 5_000
    for ids in (_ids(5_000, 300), _ids(5_000, 65_535), np.zeros(5_000), _ids(5_000, 4),
                np.arange(40)):  # uint16 corpora: random ids, all 0, ids 0..3, a tiny file
        ids.astype(np.uint16).tofile(p)
        assert len(load_corpus([p], vocab_size=65_535, heldout_frac=0.0).train_tokens) == len(ids)


def test_token_dtype_must_agree_with_the_npy_header(tmp_path):
    np.save(tmp_path / "t16.npy", _ids(1_000, VOCAB).astype(np.uint16))
    np.save(tmp_path / "t32.npy", _ids(1_000, VOCAB).astype(np.uint32))
    with pytest.raises(DataError, match=r"--token-dtype uint32 contradicts token file .*t16.npy, "
                                        r"whose \.npy header says uint16"):
        load_corpus([tmp_path / "t16.npy"], vocab_size=VOCAB, token_dtype="uint32")
    with pytest.raises(DataError, match=r"--token-dtype uint16 contradicts token file .*t32.npy, "
                                        r"whose \.npy header says uint32"):
        load_corpus([tmp_path / "t32.npy"], vocab_size=VOCAB, token_dtype="uint16")
    for name, dtype in (("t16.npy", "uint16"), ("t32.npy", "uint32"), ("t16.npy", None), ("t32.npy", None)):
        c = load_corpus([tmp_path / name], vocab_size=VOCAB, token_dtype=dtype, heldout_frac=0.0)
        assert c.train_tokens.dtype == ("uint16" if name == "t16.npy" else "uint32")  # its header
