"""Pre-tokenized corpora: one file of token ids, memory-mapped and used as is (no tokenizer).

Formats:
- `.bin`: raw little-endian token ids, no header, as nanoGPT's `prepare.py` writes `train.bin`
  (`np.memmap(..., dtype=np.uint16)`) and Megatron-style pipelines write their `.bin`; the dtype
  is not in the file, so it is given (`--token-dtype`, default uint16 as nanoGPT). Read as
  uint16, a file of uint32 ids is refused (`check_not_uint32`: its ids' high halves are the
  zeros at every second position);
- `.npy`: a 1-D numpy array file (`np.save`, `np.lib.format.open_memmap`), dtype from its header
  (a `--token-dtype` given must agree with it).

Valid dtypes: uint16, uint32. Every id must be below the plan's vocab_size (checked by a
chunked max over the memmap). Fingerprint (`file_fingerprint`): sha256 of the file's size and
bytes, the whole file when it has at most `FINGERPRINT_WHOLE_BYTES`, else `FINGERPRINT_BLOCKS`
blocks of `FINGERPRINT_BLOCK_BYTES` at evenly spaced offsets (first and last included): cheap on
a file of many GB, and it changes with the size or any sampled block, not with every byte.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from trainplan.errors import DataError

TOKEN_DTYPES = ("uint16", "uint32")
FINGERPRINT_WHOLE_BYTES = 64 * 2**20
FINGERPRINT_BLOCKS = 64
FINGERPRINT_BLOCK_BYTES = 2**20
MAX_CHUNK_TOKENS = 2**24
"""Tokens read at once when scanning for the largest id (32 MiB of uint16)."""
SNIFF_VALUES = 2**20
"""uint16 values `check_not_uint32` looks at: the file's first 2 MiB."""
MIN_SNIFF_PAIRS = 16
"""Fewer (even, odd) pairs than this are too few to tell uint32 ids from uint16 ones."""
HIGH_HALF_MAX = 3
"""The largest high half of a uint32 id taken for one: ids below 2**18 = 262,144."""


def check_token_dtype(token_dtype: str) -> np.dtype:
    """The numpy dtype named `token_dtype`; DataError unless it is uint16 or uint32."""
    if token_dtype not in TOKEN_DTYPES:
        raise DataError(f"--token-dtype {token_dtype!r} is not a token dtype; valid: "
                        f"{', '.join(TOKEN_DTYPES)} (nanoGPT's train.bin is uint16)")
    return np.dtype(token_dtype).newbyteorder("<")


def check_not_uint32(ids: np.ndarray, path: Path) -> None:
    """DataError if the uint16 values `ids` (a `.bin` read as uint16) look like uint32 ids.

    Rule, on the first `SNIFF_VALUES` values (at least `MIN_SNIFF_PAIRS` pairs; the file size a
    multiple of 4): every odd-position value (a little-endian uint32 id's high half) is at most
    `HIGH_HALF_MAX` (an id below 262,144, above every common vocabulary: a vocabulary <= 65,535
    gives only 0s there) while fewer than half of the even-position values (the low halves) are.
    A uint16 corpus meets it only if every second token is one of the ids 0..3 and most others
    are not (documents one token long, each followed by such a separator), which no tokenized
    text is; a corpus of small ids alone (all <= 3) does not meet it."""
    n = min(len(ids), SNIFF_VALUES) // 2 * 2
    if len(ids) % 2 or n < 2 * MIN_SNIFF_PAIRS:
        return
    sample = np.asarray(ids[:n]).reshape(-1, 2)
    if (sample[:, 1] <= HIGH_HALF_MAX).all() and (sample[:, 0] <= HIGH_HALF_MAX).mean() < 0.5:
        raise DataError(f"token file {path} looks like uint32 ids read as uint16: every second "
                        f"uint16 value of its first {n:,} is 0..{HIGH_HALF_MAX} (the high halves "
                        "of uint32 ids); pass --token-dtype uint32")


def open_token_file(path: Path, token_dtype: str | None = None) -> np.ndarray:
    """The token ids in `path` as a read-only 1-D memmap (`.bin`: of `token_dtype`, None for
    uint16 as nanoGPT; `.npy`: of its header's dtype, which a given `token_dtype` must be).

    Raises:
        DataError: unreadable file, a dtype other than uint16/uint32 (naming it and the valid
            ones), a `token_dtype` that contradicts a .npy header (naming both), a .npy that is
            not 1-D, a .bin whose size is not a whole number of ids, a .bin read as uint16 that
            holds uint32 ids (`check_not_uint32`), or no ids.
    """
    if token_dtype is not None:
        check_token_dtype(token_dtype)
    try:
        if path.suffix == ".npy":
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
            if ids.dtype.name not in TOKEN_DTYPES:
                raise DataError(f"token file {path} holds {ids.dtype.name} ids; valid: "
                                f"{', '.join(TOKEN_DTYPES)} (save it with .astype(np.uint16) or "
                                "np.uint32)")
            if token_dtype not in (None, ids.dtype.name):
                raise DataError(f"--token-dtype {token_dtype} contradicts token file {path}, whose "
                                f".npy header says {ids.dtype.name}; a .npy file's header gives its "
                                f"dtype: leave --token-dtype out or pass --token-dtype {ids.dtype.name}")
            if ids.ndim != 1:
                raise DataError(f"token file {path} has shape {ids.shape}; expected a 1-D token stream")
        else:
            token_dtype = token_dtype or "uint16"
            dtype = check_token_dtype(token_dtype)
            size = path.stat().st_size
            if size % dtype.itemsize:
                raise DataError(f"token file {path} has {size} bytes, not a whole number of "
                                f"{token_dtype} ids ({dtype.itemsize} bytes each); is --token-dtype "
                                "right?")
            ids = np.memmap(path, dtype=dtype, mode="r") if size else np.empty(0, dtype)
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"cannot read token file {path}: {e}") from None
    if len(ids) == 0:
        raise DataError(f"token file {path} holds no token ids")
    if path.suffix != ".npy" and ids.dtype.itemsize == 2:
        check_not_uint32(ids, path)
    return ids


def max_token_id(ids: np.ndarray) -> int:
    """The largest id in `ids`, read in chunks of `MAX_CHUNK_TOKENS` (bounded memory)."""
    return max(int(ids[i:i + MAX_CHUNK_TOKENS].max()) for i in range(0, len(ids), MAX_CHUNK_TOKENS))


def check_token_ids(ids: np.ndarray, vocab_size: int, path: Path) -> None:
    """DataError naming the largest id if one is >= vocab_size."""
    top = max_token_id(ids)
    if top >= vocab_size:
        raise DataError(f"token file {path} holds id {top}, beyond the plan's vocabulary "
                        f"(vocab_size={vocab_size}: ids 0..{vocab_size - 1}); tokenize it with the "
                        "model's tokenizer, or check --token-dtype")


def file_fingerprint(path: Path) -> str:
    """sha256 hex of `path`'s size and content, whole or sampled (see the module docstring)."""
    size = path.stat().st_size
    h = hashlib.sha256(f"size={size}".encode())
    with path.open("rb") as f:
        if size <= FINGERPRINT_WHOLE_BYTES:
            while block := f.read(FINGERPRINT_BLOCK_BYTES):
                h.update(block)
        else:
            last = size - FINGERPRINT_BLOCK_BYTES
            for k in range(FINGERPRINT_BLOCKS):
                f.seek(last * k // (FINGERPRINT_BLOCKS - 1))
                h.update(f.read(FINGERPRINT_BLOCK_BYTES))
    return h.hexdigest()
