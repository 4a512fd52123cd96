"""Step-time calibration of the local cpu profile (`trainplan calibrate`, `trainplan.executor.calibrate.calibration`).

Fits throughput factors (dimensionless) that scale the cpu `HardwareProfile` so predicted
step times (seconds per optimizer step, wall or process CPU time) match the measured
median step times of real runs. Sources: each run folder's `plan.json` / `record.json`
(`RunRecord.median_step_time_s`, `RunRecord.median_step_cpu_time_s`) and the current cpu
profile (`trainplan.hardware_profiles.load("cpu")`); nothing is written here.

The model of a preset is captured by the function the caller passes in (`CaptureModel`: the
planner's `trainplan.planner.capture.setup.capture_model`, which the command line hands over), since the
executor imports no planner code but `trainplan.planner.plan`.

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
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from scipy.optimize import least_squares

from trainplan.costmodels.step.model import Choice, StepModel
from trainplan.errors import TrainplanError, UnknownNameError
from trainplan.executor.calibrate.runs import Run, rms
from trainplan.hardware_profiles import HardwareProfile
from trainplan.hardware_profiles import load as load_profile

__all__ = ["LSQ_MIN_GAIN", "PRIOR_WEIGHT", "CaptureModel", "StepTimeFit", "StepTimePredictor", "StepTimeRow",
           "calibrate_step_time", "scaled_profile"]

LSQ_MIN_GAIN = 0.10
"""The two-factor step-time fit replaces the single ratio only when it lowers the RMS log
error over the runs by at least this fraction."""

PRIOR_WEIGHT = 0.05
"""Weight of the pull of log(factor) towards the ratio solution in the two-factor fit."""

_CAPTURES: dict = {}
"""(capture function, preset, precision, vocab_size, activation bits) -> (ModelGraph, parameter
sizes) or None (not a preset), kept for the process: capturing a model takes about a second."""


class CaptureModel(Protocol):
    """How calibration captures a preset's model: `trainplan.planner.capture.setup.capture_model`'s
    signature. Returns (graph, model name, parameter tensor sizes); the graph has the `regions`,
    `blocks`, `n_heads`, `n_kv_heads` and `head_dim` a `StepModel` is built from.

    Raises:
        UnknownNameError: `model` is not a preset (its step is then not re-predicted).
    """

    def __call__(self, model: str, precision: str, *, vocab_size: int | None = ...,
                  activation_bits: tuple[int, ...] = ...) -> tuple[Any, str, tuple[int, ...]]: ...


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
class StepTimeFit:
    """What `calibrate_step_time` fitted; nothing is written."""

    rows: tuple[StepTimeRow, ...]
    """The runs used (same hardware, planned for cpu), measured beside predicted."""
    method: str
    """"ratio", "least-squares", or "" when no run qualified (profile untouched)."""
    ratio: float
    """Median measured / predicted over the runs (compute part); NaN when none qualified."""
    compute: float
    """Factor on compute throughput (dimensionless); 1 when unchanged."""
    memory: float
    """Factor on memory throughput (dimensionless); 1 when unchanged."""
    fields: tuple[str, ...]
    """Profile fields changed."""
    profile: HardwareProfile | None
    """The calibrated cpu profile (None when no run qualified)."""


def scaled_profile(hw: HardwareProfile, compute: float, memory: float, overhead: float = 1.0) -> HardwareProfile:
    """`hw` with compute throughput x`compute`, memory throughput x`memory` and per-op
    overhead /`overhead` (through the peaks and bandwidth, so no efficiency is clamped); for
    trial predictions only."""
    return dataclasses.replace(
        hw, peak_flops_per_s={k: v * compute for k, v in hw.peak_flops_per_s.items()},
        hbm_bandwidth_bytes_per_s=hw.hbm_bandwidth_bytes_per_s * memory,
        optimizer_s_per_param={k: v / memory for k, v in hw.optimizer_s_per_param.items()},
        op_overhead_s=hw.op_overhead_s / overhead)


class StepTimePredictor:
    """Step-time predictions (seconds per step) of one run under a (scaled) profile: the
    StepModel when the plan's model is a preset, else the plan's stored breakdown (which assumes
    the plan was made with the current profile). `capture_model` captures the preset
    (`CaptureModel`); `captures` caches its graphs across runs (a dict, e.g. `{}`)."""

    def __init__(self, run: Run, captures: dict, capture_model: CaptureModel):
        self.run = run
        d = run.plan.decisions
        self.choice = Choice.from_decisions(d)  # solved checkpoint sets (remat:k) included
        key = (capture_model, run.plan.model, d.precision, run.plan.vocab_size, d.activation_bits)
        if key not in captures:
            try:
                graph, _, numels = capture_model(run.plan.model, d.precision, vocab_size=run.plan.vocab_size,
                                                 activation_bits=(d.activation_bits,))
                captures[key] = (graph, numels)
            except UnknownNameError:
                captures[key] = None
        self.captured = captures[key]

    def parts(self, hw: HardwareProfile) -> tuple[float, float]:
        """(everything but communication, communication) seconds per step under `hw`."""
        if self.captured is None:
            b = self.run.plan.predictions.step_time_breakdown_s
            return b.get("compute", 0.0) + b.get("recompute", 0.0), b.get("communication", 0.0)
        g, numels = self.captured
        cost = StepModel(g.regions, g.blocks, numels, hw, n_heads=g.n_heads, n_kv_heads=g.n_kv_heads,
                         head_dim=g.head_dim).evaluate(self.choice)
        return cost.time_s - cost.comm_s, cost.comm_s

    def time(self, hw: HardwareProfile, compute: float = 1.0, memory: float = 1.0,
             overhead: float | None = None) -> float:
        """Seconds per step under `hw` with compute and memory throughput scaled by `compute` and
        `memory` and the per-op overhead divided by `overhead` (default: `compute`)."""
        overhead = compute if overhead is None else overhead
        if self.captured is None:  # no per-node split: one factor (the ratio method)
            work, comm = self.parts(hw)
            return work / compute + comm
        scaled = (compute, memory, overhead) != (1.0, 1.0, 1.0)
        work, comm = self.parts(scaled_profile(hw, compute, memory, overhead) if scaled else hw)
        return work + comm


def _two_factor_fit(preds: list[StepTimePredictor], measured: np.ndarray, hw: HardwareProfile,
                    ratio_scale: float) -> tuple[float, float, float, float]:
    """Least squares over log factors of compute throughput, memory throughput and per-op
    overhead (the third only with 3+ runs); returns (compute, memory, overhead, rms log
    error)."""
    x0 = math.log(ratio_scale)
    k = 3 if len(preds) >= 3 else 2

    def resid(x):
        c, m = math.exp(x[0]), math.exp(x[1])
        o = math.exp(x[2]) if k == 3 else c
        r = [math.log(p.time(hw, c, m, o) / t) for p, t in zip(preds, measured, strict=False)]
        return np.array(r + [PRIOR_WEIGHT * (v - x0) for v in x])

    sol = least_squares(resid, np.full(k, x0), bounds=(np.full(k, x0 - 7), np.full(k, x0 + 7)),
                        diff_step=1e-3, x_scale=1.0)
    c, m = math.exp(sol.x[0]), math.exp(sol.x[1])
    o = math.exp(sol.x[2]) if k == 3 else c
    return c, m, o, rms(resid(sol.x)[:-k])


def _source(old: str, text: str) -> str:
    original = old.split("; original: ")[-1] if "; original: " in old else old
    return f"{text}; original: {original}" if original else text


def _apply(hw: HardwareProfile, compute: float, memory: float, overhead: float, text: str
           ) -> tuple[HardwareProfile, tuple[str, ...]]:
    """The profile with compute/memory throughput scaled: through the efficiencies when they
    stay <= 1, else through the peaks / bandwidth (same predictions); the measured optimizer
    seconds per parameter scale with memory throughput."""
    fields: dict[str, Any] = {}
    sources: dict[str, str] = {}
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


def calibrate_step_time(runs: list[Run], notes: list[str], capture_model: CaptureModel,
                        time_basis: str = "wall") -> StepTimeFit:
    """Fit the cpu profile to the runs' measured step times (median wall or process CPU
    seconds, `time_basis`: "wall" or "cpu"); nothing written. Runs not planned for cpu or not
    run on it, and runs without timed steps, are left out with a line in `notes` (appended to),
    but for runs on an accelerator planned for one (the GPU refit's, `trainplan.executor.calibrate.gpu`);
    `capture_model` re-captures each preset (`CaptureModel`).

    Raises:
        TrainplanError: the cpu profile predicts a zero step time for a run's plan.
    """
    use = []
    for run in runs:
        rec = run.record
        if run.plan.hw != "cpu" and not rec.device.startswith("cpu"):
            continue  # an accelerator run: the GPU refit's (trainplan.executor.calibrate.gpu), which notes it
        if not (rec.same_hardware and run.plan.hw == "cpu"):
            notes.append(f"{run.dir}: step time not used (planned for {run.plan.hw!r}, ran on "
                         f"{rec.device!r}; only cpu runs on the cpu calibrate the cpu profile)")
        elif not (math.isfinite(_step_s(rec, time_basis)) and _step_s(rec, time_basis) > 0):
            notes.append(f"{run.dir}: step time not used (no timed steps in record.json"
                         + (", or no CPU times: recorded before they were measured)" if time_basis == "cpu" else ")"))
        else:
            use.append(run)
    if not use:
        return StepTimeFit(rows=(), method="", ratio=math.nan, compute=1.0, memory=1.0, fields=(), profile=None)
    hw = load_profile("cpu")
    preds = [StepTimePredictor(run, _CAPTURES, capture_model) for run in use]
    for p in preds:
        if p.captured is None:
            notes.append(f"{p.run.dir}: model {p.run.plan.model!r} is not a preset, so its step is "
                         f"not re-predicted: the plan's stored breakdown is taken as the current "
                         f"profile's prediction")
    measured = np.array([_step_s(r.record, time_basis) for r in use])
    before = np.array([p.time(hw) for p in preds])
    ks = []
    for p, t in zip(preds, measured, strict=False):
        work, comm = p.parts(hw)
        if work + comm <= 0:
            raise TrainplanError(f"run folder {p.run.dir!r}: the cpu profile predicts a zero step "
                                 f"time for its plan, so there is nothing to scale")
        ks.append((t - comm) / work if t > comm and work > 0 else t / (work + comm))
    ratio = float(np.median(ks))
    compute = memory = overhead = 1.0 / ratio
    method = "ratio"
    rms_ratio = rms(np.log(np.array([p.time(hw, compute, memory) for p in preds]) / measured))
    shapes = {(p.choice, id(p.captured)) for p in preds}
    if len(preds) >= 2 and len(shapes) >= 2 and all(p.captured is not None for p in preds):
        c, m, o, rms_lsq = _two_factor_fit(preds, measured, hw, compute)
        if rms_lsq <= (1.0 - LSQ_MIN_GAIN) * rms_ratio:
            compute, memory, overhead, method = c, m, o, "least-squares"
            notes.append(f"two-factor fit: RMS log error {rms_lsq:.3g} vs {rms_ratio:.3g} for the ratio")
        else:
            notes.append(f"two-factor fit not better than the ratio (RMS log error {rms_lsq:.3g} vs "
                         f"{rms_ratio:.3g}): ratio kept")
    when = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    text = (f"calibrated by trainplan calibrate ({method}"
            f"{', process CPU time per step' if time_basis == 'cpu' else ''}) on {len(use)} run(s) "
            f"({', '.join(r.dir for r in use)}), {when}")
    new, fields = _apply(hw, compute, memory, overhead, text)
    after = [p.time(new) for p in preds]
    rows = tuple(StepTimeRow(run_dir=r.dir, measured_s=float(t), planned_s=float(r.plan.predictions.step_time_s),
                             before_s=float(b), after_s=float(a))
                 for r, t, b, a in zip(use, measured, before, after, strict=False))
    return StepTimeFit(rows=rows, method=method, ratio=ratio, compute=compute, memory=memory, fields=fields,
                       profile=new)
