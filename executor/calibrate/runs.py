"""`trainplan calibrate RUN_DIR...`: refit the local cpu profile and loss law from real runs.

Two refits, each from what `executor.train.run` wrote into a run folder (`plan.json`,
`record.json`, read by `executor.reporting.report.load_run`):

**Step time** (runs with `record.same_hardware` planned for `cpu` only): see
`executor.calibrate.step_time` (ratio or two-factor fit of the cpu profile's throughput).

**Loss law** per (model, vocabulary size). One model size cannot separate A / N**alpha from E,
so L(D) = E + B / D**beta is fitted with `LossLaw.fit(..., fix={"A": 0, "alpha": default})`
(Huber in log space, L-BFGS-B from a grid; A's term is folded into E). Points are each run's
held-out curve `(step, tokens, loss)` minus its first `SKIP_FRACTION` (warm-up), tokens
converted to effective tokens (Muennighoff et al. 2023, eq. 5) against the run's unique data
(`plan.data_tokens * data_fraction`), so a run that repeats data gives the law `solve` applies.
Caveat: points along one run are not ends of runs of that length (the learning-rate schedule
differs), the usual approximation of a law fitted to one curve.
The law is written to `<cache>/laws/<model>-v<vocab_size>.json` with its points and
residuals (`costmodels.loss.cache`); `planner.api.solve` uses it for the cpu profile.

**Bits penalties** (`executor.calibrate.bits`): runs that differ only in their bits refit the
loss penalties of the lower-precision settings, stored with the law (`LossLaw.bits`); the law
itself is then fitted to the full-width runs.

Nothing is written unless every run folder loads and every law has enough points.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from costmodels.loss.bits import components
from costmodels.loss.cache import load_local_law, save_local_law
from costmodels.loss.law import LossLaw, effective_tokens
from executor.calibrate.bits import fit_bits_penalty
from executor.calibrate.step_time import (  # noqa: F401  (re-exported: tests and callers use them)
    _CAPTURES,
    LSQ_MIN_GAIN,
    PRIOR_WEIGHT,
    StepTimeRow,
    _apply,
    _calibrate_step_time,
    _Predictor,
    _rms,
    _scaled,
    _source,
    _step_s,
    _two_factor_fit,
)
from executor.record import RunRecord
from executor.reporting.report import load_run
from hardware_profiles import HardwareProfile
from planner.plan import Plan
from trainplan_errors import TrainplanError

__all__ = ["CalibrationResult", "LawFit", "StepTimeRow", "calibrate", "load_local_law",
           "LSQ_MIN_GAIN", "MIN_POINTS", "MIN_TIMED_STEPS", "PRIOR_WEIGHT", "SKIP_FRACTION"]

SKIP_FRACTION = 0.2
"""Share of each run's held-out points (the first ones) left out of the law fit as warm-up."""

MIN_POINTS = 4
"""Held-out points needed after the skip: one more than the free parameters E, B, beta."""

MIN_TIMED_STEPS = 3
"""Timed steps a cpu run needs before its step time calibrates the cpu profile: the first two
are warm-up (`RunRecord.median_step_time_s` skips them), so at least one more."""


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True, slots=True)
class LawFit:
    """A loss law fitted for one (model, vocab_size) and where it was written."""

    model: str
    vocab_size: int
    law: LossLaw
    path: Path
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
    final_after: float


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationResult:
    """What `calibrate` measured, fitted and wrote."""

    step_time: tuple[StepTimeRow, ...]
    """Runs used for the step-time fit (same hardware, planned for cpu)."""
    step_time_method: str
    """"ratio", "least-squares", or "" when no run qualified (profile untouched)."""
    ratio: float
    """Median measured / predicted over the runs (compute part); NaN when none qualified."""
    compute_scale: float
    """Factor applied to compute throughput (matmul efficiencies or, if they would exceed 1,
    the peaks); 1 when unchanged. The ratio method gives 1 / ratio."""
    memory_scale: float
    """Factor applied to memory throughput (memory_efficiency or, if it would exceed 1,
    hbm_bandwidth_bytes_per_s)."""
    scaled_fields: tuple[str, ...]
    """Profile fields changed."""
    profile: HardwareProfile | None
    """The calibrated cpu profile (None when unchanged)."""
    profile_path: Path | None
    laws: tuple[LawFit, ...]
    notes: tuple[str, ...]


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True, slots=True)
class _Run:
    dir: str
    plan: Plan
    record: RunRecord


