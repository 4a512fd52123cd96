"""The planner's held-out learning curve, calibrated on pilot runs: a fresh-data law plus a
penalty for repeating data. What the planner simulates the governor over to predict its stop.

Along a run at a constant learning rate, with t steps done, tau tokens per step (t tau tokens
seen) and U unique tokens (the kept subset), the held-out loss is modelled as

    L(t) = E + B (t tau / D_ref)^-beta + gamma (U / U_ref)^zeta max(t tau / U - 1, 0)^kappa   (1)

in nats/token, with
- E + B (D / D_ref)^-beta: the data term of Hoffmann et al. 2022 eq. 2 along a run on fresh
  data (`trainplan.costmodels.loss.law.learning_curve` without a data limit; one model size, so A / N^alpha is
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

Calibration (`trainplan.costmodels.stopping.heldout_fit.fit_heldout_curve`): least squares over the held-out points
of pilot runs, each with its own tau and U: a fresh-data run over the plan's step range (no
repeats: the penalty is 0; it fixes E, B, beta, the local law `trainplan calibrate` fits) and
runs on smaller subsets for as many epochs as the plan (they fix gamma, kappa and, from two or
more subset sizes, zeta). `HeldoutCurve.for_run` moves the calibrated curve to a plan's tau and U, extrapolating
the penalty in U by (U / U_ref)^zeta: the assumption the benchmark (`benchmarks/governor.py`)
tests on runs the fit never saw. Eq. (1) is a power law and cannot follow a real curve's start
(warm-up, the unigram plateau); the pilots' measured departures there (`early_offsets`) are
added where the planner simulates the governor (`HeldoutCurve.loss_with_early`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

import numpy as np
from numpy.typing import ArrayLike
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from scipy.special import ndtri

from trainplan.errors import TrainplanError
from trainplan.errors.validation import one_line

Param = Literal["E", "B", "beta", "gamma", "kappa", "zeta"]
PARAMS: tuple[Param, ...] = get_args(Param)
"""The constants of eq. (1), in the order `heldout_loss` takes them."""
BETA_BOUNDS = (0.01, 3.0)
"""Bounds on the fresh-data exponent beta (dimensionless)."""
KAPPA_BOUNDS = (0.25, 4.0)
"""Bounds on the repetition exponent kappa (dimensionless): sub- to super-linear in repeats."""
ZETA_BOUNDS = (-2.0, 2.0)
"""Bounds on the data exponent zeta of the penalty (dimensionless)."""
EARLY_OFFSET_MAX_NATS = 5.0
"""Largest early offset (either sign) a curve may carry, nats: the benchmark's pilots measured
up to 0.6 nats at the end of warm-up, where eq. (1) extrapolated backwards overshoots."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PilotCurve:
    """The held-out points of one pilot run that the curve is fitted to (constant learning rate:
    after warm-up, before the run's cooldown; see `trainplan.executor.governor.pilot_curve`)."""

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
    early_steps: tuple[float, ...] = ()
    """Steps done at the pilot's evaluations after warm-up and before `steps` (the share skipped
    as the curve's early, pre-power-law part): not fitted; their residuals against the fit shape
    the start of the curve the planner simulates (`HeldoutCurve.early_offsets`)."""
    early_losses: tuple[float, ...] = ()
    """Held-out loss at `early_steps`, nats/token."""
    model: str = ""
    """The model the pilot trained ("" when not recorded)."""
    vocab_size: int = 0
    """Its tokenizer's vocabulary size (0 when not recorded)."""


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
    early_offsets: tuple[tuple[float, float, float], ...] = ()
    """Rows (pilot's unique tokens, 0 for fresh data; steps done; measured held-out loss - eq. (1),
    nats) at each pilot's evaluations after warm-up up to and including its first fitted one:
    how the start of a real curve departs from eq. (1) extrapolated backwards (warm-up, the
    unigram plateau). `loss_with_early` adds them; () when the pilots had no early points."""
    model: str = ""
    """The model the pilots trained ("" when not recorded, e.g. a curve file written before this
    field): the constants belong to one model, and losses are nats per token of one tokenizer,
    so `trainplan.planner.governor.with_governor` refuses a curve of another model or vocabulary."""
    vocab_size: int = 0
    """The pilots' tokenizer vocabulary size (0 when not recorded)."""
    source: str = ""
    """How the constants were obtained."""

    def _theta(self) -> np.ndarray:
        return np.array([getattr(self, n) for n in PARAMS], dtype=float)

    def _eval(self, theta: np.ndarray, steps: np.ndarray) -> np.ndarray:
        return heldout_loss(theta, steps * self.tokens_per_step, self.unique_tokens, self.d_ref_tokens,
                            self.u_ref_tokens)

    def loss_at(self, steps) -> np.ndarray:
        """Eq. (1) at `steps` (scalar or array of steps done; below 1 taken as 1), nats/token."""
        return self._eval(self._theta(), np.maximum(np.asarray(steps, dtype=float), 1.0))

    def early_offset(self, steps) -> np.ndarray:
        """Measured - eq. (1) at `steps` (scalar or array of steps done), nats, from the pilot
        nearest to this run in unique tokens (|log U_pilot / U_run|; a fresh run takes a fresh
        pilot, else the pilot with the most unique tokens; a repeating run takes the fresh pilot
        only when no pilot repeated): linear between that pilot's `early_offsets` rows, from
        its first row up to (not including) its last, its first fitted evaluation; 0 outside.
        Steps are taken as they are: the offsets belong to the pilots' warm-up and learning
        rate, which a plan of the same model and settings shares."""
        s = np.asarray(steps, dtype=float)
        rows = np.asarray(self.early_offsets, dtype=float).reshape(-1, 3)
        if rows.shape[0] == 0:
            return np.zeros_like(s)
        sizes = np.unique(rows[:, 0])
        repeated = sizes[sizes > 0]
        if self.unique_tokens is None or not repeated.size:
            pick = 0.0 if (sizes == 0).any() else float(sizes.max())
        else:
            pick = float(repeated[np.argmin(np.abs(np.log(repeated / self.unique_tokens)))])
        mine = rows[rows[:, 0] == pick]
        mine = mine[np.argsort(mine[:, 1])]
        at, off = mine[:, 1], mine[:, 2]
        inside = (s >= at[0]) & (s < at[-1])
        return np.where(inside, np.interp(s, at, off), 0.0)

    def loss_with_early(self, steps) -> np.ndarray:
        """The held-out loss the planner simulates the governor over (`trainplan.planner.governor.
        with_governor`): eq. (1) plus `early_offset` (the pilots' measured start, before their
        fitted range), nats/token. Equal to `loss_at` from the nearest pilot's first fitted
        evaluation on. Why: the governor fits evaluations from a quarter of its steps done on,
        so a stop near step 150 fits points from step 37, where eq. (1) extrapolated backwards
        ran 0.07-0.18 nats above the real curves (`benchmarks/governor.py`'s pilots): a more
        convex curve whose simulated gain falls below the threshold sooner than a real run's."""
        return self.loss_at(steps) + self.early_offset(np.maximum(np.asarray(steps, dtype=float), 1.0))

    @property
    def sim_noise_nats(self) -> float:
        """The evaluation noise the planner simulates, nats: the larger of the fit's RMS residual
        (`rms_nats`) and the pilots' second-difference noise (`noise_nats`). A real held-out
        curve wanders about a smooth one over several evaluations; second differences see only
        the fast part of that, and the governor's confidence band widens with all of it."""
        return max(self.rms_nats, self.noise_nats)

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
        g = central_jacobian(lambda th: self._eval(th, s).ravel(), self._theta(),
                             [PARAMS.index(n) for n in self.param_names]).T
        sd = np.sqrt(np.maximum(np.einsum("ik,ij,jk->k", g, cov, g), 0.0)).reshape(mean.shape)
        z = float(ndtri(0.5 + confidence / 2.0))  # the normal quantile, scipy.stats.norm.ppf
        return mean - z * sd, mean + z * sd

    def for_run(self, *, tokens_per_step: float, unique_tokens: float | None) -> HeldoutCurve:
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
        d["early_offsets"] = [list(r) for r in self.early_offsets]
        return d

    @classmethod
    def from_dict(cls, raw: Any) -> HeldoutCurve:
        """Inverse of `to_dict`: `raw` validated by the curve file's schema, `HeldoutCurveSchema`.

        Raises: TrainplanError naming the first bad key, its value and what is valid (a constant
        that is not a real finite number or is outside the fit's own bounds, an unknown parameter
        name, a covariance of the wrong shape), or the unknown or missing keys."""
        try:
            c = HeldoutCurveSchema.model_validate(raw)
        except ValidationError as e:
            raise TrainplanError(one_line(e, HeldoutCurveSchema)) from None
        kw = {f.name: getattr(c, f.name) for f in dataclasses.fields(cls)}
        kw["param_names"], kw["cov"] = tuple(c.param_names), tuple(tuple(r) for r in c.cov)
        kw["early_offsets"] = tuple(tuple(r) for r in c.early_offsets)
        return cls(**kw)


