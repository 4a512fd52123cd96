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

Cache: `$TRAINPLAN_CACHE_DIR/scores/<key>.npy` (+ `.json` with the settings and FLOPs) where
key = sha256(token stream, seq_len, scored windows, method, method settings, reference
fingerprint, format); a trained reference model is cached as `references/<key>.pt`. Any changed
token, window, setting or reference weight gives a new key, so it is scored again. The "loss"
criterion is applied after the cache (it re-ranks the same losses). Compute is charged (Yin and
Rush 2025, arXiv:2410.16208): `WindowScores.flops` counts the scoring pass and the reference's
training with FlopCounterMode (first batch / step, scaled), and stays the same on a cache hit
(`cached` says no compute was spent this time).

In a run (`executor.train.run` -> `PlannedBatches`): the plan's `data_method` scores every training
window (static: once before training, keeping exactly `data_fraction` of them; dynamic, when
`selection_every_steps` = K > 0: a seeded random subset first, re-scored every K steps with the
model being trained); influence and DSIR take as target a held-out slice after the run's
evaluation windows (`target_slice`); the scoring FLOPs go into `RunRecord.selection_flops`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from executor import selection_scorers as scorers
from executor.data import TokenBatches
from executor.corpus import _atomic_write, cache_root
from executor.selection_scorers import (ReferenceConfig, as_numpy_tokens, check_tokens,
                                        matmul_params, model_fingerprint, train_reference)
from hardware_profiles.errors import TrainplanError

__all__ = ["METHODS", "CRITERIA", "ReferenceConfig", "WindowScores", "score_windows", "select",
           "apply_criterion", "DynamicSelector", "scores_cache_key", "matmul_params",
           "TARGET_WINDOWS", "target_slice", "PlannedBatches"]

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
    _atomic_write(path, lambda f: torch.save({"state": model.state_dict(), "flops": flops}, f))
    return model, flops