def _load(run_dir: str | Path) -> _Run:
    p = Path(run_dir)
    if not p.is_dir():
        raise TrainplanError(f"run folder {str(p)!r} does not exist or is not a folder; pass the "
                             f"--out folder of `trainplan run` or `trainplan demo`")
    missing = [n for n in ("plan.json", "record.json") if not (p / n).is_file()]
    if missing:
        raise TrainplanError(f"run folder {str(p)!r} has no {' and no '.join(missing)}: not a "
                             f"finished trainplan run (`trainplan run` writes both)")
    plan, record = load_run(p)
    return _Run(str(p), plan, record)


def _check_timed_steps(runs: list[_Run]) -> None:
    """Refuse runs too short to time: a cpu run on this cpu with fewer than MIN_TIMED_STEPS
    timed steps would rewrite the profile from warm-up steps alone (or from nothing)."""
    for run in runs:
        rec = run.record
        n = len(rec.step_times_s)
        if rec.same_hardware and run.plan.hw == "cpu" and n < MIN_TIMED_STEPS:
            raise TrainplanError(
                f"run folder {run.dir!r} has {n} timed step{'s' if n != 1 else ''}; calibrating "
                f"the cpu profile needs runs of at least {MIN_TIMED_STEPS} (the first "
                f"{MIN_TIMED_STEPS - 1} are warm-up): train longer, or leave this run out. "
                "Nothing was written")


@contextlib.contextmanager
def _cache_env(cache_dir: str | Path | None) -> Iterator[None]:
    """Point $TRAINPLAN_CACHE_DIR at `cache_dir` for the cpu profile's load/save (which read the
    variable), restoring it afterwards. Not thread-safe."""
    if cache_dir is None:
        yield
        return
    old = os.environ.get("TRAINPLAN_CACHE_DIR")
    os.environ["TRAINPLAN_CACHE_DIR"] = str(cache_dir)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRAINPLAN_CACHE_DIR", None)
        else:
            os.environ["TRAINPLAN_CACHE_DIR"] = old


# --------------------------------------------------------------------------- loss law


def _law_points(run: _Run) -> tuple[list[dict], int, int]:
    """Used points of one run's held-out curve, the count found and the count skipped."""
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


def _fit_law(model: str, vocab: int, runs: list[_Run]) -> tuple[LossLaw, dict, LawFit]:
    """Fit L(D) = E + B / D**beta to the runs' held-out points. Raises TrainplanError when
    fewer than MIN_POINTS remain after the warm-up skip."""
    points, found, skipped = [], 0, 0
    for run in runs:
        pts, n, s = _law_points(run)
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
    n_params = float(runs[0].plan.model_n_params)
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
    law = dataclasses.replace(fitted, source=source)
    pred = np.array([law.predict(n_params, x) for x in d])
    previous = load_local_law(model, vocab) or LossLaw.besiroglu2024()
    prev_pred = np.array([previous.predict(n_params, x) for x in d])
    residuals = y - pred
    fit_record = {
        "method": ("LossLaw.fit with fix={'A': 0, 'alpha': %g}: Huber (delta 1e-3) on log "
                   "residuals, L-BFGS-B from a grid (Hoffmann et al. 2022 eq. 3, as in "
                   "Besiroglu et al. 2024)" % default.alpha),
        "form": "L(D) = E + B / D^beta, D = effective tokens (Muennighoff et al. 2023 eq. 5)",
        "n_params": n_params,
        "skip_fraction": SKIP_FRACTION,
        "n_found": found,
        "n_skipped": skipped,
        "points": [p | {"predicted": float(q), "residual": float(r)}
                   for p, q, r in zip(points, pred, residuals, strict=False)],
        "residuals": [float(r) for r in residuals],
        "rms_residual_nats": _rms(residuals),
        "max_abs_residual_nats": float(np.max(np.abs(residuals))),
    }
    last = max(points, key=lambda p: (p["run"] == dirs[-1], p["step"]))
    fit = LawFit(
        model=model, vocab_size=vocab, law=law, path=Path(), run_dirs=dirs, n_points=len(points),
        n_skipped=skipped, residuals=tuple(float(r) for r in residuals),
        previous_source=previous.source,
        rms_rel_err_before=_rms((prev_pred - y) / y), rms_rel_err_after=_rms((pred - y) / y),
        final_measured=last["loss"], final_before=previous.predict(n_params, last["effective_tokens"]),
        final_after=law.predict(n_params, last["effective_tokens"]))
    return law, fit_record, fit


