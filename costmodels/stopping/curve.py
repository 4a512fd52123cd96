"""Learning-curve math for the compute governor: the online fit and the gain it predicts.

Pure numpy/scipy: no torch, no planner, no executor. The governor (`trainplan.costmodels.stopping.rule.
Governor`, run in the loop by `trainplan.executor.governor`) fits the held-out loss of a running job with
`fit_curve` and stops it when `marginal_gain` (or `trend_gain`) says the next steps are no
longer worth their cost. The price of a step and the stop a fitted curve implies are in
`trainplan.costmodels.stopping.prediction`; the planner's curve before a run is
`trainplan.costmodels.stopping.heldout_curve`.

The curve is a power law in steps plus a floor,

    L(t) = E + A * (t + t0) ** -alpha,                               (1)

the form of the data term of Hoffmann et al. 2022 eq. 2 (loss against tokens seen, tokens being
steps times tokens per step) and of the learning-curve extrapolation of Domhan et al. 2015
("pow3"); E is the loss the run would reach with unlimited steps, t0 shifts the origin so the
curve is finite at t = 0. It is parametrised for fitting by the excess loss at a reference step
t_ref (the last observed one), D = L(t_ref) - E, so that every parameter is O(1) in nats:

    L(t) = E + D * ((t + t0) / (t_ref + t0)) ** -alpha.                (1')
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import OptimizeWarning, least_squares
from scipy.special import ndtri

from trainplan.errors import TrainplanError

#: Exponents tried as starting points (for each the model is linear in E and D).
ALPHA_STARTS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0)
#: Bounds on the exponent alpha: below 1e-3 the power law is indistinguishable from a constant,
#: above 4 from an exponential.
ALPHA_BOUNDS = (1e-3, 4.0)
#: Smallest noise scale (nats) used for the robust loss, so that an exact curve still fits.
MIN_NOISE_NATS = 1e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class CurveFit:
    """A fitted learning curve L(t) = E + D * ((t + t0) / (t_ref + t0)) ** -alpha, eq. (1').

    Steps are optimizer steps; losses are nats per token. The covariance is over the fitted
    parameters in `param_names` order (E, D, alpha and, if fitted, t0), from the Gauss-Newton
    approximation s^2 (J^T J)^+ at the optimum (Bates & Watts 1988, ch. 2), s^2 the residual
    variance; bands use the delta method on it.
    """

    E: float
    """Floor: the loss with unlimited steps, nats/token."""
    D: float
    """Excess loss over the floor at `t_ref`, nats/token (>= 0)."""
    alpha: float
    """Power-law exponent in steps, dimensionless."""
    t0: float
    """Step offset (steps, >= 0): the curve is finite at step 0."""
    t_ref: float
    """Reference step of the parametrisation: the last step fitted."""
    t_min: float
    """The first step fitted: the fit covers [t_min, t_ref]; before t_min it is extrapolated
    backwards, where eq. (1) rarely holds (warm-up)."""
    param_names: tuple[str, ...]
    """Names of the fitted parameters: ("E", "D", "alpha") or ("E", "D", "alpha", "t0")."""
    cov: tuple[tuple[float, ...], ...]
    """Covariance of the fitted parameters, same order as `param_names`."""
    n_points: int
    """Points fitted."""
    residual_std: float
    """Residual standard deviation, nats/token (s in s^2 (J^T J)^+)."""
    success: bool = True
    """False when the optimiser did not converge; the values are then its last iterate."""

    @property
    def A(self) -> float:
        """Coefficient of eq. (1): A = D * (t_ref + t0) ** alpha."""
        return self.D * (self.t_ref + self.t0) ** self.alpha

    def loss_at(self, steps) -> np.ndarray:
        """Predicted loss (nats/token) at `steps` (scalar or array, steps >= 0)."""
        return _model(np.asarray(steps, dtype=float), self.E, self.D, self.alpha, self.t0, self.t_ref)

    def gain(self, step, horizon_steps) -> np.ndarray:
        """Predicted loss drop L(step) - L(step + horizon_steps), nats/token."""
        s = np.asarray(step, dtype=float)
        return self.loss_at(s) - self.loss_at(s + horizon_steps)

    def grad(self, steps) -> np.ndarray:
        """d L(steps) / d (fitted parameters), shape (len(param_names),) + shape(steps)."""
        g = _model_grad(np.asarray(steps, dtype=float), self.E, self.D, self.alpha, self.t0, self.t_ref)
        return np.stack([g[_ALL_PARAMS.index(n)] for n in self.param_names])

    def std_of(self, grad: np.ndarray) -> np.ndarray:
        """Delta-method standard deviation of a quantity whose gradient with respect to the
        fitted parameters is `grad` (first axis: parameters): sqrt(g^T cov g); inf when the
        covariance is not finite (a degenerate fit)."""
        cov = np.asarray(self.cov, dtype=float)
        if not np.all(np.isfinite(cov)):
            return np.full(grad.shape[1:], np.inf)
        g2 = grad.reshape(grad.shape[0], -1)
        var = np.einsum("ik,ij,jk->k", g2, cov, g2).reshape(grad.shape[1:])
        return np.sqrt(np.maximum(var, 0.0))

    def band(self, steps, confidence: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
        """Central `confidence` band of the predicted *mean* loss at `steps` (delta method):
        (lower, upper), nats/token. Not a band for single noisy evaluations."""
        z = _z(confidence)
        s = np.asarray(steps, dtype=float)
        mean, sd = self.loss_at(s), self.std_of(self.grad(s))
        return mean - z * sd, mean + z * sd

    @classmethod
    def from_dict(cls, raw: dict) -> CurveFit:
        """Inverse of `to_dict` (the derived `A` is ignored)."""
        return cls(E=float(raw["E"]), D=float(raw["D"]), alpha=float(raw["alpha"]), t0=float(raw["t0"]),
                   t_ref=float(raw["t_ref"]), t_min=float(raw.get("t_min", 0.0)),
                   param_names=tuple(raw["param_names"]),
                   cov=tuple(tuple(float(v) for v in row) for row in raw["cov"]),
                   n_points=int(raw["n_points"]), residual_std=float(raw["residual_std"]),
                   success=bool(raw.get("success", True)))

    def to_dict(self) -> dict:
        """JSON-ready values (for records and reports)."""
        return {"E": self.E, "D": self.D, "A": self.A, "alpha": self.alpha, "t0": self.t0,
                "t_ref": self.t_ref, "t_min": self.t_min, "param_names": list(self.param_names),
                "cov": [list(r) for r in self.cov], "n_points": self.n_points,
                "residual_std": self.residual_std, "success": self.success}


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise TrainplanError(f"confidence must be in (0, 1), got {confidence!r}")
    # the standard normal quantile: scipy.stats.norm.ppf is ndtri (without scipy.stats' import)
    return float(ndtri(0.5 + confidence / 2.0))


_ALL_PARAMS = ("E", "D", "alpha", "t0")


def _model(t, E, D, alpha, t0, t_ref):
    return E + D * ((t + t0) / (t_ref + t0)) ** -alpha


def _model_grad(t, E, D, alpha, t0, t_ref) -> np.ndarray:
    """d L / d (E, D, alpha, t0) of eq. (1'), shape (4,) + shape(t)."""
    u = (t + t0) / (t_ref + t0)
    ua = u ** -alpha
    return np.stack([np.ones_like(u), ua, -D * ua * np.log(u),
                     -alpha * D * ua / u * (t_ref - t) / (t_ref + t0) ** 2])


def _check_xy(steps, losses, weights):
    t = np.asarray(steps, dtype=float).ravel()
    y = np.asarray(losses, dtype=float).ravel()
    if t.size != y.size:
        raise TrainplanError(f"steps and losses differ in length: {t.size} vs {y.size}")
    if t.size < 3:
        raise TrainplanError(f"fit_curve needs at least 3 points, got {t.size}")
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(y))):
        raise TrainplanError("steps and losses must be finite (drop NaN/inf points first)")
    if np.any(t < 0):
        raise TrainplanError(f"steps must be >= 0, got min {t.min()!r}")
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=float).ravel()
    if w.size != y.size or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise TrainplanError("weights must be positive, finite and as many as the losses")
    return t, y, w


