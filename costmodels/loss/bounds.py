"""Where the loss law stops being a prediction: its ceiling at ln(V) and its band outside the
range it was fitted over.

A model that learned nothing predicts each token uniformly, a loss of ln(V) nats for a vocabulary
of V tokens, so no prediction is above it. A Chinchilla-form law extrapolated far below its fitted
tokens (B / D^beta with D a few million tokens) goes far above it: tiny-llama at 4e13 FLOPs gives
about 17 nats from Besiroglu et al. 2024's constants. Clipping that at ln(V) made every such plan
predict the same loss, so the solver was indifferent between them (issue #37, item 5).

This project's rule (no published source; a modelling choice stated where it is used):

- **A soft ceiling** (`soft_ceiling`): the law's value L is kept below `KNEE_FRAC` ln(V); above
  it, c - w^2 / (L - m + w) with m = `KNEE_FRAC` ln(V), c = ln(V), w = c - m. The value and the
  slope are continuous at m, it stays below c and falls as 1/L, so more tokens always predict a
  lower loss (resolvable at the solver's 1e-5-nat objective unit far beyond the knee).
- **Such a value is a bound, not a prediction** (`is_bound`): the plan's regime says so
  (`trainplan.costmodels.loss.law.BOUND`) and its warnings say why.
- **The band widens outside the fitted range** (`widen_band`): a published law's band is the
  spread of two fits of the same runs, which can shrink where both extrapolate; outside the
  range it is at least the band at the nearest point inside, times 1 + the decades outside.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

KNEE_FRAC = 0.9
"""Share of ln(V) above which the law's value is bent under the ceiling (module docstring)."""


def soft_ceiling(loss: ArrayLike, ceiling: float) -> np.ndarray:
    """The law's loss (nats/token, any shape) under the soft ceiling `ceiling` = ln(V) (module
    docstring): unchanged below `KNEE_FRAC` x ceiling, strictly increasing, always below the
    ceiling. An infinite ceiling (no vocabulary) leaves it unchanged. Returns an array of the
    same shape (a 0-d array for a scalar)."""
    x = np.asarray(loss, dtype=float)
    if not math.isfinite(ceiling):
        return x
    knee = KNEE_FRAC * ceiling
    w = ceiling - knee
    return np.where(x <= knee, x, ceiling - w * w / (np.maximum(x, knee) - knee + w))


def is_bound(raw_loss: float, ceiling: float) -> bool:
    """Whether the law's own value `raw_loss` (nats/token) is in the soft ceiling's region, so
    that the prediction says more about ln(V) than about the law."""
    return math.isfinite(ceiling) and raw_loss > KNEE_FRAC * ceiling


def decades_outside(value: float, rng: tuple[float, float] | None) -> float:
    """How many decades (log10) `value` lies outside `rng` = (low, high); 0 inside. None: 0 (no
    range recorded: the caller says `EXTRAPOLATED` otherwise)."""
    if rng is None or value <= 0:
        return 0.0
    lo, hi = rng
    return max(math.log10(lo / value), math.log10(value / hi), 0.0)


def clamp(value: float, rng: tuple[float, float] | None) -> float:
    """`value` moved to the nearest point of `rng` (unchanged without a range)."""
    return value if rng is None else min(max(value, rng[0]), rng[1])


def widen_band(band_here: float, band_at_edge: float, decades: float) -> float:
    """The band outside the fitted range (module docstring): max(band here, band at the nearest
    point inside) x (1 + decades outside); `band_here` inside the range (decades 0)."""
    if decades <= 0:
        return band_here
    return max(band_here, band_at_edge) * (1.0 + decades)