# --------------------------------------------------------------------------- entry point


def calibrate(run_dirs: list[str | Path], *, cache_dir: str | Path | None = None,
              verbose: bool = True, time_basis: str = "wall") -> CalibrationResult:
    """Refit the local cpu profile (step time) and loss law(s) from real runs; see the module
    docstring for the method.

    Args:
        run_dirs: run folders, each with `plan.json` and `record.json`.
        cache_dir: trainplan cache root for this call (cpu profile and laws); default
            $TRAINPLAN_CACHE_DIR, else ~/.cache/trainplan.
        verbose: print a before/after table.
        time_basis: "wall" (default: the median step's wall time) or "cpu" (its process CPU
            time, `RunRecord.step_cpu_times_s`: for one-thread runs on a machine other jobs
            share, the step without their load; benchmarks/accuracy.py uses it).

    Writes the calibrated cpu profile (`hardware_profiles.save_profile`, when some run was a
    cpu run on this cpu) and one law file per (model, vocab_size) (`costmodels.loss.cache`).
    Loading the cpu profile measures the machine first if it has no cached profile (seconds).

    Raises:
        TrainplanError: no run folders; a folder missing, without plan.json/record.json or
            unreadable (named); fewer than `MIN_POINTS` usable held-out points for a law (the
            message gives the count found and the count needed); a cpu run with fewer than
            `MIN_TIMED_STEPS` timed steps. Nothing is written then.
    """
    if time_basis not in ("wall", "cpu"):
        raise TrainplanError(f"time_basis={time_basis!r}: use 'wall' or 'cpu'")
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    if not run_dirs:
        raise TrainplanError("calibrate needs at least one run folder")
    runs = [_load(d) for d in run_dirs]
    _check_timed_steps(runs)
    notes: list[str] = []
    with _cache_env(cache_dir):
        groups: dict[tuple[str, int], list[_Run]] = {}
        for run in runs:
            groups.setdefault((run.plan.model, int(run.plan.vocab_size)), []).append(run)
        fitted = []
        for key, group in groups.items():
            bits, bits_record = fit_bits_penalty(group)
            # the law from the runs without a bits penalty when there are some (the others'
            # deltas are the penalties' to explain)
            full = [r for r in group if not any(components(
                r.plan.decisions.optimizer_bits, r.plan.decisions.activation_bits,
                r.plan.decisions.precision).values())]
            law, fit_record, fit = _fit_law(*key, full or group)  # may raise
            if bits is not None:
                law = dataclasses.replace(law, bits=bits)
                fit = dataclasses.replace(fit, law=law)
                fit_record = fit_record | {"bits": bits_record}
            fitted.append((key, law, fit_record, fit))
        step = _calibrate_step_time(runs, notes, time_basis)
        profile_path = None
        if step["profile"] is not None:
            from hardware_profiles import save_profile

            profile_path = save_profile(step["profile"])
        created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        laws = []
        for (model, vocab), law, fit_record, fit in fitted:
            path = save_local_law(law, model=model, vocab_size=vocab, fit=fit_record,
                                  runs=list(fit.run_dirs), created=created)
            laws.append(dataclasses.replace(fit, path=path))
            if fit.law.beta < 0.01 or fit.law.beta > 2.9:
                notes.append(f"{model} v{vocab}: fitted beta={fit.law.beta:.3g} is at a bound of the "
                             f"fit; the curve may be too short or too noisy to trust it")
    result = CalibrationResult(
        step_time=step["rows"], step_time_method=step["method"], ratio=step["ratio"],
        compute_scale=step["compute"], memory_scale=step["memory"], scaled_fields=step["fields"],
        profile=step["profile"], profile_path=profile_path, laws=tuple(laws), notes=tuple(notes))
    _record_history(result, cache_dir)
    if verbose:
        print(format_result(result))
    return result