def noise_scale(y) -> float:
    """Noise std (same unit as y, nats for losses) of a series along a smooth trend, from its
    second differences, robust to outliers: MAD(d2) x 1.4826 / sqrt(6) (the second difference
    of i.i.d. noise has variance 6 sigma^2; 1.4826 x MAD estimates a normal sigma). At least
    MIN_NOISE_NATS; MIN_NOISE_NATS for fewer than 4 points."""
    y = np.asarray(y, dtype=float).ravel()
    if y.size < 4:
        return MIN_NOISE_NATS
    d2 = np.diff(y, 2)
    return max(MIN_NOISE_NATS, 1.4826 * float(np.median(np.abs(d2 - np.median(d2)))) / math.sqrt(6.0))



def _linear_start(t, y, w, alpha, t0, t_ref):
    """For fixed alpha and t0 eq. (1') is linear in (E, D): weighted least squares, then
    clipped into the bounds (0 <= E <= min y, D >= 0). Returns (sse, E, D)."""
    x = ((t + t0) / (t_ref + t0)) ** -alpha
    X = np.column_stack([np.ones_like(x), x]) * w[:, None]
    coef, *_ = np.linalg.lstsq(X, y * w, rcond=None)
    E = float(np.clip(coef[0], 0.0, y.min()))
    D = max(float(coef[1]), 0.0)
    r = (E + D * x - y) * w
    return float(r @ r), E, D


