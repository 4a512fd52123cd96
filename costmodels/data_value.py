"""What a smaller, better-scored data subset is worth, and what scoring it costs.

Pure (numpy/scipy, no torch): the planner builds its loss table from these functions and charges
the scoring compute to the budget; `executor.selection` does the scoring and reports the FLOPs it
counted, which `scoring_flops` predicts.

Loss of a run on a selected subset (nats per token):

    L = E + A / N**alpha + B / (q(method, f) * D')**beta            (+ offset)

- D' = effective data (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models",
  arXiv:2305.16264, eq. 5): the `tokens_seen` drawn from `unique = f * corpus_tokens` unique tokens,
  repeated epochs decaying with R_D* = 15.4 (`costmodels.loss.effective_tokens`).
- q(method, f) = 1 + a * (1 - f)**b, the *selection-quality multiplier*: how many random tokens one
  selected token is worth. q(1) = 1 (keeping everything is no selection); a > 0 when the method's
  subset beats a random one of the same size (a in (-1, inf), so q > 0). The form is a modelling
  assumption (no paper gives one): it is monotone in f, has the right end point and two
  constants, which `fit_quality` fits per method from pilot runs. It ignores that a subset's
  advantage shrinks as models and budgets grow (Goyal et al. 2024, "Scaling Laws for Data
  Filtering", arXiv:2404.07177): refit per model size.
- Scoring compute is charged to the budget (Yin and Rush 2025, "Compute-Constrained Data
  Selection", arXiv:2410.16208: counting it, perplexity and gradient scoring pay off only when the
  trained model is ~5x resp. ~10x larger than the scoring model); `scoring_flops` gives it.

Defaults: `DEFAULT_QUALITY` holds the published-number defaults used before any local fit
(random: q = 1; loss/perplexity: Ankner et al. 2024; influence and DSIR: q = 1 until fitted, see
there). `fit_local_law` refits E, B, beta of the law on the local machine's small runs.
Fitted multipliers are cached per (model, vocabulary) with `save_quality_fits` (e.g.
`python benchmarks/data.py --save-fits`) and read back by `load_quality_fits`, which the planner's
method choice (`planner.data_choice`) prefers to the defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from scipy.optimize import least_squares, nnls

from costmodels.loss import HUBER_DELTA, R_D_STAR, LossLaw, _effective, _finite
from hardware_profiles.errors import TrainplanError

__all__ = ["METHODS", "QUALITY_FORM", "QualityFit", "DEFAULT_QUALITY", "ScoringFlops",
           "SelectionOption", "selection_quality", "predicted_loss", "subset_loss", "fit_quality",
           "fit_local_law", "scoring_flops", "reference_scoring_flops", "selection_menu",
           "quality_path", "save_quality_fits", "load_quality_fits"]

METHODS = ("random", "loss", "influence", "dsir")
"""Scoring methods `executor.selection` implements."""

R_D_STAR_BOUNDS = (0.05, 100.0)
"""Range searched when `fit_local_law` fits R_D* (repetitions)."""

QUALITY_FORM = "q(f) = 1 + a * (1 - f)**b"
"""The selection-quality multiplier's functional form (a modelling assumption; see module doc)."""


def _num(name: str, value, *, low: float | None = None, low_open: bool = True,
         high: float | None = None) -> float:
    v = _finite(name, value)
    if low is not None and (v <= low if low_open else v < low):
        raise TrainplanError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and v > high:
        raise TrainplanError(f"{name} must be <= {high}, got {value!r}")
    return v


def _fraction(value) -> float:
    return _num("fraction", value, low=0.0, high=1.0)


def selection_quality(fraction: float, a: float, b: float) -> float:
    """q(f) = 1 + a * (1 - f)**b (`QUALITY_FORM`), dimensionless; q(1) = 1.

    Args: fraction in (0, 1]; a > -1; b > 0.
    Raises: TrainplanError on an input out of range.
    """
    f = _fraction(fraction)
    a = _num("a", a, low=-1.0)
    b = _num("b", b, low=0.0)
    return 1.0 + a * (1.0 - f) ** b


