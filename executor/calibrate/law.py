"""The loss-law refit of `trainplan calibrate`, per (model, vocabulary size).

One model size cannot separate A / N**alpha from E, so L(D) = E + B / D**beta is fitted with
`LossLaw.fit(..., fix={"A": 0, "alpha": default})` (Huber in log space, L-BFGS-B from a grid;
A's term is folded into E). Points are each run's held-out curve `(step, tokens, loss)` minus its
first `SKIP_FRACTION` (warm-up), tokens converted to effective tokens (Muennighoff et al. 2023,
eq. 5) against the run's unique data (`plan.data_tokens * data_fraction`), so a run that repeats
data gives the law `solve` applies. Caveat: points along one run are not ends of runs of that
length (the learning-rate schedule differs), the usual approximation of a law fitted to one
curve. Nothing is written here: `trainplan.executor.calibrate.calibration` writes the law to
`<cache>/laws/<model>-v<vocab_size>.json` with its points and residuals (`trainplan.costmodels.loss.cache`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainplan.costmodels.loss.cache import load_local_law
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.repetition import effective_tokens
from trainplan.errors import TrainplanError
from trainplan.executor.calibrate.runs import Run, rms

__all__ = ["MIN_POINTS", "SKIP_FRACTION", "LawFit", "fit_law", "law_points"]

SKIP_FRACTION = 0.2
"""Share of each run's held-out points (the first ones) left out of the law fit as warm-up."""

MIN_POINTS = 4
"""Held-out points needed after the skip: one more than the free parameters E, B, beta."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LawFit:
    """A loss law fitted for one (model, vocab_size) and where it was written."""

    model: str
    vocab_size: int
    law: LossLaw
    path: Path
    """The law file it was written to (`Path()` until written)."""
    run_dirs: tuple[str, ...]
    n_points: int
    """Held-out points used in the fit."""
    n_skipped: int
    """Held-out points left out as warm-up."""
    residuals: tuple[float, ...]
    """measured - fitted loss at each used point, nats/token."""
    previous_source: str
    """Source of the law `solve` used before (the published law or an earlier local fit)."""
    rms_rel_err_before: float
    """RMS of (predicted - measured) / measured over the used points, previous law."""
    rms_rel_err_after: float
    """The same for the fitted law."""
    final_measured: float
    """Last held-out loss of the last run, nats/token."""
    final_before: float
    """The previous law's prediction of `final_measured`, nats/token."""
    final_after: float
    """The fitted law's prediction of `final_measured`, nats/token."""


def law_points(run: Run) -> tuple[list[dict], int, int]:
    """Used points of one run's held-out curve (dicts of run, step, tokens, effective_tokens and
    loss in nats/token), the count found and the count skipped as warm-up (`SKIP_FRACTION`)."""
    curve = sorted((tuple(x) for x in run.record.heldout_loss), key=lambda x: x[0])
    skip = int(SKIP_FRACTION * len(curve))
    unique = max(1.0, float(run.plan.data_tokens) * float(run.plan.decisions.data_fraction))
    points = []
    for step, tokens, loss in curve[skip:]:
        if not (math.isfinite(loss) and loss > 0 and tokens > 0):
            continue
        points.append({"run": run.dir, "step": int(step), "tokens": int(tokens),
                       "effective_tokens": effective_tokens(float(tokens), unique),
                       "loss": float(loss)})
    return points, len(curve), skip


def fit_law(model: str, vocab: int, runs: list[Run]) -> tuple[LossLaw, dict, LawFit]:
    """Fit L(D) = E + B / D**beta to the held-out points of `runs` (all of `model` at vocabulary
    size `vocab`): (the law, the fit's record for the law file, its `LawFit` with an empty path).

    Raises:
        TrainplanError: fewer than MIN_POINTS points remain after the warm-up skip (the message
            gives the count found and the count needed), or the fit fails.
    """
    points, found, skipped = [], 0, 0
    for run in runs:
        pts, n, s = law_points(run)
        points += pts
        found += n
        skipped += s
    dirs = tuple(r.dir for r in runs)
    where = ", ".join(repr(d) for d in dirs)
    if len(points) < MIN_POINTS:
        raise TrainplanError(
            f"run folder{'s' if len(dirs) > 1 else ''} {where} ({model}, vocab {vocab}): "
            f"{found} held-out point{'s' if found != 1 else ''} found, {len(points)} usable after "
            f"skipping the first {SKIP_FRACTION:.0%} of each run as warm-up; fitting E, B, beta "
            f"needs at least {MIN_POINTS} usable points (a run with {MIN_POINTS} or more "
            f"evaluations): train longer or evaluate more often")
    n_params = float(runs[0].plan.law_n_params)
    d = np.array([p["effective_tokens"] for p in points])
    y = np.array([p["loss"] for p in points])
    default = LossLaw()
    fix = {"A": 0.0, "alpha": default.alpha}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            fitted = LossLaw.fit(np.full_like(y, n_params), d, y, fix=fix)
        except TrainplanError as e:
            raise TrainplanError(f"run folder{'s' if len(dirs) > 1 else ''} {where}: loss-law fit "
                                 f"failed: {e}") from None
    label = dirs[0] if len(dirs) == 1 else f"{len(dirs)} runs ({', '.join(dirs)})"
    source = (f"fitted to {len(points)} held-out points of {label} (trainplan calibrate): "
              f"L(D) = E + B/D^beta, A/N^alpha folded into E, so valid for {model} only")
    law = dataclasses.replace(fitted, source=source, local=True, params_range=None, tokens_range=None,
                              vocab_size=vocab if vocab >= 2 else None)
    pred = np.array([law.predict(n_params, x) for x in d])
    previous = load_local_law(model, vocab) or LossLaw.besiroglu2024()
    prev_pred = np.array([previous.predict(n_params, x) for x in d])
    residuals = y - pred
    law = dataclasses.replace(law, band_nats=rms(residuals))
    fit_record = {
        "method": (f"LossLaw.fit with fix={{'A': 0, 'alpha': {default.alpha:g}}}: Huber (delta 1e-3) on log "
                   "residuals, L-BFGS-B from a grid (Hoffmann et al. 2022 eq. 3, as in "
                   "Besiroglu et al. 2024)"),
        "form": "L(D) = E + B / D^beta, D = effective tokens (Muennighoff et al. 2023 eq. 5)",
        "n_params": n_params,
        "skip_fraction": SKIP_FRACTION,
        "n_found": found,
        "n_skipped": skipped,
        "points": [p | {"predicted": float(q), "residual": float(r)}
                   for p, q, r in zip(points, pred, residuals, strict=False)],
        "residuals": [float(r) for r in residuals],
        "rms_residual_nats": rms(residuals),
        "max_abs_residual_nats": float(np.max(np.abs(residuals))),
    }
    last = max(points, key=lambda p: (p["run"] == dirs[-1], p["step"]))
    fit = LawFit(
        model=model, vocab_size=vocab, law=law, path=Path(), run_dirs=dirs, n_points=len(points),
        n_skipped=skipped, residuals=tuple(float(r) for r in residuals),
        previous_source=previous.source,
        rms_rel_err_before=rms((prev_pred - y) / y), rms_rel_err_after=rms((pred - y) / y),
        final_measured=last["loss"], final_before=previous.predict(n_params, last["effective_tokens"]),
        final_after=law.predict(n_params, last["effective_tokens"]))
    return law, fit_record, fit
