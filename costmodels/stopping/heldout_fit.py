"""Calibrating the planner's held-out curve (`trainplan.costmodels.stopping.heldout_curve`, eq. 1) on pilot runs.

Pure (numpy/scipy). `fit_heldout_curve` is what `benchmarks/governor.py` and
`trainplan solve --heldout-curve`'s curve files come from.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

import numpy as np
from scipy.optimize import OptimizeWarning, least_squares, nnls

from trainplan.costmodels.stopping.curve import MIN_NOISE_NATS, noise_scale
from trainplan.costmodels.stopping.heldout_curve import (
    BETA_BOUNDS,
    EARLY_OFFSET_MAX_NATS,
    KAPPA_BOUNDS,
    PARAMS,
    ZETA_BOUNDS,
    HeldoutCurve,
    PilotCurve,
    central_jacobian,
    heldout_loss,
)
from trainplan.errors import TrainplanError

_BETA_STARTS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5)
_KAPPA_STARTS = (0.5, 1.0, 1.5, 2.0, 3.0)
_ZETA_STARTS = (-0.5, 0.0, 0.5, 1.0)


def fit_heldout_curve(pilots: Sequence[PilotCurve], *, tokens_per_step: float | None = None,
                      unique_tokens: float | None = None, source: str = "") -> HeldoutCurve:
    """Fit eq. (1) to the pilots' held-out points jointly (each point with its pilot's tau, U).

    Method: a grid of (beta, kappa, zeta) starts, each with (E, B, gamma) by non-negative least
    squares (eq. 1 is linear in them); from the best three, `scipy.optimize.least_squares`
    (trust-region reflective; bounds E in [0, min loss], B, gamma >= 0, beta, kappa, zeta in
    BETA_BOUNDS, KAPPA_BOUNDS, ZETA_BOUNDS) with a soft-L1 loss at the pilots' noise scale (a
    stray evaluation does not bend the curve). Covariance s^2 (J^T J)^+ with the plain Jacobian
    and s^2 = sum(r^2) / (n - p). gamma, kappa are fitted when some pilot repeats data (else
    gamma = 0), zeta when pilots at two or more subset sizes do (else 0). Also measured: the
    pilots' evaluation noise (`noise_nats`) and cooldown gain (`cooldown_gain_nats`), and each
    pilot's early offsets (`HeldoutCurve.early_offsets`: its `early_steps` and first fitted
    evaluation, measured - fitted; offsets beyond +-EARLY_OFFSET_MAX_NATS are clipped to it).

    Args: pilots (at least p + 2 points in all, p the fitted parameters; finite, losses > 0;
    of one model and vocabulary, which the curve records);
    tokens_per_step, unique_tokens: the run the returned curve is for (default: the last
    pilot's).
    Raises: TrainplanError on too few or bad points, or pilots of different models or
    vocabularies.
    """
    if not pilots:
        raise TrainplanError("fit_heldout_curve needs at least one pilot")
    t, y, u, noise = [], [], [], []
    for p in pilots:
        s, v = np.asarray(p.steps, dtype=float), np.asarray(p.losses, dtype=float)
        if s.size != v.size or not (np.all(np.isfinite(s)) and np.all(np.isfinite(v))) \
                or np.any(s <= 0) or np.any(v <= 0):
            raise TrainplanError("pilot steps and losses must be finite, > 0 and as many")
        if not (math.isfinite(p.tokens_per_step) and p.tokens_per_step > 0):
            raise TrainplanError(f"pilot tokens_per_step must be > 0, got {p.tokens_per_step!r}")
        t.append(s * p.tokens_per_step)
        y.append(v)
        u.append(np.full(s.size, np.inf if p.unique_tokens is None else float(p.unique_tokens)))
        noise.append(noise_scale(v))
    tokens, loss, unique = np.concatenate(t), np.concatenate(y), np.concatenate(u)
    rep = tokens > unique
    sizes = np.unique(unique[rep])
    names = PARAMS[:3] + (("gamma", "kappa") if rep.any() else ()) + (("zeta",) if sizes.size > 1 else ())
    models = {p.model for p in pilots if p.model}
    vocabs = {p.vocab_size for p in pilots if p.vocab_size}
    if len(models) > 1 or len(vocabs) > 1:
        raise TrainplanError(f"the pilots trained different models or vocabularies ({sorted(models)}, "
                             f"{sorted(vocabs)}): fit one curve per model and vocabulary")
    if loss.size < len(names) + 2:
        raise TrainplanError(f"fit_heldout_curve needs at least {len(names) + 2} points, got {loss.size}")
    d_ref = float(tokens.max())
    u_ref = float(sizes.max()) if sizes.size else 1.0
    scale = max(float(np.median(noise)), MIN_NOISE_NATS)
    lo = np.array([0.0, 0.0, BETA_BOUNDS[0], 0.0, KAPPA_BOUNDS[0], ZETA_BOUNDS[0]])
    hi = np.array([float(loss.min()), 10.0 * float(loss.max()), BETA_BOUNDS[1],
                   10.0 * float(loss.max()), KAPPA_BOUNDS[1], ZETA_BOUNDS[1]])
    free = [PARAMS.index(n) for n in names]
    lo_f, hi_f = lo[free], hi[free]

    def full(x):
        theta = np.array([0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
        theta[free] = x
        return theta

    def resid(x):
        return heldout_loss(full(x), tokens, unique, d_ref, u_ref) - loss

    starts = []
    for beta in _BETA_STARTS:
        for kappa in (_KAPPA_STARTS if "kappa" in names else (1.0,)):
            for zeta in (_ZETA_STARTS if "zeta" in names else (0.0,)):
                fresh_col = (tokens / d_ref) ** -beta
                pen_col = heldout_loss((0.0, 0.0, beta, 1.0, kappa, zeta), tokens, unique, d_ref, u_ref)
                X = np.column_stack([np.ones_like(tokens), fresh_col, pen_col])
                coef, _ = nnls(X[:, :3 if "gamma" in names else 2], loss)
                theta = np.array([coef[0], coef[1], beta, coef[2] if "gamma" in names else 0.0,
                                  kappa, zeta])
                x0 = np.clip(theta[free], lo_f + 1e-9 * (hi_f - lo_f), hi_f - 1e-9 * (hi_f - lo_f))
                r = resid(x0)
                starts.append((float(r @ r), x0))
    starts.sort(key=lambda s: s[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)
        # the best optimum wins (the first of equals)
        best = min((least_squares(resid, x0, bounds=(lo_f, hi_f), method="trf", loss="soft_l1",
                                  f_scale=scale, x_scale="jac", max_nfev=3000) for _, x0 in starts[:3]),
                   key=lambda res: res.cost)
    x = best.x
    r = resid(x)
    s2 = float(r @ r) / max(loss.size - len(free), 1)
    J = central_jacobian(resid, x, list(range(len(free))))
    with np.errstate(all="ignore"):
        cov = np.linalg.pinv(J.T @ J, rcond=1e-12) * s2
    if not np.all(np.isfinite(cov)):
        cov = np.full((len(free), len(free)), np.inf)
    theta = full(x)
    last = pilots[-1]
    E, B, beta, gamma, kappa, zeta = (float(v) for v in theta)  # PARAMS order
    curve = HeldoutCurve(
        E=E, B=B, beta=beta, gamma=gamma, kappa=kappa, zeta=zeta, d_ref_tokens=d_ref, u_ref_tokens=u_ref,
        tokens_per_step=float(tokens_per_step or last.tokens_per_step),
        unique_tokens=last.unique_tokens if tokens_per_step is None and unique_tokens is None
        else unique_tokens, param_names=names, cov=tuple(tuple(float(v) for v in row) for row in cov),
        noise_nats=float(np.median(noise)), rms_nats=math.sqrt(float(r @ r) / loss.size),
        n_points=int(loss.size), model=models.pop() if models else "",
        vocab_size=vocabs.pop() if vocabs else 0,
        source=source or f"fit to {len(pilots)} pilot run(s), {loss.size} held-out points")
    gains = []
    for p in pilots:
        if p.final_step is not None and p.final_loss is not None:
            at = curve.for_run(tokens_per_step=p.tokens_per_step, unique_tokens=p.unique_tokens)
            gains.append(float(at.loss_at(p.final_step)) - float(p.final_loss))
    return dataclasses.replace(curve, cooldown_gain_nats=float(np.median(gains)) if gains else 0.0,
                               early_offsets=_early_offsets(curve, pilots))


def _early_offsets(curve: HeldoutCurve, pilots: Sequence[PilotCurve]) -> tuple:
    """`HeldoutCurve.early_offsets` rows of the pilots that have early points: (U or 0 for fresh,
    step, measured - fitted) at each early step and at the first fitted one."""
    rows = []
    for p in pilots:
        if not p.early_steps or not p.steps or len(p.early_steps) != len(p.early_losses):
            continue
        at = curve.for_run(tokens_per_step=p.tokens_per_step, unique_tokens=p.unique_tokens)
        steps = np.array([*p.early_steps, p.steps[0]], dtype=float)
        losses = np.array([*p.early_losses, p.losses[0]], dtype=float)
        ok = np.isfinite(losses) & (steps > 0)
        off = np.clip(losses[ok] - at.loss_at(steps[ok]), -EARLY_OFFSET_MAX_NATS, EARLY_OFFSET_MAX_NATS)
        u = 0.0 if p.unique_tokens is None else float(p.unique_tokens)
        rows += [(u, float(s), float(o)) for s, o in zip(steps[ok], off, strict=False)]
    return tuple(rows)