@dataclass(frozen=True, kw_only=True, slots=True)
class QualityFit:
    """The selection-quality multiplier of one scoring method, q(f) = 1 + a * (1 - f)**b."""

    method: str
    """Scoring method, one of `METHODS` (or a user name)."""
    a: float = 0.0
    """q at f -> 0 minus one, dimensionless, > -1. 0: the subset is worth a random one."""
    b: float = 1.0
    """Exponent on the pruned share (1 - f), dimensionless, > 0."""
    n_points: int = 0
    """Pilot runs the constants were fitted on (0: a default)."""
    max_rel_err: float = 0.0
    """Largest |predicted - measured| / measured loss over those runs (in-sample)."""
    source: str = "default"
    """Where the constants come from."""

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise TrainplanError(f"QualityFit.method must be a non-empty name, got {self.method!r}")
        _num("QualityFit.a", self.a, low=-1.0)
        _num("QualityFit.b", self.b, low=0.0)
        _num("QualityFit.max_rel_err", self.max_rel_err, low=0.0, low_open=False)

    def q(self, fraction: float) -> float:
        """q(fraction), dimensionless; see `selection_quality`."""
        return selection_quality(fraction, self.a, self.b)


DEFAULT_QUALITY: dict[str, QualityFit] = {
    "random": QualityFit(method="random", source="no selection: a random subset is worth its size"),
    # Ankner et al. 2024 ("Perplexed by Perplexity", arXiv:2405.20541), abstract and Sec. 4:
    # pruning to 50% by a 125M reference model's perplexity reaches the unpruned 3B model's
    # downstream accuracy in 1/1.45 of the steps, i.e. q(0.5) = 1.45 -> a = 0.9 with b = 1.
    # Measured on downstream accuracy, not loss, at 1B-3B: a prior for large models, refit locally.
    "loss": QualityFit(method="loss", a=0.9, b=1.0,
                       source="Ankner et al. 2024 (arXiv:2405.20541): 1.45x fewer steps at 50% "
                              "kept, read as q(0.5) = 1.45 with b = 1 (downstream accuracy, 1-3B)"),
    # LESS (Xia et al. 2024) and DSIR (Xie et al. 2023) report task accuracy after instruction
    # tuning / continued pretraining, which gives no multiplier on pretraining loss: q = 1 until a
    # local fit says otherwise, so the solver never pays for scoring on faith.
    "influence": QualityFit(method="influence",
                            source="no published pretraining-loss multiplier (LESS, Xia et al. "
                                   "2024, reports task accuracy): q = 1 until fitted"),
    "dsir": QualityFit(method="dsir",
                       source="no published pretraining-loss multiplier (DSIR, Xie et al. 2023, "
                              "reports downstream accuracy): q = 1 until fitted"),
}
"""Quality multipliers used before a local fit, by method."""


def predicted_loss(law: LossLaw, n_params: float, tokens_seen: float, unique_tokens: float | None,
                   quality: float = 1.0) -> float:
    """Predicted final loss, nats per token, of training on `unique_tokens` unique tokens of
    selection quality `quality` until `tokens_seen` tokens.

    L = E + A / N**alpha + B / (quality * D')**beta with D' = `effective_tokens(tokens_seen,
    unique_tokens, law.r_d_star)` (Hoffmann et al. 2022 eq. 2; Muennighoff et al. 2023 eq. 5):
    `LossLaw.predict`. Pass `quality = QualityFit.q(fraction)` for a selected subset.

    Args: n_params (parameters, > 0), tokens_seen (tokens, > 0), unique_tokens (tokens, > 0; None:
    unlimited), quality (dimensionless, > 0).
    Raises: TrainplanError on a non-positive or non-finite input.
    """
    return law.predict(n_params, tokens_seen, unique_tokens=unique_tokens, quality=quality)


def subset_loss(law: LossLaw, n_params: float, tokens_seen: float, corpus_tokens: float,
                fraction: float, fit: QualityFit = DEFAULT_QUALITY["random"], *,
                offset: float = 0.0) -> float:
    """Predicted final loss, nats per token, of keeping `fraction` of a corpus of
    `corpus_tokens` unique tokens by `fit`'s method and training for `tokens_seen` tokens.

    unique = max(1, fraction * corpus_tokens), quality = fit.q(fraction), then `predicted_loss`,
    plus `offset` (nats; e.g. a learning-rate cooldown's gain when the law was fitted on the
    stable phase of runs).

    Raises: TrainplanError on an input out of range.
    """
    f = _fraction(fraction)
    corpus = _num("corpus_tokens", corpus_tokens, low=0.0)
    unique = max(1.0, f * corpus)
    return predicted_loss(law, n_params, tokens_seen, unique, fit.q(f)) + float(offset)


