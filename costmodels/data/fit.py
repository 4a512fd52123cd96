"""Fitting the data-value model (`trainplan.costmodels.data.value`) to local runs: the law's constants
(`fit_local_law`, optionally with R_D*) and each scoring method's selection-quality multiplier
(`fit_quality`).

Effective tokens:
Muennighoff et al. 2023, "Scaling Data-Constrained Language Models" (arXiv:2305.16264), eq. 5;
law fit: Hoffmann et al. 2022 eq. 3 / Besiroglu et al. 2024 (`trainplan.costmodels.loss.law.LossLaw.fit`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

import numpy as np
from scipy.optimize import least_squares, nnls

from trainplan.costmodels.checks import check_range
from trainplan.costmodels.data.quality import QUALITY_FORM, QualityFit, check_fraction
from trainplan.costmodels.data.value import subset_loss_curve
from trainplan.costmodels.loss.fit import HUBER_DELTA
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.repetition import R_D_STAR, effective_array
from trainplan.errors import TrainplanError

R_D_STAR_BOUNDS = (0.05, 100.0)
"""Range searched when `fit_local_law` fits R_D* (repetitions)."""


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
    for v in f:
        check_fraction(v)
    if not (np.all(np.isfinite(loss)) and np.all(loss > 0) and np.all(np.isfinite(tok))
            and np.all(tok > 0)):
        raise TrainplanError(f"losses and tokens_seen must be positive and finite, got "
                             f"{loss.tolist()[:8]} and {tok.tolist()[:8]}")
    corpus = check_range("corpus_tokens", corpus_tokens, low=0.0)
    n = check_range("n_params", n_params, low=0.0)
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
        pred = subset_loss_curve(law, n, tok, unique, np.maximum(q, 1e-12)) + offset
        return np.log(np.maximum(pred, 1e-12)) - log_loss

    lo = [-1.0 + 1e-6] + ([] if fix_b is not None else [1e-3])
    hi = [1e3] + ([] if fix_b is not None else [20.0])
    starts = [[a0] + ([] if fix_b is not None else [b0])
              for a0 in (-0.5, 0.0, 0.5, 2.0, 10.0) for b0 in ((1.0,) if fix_b is not None
                                                               else (0.5, 1.0, 2.0))]
    # the best optimum wins (the first of equals)
    best = min((least_squares(residuals, x0, bounds=(lo, hi), method="trf", xtol=1e-14, ftol=1e-14,
                              gtol=1e-14, max_nfev=5000) for x0 in starts), key=lambda res: res.cost)
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
    the same `n_params`, A = 0 and alpha at its default are pinned (the size term is one
    constant, folded into E; the law then predicts only at that size), so E, B, beta are fitted.

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
    r = check_range("r_d_star", r_d_star, low=0.0)
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
    law = LossLaw.fit(n, effective_array(seen, unique, r), loss, fix=pinned)
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
        eff = effective_array(seen, unique, math.exp(log_r))
        return e + size + np.exp(log_b - beta * np.log(eff))

    def residuals(theta):
        return np.log(np.maximum(pred(theta), 1e-12)) - log_loss

    starts = []
    for beta in (0.1, 0.25, 0.5, 1.0):
        for log_r in np.linspace(lo_r, hi_r, 7):
            col = effective_array(seen, unique, math.exp(log_r)) ** -beta
            (e, b), _ = nnls(np.column_stack([np.ones_like(col), col]) / loss[:, None],
                             (loss - size) / loss)
            theta = np.array([e, math.log(max(b, 1e-9)), beta, log_r])
            starts.append((float(np.sum(residuals(theta) ** 2)), theta))
    starts.sort(key=lambda s: s[0])
    bounds = ([0.0, -30.0, 1e-3, lo_r], [np.inf, 60.0, 3.0, hi_r])
    # the best optimum wins (the first of equals)
    best = min((least_squares(residuals, np.clip(theta, bounds[0], bounds[1]), bounds=bounds,
                              loss="soft_l1", f_scale=HUBER_DELTA, xtol=1e-12, ftol=1e-12,
                              gtol=1e-12, max_nfev=2000) for _, theta in starts[:6]),
               key=lambda res: res.cost)
    return float(math.exp(best.x[3]))
