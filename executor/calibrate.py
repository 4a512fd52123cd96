"""`trainplan calibrate RUN_DIR...`: refit the local cpu profile and loss law from real runs.

Two refits, each from what `executor.train.run` wrote into a run folder (`plan.json`,
`record.json`, read by `executor.report.load_run`):

**Step time** (runs with `record.same_hardware` planned for `cpu` only). Each run's step is
re-predicted with the *current* cpu profile (the model re-captured from its preset, the plan's
decisions as the `Choice`), so calibrating twice on the same runs does not compound. Per run,
k = (measured median step time - communication) / (compute + recompute); the ratio
r = median k. Dividing every `matmul_efficiency` point and `memory_efficiency` by r scales
every roofline node's time by exactly r (a node's time is max(FLOPs / (peak * eff),
bytes / (bandwidth * mem_eff))), so the next prediction matches the measured median; the
communication term is left as it is. Efficiencies must stay in (0, 1]: when dividing by r
(r < 1, the CPU ran faster than predicted) would push any of them above 1, the same factor goes
onto the peaks instead (`peak_flops_per_s`, every dtype; for the memory term
`hbm_bandwidth_bytes_per_s`), which gives identical predictions because only the products
peak * eff and bandwidth * mem_eff enter the model.

With two or more runs of different shapes, a two-factor fit is tried as well: separate
throughput factors for the compute-bound (matmul) and memory-bound terms, by
`scipy.optimize.least_squares` on log(predicted / measured) with a weak pull (weight
`PRIOR_WEIGHT`) towards the ratio solution so an unidentified direction stays put. It replaces
the ratio only when it lowers the RMS log error by at least `LSQ_MIN_GAIN`.

**Loss law** per (model, vocabulary size). One model size cannot separate A / N**alpha from E,
so L(D) = E + B / D**beta is fitted with `LossLaw.fit(..., fix={"A": 0, "alpha": default})`
(Huber in log space, L-BFGS-B from a grid; A's term is folded into E). Points are each run's
held-out curve `(step, tokens, loss)` minus its first `SKIP_FRACTION` (warm-up), tokens
converted to effective tokens (Muennighoff et al. 2023, eq. 5) against the run's unique data
(`plan.data_tokens * data_fraction`), so a run that repeats data gives the law `solve` applies.
Caveat: points along one run are not ends of runs of that length (the learning-rate schedule
differs), the usual approximation of a law fitted to one curve.
The law is written to `<cache>/laws/<model>-v<vocab_size>.json` with its points and
residuals (`costmodels.loss_cache`); `planner.api.solve` uses it for the cpu profile.

Nothing is written unless every run folder loads and every law has enough points.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from costmodels.loss import LossLaw, effective_tokens
from costmodels.loss_cache import load_local_law, save_local_law
from executor.record import RunRecord
from executor.report import load_run
from hardware_profiles import HardwareProfile
from hardware_profiles.errors import TrainplanError, UnknownNameError
from planner.plan import Plan

__all__ = ["CalibrationResult", "LawFit", "StepTimeRow", "calibrate", "load_local_law",
           "LSQ_MIN_GAIN", "MIN_POINTS", "MIN_TIMED_STEPS", "PRIOR_WEIGHT", "SKIP_FRACTION"]

SKIP_FRACTION = 0.2
"""Share of each run's held-out points (the first ones) left out of the law fit as warm-up."""

MIN_POINTS = 4
"""Held-out points needed after the skip: one more than the free parameters E, B, beta."""

MIN_TIMED_STEPS = 3
"""Timed steps a cpu run needs before its step time calibrates the cpu profile: the first two
are warm-up (`RunRecord.median_step_time_s` skips them), so at least one more."""

LSQ_MIN_GAIN = 0.10
"""The two-factor step-time fit replaces the single ratio only when it lowers the RMS log
error over the runs by at least this fraction."""

PRIOR_WEIGHT = 0.05
"""Weight of the pull of log(factor) towards the ratio solution in the two-factor fit."""