def _record_history(result: CalibrationResult, cache_dir) -> None:
    """Append this calibration's before/after errors to the history the HTML report plots."""
    from executor.reporting.figures import append_calibration_history

    rows = [{"term": "step_time", "rel_err_before": r.rel_err_before, "rel_err_after": r.rel_err_after}
            for r in result.step_time]
    rows += [{"term": "final_loss", "rel_err_before": f.rms_rel_err_before,
              "rel_err_after": f.rms_rel_err_after} for f in result.laws]
    if rows:
        append_calibration_history(rows, cache_dir)


def _pct(x: float) -> str:
    return f"{x:+.1%}" if math.isfinite(x) else "n/a"


def format_result(result: CalibrationResult) -> str:
    """The before/after table `calibrate` prints."""
    out = []
    if result.step_time:
        out.append(f"step time (cpu profile; {result.step_time_method}: median measured/predicted "
                   f"{result.ratio:.4g}; compute x{result.compute_scale:.4g}, memory "
                   f"x{result.memory_scale:.4g} via {', '.join(result.scaled_fields)})")
        w = max(len("run"), *(len(r.run_dir) for r in result.step_time))
        out.append(f"  {'run':<{w}}  {'measured':>10}  {'before':>10} {'err':>7}  {'after':>10} {'err':>7}")
        for r in result.step_time:
            out.append(f"  {r.run_dir:<{w}}  {r.measured_s:>9.4g}s  {r.before_s:>9.4g}s "
                       f"{_pct(r.rel_err_before):>7}  {r.after_s:>9.4g}s {_pct(r.rel_err_after):>7}")
        out.append(f"  cpu profile written to {result.profile_path}")
    else:
        out.append("step time: no run on this cpu planned for cpu; cpu profile unchanged")
    for f in result.laws:
        law = f.law
        out.append(f"loss law {f.model} v{f.vocab_size}: L(D) = {law.E:.4g} + {law.B:.4g} / D^{law.beta:.4g} "
                   f"from {f.n_points} held-out points ({f.n_skipped} skipped as warm-up)")
        out.append(f"  {'':<28}{'before':>10}  {'after':>10}")
        out.append(f"  {'final held-out loss, nats':<28}{f.final_before:>10.4g}  {f.final_after:>10.4g}"
                   f"   (measured {f.final_measured:.4g})")
        out.append(f"  {'RMS rel err on the points':<28}{f.rms_rel_err_before:>10.1%}  "
                   f"{f.rms_rel_err_after:>10.1%}")
        out.append(f"  before: {f.previous_source}")
        if law.bits is not None:
            from costmodels.loss.bits import COMPONENTS

            out.append("  bits penalties, nats: " + ", ".join(
                f"{c.removesuffix('_nats')} {getattr(law.bits, c):.4g}" for c in COMPONENTS))
        out.append(f"  written to {f.path}")
    out += [f"note: {n}" for n in result.notes]
    return "\n".join(out)