LOSS_MAX_NATS = 100.0
"""Largest loss constant (E, B, gamma) a curve may carry, nats/token: ln of a 10^6-token
vocabulary is 13.8, so no held-out loss comes near it (E = 1e300 once passed as a floor)."""
COOLDOWN_GAIN_MAX_NATS = 1.0
"""Largest cooldown gain (either sign) a curve file may carry, nats: the pilots of
`benchmarks/governor.py` measured 0.07-0.15 nats on tiny-llama; ten times that is no pilot fit
(a gain of 1e9 once gave a predicted loss of -1e9)."""


class HeldoutCurveSchema(BaseModel):
    """The held-out curve file (`HeldoutCurve.to_dict`, e.g. `benchmarks/governor.py`'s
    governor_curve.json), declared once: the fields of `HeldoutCurve` (documented there), each
    constant within the fit's own bounds (`trainplan.costmodels.stopping.heldout_fit.fit_heldout_curve`);
    strict (no bool or string for a number, no NaN or infinity but in `cov`). Its JSON Schema is
    `docs/schemas/heldout_curve.schema.json`; why pydantic: `trainplan.errors.validation`."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True,
                              title="trainplan held-out curve")

    E: float = Field(ge=0, le=LOSS_MAX_NATS)
    B: float = Field(ge=0, le=LOSS_MAX_NATS)
    beta: float = Field(ge=BETA_BOUNDS[0], le=BETA_BOUNDS[1])
    gamma: float = Field(ge=0, le=LOSS_MAX_NATS)
    kappa: float = Field(ge=KAPPA_BOUNDS[0], le=KAPPA_BOUNDS[1])
    zeta: float = Field(ge=ZETA_BOUNDS[0], le=ZETA_BOUNDS[1])
    d_ref_tokens: float = Field(gt=0)
    u_ref_tokens: float = Field(gt=0)
    tokens_per_step: float = Field(gt=0)
    unique_tokens: Annotated[float, Field(gt=0)] | None
    param_names: list[Param] = list(PARAMS)
    cov: list[list[Annotated[float, Field(allow_inf_nan=True)]]] = []
    noise_nats: float = Field(default=0.0, ge=0)
    rms_nats: float = Field(default=0.0, ge=0)
    cooldown_gain_nats: float = Field(default=0.0, ge=-COOLDOWN_GAIN_MAX_NATS, le=COOLDOWN_GAIN_MAX_NATS)
    n_points: int = Field(default=0, ge=0)
    early_offsets: list[Annotated[tuple[Annotated[float, Field(ge=0)], Annotated[float, Field(gt=0)],
                                        Annotated[float, Field(ge=-EARLY_OFFSET_MAX_NATS, le=EARLY_OFFSET_MAX_NATS)]],
                                  Field(strict=False)]] = []
    """Rows [unique tokens >= 0 (0: fresh), steps > 0, offset in nats]."""
    model: str = ""
    vocab_size: int = Field(default=0, ge=0)
    source: str = ""

    @field_validator("param_names")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"must be distinct names of {', '.join(PARAMS)}")
        return v

    @field_validator("cov")
    @classmethod
    def _square(cls, v: list[list[float]], info: ValidationInfo) -> list[list[float]]:
        n = len(info.data.get("param_names", PARAMS))
        if v and (len(v) != n or any(len(r) != n for r in v)):
            raise ValueError(f"must be {n} x {n} (one row per name in param_names)")
        if any(math.isnan(x) for r in v for x in r):
            raise ValueError("must hold numbers (inf for a fit without a covariance), not NaN")
        return v


def heldout_loss(theta: Sequence[float] | np.ndarray, tokens: ArrayLike, unique: ArrayLike | None, d_ref: float,
                 u_ref: float) -> np.ndarray:
    """Eq. (1): the held-out loss, nats/token, at `tokens` seen.

    Args: theta = (E, B, beta, gamma, kappa, zeta) in `PARAMS` order (nats, nats, -, nats, -, -);
    tokens (tokens seen, > 0, array-like); unique (unique tokens, broadcast with `tokens`; None
    or inf: fresh data, no penalty); d_ref and u_ref (tokens, > 0): the reference counts of
    `HeldoutCurve.d_ref_tokens` and `u_ref_tokens`.
    Returns: the loss, the broadcast shape of `tokens` and `unique`. No input checks.
    """
    E, B, beta, gamma, kappa, zeta = theta
    t = np.asarray(tokens, dtype=float)
    fresh = E + B * (t / d_ref) ** -beta
    if unique is None:
        return fresh
    u = np.asarray(unique, dtype=float)
    finite = np.isfinite(u)
    u_safe = np.where(finite, u, u_ref)
    reps = np.where(finite, np.maximum(t / u_safe - 1.0, 0.0), 0.0)
    return fresh + gamma * (u_safe / u_ref) ** zeta * reps ** kappa


def central_jacobian(f: Callable[[np.ndarray], np.ndarray], x: np.ndarray, idx: list[int]) -> np.ndarray:
    """Central-difference Jacobian of `f` (a 1-D array of x) with respect to x[idx], step
    1e-6 x max(|x[i]|, 1e-3) per parameter: shape (len(f(x)), len(idx)). Used for the delta-method
    bands of eq. (1) (`HeldoutCurve`) and the covariance of its fit (`fit_heldout_curve`)."""
    cols = []
    for i in idx:
        h = 1e-6 * max(abs(x[i]), 1e-3)
        up, dn = x.copy(), x.copy()
        up[i] += h
        dn[i] -= h
        cols.append((f(up) - f(dn)) / (2 * h))
    return np.column_stack(cols)