_CAPTURES: dict = {}
"""(preset, precision, vocab_size) -> (ModelGraph, parameter sizes) or None (not a preset),
kept for the process: capturing a model takes about a second."""


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTimeRow:
    """One run's step time, seconds: measured median, and predicted with the profile before
    and after calibration (and as stored in the plan, made with the profile of its day)."""

    run_dir: str
    measured_s: float
    planned_s: float
    before_s: float
    after_s: float

    @property
    def rel_err_before(self) -> float:
        """(before - measured) / measured."""
        return (self.before_s - self.measured_s) / self.measured_s

    @property
    def rel_err_after(self) -> float:
        """(after - measured) / measured."""
        return (self.after_s - self.measured_s) / self.measured_s


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


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else math.nan


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
                   for p, q, r in zip(points, pred, residuals)],
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


# --------------------------------------------------------------------------- step time


def _scaled(hw: HardwareProfile, compute: float, memory: float, overhead: float = 1.0) -> HardwareProfile:
    """`hw` with compute throughput x`compute`, memory throughput x`memory` and per-op
    overhead /`overhead` (through the peaks and bandwidth, so no efficiency is clamped); for
    trial predictions only."""
    return dataclasses.replace(
        hw, peak_flops_per_s={k: v * compute for k, v in hw.peak_flops_per_s.items()},
        hbm_bandwidth_bytes_per_s=hw.hbm_bandwidth_bytes_per_s * memory,
        optimizer_s_per_param={k: v / memory for k, v in hw.optimizer_s_per_param.items()},
        op_overhead_s=hw.op_overhead_s / overhead)


class _Predictor:
    """Step-time predictions of one run under a (scaled) profile: the StepModel when the
    plan's model is a preset, else the plan's stored breakdown (which assumes the plan was made
    with the current profile)."""

    def __init__(self, run: _Run, captures: dict):
        from costmodels.step import Choice

        self.run = run
        d = run.plan.decisions
        self.choice = Choice.from_decisions(d)  # solved checkpoint sets (remat:k) included
        key = (run.plan.model, d.precision, run.plan.vocab_size)
        if key not in captures:
            from planner.api import capture_model

            try:
                graph, _, numels = capture_model(run.plan.model, d.precision, vocab_size=run.plan.vocab_size)
                captures[key] = (graph, numels)
            except UnknownNameError:
                captures[key] = None
        self.captured = captures[key]

    def parts(self, hw: HardwareProfile) -> tuple[float, float]:
        """(everything but communication, communication) seconds per step under `hw`."""
        if self.captured is None:
            b = self.run.plan.predictions.step_time_breakdown_s
            return b.get("compute", 0.0) + b.get("recompute", 0.0), b.get("communication", 0.0)
        from costmodels.step import StepModel

        g, numels = self.captured
        cost = StepModel(g.regions, g.blocks, numels, hw, n_heads=g.n_heads, n_kv_heads=g.n_kv_heads,
                         head_dim=g.head_dim).evaluate(self.choice)
        return cost.time_s - cost.comm_s, cost.comm_s

    def time(self, hw: HardwareProfile, compute: float = 1.0, memory: float = 1.0,
             overhead: float | None = None) -> float:
        overhead = compute if overhead is None else overhead
        if self.captured is None:  # no per-node split: one factor (the ratio method)
            work, comm = self.parts(hw)
            return work / compute + comm
        scaled = (compute, memory, overhead) != (1.0, 1.0, 1.0)
        work, comm = self.parts(_scaled(hw, compute, memory, overhead) if scaled else hw)
        return work + comm


