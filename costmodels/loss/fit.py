"""The numerical fit behind `trainplan.costmodels.loss.law.LossLaw.fit`: input checks
(`check_fit_arrays`), the Huber/L-BFGS-B fit in log space (`huber_fit`) and its
variable-projection starting grid.

The law and its sources are in `trainplan.costmodels.loss.law`, which validates the pinned names and the
identifiability of a fit before it calls `huber_fit`. Method: Hoffmann et al. 2022, "Training
Compute-Optimal Large Language Models" (arXiv:2203.15556), Sec. 3.3 eq. 3, as corrected by
Besiroglu et al. 2024 (arXiv:2404.10102): Huber loss on log residuals, summed, L-BFGS-B from a
grid of starts.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize, nnls

from trainplan.errors import TrainplanError

#: Hoffmann et al. 2022, Sec. 3.3 eq. 3 (and Besiroglu et al. 2024): Huber threshold on
#: log-space residuals.
HUBER_DELTA = 1e-3


def check_fit_arrays(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The measured (n_params, tokens, losses) of a law fit as flat float arrays.

    Args: up to three array-likes, in that order: parameters, tokens, losses (nats/token).
    Returns: each flattened to a 1-D float array.
    Raises: TrainplanError naming the array when one is empty, holds a non-finite or
    non-positive value, or when their lengths differ.
    """
    names = ("n_params", "tokens", "losses")
    out = [np.asarray(a, dtype=float).ravel() for a in arrays]
    for name, a in zip(names, out, strict=False):
        if a.size == 0:
            raise TrainplanError(f"{name} is empty")
        if not np.all(np.isfinite(a)) or np.any(a <= 0):
            raise TrainplanError(f"{name} must be positive and finite, got {a.tolist()[:8]}")
    if len({a.size for a in out}) != 1:
        raise TrainplanError(f"n_params, tokens, losses differ in length: {[a.size for a in out]}")
    return tuple(out)


def huber_fit(n: np.ndarray, d: np.ndarray, loss: np.ndarray, pinned: dict[str, float],
              free: list[str]) -> dict[str, float]:
    """Fit L = E + A / n**alpha + B / d**beta (Hoffmann et al. 2022 eq. 2) to `loss` over the
    `free` names, the others fixed at `pinned`.

    Minimises the sum of Huber(delta = `HUBER_DELTA`) losses of log(predicted) - log(observed)
    (Hoffmann et al. 2022 eq. 3; Besiroglu et al. 2024) by L-BFGS-B over log E, log A, log B
    (bounds [-25, 60]) and alpha, beta (bounds [0, 3]), from the best variable-projection grid
    starts; the best optimum wins.

    Args: n (parameters), d (tokens), loss (nats/token): checked 1-D arrays of equal length
    (`check_fit_arrays`); pinned: name -> value for the fixed names; free: the names fitted, in
    `LossLaw.FIT_NAMES` order.
    Returns: all five values by name ("E", "A", "B", "alpha", "beta").
    """
    log_n, log_d, log_loss = np.log(n), np.log(d), np.log(loss)
    logs = {"E", "A", "B"}

    def unpack(theta):
        vals = dict(pinned)
        for k, t in zip(free, theta, strict=False):
            vals[k] = math.exp(t) if k in logs else float(t)
        return vals

    def objective(theta):
        v = unpack(theta)
        t_a = v["A"] * np.exp(-v["alpha"] * log_n)
        t_b = v["B"] * np.exp(-v["beta"] * log_d)
        s = v["E"] + t_a + t_b
        if np.any(s <= 0) or not np.all(np.isfinite(s)):
            return 1e30, np.zeros_like(theta)
        r = (np.log(s) - log_loss) / HUBER_DELTA  # Huber_delta(x)/delta^2 == Huber_1(x/delta)
        absr = np.abs(r)
        f = np.where(absr <= 1.0, 0.5 * r * r, absr - 0.5).sum()
        w = np.clip(r, -1.0, 1.0) / HUBER_DELTA / s  # d f / d s
        parts = {
            "E": v["E"], "A": t_a, "B": t_b,
            "alpha": -t_a * log_n, "beta": -t_b * log_d,
        }
        grad = np.array([np.sum(w * parts[k]) for k in free])
        return float(f), grad

    starts = _grid_starts(n, d, loss, pinned, free)
    bounds = [(-25.0, 60.0) if k in logs else (0.0, 3.0) for k in free]
    best = None
    for theta0 in starts:
        if not free:
            break
        res = minimize(
            objective, theta0, jac=True, method="L-BFGS-B", bounds=bounds,
            options={"maxiter": 20000, "ftol": 1e-15, "gtol": 1e-12, "maxcor": 30},
        )
        if best is None or res.fun < best.fun:
            best = res
    return unpack(best.x if best is not None else np.array([]))


def _grid_starts(n, d, loss, pinned, free, keep: int = 10) -> list[np.ndarray]:
    """Variable-projection starts: for each (alpha, beta) on a grid, the best non-negative
    (E, A, B) by weighted least squares on L (weights 1/L approximate log residuals)."""
    grid = np.linspace(0.05, 2.0, 40)
    alphas = [pinned["alpha"]] if "alpha" in pinned else grid
    betas = [pinned["beta"]] if "beta" in pinned else grid
    w = 1.0 / loss
    scored = []
    for al in alphas:
        t_a = n**-al
        for be in betas:
            t_b = d**-be
            rhs = loss.copy()
            cols, names = [], []
            for k, col in (("E", np.ones_like(loss)), ("A", t_a), ("B", t_b)):
                if k in pinned:
                    rhs -= pinned[k] * col
                else:
                    cols.append(col)
                    names.append(k)
            coef = dict(pinned)
            if cols:
                x, _ = nnls(np.column_stack(cols) * w[:, None], rhs * w)
                coef.update(zip(names, np.maximum(x, 1e-6), strict=False))
            coef["alpha"], coef["beta"] = al, be
            pred = coef["E"] + coef["A"] * t_a + coef["B"] * t_b
            if np.any(pred <= 0):
                continue
            score = float(np.sum((np.log(pred) - np.log(loss)) ** 2))
            theta = np.array([math.log(coef[k]) if k in ("E", "A", "B") else coef[k] for k in free])
            scored.append((score, theta))
    scored.sort(key=lambda s: s[0])
    return [t for _, t in scored[:keep]] or [np.zeros(len(free))]