def _curve(law: LossLaw, n_params, tokens: np.ndarray, unique: np.ndarray, q) -> np.ndarray:
    """Vectorised `predicted_loss` (arrays broadcast)."""
    eff = _effective(tokens, unique, law.r_d_star)
    return law.E + law.A / n_params**law.alpha + law.B / (q * eff) ** law.beta


def fit_quality(fractions: Sequence[float], losses: Sequence[float], law: LossLaw, *,
                n_params: float, tokens_seen: float | Sequence[float], corpus_tokens: float,
                method: str = "selected", offset: float = 0.0,
                fix_b: float | None = None) -> QualityFit:
    """Fit q(f) = 1 + a * (1 - f)**b to measured final losses of pilot runs of one method.

    Each run kept `fractions[i]` of a corpus of `corpus_tokens` unique tokens, trained for
    `tokens_seen[i]` tokens (a scalar for all) and measured `losses[i]` (nats/token). With the
    law fixed (fitted on random-subset runs, `fit_local_law`), minimise the squared log-residuals
    of `subset_loss` over a in (-1, 1e3) and b in (1e-3, 20) (scipy `least_squares`, trust region
    reflective, started from a small grid; the best optimum wins). `fix_b` pins b (then one pilot
    run suffices).

    Identifiability: a run at f = 1 carries no information on a or b (q(1) = 1); a measured loss
    below the law's floor E + A / N**alpha pulls a to its bound.

    Returns: a QualityFit with `n_points` and the in-sample `max_rel_err`.
    Raises: TrainplanError on mismatched or invalid arrays, or fewer informative runs (f < 1)
    than free constants.
    """
    f = np.asarray(fractions, dtype=float).ravel()
    loss = np.asarray(losses, dtype=float).ravel()
    tok = np.broadcast_to(np.asarray(tokens_seen, dtype=float), f.shape).astype(float)
    if f.size == 0 or f.size != loss.size or tok.size != f.size:
        raise TrainplanError(f"fractions ({f.size}), losses ({loss.size}) and tokens_seen "
                             f"({np.size(tokens_seen)}) must be non-empty and of equal length")
    for i, v in enumerate(f):
        _fraction(v)
    if not (np.all(np.isfinite(loss)) and np.all(loss > 0) and np.all(np.isfinite(tok))
            and np.all(tok > 0)):
        raise TrainplanError(f"losses and tokens_seen must be positive and finite, got "
                             f"{loss.tolist()[:8]} and {tok.tolist()[:8]}")
    corpus = _num("corpus_tokens", corpus_tokens, low=0.0)
    n = _num("n_params", n_params, low=0.0)
    n_free = 1 if fix_b is not None else 2
    informative = int(np.sum(f < 1.0))
    if informative < n_free:
        raise TrainplanError(f"fit_quality needs at least {n_free} pilot run(s) with fraction < 1 "
                             f"for {'a' if n_free == 1 else 'a and b'}, got {informative} "
                             f"(fractions {f.tolist()}); add runs or pass fix_b")
    unique = np.maximum(1.0, f * corpus)
    log_loss = np.log(loss)

    def residuals(theta):
        a = theta[0]
        b = fix_b if fix_b is not None else theta[1]
        q = 1.0 + a * (1.0 - f) ** b
        pred = _curve(law, n, tok, unique, np.maximum(q, 1e-12)) + offset
        return np.log(np.maximum(pred, 1e-12)) - log_loss

    lo = [-1.0 + 1e-6] + ([] if fix_b is not None else [1e-3])
    hi = [1e3] + ([] if fix_b is not None else [20.0])
    starts = [[a0] + ([] if fix_b is not None else [b0])
              for a0 in (-0.5, 0.0, 0.5, 2.0, 10.0) for b0 in ((1.0,) if fix_b is not None
                                                               else (0.5, 1.0, 2.0))]
    best = None
    for x0 in starts:
        res = least_squares(residuals, x0, bounds=(lo, hi), method="trf", xtol=1e-14,
                            ftol=1e-14, gtol=1e-14, max_nfev=5000)
        if best is None or res.cost < best.cost:
            best = res
    a = float(best.x[0])
    b = float(fix_b) if fix_b is not None else float(best.x[1])
    if a >= 0.99 * hi[0]:
        warnings.warn(f"fit_quality({method!r}): a hit its bound {hi[0]:g}: a measured loss is "
                      f"at or below the law's floor (E + A/N^alpha = "
                      f"{law.E + law.A / n**law.alpha + offset:.4g} with the offset); refit the "
                      "law on longer runs", UserWarning, stacklevel=2)
    rel = float(np.max(np.abs(np.expm1(residuals(best.x)))))
    src = (f"fit to {f.size} pilot run(s) at fractions {sorted(set(f.tolist()))} "
           f"({QUALITY_FORM}{', b pinned' if fix_b is not None else ''})")
    return QualityFit(method=method, a=a, b=b, n_points=int(f.size), max_rel_err=rel, source=src)


