"""Checks of scalar inputs shared by the cost models (the loss law, the data-value model).

Each returns the value as a float and raises `TrainplanError` naming the input, the bound and
the value given (e.g. "tokens_seen must be >= 0, got -1"), so a bad number in a plan, a curve
file or a benchmark fails with the same message wherever it enters.
"""

from __future__ import annotations

import math

from trainplan.errors import TrainplanError


def check_finite(name: str, value: float) -> float:
    """`value` as a float.

    Raises: TrainplanError "`name` must be a number" when float() rejects it, "`name` must be
    finite" for NaN or +-inf."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TrainplanError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise TrainplanError(f"{name} must be finite, got {value!r}")
    return v


def check_positive(name: str, value: float) -> float:
    """`value` as a float, finite and > 0. Raises: TrainplanError otherwise (`check_finite`)."""
    v = check_finite(name, value)
    if v <= 0.0:
        raise TrainplanError(f"{name} must be > 0, got {value!r}")
    return v


def check_non_negative(name: str, value: float) -> float:
    """`value` as a float, finite and >= 0. Raises: TrainplanError otherwise (`check_finite`)."""
    v = check_finite(name, value)
    if v < 0.0:
        raise TrainplanError(f"{name} must be >= 0, got {value!r}")
    return v


def check_range(name: str, value: float, *, low: float | None = None, low_open: bool = True,
                high: float | None = None) -> float:
    """`value` as a float, finite and within the bounds: above `low` (strictly unless
    `low_open=False`) and at most `high`; None: no bound on that side.

    Raises: TrainplanError naming the bound it breaks (`check_finite` for a non-number)."""
    v = check_finite(name, value)
    if low is not None and (v <= low if low_open else v < low):
        raise TrainplanError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and v > high:
        raise TrainplanError(f"{name} must be <= {high}, got {value!r}")
    return v
