"""Data subset selection: score the corpus's windows, keep exactly the planned fraction.

    scores = score_windows(corpus.train_tokens, seq_len=128, method="influence",
                           target_tokens=corpus.heldout_tokens[:4096])
    keep = select(scores.scores, 0.25, seed=0)               # window indices, sorted
    batches = TokenBatches(corpus.train_tokens, seq_len=128, micro_batch=8, keep_indices=keep)
    charge = scores.flops                                     # FLOPs to take from the budget

Windows are `TokenBatches`' windows: window i = tokens[i*seq_len : i*seq_len + seq_len + 1].

Methods (higher score = keep):
- "random": uniform scores from the seed; the baseline.
- "loss": mean cross-entropy of each window under a small reference model, trained briefly on a
  random subset (`ReferenceConfig`) or passed in. `criterion` says which part of the loss
  distribution to keep: "middle" (default), "high" or "low". Marion et al. 2023 ("When Less is
  More", arXiv:2309.04564) compared keeping the bottom, middle or top of a reference model's
  perplexity ranking for pretraining and found the middle best; Ankner et al. 2024 ("Perplexed by
  Perplexity", arXiv:2405.20541) found the best criterion depends on the corpus (medium on Dolma,
  high on the Pile). "high" is the classic hard-example rule (Loshchilov and Hutter 2015) and,
  with the model being trained minus a reference, RHO-LOSS/RHO-1's reducible loss (Mindermann et
  al. 2022; Lin et al. 2024): `DynamicSelector(criterion="reducible", irreducible=...)`. A single
  homogeneous corpus (our default, Shakespeare) has little noise to drop and the extremes are
  lists and stage directions (low) or rare names (high), so "middle" is the default.
- "influence": LESS-style (Xia et al. 2024) gradient similarity to a held-out target set:
  per-example gradients of the reference model's linear layers, factored Rademacher projection
  (d = sum of min(rank, out) * min(rank, in), about 1,000 for the default reference), cosine with
  the target windows' mean normalised gradient. Needs `target_tokens`.
- "dsir": hashed unigram+bigram importance weights target / raw (Xie et al. 2023). Needs
  `target_tokens`. No model, so almost free.

Cache: `<cache root>/scores/<key>.npy` (`trainplan.hardware_profiles.cache.cache_root`; + `.json` with the
settings and FLOPs) where key = sha256(token stream, seq_len, scored windows, method, method settings, reference
fingerprint, format); a trained reference model is cached as `references/<key>.pt`. Any changed
token, window, setting or reference weight gives a new key, so it is scored again. The "loss"
criterion is applied after the cache (it re-ranks the same losses). Compute is charged (Yin and
Rush 2025, arXiv:2410.16208): `WindowScores.flops` counts the scoring pass and the reference's
training with FlopCounterMode (first batch / step, scaled), and stays the same on a cache hit
(`cached` says no compute was spent this time).

A run's selection (`DynamicSelector`, `PlannedBatches`, `target_slice`) is in
`trainplan.executor.data.dynamic_selection`; the reference model and the scorers are in
`trainplan.executor.data.scorers`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from trainplan.errors import TrainplanError
from trainplan.executor.data import scorers
from trainplan.executor.data.corpus import atomic_write
from trainplan.executor.data.dsir import DSIR_BUCKETS
from trainplan.executor.data.scorers import (
    ReferenceConfig,
    as_numpy_tokens,
    check_tokens,
    model_fingerprint,
    train_reference,
)
from trainplan.executor.data.token_files import MAX_CHUNK_TOKENS, max_token_id
from trainplan.hardware_profiles.cache import cache_root

__all__ = ["METHODS", "CRITERIA", "DEFAULT_RANK", "WindowScores", "score_windows", "select",
           "apply_criterion", "scores_cache_key"]

METHODS = ("random", "loss", "influence", "dsir")
CRITERIA = ("middle", "high", "low")
"""Which part of the loss distribution the "loss" method keeps (module docstring)."""
SCORES_FORMAT = 1
"""Bump when the meaning of cached scores changes."""
DEFAULT_RANK = 8
"""Influence: projection size per side of each layer's gradient (k_o = k_i = 8, 64 dims a layer)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowScores:
    """Scores of one scoring pass."""

    method: str
    scores: np.ndarray
    """(n,) float64: one score per scored window, higher = keep (the criterion applied)."""
    raw: np.ndarray
    """(n,) float64: the method's raw number (loss in nats, cosine, log weight, uniform draw)."""
    windows: np.ndarray
    """(n,) int64: the window index of each score (all windows, in order, when none were named)."""
    scoring_flops: float
    """FLOPs of the scoring pass (forward, backward and projection)."""
    reference_flops: float
    """FLOPs of training the reference model (0 when it was passed in or not needed)."""
    cached: bool
    """True when the scores came from the cache (no compute spent this time)."""
    key: str
    """Cache key (sha256 hex)."""
    settings: dict = field(default_factory=dict)
    """What entered the key, for the record."""

    @property
    def flops(self) -> float:
        """FLOPs to charge to the budget: scoring plus reference training."""
        return self.scoring_flops + self.reference_flops


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokens_sha256(tokens: np.ndarray) -> str:
    """sha256 hex of the token stream as int64 bytes, read `MAX_CHUNK_TOKENS` at a time (the same
    digest for any integer dtype; bounded memory on a memory-mapped corpus)."""
    h = hashlib.sha256()
    for i in range(0, len(tokens), MAX_CHUNK_TOKENS):
        h.update(np.asarray(tokens[i:i + MAX_CHUNK_TOKENS], dtype=np.int64).tobytes())
    return h.hexdigest()