def fit_local_law(n_params: Sequence[float] | float, tokens_seen: Sequence[float],
                  unique_tokens: Sequence[float] | float, losses: Sequence[float], *,
                  r_d_star: float = R_D_STAR, fix: dict[str, float] | None = None,
                  fit_r_d_star: bool = False) -> LossLaw:
    """Fit the law's local constants to small runs' held-out losses (curve points or finals).

    Converts each (tokens_seen, unique_tokens) to effective tokens (Muennighoff et al. 2023,
    eq. 5, with `r_d_star`, the published 15.4 by default), then `LossLaw.fit` (Hoffmann et
    al. 2022 eq. 3 / Besiroglu et al. 2024: Huber in log space, L-BFGS-B). When every run has
    the same `n_params`, A = 0 and alpha at its default are pinned (the size term is one constant, folded into E; the law then predicts only
    at that size), so E, B, beta are fitted.

    fit_r_d_star: also fit R_D* (`_fit_r_d_star`: E, B, beta and log R_D* jointly by scipy
    `least_squares` on log residuals, soft-L1 with LossLaw.fit's Huber scale, from a grid of
    starts; then `LossLaw.fit` at that R_D*). Small models
    early in training lose far more to repetition than Muennighoff et al.'s 15.4 (fitted at
    10M-9B parameters, many epochs): refit it when the local runs repeat data.

    Points from the middle of a run with a decaying learning rate sit above an end-of-run curve
    (Hoffmann et al. 2022, Sec. 3.1): fit on the constant-rate phase and add the cooldown's gain
    as `subset_loss(offset=...)`, or fit on final losses only.

    Returns: the fitted LossLaw with `r_d_star` set.
    Raises: TrainplanError on bad arrays or too few points (see `LossLaw.fit`).
    """
    loss = np.asarray(losses, dtype=float).ravel()
    n = np.broadcast_to(np.asarray(n_params, dtype=float), loss.shape).astype(float)
    seen = np.asarray(tokens_seen, dtype=float).ravel()
    unique = np.broadcast_to(np.asarray(unique_tokens, dtype=float), loss.shape).astype(float)
    if seen.size != loss.size:
        raise TrainplanError(f"tokens_seen ({seen.size}) and losses ({loss.size}) differ in length")
    if np.any(~np.isfinite(unique)) or np.any(unique <= 0) or np.any(~np.isfinite(seen)) \
            or np.any(seen <= 0):
        raise TrainplanError("tokens_seen and unique_tokens must be positive and finite")
    r = _num("r_d_star", r_d_star, low=0.0)
    pinned = dict(fix or {})
    if np.all(n == n[0]):
        pinned.setdefault("A", 0.0)
        pinned.setdefault("alpha", LossLaw().alpha)
    how = "published"
    if fit_r_d_star:
        if np.all(seen <= unique):
            raise TrainplanError("fit_r_d_star needs runs that repeat data (tokens_seen > "
                                 "unique_tokens); none does")

        r = _fit_r_d_star(n, seen, unique, loss, pinned)
        how = "fitted"
    law = LossLaw.fit(n, _effective(seen, unique, r), loss, fix=pinned)
    return dataclasses.replace(law, r_d_star=r, source=law.source + f"; effective tokens with "
                               f"{how} R_D*={r:.4g}")