def _two_factor_fit(preds: list[_Predictor], measured: np.ndarray, hw: HardwareProfile,
                    ratio_scale: float) -> tuple[float, float, float, float]:
    """Least squares over log factors of compute throughput, memory throughput and per-op
    overhead (the third only with 3+ runs); returns (compute, memory, overhead, rms log
    error)."""
    from scipy.optimize import least_squares

    x0 = math.log(ratio_scale)
    k = 3 if len(preds) >= 3 else 2

    def resid(x):
        c, m = math.exp(x[0]), math.exp(x[1])
        o = math.exp(x[2]) if k == 3 else c
        r = [math.log(p.time(hw, c, m, o) / t) for p, t in zip(preds, measured)]
        return np.array(r + [PRIOR_WEIGHT * (v - x0) for v in x])

    sol = least_squares(resid, np.full(k, x0), bounds=(np.full(k, x0 - 7), np.full(k, x0 + 7)),
                        diff_step=1e-3, x_scale=1.0)
    c, m = math.exp(sol.x[0]), math.exp(sol.x[1])
    o = math.exp(sol.x[2]) if k == 3 else c
    return c, m, o, _rms(resid(sol.x)[:-k])


def _source(old: str, text: str) -> str:
    original = old.split("; original: ")[-1] if "; original: " in old else old
    return f"{text}; original: {original}" if original else text


def _apply(hw: HardwareProfile, compute: float, memory: float, overhead: float, text: str
           ) -> tuple[HardwareProfile, tuple[str, ...]]:
    """The profile with compute/memory throughput scaled: through the efficiencies when they
    stay <= 1, else through the peaks / bandwidth (same predictions); the measured optimizer
    seconds per parameter scale with memory throughput."""
    fields, sources = {}, {}
    curve = tuple((f, e * compute) for f, e in hw.matmul_efficiency)
    if max(e for _, e in curve) <= 1.0:
        fields["matmul_efficiency"] = curve
        sources["matmul_efficiency"] = _source(hw.sources.get("matmul_efficiency", ""),
                                               f"{text}: x{compute:.4g}")
    else:
        fields["peak_flops_per_s"] = {k: v * compute for k, v in hw.peak_flops_per_s.items()}
        for k in hw.peak_flops_per_s:
            sources[f"peak_flops_per_s.{k}"] = _source(
                hw.sources.get(f"peak_flops_per_s.{k}", ""),
                f"{text}: x{compute:.4g} (on the peak: the efficiencies would exceed 1)")
    mem = hw.memory_efficiency * memory
    if mem <= 1.0:
        fields["memory_efficiency"] = mem
        sources["memory_efficiency"] = _source(hw.sources.get("memory_efficiency", ""),
                                               f"{text}: x{memory:.4g}")
    else:
        fields["hbm_bandwidth_bytes_per_s"] = hw.hbm_bandwidth_bytes_per_s * memory
        sources["hbm_bandwidth_bytes_per_s"] = _source(
            hw.sources.get("hbm_bandwidth_bytes_per_s", ""),
            f"{text}: x{memory:.4g} (on the bandwidth: memory_efficiency would exceed 1)")
    if hw.optimizer_s_per_param:  # the measured optimizer step is memory-bound work too
        fields["optimizer_s_per_param"] = {k: v / memory for k, v in hw.optimizer_s_per_param.items()}
        sources["optimizer_s_per_param"] = _source(hw.sources.get("optimizer_s_per_param", ""),
                                                   f"{text}: /{memory:.4g}")
    fields["op_overhead_s"] = hw.op_overhead_s / overhead
    sources["op_overhead_s"] = _source(hw.sources.get("op_overhead_s", ""), f"{text}: /{overhead:.4g}")
    return hw.with_calibration(sources=sources, **fields), tuple(fields)


def _step_s(rec, time_basis: str) -> float:
    return rec.median_step_cpu_time_s if time_basis == "cpu" else rec.median_step_time_s