def score_windows(tokens: torch.Tensor | np.ndarray, *, seq_len: int, method: str,
                  reference: nn.Module | ReferenceConfig | None = None,
                  target_tokens: torch.Tensor | np.ndarray | None = None, seed: int = 0,
                  windows: Sequence[int] | np.ndarray | None = None, batch_size: int = 16,
                  criterion: str = "middle", rank: int = DEFAULT_RANK, grad_blocks: int = 2,
                  buckets: int = scorers.DSIR_BUCKETS, vocab_size: int | None = None,
                  cache_dir: str | Path | None = None, use_cache: bool = True,
                  progress: bool = False) -> WindowScores:
    """Score windows of `tokens` with `method` (see the module docstring), cached on disk.

    tokens: (n_tokens,) int token stream (e.g. `TokenCorpus.train_tokens`).
    seq_len: window length; window i is tokens[i*seq_len : i*seq_len + seq_len + 1].
    reference: "loss"/"influence": a model to score with (`model(input_ids=x).logits`), or a
        ReferenceConfig to train one (None: the default config), cached like the scores.
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
    cache_dir: cache root (default `$TRAINPLAN_CACHE_DIR`, else ~/.cache/trainplan).
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
    tokens_sha = _sha(tok.tobytes())
    root = cache_root(cache_dir)
    settings: dict = {}
    vocab = int(vocab_size or int(tok.max()) + 1)
    if method == "random":
        settings = {"seed": int(seed)}
    elif method == "dsir":
        settings = {"buckets": buckets, "target": _sha(target.tobytes()), "ngrams": [1, 2],
                    "smoothing": "raw add-one, target Dirichlet toward raw (m = N_t)"}
    else:
        settings = {"reference": _reference_fingerprint(reference, vocab)}
        if method == "influence":
            settings.update(target=_sha(target.tobytes()), rank=rank, seed=int(seed),
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
            _atomic_write(path, lambda f: np.save(f, raw))
            _atomic_write(path.with_suffix(".json"),
                          lambda f: f.write(json.dumps(meta, indent=1).encode()))
    scores = apply_criterion(raw, criterion) if method == "loss" else raw.copy()
    return WindowScores(method=method, scores=scores, raw=raw, windows=win,
                        scoring_flops=float(scoring_flops), reference_flops=float(ref_flops),
                        cached=cached, key=key,
                        settings={**settings, **({"criterion": criterion}
                                                 if method == "loss" else {})})


class DynamicSelector:
    """Re-select the kept windows every `rescore_every` steps with the model being trained.

    At step 0 `maybe_rescore` returns the initial subset (`initial_keep`, else a random one from
    `seed`); at every later multiple of `rescore_every` it scores the candidate windows with
    `model` (no cache: the model changes) and returns the new top `round(fraction * n)`; at
    other steps None. Methods: "random" (a fresh random subset, seed + step), "loss" (criterion
    "high" by default: online hard-example selection, Loshchilov and Hutter 2015; "reducible":
    loss minus `irreducible`, RHO-LOSS, Mindermann et al. 2022), "influence" (needs
    `target_tokens`), "dsir" (model-free: scores once, so rescoring changes nothing).
    `flops_spent` accumulates the scoring FLOPs to charge; `history` logs each selection.

    Train-loop use:
        sel = DynamicSelector("loss", 0.5, 200, tokens=data.train_tokens, seq_len=d.seq_len)
        for step in range(start, d.max_steps):
            keep = sel.maybe_rescore(step, model)
            if keep is not None:
                batches = TokenBatches(data.train_tokens, seq_len=..., micro_batch=...,
                                       keep_indices=keep, seed=d.seed, rank=..., world_size=...)
            x, y = batches.batch(step)
    Checkpoint `state_dict()` with the run and `load_state_dict` on resume (then call
    `maybe_rescore(start, model)` or use `keep` directly).
    """

    def __init__(self, method: str, fraction: float, rescore_every: int, *,
                 tokens: torch.Tensor | np.ndarray, seq_len: int,
                 windows: Sequence[int] | np.ndarray | None = None,
                 target_tokens: torch.Tensor | np.ndarray | None = None, seed: int = 0,
                 batch_size: int = 16, criterion: str = "high",
                 irreducible: np.ndarray | None = None, rank: int = DEFAULT_RANK,
                 grad_blocks: int = 1, initial_keep: np.ndarray | None = None,
                 progress: bool = False) -> None:
        if method not in METHODS:
            raise TrainplanError(f"unknown scoring method {method!r}; known: {list(METHODS)}")
        if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
            raise TrainplanError(f"fraction={fraction!r} is invalid; expected 0 < fraction <= 1")
        if isinstance(rescore_every, bool) or not isinstance(rescore_every, int) \
                or rescore_every < 1:
            raise TrainplanError(f"rescore_every={rescore_every!r} must be a whole number >= 1")
        if method == "loss" and criterion not in CRITERIA + ("reducible",):
            raise TrainplanError(f"unknown criterion {criterion!r}; known: "
                                 f"{list(CRITERIA + ('reducible',))}")
        if method in ("influence", "dsir") and target_tokens is None:
            raise TrainplanError(f"dynamic {method!r} needs target_tokens")
        self.tokens = as_numpy_tokens(tokens)
        n_windows = check_tokens(self.tokens, seq_len)
        self.windows = (np.arange(n_windows, dtype=np.int64) if windows is None
                        else np.asarray(windows, dtype=np.int64).ravel())
        if self.windows.size == 0 or self.windows.min() < 0 or self.windows.max() >= n_windows:
            raise TrainplanError(f"windows must be non-empty indices in [0, {n_windows})")
        if criterion == "reducible" and (irreducible is None
                                         or len(irreducible) != len(self.windows)):
            raise TrainplanError("criterion 'reducible' needs `irreducible`: one reference loss "
                                 f"per candidate window ({len(self.windows)})")
        self.method, self.fraction, self.rescore_every = method, float(fraction), rescore_every
        self.seq_len, self.seed, self.batch_size = seq_len, seed, batch_size
        self.criterion = criterion
        self.irreducible = None if irreducible is None else np.asarray(irreducible, np.float64)
        self.target = None if target_tokens is None else as_numpy_tokens(target_tokens)
        self.rank, self.grad_blocks, self.progress = rank, grad_blocks, progress
        self.initial_keep = None if initial_keep is None else np.sort(np.asarray(initial_keep,
                                                                                np.int64))
        self.keep: np.ndarray | None = None
        """The current kept window indices (None before step 0)."""
        self.flops_spent = 0.0
        """Scoring FLOPs spent so far, to charge to the budget."""
        self.history: list[dict] = []
        """One entry per selection: step, kept windows, how many changed, FLOPs."""

    @property
    def n_keep(self) -> int:
        return max(1, round(self.fraction * len(self.windows)))

    def _record(self, step: int, keep: np.ndarray, flops: float) -> np.ndarray:
        changed = (self.n_keep if self.keep is None
                   else int(self.n_keep - np.intersect1d(self.keep, keep).size))
        self.keep = keep
        self.flops_spent += flops
        self.history.append({"step": int(step), "n_kept": int(keep.size), "changed": changed,
                             "flops": float(flops)})
        return keep

    def _score(self, step: int, model: nn.Module) -> tuple[np.ndarray, float]:
        starts = self.windows * self.seq_len
        common = dict(seq_len=self.seq_len, batch_size=self.batch_size, progress=self.progress)
        if self.method == "random":
            return scorers.score_random(self.tokens, starts, seed=self.seed + step)
        if self.method == "dsir":
            return scorers.score_dsir(self.tokens, starts, target_tokens=self.target,
                                      buckets=scorers.DSIR_BUCKETS, **common)
        if self.method == "loss":
            raw, flops = scorers.score_loss(self.tokens, starts, model=model, **common)
            if self.criterion == "reducible":
                return raw - self.irreducible, flops
            return apply_criterion(raw, self.criterion), flops
        return scorers.score_influence(self.tokens, starts, model=model,
                                       target_tokens=self.target, rank=self.rank, seed=self.seed,
                                       grad_blocks=self.grad_blocks, **common)

    def maybe_rescore(self, step: int, model: nn.Module) -> np.ndarray | None:
        """The kept window indices (sorted) when this step selects, else None (keep using the
        previous ones). Step 0 (or the first call) gives the initial subset."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise TrainplanError(f"step={step!r} must be a whole number >= 0")
        first = self.keep is None
        if first and self.initial_keep is not None:
            return self._record(step, self.initial_keep, 0.0)
        if step == 0 or step % self.rescore_every != 0:
            if not first:
                return None
            scores, _ = scorers.score_random(self.tokens, self.windows, seed=self.seed)
            return self._record(step, select(scores, self.fraction, seed=self.seed,
                                             windows=self.windows), 0.0)
        scores, flops = self._score(int(step), model)
        return self._record(step, select(scores, self.fraction, seed=self.seed + int(step),
                                         windows=self.windows), flops)

    def state_dict(self) -> dict:
        """The selector's state for a checkpoint (kept windows, FLOPs spent, history)."""
        return {"keep": None if self.keep is None else self.keep.tolist(),
                "flops_spent": self.flops_spent, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.keep = None if state["keep"] is None else np.asarray(state["keep"], np.int64)
        self.flops_spent = float(state["flops_spent"])
        self.history = list(state["history"])


# ---- a plan's data subset in a run ------------------------------------------------------------

TARGET_WINDOWS = 64
"""Windows of the held-out target slice influence and DSIR select toward in a run (as
`benchmarks/data.py`)."""
SELECTION_FILE = "selection.json"
"""Dynamic selection's log in the run folder: every selection's step, FLOPs and kept windows,
read back on resume."""


def target_slice(heldout_tokens: torch.Tensor | np.ndarray, *, seq_len: int, skip_windows: int,
                 windows: int = TARGET_WINDOWS) -> torch.Tensor | np.ndarray | None:
    """The target set of influence/DSIR in a run: up to `windows` windows of `heldout_tokens`
    starting one window after the first `skip_windows` (the evaluation windows, which end at
    token skip_windows * seq_len), so no target token is an evaluation token. None when fewer
    than seq_len + 1 tokens are left there."""
    start = (skip_windows + 1) * seq_len
    part = heldout_tokens[start:start + windows * seq_len + 1]
    return part if len(part) >= seq_len + 1 else None


class PlannedBatches:
    """The training batches of a plan's data subset, for `executor.train.run`.

    `batch(step)` as `TokenBatches.batch`; `update(step)` before each step (dynamic selection
    re-scores there, outside the measured step). Per the plan's decisions:
    - `data_fraction` 1: every window, whatever the method (nothing to select);
    - `random`, static: `TokenBatches(fraction=...)`, a seeded uniform subset (as before);
    - another method, static: `score_windows` over all training windows (cached on disk, so a
      resume or rerun gives the same scores), `select` the top `data_fraction` (exactly
      `max(1, round(f * n))` windows, ties by the seed), `TokenBatches(keep_indices=...)`;
    - `selection_every_steps` K > 0: `DynamicSelector` (one device only), its selections logged
      to `out/selection.json` and restored from there on resume.
    Influence and DSIR select toward `target_slice` of the held-out tokens after the `held`
    evaluation batches. `record.selection_flops` gets the scoring FLOPs (static plus every
    re-score so far; assigned, so a resumed record is not charged twice).

    Raises: TrainplanError on an unknown method, a bad `selection_every_steps`, dynamic
    selection on more than one device, influence/DSIR without a held-out target, or a resume
    of a dynamic run without its selection log.
    """

    def __init__(self, plan, data, *, model: nn.Module, rank: int, held: Sequence, out: Path,
                 start: int, record, progress: bool = False,
                 cache_dir: str | Path | None = None) -> None:
        d = plan.decisions
        method, f = d.data_method, float(d.data_fraction)
        every = getattr(d, "selection_every_steps", 0)
        if method not in METHODS:
            raise TrainplanError(f"plan's data_method={method!r} is not known; known: "
                                 f"{list(METHODS)}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise TrainplanError(f"plan's selection_every_steps={every!r} must be a whole number "
                                 ">= 0 (0: static selection)")
        self.model, self.record, self.path = model, record, Path(out) / SELECTION_FILE
        self._kw = dict(seq_len=d.seq_len, micro_batch=d.micro_batch, seed=d.seed, rank=rank,
                        world_size=d.dp_degree)
        self._tokens = data.train_tokens
        self.selector: DynamicSelector | None = None
        self.static_flops = 0.0
        self.batches: TokenBatches | None = None
        self._entries: list[dict] = []
        if f >= 1.0 or (method == "random" and every == 0):
            self.batches = TokenBatches(data.train_tokens, fraction=min(f, 1.0), **self._kw)
            if f >= 1.0 and (method != "random" or every):
                self._note(f"data selection: fraction 1, every window kept; {method} not scored")
            return
        target = None
        if method in ("influence", "dsir"):
            skip = sum(len(x) for x, _ in held)
            target = target_slice(data.heldout_tokens, seq_len=d.seq_len, skip_windows=skip)
            if target is None:
                raise TrainplanError(
                    f"data_method {method!r} needs a held-out target slice: the corpus's "
                    f"{len(data.heldout_tokens)} held-out tokens leave fewer than seq_len + 1 = "
                    f"{d.seq_len + 1} after the {skip} evaluation windows and a one-window gap; "
                    "use a larger corpus or data_method 'loss' or 'random'")
        show = progress and rank == 0
        if every == 0:
            s = score_windows(data.train_tokens, seq_len=d.seq_len, method=method,
                              target_tokens=target, seed=d.seed, vocab_size=data.vocab_size,
                              cache_dir=cache_dir, progress=show)
            keep = select(s.scores, f, seed=d.seed, windows=s.windows)
            self.batches = TokenBatches(data.train_tokens, keep_indices=keep, **self._kw)
            self.static_flops = s.flops
            self._note(f"data selection: {method} kept {len(keep)} of {len(s.windows)} windows "
                       f"(static; scores {'from the cache' if s.cached else 'computed'}, key "
                       f"{s.key[:12]}); {s.flops:.4g} scoring FLOPs charged")
            return
        if d.devices != 1:
            raise TrainplanError(f"dynamic data selection (selection_every_steps={every}) runs "
                                 f"on one device only; the plan uses {d.devices}: use static "
                                 "selection (selection_every_steps=0)")
        self.selector = DynamicSelector(method, f, every, tokens=data.train_tokens,
                                        seq_len=d.seq_len, target_tokens=target, seed=d.seed,
                                        progress=show)
        if start > 0:
            self._restore(start)
        self._note(f"data selection: {method} dynamic, re-scored every {every} steps with the "
                   f"model being trained (log in {self.path.name})")

    def _note(self, text: str) -> None:
        if not any(n.startswith(text.split(" (")[0]) for n in self.record.notes):
            self.record.notes.append(text)
        self._charge()

    def _charge(self) -> None:
        self.record.selection_flops = self.static_flops + (
            self.selector.flops_spent if self.selector is not None else 0.0)

    def _restore(self, start: int) -> None:
        """The selections made before step `start` (and at it, if logged), from the log."""
        try:
            log = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise TrainplanError(f"cannot resume dynamic data selection: {self.path} is missing "
                                 f"or unreadable ({e}); start the run again") from None
        self._entries = [e for e in log["entries"] if e["step"] <= start]
        if not self._entries:
            raise TrainplanError(f"cannot resume dynamic data selection: {self.path} has no "
                                 f"selection at or before step {start}")
        keep = np.asarray(self._entries[-1]["keep"], dtype=np.int64)
        self.selector.load_state_dict({
            "keep": keep.tolist(), "flops_spent": sum(e["flops"] for e in self._entries),
            "history": [{k: v for k, v in e.items() if k != "keep"} for e in self._entries]})
        self.batches = TokenBatches(self._tokens, keep_indices=keep, **self._kw)

    def update(self, step: int) -> None:
        """Before training step `step`: dynamic selection re-scores when due (and logs it)."""
        sel = self.selector
        if sel is None or (sel.history and sel.history[-1]["step"] >= step):
            return
        keep = sel.maybe_rescore(step, self.model)
        if keep is None:
            return
        self.batches = TokenBatches(self._tokens, keep_indices=keep, **self._kw)
        self._entries.append({**sel.history[-1], "keep": keep.tolist()})
        d = {"method": sel.method, "fraction": sel.fraction, "every": sel.rescore_every,
             "entries": self._entries}
        _atomic_write(self.path, lambda fh: fh.write(json.dumps(d).encode()))
        self._charge()

    @property
    def kept_windows(self) -> np.ndarray:
        """The windows the current batches draw from (sorted)."""
        return self.batches.kept_windows

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batches is None:
            self.update(step)
        return self.batches.batch(step)