def scores_cache_key(tokens_sha: str, *, seq_len: int, windows_sha: str, method: str,
                     settings: dict) -> str:
    """sha256 hex of everything that determines the raw scores."""
    blob = json.dumps({"format": SCORES_FORMAT, "tokens": tokens_sha, "seq_len": seq_len,
                       "windows": windows_sha, "method": method, "settings": settings},
                      sort_keys=True)
    return _sha(blob.encode())


def apply_criterion(raw: np.ndarray, criterion: str) -> np.ndarray:
    """Scores (higher = keep) from raw losses: "high" keeps the highest loss, "low" the lowest,
    "middle" the windows whose rank is closest to the median (the middle quantile band).

    Raises: TrainplanError on an unknown criterion."""
    raw = np.asarray(raw, dtype=np.float64)
    if criterion == "high":
        return raw.copy()
    if criterion == "low":
        return -raw
    if criterion == "middle":
        n = len(raw)
        rank = np.empty(n)
        rank[np.argsort(raw, kind="stable")] = np.arange(n)
        return -np.abs(rank / max(n - 1, 1) - 0.5)
    raise TrainplanError(f"unknown loss criterion {criterion!r}; known: {list(CRITERIA)}")


def select(scores: np.ndarray, fraction: float, *, seed: int, windows: np.ndarray | None = None,
           temperature: float = 0.0) -> np.ndarray:
    """Indices to keep: the top `max(1, round(fraction * n))` scores, sorted ascending.

    Ties are broken by a random order drawn from `default_rng(seed)`, so the result is fixed for
    a seed. `temperature > 0` adds Gumbel(0, temperature) noise first (seeded): the Gumbel top-k
    trick samples k without replacement with probability proportional to exp(score /
    temperature), DSIR's importance resampling at temperature 1 (Xie et al. 2023). `windows`: map
    positions to window indices (e.g. `WindowScores.windows`); without it positions are returned.

    Raises: TrainplanError for an empty or non-finite score array, fraction not in (0, 1], or
    `windows` of another length.
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    if s.size == 0 or not np.all(np.isfinite(s)):
        raise TrainplanError(f"scores must be a non-empty finite array, got {s.size} values"
                             f"{'' if s.size == 0 else ' with NaN/inf'}")
    if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
        raise TrainplanError(f"fraction={fraction!r} is invalid; expected 0 < fraction <= 1")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise TrainplanError(f"temperature={temperature!r} must be >= 0")
    rng = np.random.default_rng(seed)
    tiebreak = rng.permutation(s.size)
    if temperature > 0:
        s = s + temperature * rng.gumbel(size=s.size)
    k = max(1, round(fraction * s.size))
    order = np.lexsort((tiebreak, -s))  # by score descending, then the seeded order
    chosen = np.sort(order[:k])
    if windows is None:
        return chosen
    w = np.asarray(windows, dtype=np.int64).ravel()
    if w.size != s.size:
        raise TrainplanError(f"windows has {w.size} entries for {s.size} scores")
    return np.sort(w[chosen])


def _load(path: Path) -> tuple[np.ndarray, dict] | None:
    try:
        raw = np.load(path.with_suffix(".npy"))
        meta = json.loads(path.with_suffix(".json").read_text())
        return raw, meta
    except (OSError, ValueError):  # missing or unreadable: score again
        return None


def _reference_fingerprint(reference, vocab: int) -> str:
    """What identifies the reference in the cache keys: its weights when passed in, else its
    training settings (training is deterministic given them and the data in the key)."""
    if isinstance(reference, nn.Module):
        return model_fingerprint(reference)
    config = reference if reference is not None else ReferenceConfig()
    if not isinstance(config, ReferenceConfig):
        raise TrainplanError(f"reference must be None, an nn.Module or a ReferenceConfig, got "
                             f"{type(reference).__name__}")
    return config.fingerprint() + f"|v{vocab}"


def _reference_model(tokens: np.ndarray, reference, fingerprint: str, *, seq_len: int,
                     windows: np.ndarray, key_parts: dict, vocab: int, root: Path,
                     progress: bool) -> tuple[nn.Module, float]:
    """(model, training FLOPs) of the reference: passed in (0 FLOPs), or trained per its
    ReferenceConfig and cached as `root/references/<key>.pt` with its FLOPs."""
    if isinstance(reference, nn.Module):
        return reference, 0.0
    config = reference if reference is not None else ReferenceConfig()
    key = _sha(json.dumps({**key_parts, "reference": fingerprint}, sort_keys=True).encode())
    path = root / "references" / f"{key}.pt"
    if path.is_file():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            model = scorers.build_reference(config, vocab, seq_len)
            model.load_state_dict(saved["state"])
            return model.eval(), float(saved["flops"])
        except (OSError, RuntimeError, KeyError, ValueError):  # unreadable: train again
            pass
    model, flops = train_reference(tokens, seq_len=seq_len, vocab_size=vocab, config=config,
                                   windows=windows, progress=progress)
    atomic_write(path, lambda f: torch.save({"state": model.state_dict(), "flops": flops}, f))
    return model, flops


def score_windows(tokens: torch.Tensor | np.ndarray, *, seq_len: int, method: str,
                  reference: nn.Module | ReferenceConfig | None = None,
                  target_tokens: torch.Tensor | np.ndarray | None = None, seed: int = 0,
                  windows: Sequence[int] | np.ndarray | None = None, batch_size: int = 16,
                  criterion: str = "middle", rank: int = DEFAULT_RANK, grad_blocks: int = 2,
                  buckets: int = DSIR_BUCKETS, vocab_size: int | None = None,
                  cache_dir: str | Path | None = None, use_cache: bool = True,
                  progress: bool = False) -> WindowScores:
    """Score windows of `tokens` with `method` (see the module docstring), cached on disk.

    tokens: (n_tokens,) int token stream (e.g. `TokenCorpus.train_tokens`).
    seq_len: window length; window i is tokens[i*seq_len : i*seq_len + seq_len + 1].
    reference: "loss"/"influence": a model to score with (its logits as
        `trainplan.modeling.model_call.forward_logits` takes them), or a ReferenceConfig to train one
        (None: the default config), cached like the scores.
    target_tokens: "influence"/"dsir": a held-out token stream of the target distribution,
        windowed the same way (at least one window). Keep it disjoint from evaluation data.
    seed: "random": the draw; "influence": the projection matrices.
    windows: indices of the windows to score (default all); scores come back in this order.
    batch_size: windows per forward (memory only; not in the cache key).
    criterion: "loss" only: "middle", "high" or "low" (`apply_criterion`).
    rank: "influence": projection size per side of each layer; grad_blocks: transformer blocks
        (from the top) whose linear layers give gradients, plus lm_head.
    buckets: "dsir": hashed n-gram buckets (10,000 as in Xie et al. 2023).
    vocab_size: for training a reference (default: max token + 1; pass the tokenizer's).
    cache_dir: cache root (default: `trainplan.hardware_profiles.cache.cache_root()`).
    use_cache: False scores afresh and writes nothing.

    Returns: WindowScores (scores, raw, windows, FLOPs, cache key).
    Raises: TrainplanError/DataError on an unknown method or criterion, too few tokens for one
        window, out-of-range windows, a missing target for influence/dsir.
    """
    if method not in METHODS:
        raise TrainplanError(f"unknown scoring method {method!r}; known: {list(METHODS)}")
    if method == "loss" and criterion not in CRITERIA:
        raise TrainplanError(f"unknown loss criterion {criterion!r}; known: {list(CRITERIA)}")
    for name, v in (("batch_size", batch_size), ("rank", rank), ("buckets", buckets)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TrainplanError(f"{name}={v!r} must be a whole number >= 1")
    tok = as_numpy_tokens(tokens)
    n_windows = check_tokens(tok, seq_len)
    if windows is None:
        win = np.arange(n_windows, dtype=np.int64)
        windows_sha = f"all:{n_windows}"
    else:
        win = np.asarray(windows, dtype=np.int64).ravel()
        if win.size == 0 or win.min() < 0 or win.max() >= n_windows:
            raise TrainplanError(f"windows must be non-empty indices in [0, {n_windows})")
        windows_sha = _sha(win.tobytes())
    if method in ("influence", "dsir") and target_tokens is None:
        raise TrainplanError(f"method {method!r} needs target_tokens (a held-out token stream of "
                             "the target distribution)")
    target = None if target_tokens is None else as_numpy_tokens(target_tokens)
    tokens_sha = tokens_sha256(tok)
    root = cache_root(cache_dir)
    settings: dict = {}
    vocab = int(vocab_size or max_token_id(tok) + 1)
    if method == "random":
        settings = {"seed": int(seed)}
    elif method == "dsir":
        assert target is not None  # checked above: dsir needs target_tokens
        settings = {"buckets": buckets, "target": tokens_sha256(target), "ngrams": [1, 2],
                    "smoothing": "raw add-one, target Dirichlet toward raw (m = N_t)"}
    else:
        settings = {"reference": _reference_fingerprint(reference, vocab)}
        if method == "influence":
            assert target is not None  # checked above: influence needs target_tokens
            settings.update(target=tokens_sha256(target), rank=rank, seed=int(seed),
                            grad_blocks=grad_blocks, loss="mean-ce", projection="rademacher-kron")
    key = scores_cache_key(tokens_sha, seq_len=seq_len, windows_sha=windows_sha, method=method,
                           settings=settings)
    path = root / "scores" / f"{key}.npy"
    hit = _load(path) if use_cache else None
    if hit is not None and len(hit[0]) == len(win):
        raw, meta = hit
        scoring_flops, ref_flops = float(meta["scoring_flops"]), float(meta["reference_flops"])
        cached = True
    else:
        model, ref_flops = None, 0.0
        if method in ("loss", "influence"):
            model, ref_flops = _reference_model(
                tok, reference, settings["reference"], seq_len=seq_len, windows=win,
                key_parts={"format": SCORES_FORMAT, "tokens": tokens_sha, "seq_len": seq_len,
                           "windows": windows_sha}, vocab=vocab, root=root, progress=progress)
        scorer = scorers.SCORERS[method]
        raw, scoring_flops = scorer(tok, win * seq_len, seq_len=seq_len, model=model,
                                    target_tokens=target, seed=seed, batch_size=batch_size,
                                    rank=rank, grad_blocks=grad_blocks, buckets=buckets,
                                    progress=progress)
        raw = np.asarray(raw, dtype=np.float64)
        if raw.shape != win.shape:
            raise TrainplanError(f"scorer {method!r} returned shape {raw.shape}, expected "
                                 f"{win.shape}")
        cached = False
        if use_cache:
            meta = {"method": method, "settings": settings, "seq_len": seq_len,
                    "n_windows": int(win.size), "scoring_flops": float(scoring_flops),
                    "reference_flops": float(ref_flops)}
            atomic_write(path, lambda f: np.save(f, raw))
            atomic_write(path.with_suffix(".json"),
                          lambda f: f.write(json.dumps(meta, indent=1).encode()))
    scores = apply_criterion(raw, criterion) if method == "loss" else raw.copy()
    return WindowScores(method=method, scores=scores, raw=raw, windows=win,
                        scoring_flops=float(scoring_flops), reference_flops=float(ref_flops),
                        cached=cached, key=key,
                        settings={**settings, **({"criterion": criterion}
                                                 if method == "loss" else {})})