def _calibrate_step_time(runs: list[_Run], notes: list[str], time_basis: str = "wall") -> dict:
    """Fit the cpu profile to the runs' measured step times (median wall or process CPU
    seconds, `time_basis`); nothing written."""
    from hardware_profiles import load as load_profile

    use = []
    for run in runs:
        rec = run.record
        if not (rec.same_hardware and run.plan.hw == "cpu"):
            notes.append(f"{run.dir}: step time not used (planned for {run.plan.hw!r}, ran on "
                         f"{rec.device!r}; only cpu runs on the cpu calibrate the cpu profile)")
        elif not (math.isfinite(_step_s(rec, time_basis)) and _step_s(rec, time_basis) > 0):
            notes.append(f"{run.dir}: step time not used (no timed steps in record.json"
                         + (", or no CPU times: recorded before they were measured)" if time_basis == "cpu" else ")"))
        else:
            use.append(run)
    empty = dict(rows=(), method="", ratio=math.nan, compute=1.0, memory=1.0, fields=(), profile=None)
    if not use:
        return empty
    hw = load_profile("cpu")
    preds = [_Predictor(run, _CAPTURES) for run in use]
    for p in preds:
        if p.captured is None:
            notes.append(f"{p.run.dir}: model {p.run.plan.model!r} is not a preset, so its step is "
                         f"not re-predicted: the plan's stored breakdown is taken as the current "
                         f"profile's prediction")
    measured = np.array([_step_s(r.record, time_basis) for r in use])
    before = np.array([p.time(hw) for p in preds])
    ks = []
    for p, t in zip(preds, measured):
        work, comm = p.parts(hw)
        if work + comm <= 0:
            raise TrainplanError(f"run folder {p.run.dir!r}: the cpu profile predicts a zero step "
                                 f"time for its plan, so there is nothing to scale")
        ks.append((t - comm) / work if t > comm and work > 0 else t / (work + comm))
    ratio = float(np.median(ks))
    compute = memory = overhead = 1.0 / ratio
    method = "ratio"
    rms_ratio = _rms(np.log(np.array([p.time(hw, compute, memory) for p in preds]) / measured))
    shapes = {(p.choice, id(p.captured)) for p in preds}
    if len(preds) >= 2 and len(shapes) >= 2 and all(p.captured is not None for p in preds):
        c, m, o, rms_lsq = _two_factor_fit(preds, measured, hw, compute)
        if rms_lsq <= (1.0 - LSQ_MIN_GAIN) * rms_ratio:
            compute, memory, overhead, method = c, m, o, "least-squares"
            notes.append(f"two-factor fit: RMS log error {rms_lsq:.3g} vs {rms_ratio:.3g} for the ratio")
        else:
            notes.append(f"two-factor fit not better than the ratio (RMS log error {rms_lsq:.3g} vs "
                         f"{rms_ratio:.3g}): ratio kept")
    when = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    text = (f"calibrated by trainplan calibrate ({method}"
            f"{', process CPU time per step' if time_basis == 'cpu' else ''}) on {len(use)} run(s) "
            f"({', '.join(r.dir for r in use)}), {when}")
    new, fields = _apply(hw, compute, memory, overhead, text)
    after = [p.time(new) for p in preds]
    rows = tuple(StepTimeRow(run_dir=r.dir, measured_s=float(t), planned_s=float(r.plan.predictions.step_time_s),
                             before_s=float(b), after_s=float(a))
                 for r, t, b, a in zip(use, measured, before, after))
    return dict(rows=rows, method=method, ratio=ratio, compute=compute, memory=memory, fields=fields,
                profile=new)


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
    cpu run on this cpu) and one law file per (model, vocab_size) (`costmodels.loss_cache`).
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
        fitted = [(key, *_fit_law(*key, group)) for key, group in groups.items()]  # may raise
        step = _calibrate_step_time(runs, notes, time_basis)
        profile_path = None
        if step["profile"] is not None:
            from hardware_profiles import save_profile

            profile_path = save_profile(step["profile"])
        created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
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


def _record_history(result: "CalibrationResult", cache_dir) -> None:
    """Append this calibration's before/after errors to the history the HTML report plots."""
    from executor.figures import append_calibration_history

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
        out.append(f"  written to {f.path}")
    out += [f"note: {n}" for n in result.notes]
    return "\n".join(out)
