"""DSIR importance scoring for `trainplan.executor.data.selection` (Xie et al. 2023, arXiv:2302.03169): hashed
unigram and bigram bucket models of the target and of the raw windows, and each window's log
importance weight under them."""

from __future__ import annotations

import numpy as np

from trainplan.errors import TrainplanError

DSIR_BUCKETS = 10_000
"""Hashed n-gram buckets: Xie et al. 2023 (DSIR, arXiv:2302.03169), Sec. 4: 10,000 buckets of
hashed unigrams and bigrams."""


def _ngram_features(tokens, starts: np.ndarray, seq_len: int, buckets: int) -> np.ndarray:
    """(n, 2 * seq_len + 1) hashed unigram and bigram bucket ids of each window's seq_len + 1
    tokens (a multiplicative hash, fixed: the features do not depend on a seed)."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = np.asarray(tokens[idx] if isinstance(tokens, np.ndarray) else
                   np.asarray(tokens)[idx], dtype=np.uint64)
    uni = (w * np.uint64(0x9E3779B1)) % np.uint64(buckets)
    bi = ((w[:, :-1] * np.uint64(0x85EBCA77)) ^ (w[:, 1:] * np.uint64(0xC2B2AE3D) + np.uint64(1))) \
        % np.uint64(buckets)
    return np.concatenate([uni, bi], axis=1).astype(np.int64)


def score_dsir(tokens, starts: np.ndarray, *, seq_len: int, target_tokens, buckets: int,
               **_) -> tuple[np.ndarray, float]:
    """DSIR importance (Xie et al. 2023, arXiv:2302.03169, Sec. 3-4): bag-of-hashed-n-gram models
    of the target (from `target_tokens`) and of the raw windows; each window's log importance
    weight log p_target(x) - log p_raw(x) = sum over its features of log(p_t[b] / p_r[b]).
    Higher: more target-like. DSIR then resamples by these weights (Gumbel top-k:
    `select(..., temperature=1)`). FLOPs: 2 per feature (a gather and an add).

    Smoothing: the raw model is add-one smoothed (as DSIR's); the target model is Dirichlet
    smoothed toward the raw one, p_t = (c_t + m p_r) / (N_t + m) with prior mass m = N_t (the
    target's own feature count). DSIR's add-one smoothing assumes a large target; with a few
    thousand target tokens it gives every unseen bucket more target mass than raw mass, which
    ranks windows of rare or garbage tokens as most target-like. With the raw prior an unseen
    feature costs log 2 and only features over-represented in the target raise the weight."""
    target = np.asarray(target_tokens)
    n_target = (len(target) - 1) // seq_len
    if n_target < 1:
        raise TrainplanError(f"dsir needs target_tokens with at least seq_len + 1 = "
                             f"{seq_len + 1} tokens, got {len(target)}")
    feats = _ngram_features(tokens, starts, seq_len, buckets)
    t_feats = _ngram_features(target, np.arange(n_target) * seq_len, seq_len, buckets)
    raw = np.bincount(feats.ravel(), minlength=buckets) + 1.0
    p_raw = raw / raw.sum()
    c_t = np.bincount(t_feats.ravel(), minlength=buckets).astype(np.float64)
    prior = float(t_feats.size)
    p_t = (c_t + prior * p_raw) / (c_t.sum() + prior)
    log_ratio = np.log(p_t) - np.log(p_raw)
    return log_ratio[feats].sum(1), 2.0 * feats.size + 2.0 * t_feats.size