def fit_curve(steps: ArrayLike, losses: ArrayLike, *, weights: ArrayLike | None = None,
              t0: float | None = 1.0, robust: bool = True) -> CurveFit:
    """Fit L(t) = E + A (t + t0)^-alpha (eq. 1) to (step, loss) points.

    Method: starts from a grid of alpha (for each, E and D by linear least squares), then
    `scipy.optimize.least_squares` (trust-region reflective, bounds 0 <= E <= min loss, D >= 0,
    alpha in ALPHA_BOUNDS, t0 in [0, 2 x last step + 10] when fitted) with a soft-L1 robust loss
    whose scale is the noise estimated from second differences (`robust=False`: plain least
    squares), so that a stray evaluation does not bend the curve. The covariance is
    s^2 (J^T J)^+ at the optimum, J the plain Jacobian of the residuals and
    s^2 = sum(r^2) / (n - p) over all residuals (outliers included: a wider band).

    Args:
        steps: optimizer steps (>= 0); losses: nats/token, finite. At least 3 points (4 when
            t0 is fitted).
        weights: per-point weights (> 0), multiplying the residuals, e.g. 1/sigma.
        t0: fixed step offset (>= 0), or None to fit it.
        robust: soft-L1 loss (default) or plain least squares.

    Returns: the `CurveFit`.
    Raises: TrainplanError on mismatched, non-finite, negative or too few points, or a negative
    t0.
    """
    t, y, w = _check_xy(steps, losses, weights)
    if np.any(y < 0):
        raise TrainplanError(f"losses must be >= 0 (cross-entropy), got min {y.min()!r}")
    fixed_t0: float | None = None
    if t0 is not None:
        if not math.isfinite(t0) or t0 < 0:
            raise TrainplanError(f"t0 must be None or a finite number >= 0, got {t0!r}")
        fixed_t0 = float(t0)
    fit_t0 = fixed_t0 is None
    n_par = 4 if fit_t0 else 3
    if t.size < n_par:
        raise TrainplanError(f"fit_curve needs at least {n_par} points with t0 fitted, got {t.size}")
    t_ref = float(t.max())
    t0_grid = (0.0, 0.1 * t_ref + 1.0, 0.5 * t_ref + 1.0) if fixed_t0 is None else (fixed_t0,)
    best = min(((_linear_start(t, y, w, a, c, t_ref), a, c) for a in ALPHA_STARTS for c in t0_grid),
               key=lambda s: s[0][0])
    (_, E0, D0), a0, c0 = best
    ymin, span = float(y.min()), float(y.max() - y.min())
    lo = [0.0, 0.0, ALPHA_BOUNDS[0]] + ([0.0] if fit_t0 else [])
    hi = [max(ymin, 1e-9), max(10.0 * span + 10.0 * y.max(), 1.0), ALPHA_BOUNDS[1]]
    hi += [2.0 * t_ref + 10.0] if fit_t0 else []
    x0 = np.clip(np.array([E0, D0, a0] + ([c0] if fit_t0 else []), dtype=float),
                 np.array(lo) + 1e-12 * (np.array(hi) - np.array(lo)),
                 np.array(hi) - 1e-9 * (np.array(hi) - np.array(lo)))

    def resid(p):
        c = p[3] if fit_t0 else fixed_t0
        return (_model(t, p[0], p[1], p[2], c, t_ref) - y) * w

    def jac(p):
        g = _model_grad(t, p[0], p[1], p[2], p[3] if fit_t0 else fixed_t0, t_ref)
        return g[:n_par].T * w[:, None]

    scale = noise_scale(y) * float(np.median(w))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)
        res = least_squares(resid, x0, jac=jac, bounds=(lo, hi), method="trf",
                            loss="soft_l1" if robust else "linear", f_scale=max(scale, MIN_NOISE_NATS),
                            x_scale="jac", max_nfev=2000, xtol=1e-12, ftol=1e-12, gtol=1e-12)
    p = res.x
    r = resid(p)
    dof = max(t.size - n_par, 1)
    s2 = float(r @ r) / dof
    J = jac(p)  # plain Jacobian: the robust loss's reweighted one would shrink the band
    with np.errstate(all="ignore"):
        cov = np.linalg.pinv(J.T @ J, rcond=1e-12) * s2
    if not np.all(np.isfinite(cov)):
        cov = np.full((n_par, n_par), np.inf)
    names = ("E", "D", "alpha", "t0") if fit_t0 else ("E", "D", "alpha")
    return CurveFit(E=float(p[0]), D=float(p[1]), alpha=float(p[2]),
                    t0=float(p[3]) if fixed_t0 is None else fixed_t0, t_ref=t_ref, t_min=float(t.min()),
                    param_names=names,
                    cov=tuple(tuple(float(v) for v in row) for row in cov), n_points=int(t.size),
                    residual_std=math.sqrt(s2), success=bool(res.success))


