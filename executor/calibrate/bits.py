"""Refit the bits loss penalties (`trainplan.costmodels.loss.bits.BitsPenalty`) from runs that differ only in
their bits; part of `trainplan calibrate` (`trainplan.executor.calibrate.calibration`).

Runs are grouped by everything that moves the loss besides bits (model, vocabulary, sequence,
micro-batch, steps, data fraction and method, seed, learning rate, devices). In a group with a
full-width run (no penalty component on: `trainplan.costmodels.loss.bits.components`), each other run's final
held-out loss minus the full-width one's (the mean, when several) is one observation of the sum
of its components' penalties; the components seen are fitted by non-negative least squares
(`scipy.optimize.nnls`, Lawson & Hanson 1974: penalties cannot be negative) after taking the
unseen components' defaults off, and the unseen keep their defaults. One seed per setting gives
deltas with the run-to-run noise of a single seed in them (benchmarks/bits.py measures that
floor): calibrate on the same settings and lengths the plans will use.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy.optimize import nnls

from trainplan.costmodels.loss.bits import COMPONENTS, DEFAULT_BITS_PENALTY, BitsPenalty, components


def _group_key(run) -> tuple:
    p, d = run.plan, run.plan.decisions
    return (p.model, int(p.vocab_size), d.seq_len, d.micro_batch, d.max_steps, d.data_fraction,
            d.data_method, d.seed, d.lr, d.devices, d.sp_degree)


def _final_loss(run) -> float | None:
    curve = [x for x in run.record.heldout_loss if np.isfinite(x[2])]
    if not curve or run.record.steps < run.plan.decisions.max_steps:
        return None
    return float(max(curve, key=lambda x: x[0])[2])


def fit_bits_penalty(runs, default: BitsPenalty | None = None) -> tuple[BitsPenalty | None, dict]:
    """The penalties refit from `runs` (objects with `.dir`, `.plan`, `.record`: finished runs of
    one model), and a record of the fit; (None, record) when no group has a full-width run and
    another setting (nothing to fit).

    Returns: (BitsPenalty | None, {"observations": [...], "fitted": [...], "residuals": [...]}).
    """
    default = default or DEFAULT_BITS_PENALTY
    groups: dict[tuple, list] = {}
    final: dict[str, float] = {}
    for run in runs:
        loss = _final_loss(run)
        if loss is not None:
            final[run.dir] = loss
            groups.setdefault(_group_key(run), []).append(run)
    rows, ys, obs = [], [], []
    for group in groups.values():
        comp = {r.dir: components(r.plan.decisions.optimizer_bits, r.plan.decisions.activation_bits,
                                  r.plan.decisions.precision) for r in group}
        base = [r for r in group if not any(comp[r.dir].values())]
        if not base or len(base) == len(group):
            continue
        base_loss = float(np.mean([final[r.dir] for r in base]))
        for r in group:
            if any(comp[r.dir].values()):
                rows.append([comp[r.dir][c] for c in COMPONENTS])
                ys.append(final[r.dir] - base_loss)
                obs.append({"run": r.dir, "baseline": [b.dir for b in base], "delta_nats": ys[-1],
                            "components": [c for c in COMPONENTS if comp[r.dir][c]]})
    record = {"method": "non-negative least squares of final held-out loss deltas against a "
                        "full-width run of the same group (scipy.optimize.nnls)",
              "observations": obs}
    if not rows:
        return None, record | {"fitted": []}
    A, y = np.array(rows, dtype=float), np.array(ys)
    seen = [i for i, c in enumerate(COMPONENTS) if A[:, i].any()]
    unseen = [i for i in range(len(COMPONENTS)) if i not in seen]
    y_left = y - A[:, unseen] @ np.array([getattr(default, COMPONENTS[i]) for i in unseen]) if unseen else y
    x, _ = nnls(A[:, seen], y_left)
    fitted = {COMPONENTS[i]: float(v) for i, v in zip(seen, x, strict=False)}
    penalty = dataclasses.replace(default, **fitted)
    pred = np.array([sum(getattr(penalty, c) * a for c, a in zip(COMPONENTS, row, strict=False)) for row in rows])
    return penalty, record | {"fitted": sorted(fitted), "values": fitted,
                              "residuals": [float(v) for v in y - pred]}
