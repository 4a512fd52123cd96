"""The run as its own pilot: its final held-out loss forecast from its own curve, while it runs.

Pure (numpy/scipy). The executor calls `forecast_final_loss` after each held-out evaluation and
keeps what it returns (`trainplan.executor.record.RunRecord.loss_forecast`); the report compares
the forecast made at 10%, 30% and 50% of the steps with the measured end
(`trainplan.executor.reporting.forecast`).

**The forecast.** The executor's schedule is warmup-stable-decay (`trainplan.executor.apply.applied.lr_at`:
linear warmup over w steps, constant, linear cooldown over the last 20%). Until the cooldown every
horizon shares the curve (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond
Fixed Training Durations", arXiv:2405.18392, Sec. 3), so at s steps done:

1. the training losses of steps done t in [max(2w, ceil(0.1 s)), min(s, cooldown start)] are fitted
   with L(t) = E + B (t - w/2)^-beta, E pinned at the floor the plan's law gives (the published
   law's E + A / N^alpha, carried per byte: over so short a range a free floor and exponent
   trade off, `trainplan.costmodels.loss.pilots.fit_pilot_law`; at most `FLOOR_CAP` of the lowest
   fitted loss), B and beta free
   (`scipy.optimize.curve_fit`, least squares in nats). The first 10% of the curve is left out,
   as Choshen et al. 2024 ("A Hitchhiker's Guide to Scaling Law Estimation", arXiv:2410.11840,
   Sec. 5) advise; t - w/2 is the learning rate's area (Tissue et al. 2024, arXiv:2408.11029);
2. training and held-out losses differ by a near-constant offset (generalization gap and the
   held-out text's own difficulty): the mean residual of the last `OFFSET_POINTS` held-out points
   against the fit;
3. the constant-rate held-out loss at the end, L(max_steps) + offset, less the cooldown's gain:
   `cooldown_gain` times its excess over E (the pilots' gamma, the same assumption as their fit:
   the cooldown removes a share of the remaining excess; without pilots the middle of
   `UNKNOWN_GAIN_RANGE`).

The band is the 80% normal interval (z = 1.2816) of the fit's uncertainty at the end (the delta
method on `curve_fit`'s covariance) and the offset's standard error, plus the whole cooldown gain
(it is carried from the pilots' shorter cooldowns, not measured on this run; without pilots, the
half-width of `UNKNOWN_GAIN_RANGE`). It is not a
calibrated interval: training losses of consecutive steps are correlated, so the covariance is
too small; the benchmarks report how often it covers (`benchmarks/loss.py`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit

from trainplan.costmodels.checks import check_non_negative
from trainplan.errors import TrainplanError

FORECAST_FRACTIONS = (0.1, 0.3, 0.5)
"""Shares of the planned steps at which the report reads the forecast (issue #37's 30% target)."""
SKIP_FRAC = 0.1
"""Share of the steps so far left out of the fit (Choshen et al. 2024, Sec. 5: the first ~10%)."""
MIN_POINTS = 8
"""Fewest training losses a forecast is fitted to."""
OFFSET_POINTS = 3
"""Latest held-out points the train/held-out offset is averaged over."""
FLOOR_CAP = 0.9
"""The floor is at most this share of the lowest fitted training loss (the pilots' rule,
`trainplan.costmodels.loss.pilots.fit_pilot_law`): a law whose floor the run is already below
(another corpus's, or a published law far from this model) does not bound this run."""
UNKNOWN_GAIN_RANGE = (0.0, 0.2)
"""The cooldown gain assumed when none was measured (no pilots): anywhere in this range of the
excess, so the forecast takes off its middle and the band holds its half-width. Measured on this
project's runs: 2.7-7.1% of the excess after cooldowns of 146-836 steps (`benchmarks/loss.py`'s
design runs, docs/loss.md) and 19% on a 150-step tiny-llama run at micro-batch 2."""
Z_80 = 1.2816
"""The standard normal's 90th percentile: an 80% two-sided interval."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Forecast:
    """A forecast of a run's final held-out loss made at `step` steps done (nats/token)."""

    step: int
    final_loss: float
    """Forecast held-out loss after the cooldown, at `max_steps`."""
    band_nats: float
    """Half-width of its band (module docstring)."""
    constant_rate_loss: float
    """Forecast held-out loss at `max_steps` without the cooldown."""
    B: float
    beta: float
    offset_nats: float
    """Held-out minus the fitted training loss, over the latest held-out points."""
    points: int
    """Training losses fitted."""
    floor_nats: float
    """E the fit used: `floor_nats`, at most `FLOOR_CAP` of the lowest fitted training loss."""


def cooldown_start(max_steps: int) -> int:
    """Steps done before the executor's linear cooldown: max_steps - max(1, int(0.2 max_steps))
    (`trainplan.executor.apply.applied.lr_at`: every step up to it runs at the peak rate)."""
    return int(max_steps) - max(1, int(0.2 * int(max_steps)))


def forecast_final_loss(train_loss: Sequence[tuple[int, float]], heldout_loss: Sequence[tuple],
                        *, step: int, max_steps: int, warmup_steps: int, floor_nats: float,
                        cooldown_gain: float | None = 0.0) -> Forecast | None:
    """The final held-out loss of a warmup-stable-decay run forecast at `step` steps done (module
    docstring), or None while there are too few points: fewer than `MIN_POINTS` training losses
    in the fitted window, no held-out point in it, or a fit that does not converge.

    Args: train_loss: (step index from 0, loss in nats/token), the record's `train_loss`;
    heldout_loss: (steps done, tokens, loss in nats/token), the record's `heldout_loss`; step:
    steps done now; max_steps, warmup_steps: the plan's; floor_nats: E (nats/token, >= 0);
    cooldown_gain: the share of the excess over E the cooldown removes, in [0, 1); None: not
    measured, `UNKNOWN_GAIN_RANGE` (the middle taken off, the half-width in the band).
    Returns: a `Forecast`, or None.
    Raises: TrainplanError on a negative floor or a cooldown gain outside [0, 1).
    """
    e = check_non_negative("floor_nats", floor_nats)
    lo_gain, hi_gain = UNKNOWN_GAIN_RANGE if cooldown_gain is None else (cooldown_gain, cooldown_gain)
    gain = check_non_negative("cooldown_gain", (lo_gain + hi_gain) / 2)
    if gain >= 1.0:
        raise TrainplanError(f"cooldown_gain must be in [0, 1), got {cooldown_gain!r}")
    w = max(0, int(warmup_steps))
    lo = max(2 * w, math.ceil(SKIP_FRAC * step), 1)
    hi = min(int(step), cooldown_start(max_steps))
    pts = [(i + 1, y) for i, y in train_loss if lo <= i + 1 <= hi and math.isfinite(y) and y > 0]
    held = [(s, y) for s, _, y in heldout_loss if lo <= s <= hi and math.isfinite(y)][-OFFSET_POINTS:]
    if len(pts) < MIN_POINTS or not held:
        return None
    t = np.array([p[0] for p in pts], float) - w / 2.0
    y = np.array([p[1] for p in pts], float)
    e = min(e, FLOOR_CAP * float(y.min()))  # a floor the run is already below does not hold for it

    def curve(x: np.ndarray, log_b: float, beta: float) -> np.ndarray:
        return e + np.exp(log_b) * x ** -beta

    slope, icpt = np.polyfit(np.log(t), np.log(y - e), 1)  # a start: log(y - E) is linear in log t
    p0 = (float(icpt), float(np.clip(-slope, 0.01, 1.9)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)  # a singular covariance: inf below
            (log_b, beta), cov = curve_fit(curve, t, y, p0=p0, bounds=([-50.0, 0.0], [50.0, 2.0]))
    except (RuntimeError, ValueError):
        return None
    x_end = float(max_steps) - w / 2.0
    hs = np.array([s for s, _ in held], float) - w / 2.0
    resid = np.array([yh for _, yh in held], float) - curve(hs, log_b, beta)
    offset = float(resid.mean())
    const = float(curve(np.array([x_end]), log_b, beta)[0]) + offset
    grad = np.exp(log_b) * x_end ** -beta * np.array([1.0, -math.log(x_end)])  # d L / d (log B, beta)
    var_fit = float(grad @ cov @ grad) if np.all(np.isfinite(cov)) else math.inf
    fit_sd = float(np.std(y - curve(t, log_b, beta), ddof=2)) if len(y) > 2 else 0.0
    var_offset = (float(np.var(resid, ddof=1)) if len(resid) > 1 else fit_sd ** 2) / len(resid)
    excess = max(const - e, 0.0)
    band = Z_80 * math.sqrt(var_fit + var_offset) + max(gain, (hi_gain - lo_gain) / 2) * excess
    return Forecast(step=int(step), final_loss=const - gain * excess, band_nats=band, constant_rate_loss=const,
                    B=float(np.exp(log_b)), beta=float(beta), offset_nats=offset, points=len(pts),
                    floor_nats=e)