def marginal_gain(fit: CurveFit, step: float, horizon_steps: float,
                  confidence: float = 0.9) -> tuple[float, float, float]:
    """Predicted loss drop over the next `horizon_steps` steps after `step`:
    L(step) - L(step + horizon_steps) in nats/token, with a central `confidence` band by the
    delta method (so `upper` is a one-sided bound at (1 + confidence) / 2).

    Returns: (mean, lower, upper); lower is clipped at 0 (the model never predicts a rise).
    Raises: TrainplanError on horizon_steps <= 0, a negative step or a bad confidence.
    """
    if not horizon_steps > 0:
        raise TrainplanError(f"horizon_steps must be > 0, got {horizon_steps!r}")
    if not step >= 0:
        raise TrainplanError(f"step must be >= 0, got {step!r}")
    z = _z(confidence)
    s, h = float(step), float(horizon_steps)
    mean = float(fit.gain(s, h))
    sd = float(fit.std_of(fit.grad(s) - fit.grad(s + h)))
    return mean, max(mean - z * sd, 0.0), mean + z * sd


def trend_gain(steps: ArrayLike, losses: ArrayLike,
               confidence: float = 0.9) -> tuple[float, float, float]:
    """Loss drop per step from a straight line fitted to (step, loss) by ordinary least squares:
    -slope, with a central `confidence` band from the slope's standard error
    s / sqrt(sum (t - mean t)^2). Model-free where eq. (1) is not: a rising curve (overfitting on
    repeated data) gives a negative drop, which a power law plus floor cannot express. On a
    convex decreasing curve the secant over a window is steeper than the tangent at its end, so
    this overstates the current drop: a conservative (late) stop signal.

    Returns: (mean, lower, upper), nats/token per step.
    Raises: TrainplanError on fewer than 3 points, non-finite values or one distinct step.
    """
    t, y, _ = _check_xy(steps, losses, None)
    tc = t - t.mean()
    sxx = float(tc @ tc)
    if sxx <= 0:
        raise TrainplanError("trend_gain needs at least two distinct steps")
    slope = float(tc @ (y - y.mean())) / sxx
    r = y - y.mean() - slope * tc
    se = math.sqrt(float(r @ r) / max(t.size - 2, 1) / sxx)
    z = _z(confidence)
    return -slope, -slope - z * se, -slope + z * se
