"""The planner's held-out learning curve, calibrated on pilot runs: a fresh-data law plus a
penalty for repeating data. What the planner simulates the governor over to predict its stop.

Along a run at a constant learning rate, with t steps done, tau tokens per step (t tau tokens
seen) and U unique tokens (the kept subset), the held-out loss is modelled as

    L(t) = E + B (t tau / D_ref)^-beta + gamma (U / U_ref)^zeta max(t tau / U - 1, 0)^kappa   (1)

in nats/token, with
- E + B (D / D_ref)^-beta: the data term of Hoffmann et al. 2022 eq. 2 along a run on fresh
  data (`costmodels.loss.learning_curve` without a data limit; one model size, so A / N^alpha is
  folded into E, as `trainplan calibrate` fits it); D_ref is a reference token count (the
  largest the fit saw), so B is the excess over E there, in nats;
- gamma (U / U_ref)^zeta R^kappa, R = t tau / U - 1 the repeats beyond the first epoch: an
  additive penalty for repetition (Lovelace et al. 2026, arXiv:2605.01640, "Prescriptive
  Scaling Laws for Data Constrained Training", add an overfitting penalty to the Chinchilla
  form; this power law in the repeats and in the unique data is this module's own form, not
  theirs, fitted per model): zero within the first epoch,
  growing with every further one; U_ref is a reference unique-token count (the largest pilot's),
  zeta says how the penalty at a given number of repeats scales with the data (0: by repeats
  alone).

Why not the planner's data-constrained law (Muennighoff et al. 2023 eq. 5, effective tokens
D' = U (1 + R_D* (1 - exp(-R / R_D*)))): D' is increasing and bounded, so the loss it predicts
only flattens. A small model that repeats its data many times overfits: its held-out loss
passes a minimum and rises, and the governor (its straight-line check) stops it near that
minimum, a step the Muennighoff law cannot place. In (1) the fresh term keeps falling and the
penalty keeps growing; their sum has that minimum.

Calibration (`fit_heldout_curve`): least squares over the held-out points of pilot runs, each
with its own tau and U: a fresh-data run over the plan's step range (no repeats: the penalty is
0; it fixes E, B, beta, the local law `trainplan calibrate` fits) and runs on smaller subsets
for as many epochs as the plan (they fix gamma, kappa and, from two or more subset sizes,
zeta). `HeldoutCurve.for_run` moves the calibrated curve to a plan's tau and U, extrapolating
the penalty in U by (U / U_ref)^zeta: the assumption the benchmark (`benchmarks/governor.py`)
tests on runs the fit never saw.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import OptimizeWarning, least_squares, nnls
from scipy.stats import norm

from costmodels.governor import MIN_NOISE_NATS, noise_scale
from hardware_profiles.errors import TrainplanError

PARAMS = ("E", "B", "beta", "gamma", "kappa", "zeta")
BETA_BOUNDS = (0.01, 3.0)
"""Bounds on the fresh-data exponent beta (dimensionless)."""
KAPPA_BOUNDS = (0.25, 4.0)
"""Bounds on the repetition exponent kappa (dimensionless): sub- to super-linear in repeats."""
ZETA_BOUNDS = (-2.0, 2.0)
"""Bounds on the data exponent zeta of the penalty (dimensionless)."""
_BETA_STARTS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5)
_KAPPA_STARTS = (0.5, 1.0, 1.5, 2.0, 3.0)
_ZETA_STARTS = (-0.5, 0.0, 0.5, 1.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class PilotCurve:
    """The held-out points of one pilot run that the curve is fitted to (constant learning rate:
    after warm-up, before the run's cooldown; see `executor.governor.pilot_curve`)."""

    steps: tuple[float, ...]
    """Steps done at each evaluation."""
    losses: tuple[float, ...]
    """Held-out loss at each evaluation, nats/token."""
    tokens_per_step: float
    """Tokens per optimizer step of the pilot (tau)."""
    unique_tokens: float | None
    """Unique tokens the pilot drew from (U); None: fresh data (no repeats)."""
    final_step: int | None = None
    """The pilot's last step (after its cooldown), when `final_loss` is given."""
    final_loss: float | None = None
    """Held-out loss at `final_step`, nats/token: with the curve it measures the cooldown's gain."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldoutCurve:
    """Eq. (1) with calibrated constants for one run's tau and U. Losses in nats/token, steps are
    steps done at a constant learning rate."""

    E: float
    """Floor of the fresh-data term, nats/token."""
    B: float
    """Fresh-data excess over E at `d_ref_tokens` tokens seen, nats/token."""
    beta: float
    """Fresh-data exponent in tokens seen, dimensionless."""
    gamma: float
    """Repetition penalty after one repeat beyond the first epoch at U = `u_ref_tokens`,
    nats/token (0: none)."""
    kappa: float
    """Exponent of the penalty in repeats, dimensionless."""
    zeta: float
    """Exponent of the penalty in unique tokens, dimensionless (0: by repeats alone)."""
    d_ref_tokens: float
    """Reference token count of the fresh term (tokens)."""
    u_ref_tokens: float
    """Reference unique-token count of the penalty (tokens)."""
    tokens_per_step: float
    """Tokens per step of the run this curve is for (tau)."""
    unique_tokens: float | None
    """Unique tokens of that run (U); None: fresh data, no penalty."""
    param_names: tuple[str, ...] = PARAMS
    """The fitted parameters (gamma, kappa absent when no pilot repeated data; zeta absent
    unless pilots at two or more subset sizes did)."""
    cov: tuple[tuple[float, ...], ...] = ()
    """Covariance of the fitted parameters (Gauss-Newton s^2 (J^T J)^+, J the plain Jacobian;
    Bates & Watts 1988, ch. 2), in `param_names` order; () when not fitted."""
    noise_nats: float = 0.0
    """Held-out evaluation noise of the pilots (median of `noise_scale` over them), nats."""
    rms_nats: float = 0.0
    """RMS residual of the fit over the pilots' points, nats."""
    cooldown_gain_nats: float = 0.0
    """Loss a run's cooldown removes below the constant-rate curve (median over the pilots of
    curve(final step) - final loss), nats; what the governed run's final loss gains over (1)."""
    n_points: int = 0
    """Pilot points fitted."""
    source: str = ""
    """How the constants were obtained."""

    def _theta(self) -> np.ndarray:
        return np.array([getattr(self, n) for n in PARAMS], dtype=float)

    def _eval(self, theta: np.ndarray, steps: np.ndarray) -> np.ndarray:
        return _model(theta, steps * self.tokens_per_step, self.unique_tokens, self.d_ref_tokens,
                      self.u_ref_tokens)

    def loss_at(self, steps) -> np.ndarray:
        """Eq. (1) at `steps` (scalar or array of steps done; below 1 taken as 1), nats/token."""
        return self._eval(self._theta(), np.maximum(np.asarray(steps, dtype=float), 1.0))

    def band(self, steps, confidence: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
        """Central `confidence` band of the predicted mean loss at `steps` (delta method on
        `cov`, central differences), (lower, upper) nats/token; the mean itself without `cov`.
        A band for the fitted constants: it does not cover the extrapolation in U itself."""
        s = np.maximum(np.asarray(steps, dtype=float), 1.0)
        mean = self.loss_at(s)
        if not self.cov:
            return mean, mean
        cov = np.asarray(self.cov, dtype=float)
        if not np.all(np.isfinite(cov)):
            return np.full_like(mean, -np.inf), np.full_like(mean, np.inf)
        g = _jacobian(lambda th: self._eval(th, s).ravel(), self._theta(),
                      [PARAMS.index(n) for n in self.param_names]).T
        sd = np.sqrt(np.maximum(np.einsum("ik,ij,jk->k", g, cov, g), 0.0)).reshape(mean.shape)
        z = float(norm.ppf(0.5 + confidence / 2.0))
        return mean - z * sd, mean + z * sd

    def for_run(self, *, tokens_per_step: float, unique_tokens: float | None) -> "HeldoutCurve":
        """The same calibration for another run: its tokens per step and unique tokens (None:
        fresh data)."""
        if not (math.isfinite(tokens_per_step) and tokens_per_step > 0):
            raise TrainplanError(f"tokens_per_step must be > 0, got {tokens_per_step!r}")
        if unique_tokens is not None and not (math.isfinite(unique_tokens) and unique_tokens > 0):
            raise TrainplanError(f"unique_tokens must be None or > 0, got {unique_tokens!r}")
        return dataclasses.replace(self, tokens_per_step=float(tokens_per_step),
                                   unique_tokens=None if unique_tokens is None else float(unique_tokens))

    def to_dict(self) -> dict:
        """JSON-ready values."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["param_names"], d["cov"] = list(self.param_names), [list(r) for r in self.cov]
        return d

    @classmethod
    def from_dict(cls, raw: dict) -> "HeldoutCurve":
        """Inverse of `to_dict`.

        Raises: TrainplanError when a constant is not a real finite number or is outside the
        fit's own bounds, a parameter name is unknown or the covariance has the wrong shape;
        TypeError / ValueError when `raw` is not such a mapping (missing or unknown fields)."""
        kw = dict(raw)
        kw["param_names"] = tuple(kw.get("param_names", PARAMS))
        kw["cov"] = tuple(tuple(float(v) for v in r) for r in kw.get("cov", ()))
        curve = cls(**kw)
        bad = _curve_problem(curve)
        if bad:
            raise TrainplanError(bad)
        return curve


COOLDOWN_GAIN_MAX_NATS = 1.0
"""Largest cooldown gain (either sign) a curve file may carry, nats: the pilots of
`benchmarks/governor.py` measured 0.07-0.15 nats on tiny-llama; ten times that is no pilot fit
(a gain of 1e9 once gave a predicted loss of -1e9)."""


def _curve_problem(c: "HeldoutCurve") -> str | None:
    """What makes `c` unusable as eq. (1) (None when nothing): constants that are not real
    finite numbers or out of the fit's own bounds (`fit_heldout_curve`), unknown parameter
    names, a covariance of the wrong shape."""
    ranges = {"E": (0.0, None), "B": (0.0, None), "beta": BETA_BOUNDS, "gamma": (0.0, None),
              "kappa": KAPPA_BOUNDS, "zeta": ZETA_BOUNDS, "d_ref_tokens": (0.0, None),
              "u_ref_tokens": (0.0, None), "tokens_per_step": (0.0, None), "noise_nats": (0.0, None),
              "rms_nats": (0.0, None), "cooldown_gain_nats": (-COOLDOWN_GAIN_MAX_NATS, COOLDOWN_GAIN_MAX_NATS)}
    for name, (lo, hi) in ranges.items():
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return f"{name}={v!r} must be a finite number"
        strict = name in ("d_ref_tokens", "u_ref_tokens", "tokens_per_step")
        if (lo is not None and (v <= lo if strict else v < lo)) or (hi is not None and v > hi):
            valid = ([f"{'>' if strict else '>='} {lo}"] if lo is not None else []) + \
                ([f"<= {hi}"] if hi is not None else [])
            return f"{name}={v!r} is out of range ({', '.join(valid)})"
    if not set(c.param_names) <= set(PARAMS) or len(set(c.param_names)) != len(c.param_names):
        return f"param_names={list(c.param_names)!r} must be distinct names of {list(PARAMS)}"
    if c.cov and (len(c.cov) != len(c.param_names) or any(len(r) != len(c.param_names) for r in c.cov)):
        return f"cov must be {len(c.param_names)} x {len(c.param_names)} (one row per name in param_names)"
    return None


def _model(theta, tokens, unique, d_ref, u_ref) -> np.ndarray:
    """Eq. (1) at `tokens` seen; `unique` None or inf: fresh data."""
    E, B, beta, gamma, kappa, zeta = theta
    tokens = np.asarray(tokens, dtype=float)
    fresh = E + B * (tokens / d_ref) ** -beta
    if unique is None:
        return fresh
    u = np.asarray(unique, dtype=float)
    finite = np.isfinite(u)
    u_safe = np.where(finite, u, u_ref)
    reps = np.where(finite, np.maximum(tokens / u_safe - 1.0, 0.0), 0.0)
    return fresh + gamma * (u_safe / u_ref) ** zeta * reps ** kappa


def _jacobian(f, x: np.ndarray, idx: list[int]) -> np.ndarray:
    """Central-difference Jacobian of f with respect to x[idx]: shape (len(f(x)), len(idx))."""
    cols = []
    for i in idx:
        h = 1e-6 * max(abs(x[i]), 1e-3)
        up, dn = x.copy(), x.copy()
        up[i] += h
        dn[i] -= h
        cols.append((f(up) - f(dn)) / (2 * h))
    return np.column_stack(cols)


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
    pilots' evaluation noise (`noise_nats`) and cooldown gain (`cooldown_gain_nats`).

    Args: pilots (at least p + 2 points in all, p the fitted parameters; finite, losses > 0);
    tokens_per_step, unique_tokens: the run the returned curve is for (default: the last
    pilot's).
    Raises: TrainplanError on too few or bad points.
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
        return _model(full(x), tokens, unique, d_ref, u_ref) - loss

    starts = []
    for beta in _BETA_STARTS:
        for kappa in (_KAPPA_STARTS if "kappa" in names else (1.0,)):
            for zeta in (_ZETA_STARTS if "zeta" in names else (0.0,)):
                fresh_col = (tokens / d_ref) ** -beta
                pen_col = _model((0.0, 0.0, beta, 1.0, kappa, zeta), tokens, unique, d_ref, u_ref)
                X = np.column_stack([np.ones_like(tokens), fresh_col, pen_col])
                coef, _ = nnls(X[:, :3 if "gamma" in names else 2], loss)
                theta = np.array([coef[0], coef[1], beta, coef[2] if "gamma" in names else 0.0,
                                  kappa, zeta])
                x0 = np.clip(theta[free], lo_f + 1e-9 * (hi_f - lo_f), hi_f - 1e-9 * (hi_f - lo_f))
                r = resid(x0)
                starts.append((float(r @ r), x0))
    starts.sort(key=lambda s: s[0])
    best = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)
        for _, x0 in starts[:3]:
            res = least_squares(resid, x0, bounds=(lo_f, hi_f), method="trf", loss="soft_l1",
                                f_scale=scale, x_scale="jac", max_nfev=3000)
            if best is None or res.cost < best.cost:
                best = res
    x = best.x
    r = resid(x)
    s2 = float(r @ r) / max(loss.size - len(free), 1)
    J = _jacobian(resid, x, list(range(len(free))))
    with np.errstate(all="ignore"):
        cov = np.linalg.pinv(J.T @ J, rcond=1e-12) * s2
    if not np.all(np.isfinite(cov)):
        cov = np.full((len(free), len(free)), np.inf)
    theta = full(x)
    last = pilots[-1]
    curve = HeldoutCurve(
        **dict(zip(PARAMS, (float(v) for v in theta))), d_ref_tokens=d_ref, u_ref_tokens=u_ref,
        tokens_per_step=float(tokens_per_step or last.tokens_per_step),
        unique_tokens=last.unique_tokens if tokens_per_step is None and unique_tokens is None
        else unique_tokens, param_names=names, cov=tuple(tuple(float(v) for v in row) for row in cov),
        noise_nats=float(np.median(noise)), rms_nats=math.sqrt(float(r @ r) / loss.size),
        n_points=int(loss.size),
        source=source or f"fit to {len(pilots)} pilot run(s), {loss.size} held-out points")
    gains = []
    for p in pilots:
        if p.final_step is not None and p.final_loss is not None:
            at = curve.for_run(tokens_per_step=p.tokens_per_step, unique_tokens=p.unique_tokens)
            gains.append(float(at.loss_at(p.final_step)) - float(p.final_loss))
    return dataclasses.replace(curve, cooldown_gain_nats=float(np.median(gains)) if gains else 0.0)


__all__ = ["BETA_BOUNDS", "KAPPA_BOUNDS", "ZETA_BOUNDS", "HeldoutCurve", "PilotCurve",
           "fit_heldout_curve"]