def _fit_r_d_star(n: np.ndarray, seen: np.ndarray, unique: np.ndarray, loss: np.ndarray,
                  pinned: dict[str, float]) -> float:
    """R_D* of the law E + A / N**alpha + B / D'**beta (A, alpha pinned or folded) that fits the
    losses best, fitted jointly with E, B, beta; see `fit_local_law`."""
    size = pinned.get("A", 0.0) / n ** pinned.get("alpha", LossLaw().alpha)
    log_loss = np.log(loss)
    lo_r, hi_r = (math.log(v) for v in R_D_STAR_BOUNDS)

    def pred(theta):
        e, log_b, beta, log_r = theta
        eff = _effective(seen, unique, math.exp(log_r))
        return e + size + np.exp(log_b - beta * np.log(eff))

    def residuals(theta):
        return np.log(np.maximum(pred(theta), 1e-12)) - log_loss

    starts = []
    for beta in (0.1, 0.25, 0.5, 1.0):
        for log_r in np.linspace(lo_r, hi_r, 7):
            col = _effective(seen, unique, math.exp(log_r)) ** -beta
            (e, b), _ = nnls(np.column_stack([np.ones_like(col), col]) / loss[:, None],
                             (loss - size) / loss)
            theta = np.array([e, math.log(max(b, 1e-9)), beta, log_r])
            starts.append((float(np.sum(residuals(theta) ** 2)), theta))
    starts.sort(key=lambda s: s[0])
    bounds = ([0.0, -30.0, 1e-3, lo_r], [np.inf, 60.0, 3.0, hi_r])
    best = None
    for _, theta in starts[:6]:
        res = least_squares(residuals, np.clip(theta, bounds[0], bounds[1]), bounds=bounds,
                            loss="soft_l1", f_scale=HUBER_DELTA, xtol=1e-12, ftol=1e-12,
                            gtol=1e-12, max_nfev=2000)
        if best is None or res.cost < best.cost:
            best = res
    return float(math.exp(best.x[3]))


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoringFlops:
    """FLOPs one scoring pass costs, by part; they add (`+`) and `total` sums them."""

    reference_train_flops: float = 0.0
    """Training the reference / proxy model: 6 * N * tokens (+ attention)."""
    forward_flops: float = 0.0
    """Forward passes over the scored (and target) windows: 2 * N * tokens (+ attention)."""
    backward_flops: float = 0.0
    """Backward passes for per-example gradients (influence): activation gradients only."""
    projection_flops: float = 0.0
    """Random projection of the per-example gradients (influence)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _num(f"ScoringFlops.{f.name}", getattr(self, f.name), low=0.0, low_open=False)

    @property
    def total(self) -> float:
        """All parts, FLOPs."""
        return (self.reference_train_flops + self.forward_flops + self.backward_flops
                + self.projection_flops)

    def __add__(self, other: ScoringFlops) -> ScoringFlops:
        return ScoringFlops(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                               for f in dataclasses.fields(self)})


def scoring_flops(method: str, n_windows: int, seq_len: int, reference_params: float, *,
                  n_layers: int = 0, hidden: int = 0, target_windows: int = 0,
                  reference_train_tokens: float = 0.0,
                  grad_layers: Iterable[tuple[int, int]] = (), projection_rank: int = 8,
                  rescores: int = 1) -> ScoringFlops:
    """Predicted FLOPs of scoring `n_windows` windows of `seq_len` tokens with `method`.

    reference_params: parameters of the scoring model that enter matrix products (all but an
        untied input-embedding lookup; for a tied model, all of them), N.
    n_layers, hidden: the scoring model's layers and width, for the attention term (per token and
        layer 4 * seq_len * hidden forward, QK^T and AV counted in full as FlopCounterMode counts
        SDPA; 0 leaves it out).
    target_windows: windows of the target set, scored alongside (influence).
    reference_train_tokens: tokens the reference model is trained on first (0: given, no cost).
    grad_layers: (out_features, in_features) of each linear layer whose per-example gradient is
        projected (influence); projection_rank: k per side, so a layer gives k_o * k_i dims.
    rescores: how many times the windows are scored (dynamic selection: steps // rescore_every).

    Formulas (per token T = windows * seq_len): forward 2 N T + 4 n_layers seq_len hidden T;
    reference training three times a forward (Kaplan et al. 2020, 6 N per token); influence adds a
    backward of activation gradients only, another forward's worth (weight gradients are replaced
    by the projected per-example ones), and per layer and token 2 (out k_o + in k_i) + 2 k_o k_i
    for the factored projection (Choe et al. 2024, LoGra, arXiv:2405.13954). random: 0; dsir: 0
    model FLOPs (hashed n-gram counting, a few integer operations per token, counted as 2 per
    n-gram feature).

    Raises: TrainplanError on an unknown method or a negative size.
    """
    if method not in METHODS:
        raise TrainplanError(f"unknown scoring method {method!r}; known: {list(METHODS)}")
    for name, v in (("n_windows", n_windows), ("seq_len", seq_len), ("target_windows",
                    target_windows), ("n_layers", n_layers), ("hidden", hidden),
                    ("rescores", rescores), ("projection_rank", projection_rank)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise TrainplanError(f"{name} must be a whole number >= 0, got {v!r}")
    n = _num("reference_params", reference_params, low=0.0, low_open=False)
    train_tokens = _num("reference_train_tokens", reference_train_tokens, low=0.0, low_open=False)
    if method == "random":
        return ScoringFlops()
    tokens = float(n_windows + (target_windows if method != "loss" else 0)) * seq_len
    if method == "dsir":
        return ScoringFlops(forward_flops=2.0 * 2 * tokens * rescores)  # unigram + bigram features
    per_token_fwd = 2.0 * n + 4.0 * n_layers * seq_len * hidden
    train = 3.0 * per_token_fwd * train_tokens
    fwd = per_token_fwd * tokens * rescores
    if method == "loss":
        return ScoringFlops(reference_train_flops=train, forward_flops=fwd)
    k = projection_rank
    proj = sum(2.0 * (o * min(k, o) + i * min(k, i)) + 2.0 * min(k, o) * min(k, i)
               for o, i in grad_layers) * tokens * rescores
    return ScoringFlops(reference_train_flops=train, forward_flops=fwd, backward_flops=fwd,
                        projection_flops=proj)


def reference_scoring_flops(method: str, n_windows: int, seq_len: int, vocab_size: int, *,
                            hidden: int = 32, intermediate: int = 88, layers: int = 2,
                            heads: int = 4, kv_heads: int = 2, train_steps: int = 100,
                            train_micro_batch: int = 8, target_windows: int = 64,
                            projection_rank: int = 8, grad_blocks: int = 2) -> ScoringFlops:
    """`scoring_flops` for `executor.selection`'s default reference model (a tied-embedding
    Llama; the defaults mirror `executor.selection.ReferenceConfig`), trained for
    `train_steps` x `train_micro_batch` windows, before any scoring has run: what the planner
    charges a method it has not tried yet. Matmul parameters per layer: 2 h^2 (q, o) +
    2 h kv_heads (h / heads) (k, v) + 3 h I (gate, up, down), plus the V x h output matrix.

    Raises: TrainplanError on an unknown method or a bad size.
    """
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                 (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    n = layers * sum(o * i for o, i in per_layer) + vocab_size * hidden
    grads = per_layer * min(grad_blocks, layers) + [(vocab_size, hidden)]
    return scoring_flops(method, n_windows, seq_len, n, n_layers=layers, hidden=hidden,
                         target_windows=target_windows,
                         reference_train_tokens=float(train_steps * train_micro_batch * seq_len),
                         grad_layers=grads, projection_rank=projection_rank)


@dataclass(frozen=True, kw_only=True, slots=True)
class SelectionOption:
    """One (method, fraction) entry of the solver's data-subset menu."""

    method: str
    fraction: float
    """Share of the corpus's windows kept, (0, 1]."""
    quality: float
    """q(method, fraction), dimensionless."""
    unique_tokens: float
    """fraction * corpus_tokens, tokens."""
    scoring_flops: float
    """FLOPs charged to the budget before training (0 for random)."""


def selection_menu(fits: dict[str, QualityFit], fractions: Sequence[float], *,
                   corpus_tokens: float, scoring: dict[str, float]) -> list[SelectionOption]:
    """The solver's data-subset menu: every (method, fraction) pair worth considering.

    `fits`: the quality multiplier of each method (e.g. `DEFAULT_QUALITY` updated with local
    fits); `scoring`: each method's scoring FLOPs (`scoring_flops(...).total`, or what
    `executor.selection` counted; a method missing here costs 0). Fraction 1.0 is kept for random
    only (selecting everything is no selection, and would pay for scoring).

    Raises: TrainplanError on an invalid fraction or corpus size.
    """
    corpus = _num("corpus_tokens", corpus_tokens, low=0.0)
    out = []
    for method, fit in fits.items():
        for f in sorted({_fraction(x) for x in fractions}):
            if f == 1.0 and method != "random":
                continue
            out.append(SelectionOption(method=method, fraction=f, quality=fit.q(f),
                                       unique_tokens=max(1.0, f * corpus),
                                       scoring_flops=float(scoring.get(method, 0.0))))
    return out


QUALITY_CACHE_FORMAT = 1
"""Version of the quality-fit file layout; a file of another version is ignored."""


def quality_path(model: str, vocab_size: int, cache_dir: str | Path | None = None) -> Path:
    """`<cache root>/quality/<model>-v<vocab_size>.json` (the cache root as
    `costmodels.loss_cache.cache_root`; characters other than letters, digits, `.`, `_`, `-` in
    the model name become `_`)."""
    from costmodels.loss_cache import cache_root

    if not isinstance(model, str) or not model.strip():
        raise TrainplanError(f"model must be a non-empty name, got {model!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise TrainplanError(f"vocab_size must be a positive whole number, got {vocab_size!r}")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model.strip())
    return cache_root(cache_dir) / "quality" / f"{safe}-v{vocab_size}.json"


def save_quality_fits(fits: Iterable[QualityFit] | dict[str, QualityFit], *, model: str,
                      vocab_size: int, corpus: str = "", cache_dir: str | Path | None = None
                      ) -> Path:
    """Cache fitted selection-quality multipliers of (model, vocab_size), atomically, merged
    into the methods already cached; returns the path. `corpus` names the data they were
    fitted on (kept in the file and in each fit's source: a multiplier belongs to its corpus).

    Raises: TrainplanError on a bad model name or vocabulary size."""
    items = list(fits.values()) if isinstance(fits, dict) else list(fits)
    path = quality_path(model, vocab_size, cache_dir)
    known = {f.method: f for f in load_quality_fits(model, vocab_size, cache_dir).values()}
    for f in items:
        src = f.source + (f"; corpus {corpus}" if corpus and corpus not in f.source else "")
        known[f.method] = dataclasses.replace(f, source=src)
    record = {"format": QUALITY_CACHE_FORMAT, "model": model, "vocab_size": int(vocab_size),
              "corpus": corpus, "form": QUALITY_FORM,
              "fits": {m: dataclasses.asdict(f) for m, f in sorted(known.items())}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def load_quality_fits(model: str, vocab_size: int, cache_dir: str | Path | None = None
                      ) -> dict[str, QualityFit]:
    """The cached multipliers of (model, vocab_size) by method; {} when none are cached. A file
    that cannot be read back (corrupt, other format, another model, invalid constants) gives {}
    with a `RuntimeWarning`: planning falls back to the defaults rather than failing."""
    path = quality_path(model, vocab_size, cache_dir)
    if not path.exists():
        return {}
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or record.get("format") != QUALITY_CACHE_FORMAT:
            raise TrainplanError(f"not a quality-fit file of format {QUALITY_CACHE_FORMAT}")
        if record.get("model") != model or record.get("vocab_size") != vocab_size:
            raise TrainplanError(f"written for {record.get('model')!r} "
                                 f"v{record.get('vocab_size')}, not {model!r} v{vocab_size}")
        return {m: QualityFit(**raw) for m, raw in record["fits"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError, TrainplanError) as e:
        warnings.warn(f"ignoring cached quality fits {path}: {e}", RuntimeWarning, stacklevel=2)
        return {}
