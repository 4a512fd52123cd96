"""Refit an accelerator's hardware profile from runs recorded on it; part of `trainplan calibrate`
(`trainplan.executor.calibrate.calibration`). The result is a profile file the planner takes back with
`--hw FILE` (`trainplan.hardware_profiles.profile_file.write_profile_file`).

Measured, per run (`trainplan.executor.record.RunRecord` on CUDA/ROCm): device seconds per step by kind
(`kernel_time_s`: matmul, other, communication and busy, from torch.profiler,
`trainplan.executor.kernels`), the median step's wall time (`median_step_time_s`), the allocator's peaks
over the timed steps (`max_allocated_bytes`, `max_reserved_bytes`) and the device's memory
(`device_memory_bytes`). Predicted: the same split of the run's step re-predicted on the profile
being refit (`trainplan.executor.calibrate.gpu_parts.PartsPredictor`), so calibrating twice on the same
runs does not compound. Each factor is fitted over all runs at once, summed measured against
summed predicted seconds:

1. memory throughput m = predicted / measured `other` seconds: ops without FLOPs and the
   optimizer step are memory-bound, their time bytes / (bandwidth x `memory_efficiency`);
2. compute throughput c: the root (`scipy.optimize.brentq`, Brent 1973) of predicted `matmul`
   seconds under (c, m) = measured; an op's roofline is max(FLOPs / (peak x efficiency), bytes /
   (bandwidth x memory efficiency)) (Williams et al. 2009), so c acts only where FLOPs bind. The
   whole `matmul_efficiency` curve is multiplied by c (its shape, the Calculon-style small-op
   fall-off, is kept; its plateau moves);
3. network n: the root of predicted communication seconds (every collective, latency + bytes /
   (bandwidth x `network_efficiency`), `trainplan.costmodels.step.comm`) = measured NCCL/RCCL kernel
   seconds; only from runs with communication (more than one device). NCCL kernels also spin
   while they wait for the slowest rank, so n is a lower bound of the links' efficiency;
4. `op_overhead_s` = sum of (wall - busy) / sum of ops: the host time the device sat idle
   (launch, dispatch, Python), per executed op;
5. `memory_reserve_bytes` = the largest over the runs of what the device held beyond the
   predicted tensor peak: (`hbm_bytes` - the memory the driver exposes) + (used - reserved at
   the same moment: the runtime context, NCCL buffers, other processes) + (max reserved - max
   allocated: the caching allocator's slack and fragmentation) + (max allocated - predicted peak:
   what the replay of tensor lifetimes does not see). It must hold for every run, hence the largest.

A factor that would push an efficiency above 1 goes onto the peaks or bandwidths instead, which
predicts the same (only their products enter the model), as the cpu refit does
(`trainplan.executor.calibrate.step_time`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scipy.optimize import brentq

from trainplan.errors import TrainplanError
from trainplan.executor.calibrate.gpu_parts import PartsPredictor, PredictedParts
from trainplan.executor.calibrate.step_time import scaled_profile
from trainplan.executor.record import RunRecord
from trainplan.hardware_profiles import HardwareProfile

__all__ = ["GpuFit", "GpuObservation", "GpuRow", "fit_gpu_profile", "format_gpu_fit", "observations_from_runs"]

_BOUND = 1e4
"""Factors are searched in [1/_BOUND, _BOUND]."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuObservation:
    """One run to refit from: its folder (a label), its step's predictor and its record."""

    run_dir: str
    predictor: PartsPredictor
    record: RunRecord

    def measured(self, kind: str) -> float:
        """Measured device seconds per step of `kind` (`trainplan.executor.kernels.KINDS`, or `busy`)."""
        return float((self.record.kernel_time_s or {}).get(kind, math.nan))


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuRow:
    """One run, measured beside predicted before and after the refit (seconds per step, bytes)."""

    run_dir: str
    measured: dict[str, float]
    """`wall` (median timed step), `matmul`, `other`, `communication`, `busy` (s); `allocated`,
    `reserved` (max over the timed steps, bytes)."""
    before: PredictedParts
    after: PredictedParts


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuFit:
    """What `fit_gpu_profile` fitted; nothing is written."""

    profile: HardwareProfile
    """The refit profile (the base's name: plans made with it name the same hardware)."""
    compute: float
    """Factor on compute throughput (`matmul_efficiency`, or the peaks); 1 when not fitted."""
    memory: float
    """Factor on memory throughput (`memory_efficiency`, or `hbm_bandwidth_bytes_per_s`)."""
    network: float
    """Factor on link throughput (`network_efficiency`, or the bandwidths); 1 when not fitted."""
    fields: tuple[str, ...]
    """Profile fields changed."""
    rows: tuple[GpuRow, ...]
    notes: tuple[str, ...]


def _network_scaled(hw: HardwareProfile, factor: float) -> HardwareProfile:
    """`hw` with both link bandwidths x`factor` (same as network_efficiency x`factor`, unclamped)."""
    return dataclasses.replace(hw, intra_node_bandwidth_bytes_per_s=hw.intra_node_bandwidth_bytes_per_s * factor,
                               inter_node_bandwidth_bytes_per_s=hw.inter_node_bandwidth_bytes_per_s * factor)


def _root(f: Callable[[float], float], what: str, notes: list[str]) -> float:
    """The factor x in [1/_BOUND, _BOUND] where the decreasing f(x) (predicted - measured) is 0;
    1 with a note when there is none in range."""
    lo, hi = math.log(1 / _BOUND), math.log(_BOUND)
    f_lo, f_hi = f(math.exp(lo)), f(math.exp(hi))
    if not (f_lo >= 0 >= f_hi):
        notes.append(f"{what}: no factor in [{1 / _BOUND:g}, {_BOUND:g}] matches the measured time "
                     f"(predicted minus measured {f_lo:.3g} s to {f_hi:.3g} s); left unchanged")
        return 1.0
    return math.exp(brentq(lambda x: f(math.exp(x)), lo, hi, xtol=1e-12, rtol=1e-12))


def _sig(x: float) -> float:
    """`x` to 8 significant digits: a readable profile file, 1e-8 off the fit at most."""
    return float(f"{x:.8g}")


def _source(old: str, text: str) -> str:
    original = old.split("; original: ")[-1] if "; original: " in old else old
    return f"{text}; original: {original}" if original else text


def _scale(hw: HardwareProfile, fields: dict[str, Any], sources: dict[str, str], text: str, *,
           eff_field: str, factor: float, fallback: tuple[str, ...]) -> None:
    """`eff_field` x`factor` into `fields` when it stays <= 1, else every `fallback` rate x`factor`."""
    if factor == 1.0:
        return
    value = getattr(hw, eff_field)
    top = max(e for _, e in value) * factor if eff_field == "matmul_efficiency" else value * factor
    if top <= 1.0:
        fields[eff_field] = (tuple((f, _sig(e * factor)) for f, e in value) if eff_field == "matmul_efficiency"
                             else _sig(value * factor))
        sources[eff_field] = _source(hw.sources.get(eff_field, ""), f"{text}: x{factor:.4g}")
        return
    for name in fallback:
        if name == "peak_flops_per_s":
            fields[name] = {k: _sig(v * factor) for k, v in hw.peak_flops_per_s.items()}
            for k in hw.peak_flops_per_s:
                sources[f"{name}.{k}"] = _source(hw.sources.get(f"{name}.{k}", ""),
                                                 f"{text}: x{factor:.4g} (on the peak: {eff_field} would exceed 1)")
        else:
            fields[name] = _sig(getattr(hw, name) * factor)
            sources[name] = _source(hw.sources.get(name, ""),
                                    f"{text}: x{factor:.4g} (on the rate: {eff_field} would exceed 1)")


def _reserve_bytes(hw: HardwareProfile, obs: GpuObservation, predicted_peak: float) -> float:
    """What the run's device held beyond the predicted tensor peak, bytes (module docstring, 5)."""
    rec = obs.record
    reserve = rec.max_reserved_bytes - predicted_peak
    mem = rec.device_memory_bytes or {}
    if {"total", "used", "reserved"} <= set(mem):
        reserve += max(0.0, hw.hbm_bytes - mem["total"]) + max(0.0, mem["used"] - mem["reserved"])
    return reserve


def fit_gpu_profile(hw: HardwareProfile, observations: list[GpuObservation], *, label: str = "") -> GpuFit:
    """Refit `hw` to the runs `observations` (module docstring); nothing written. `label` names
    the runs in the sources (default: their folders).

    A factor that cannot be fitted (nothing of its kind measured or predicted, no root in range)
    stays 1, with a line in `GpuFit.notes`.

    Raises:
        TrainplanError: no observation has a kernel time split (`RunRecord.kernel_time_s`).
    """
    use = [o for o in observations if o.record.kernel_time_s]
    if not use:
        raise TrainplanError("no run has a kernel time split (record.json's kernel_time_s): the GPU refit needs "
                             "runs on a CUDA/ROCm device of at least 6 steps (steps 4 and 5 are profiled)")
    notes: list[str] = []
    before = [o.predictor.parts(hw, memory=True) for o in use]

    def total(parts: list[PredictedParts], kind: str) -> float:
        return sum(getattr(p, f"{kind}_s") for p in parts)

    def measured(kind: str) -> float:
        return sum(o.measured(kind) for o in use)

    m = 1.0
    if measured("other") > 0 and total(before, "other") > 0:
        m = total(before, "other") / measured("other")
    else:
        notes.append("memory_efficiency: no memory-bound time measured or predicted; left unchanged")

    def matmul_gap(c: float) -> float:
        trial = scaled_profile(hw, c, m)
        return sum(o.predictor.parts(trial).matmul_s for o in use) - measured("matmul")

    c = _root(matmul_gap, "matmul_efficiency", notes) if measured("matmul") > 0 else 1.0
    n = 1.0
    comm_runs = [o for o, p in zip(use, before, strict=True) if p.comm_s > 0 and o.measured("communication") > 0]
    if comm_runs:
        target = sum(o.measured("communication") for o in comm_runs)
        n = _root(lambda x: sum(o.predictor.parts(_network_scaled(hw, x)).comm_s for o in comm_runs) - target,
                  "network_efficiency", notes)
    else:
        notes.append("network_efficiency: no run with communication (more than one device) to refit it from; "
                     "left unchanged")
    timed = [(o, p) for o, p in zip(use, before, strict=True)
             if math.isfinite(o.record.median_step_time_s) and math.isfinite(o.measured("busy"))]
    idle = sum(max(0.0, o.record.median_step_time_s - o.measured("busy")) for o, _ in timed)
    ops = sum(p.n_ops for _, p in timed)
    reserves = [r for o, p in zip(use, before, strict=True) if math.isfinite(r := _reserve_bytes(hw, o, p.peak_bytes))]
    reserve = min(max(0.0, max(reserves)), hw.hbm_bytes - 1.0) if reserves else math.nan

    when = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    text = (f"calibrated by trainplan calibrate on {len(use)} accelerator run(s) "
            f"({label or ', '.join(o.run_dir for o in use)}), {when}")
    fields: dict[str, Any] = {}
    sources: dict[str, str] = {}
    _scale(hw, fields, sources, text, eff_field="matmul_efficiency", factor=c, fallback=("peak_flops_per_s",))
    _scale(hw, fields, sources, text, eff_field="memory_efficiency", factor=m, fallback=("hbm_bandwidth_bytes_per_s",))
    _scale(hw, fields, sources, text, eff_field="network_efficiency", factor=n,
           fallback=("intra_node_bandwidth_bytes_per_s", "inter_node_bandwidth_bytes_per_s"))
    if ops > 0:
        fields["op_overhead_s"] = _sig(idle / ops)
        sources["op_overhead_s"] = _source(hw.sources.get("op_overhead_s", ""),
                                           f"{text}: (wall - busy device time) / ops = {idle:.4g} s / {ops:.4g}")
    if math.isfinite(reserve):
        fields["memory_reserve_bytes"] = round(reserve)
        sources["memory_reserve_bytes"] = _source(
            hw.sources.get("memory_reserve_bytes", ""),
            f"{text}: largest of (hbm - exposed) + (used - reserved) + (max reserved - predicted peak)")
    else:
        notes.append("memory_reserve_bytes: the allocator's peaks were not recorded; left unchanged")
    if ops <= 0:
        notes.append("op_overhead_s: no run with timed steps and a busy time; left unchanged")
    new = hw.with_calibration(sources=sources, **fields)
    rows = tuple(GpuRow(run_dir=o.run_dir, before=b, after=o.predictor.parts(new, memory=True), measured={
        "wall": o.record.median_step_time_s, **{k: o.measured(k) for k in ("matmul", "other", "communication", "busy")},
        "allocated": o.record.max_allocated_bytes, "reserved": o.record.max_reserved_bytes})
        for o, b in zip(use, before, strict=True))
    return GpuFit(profile=new, compute=c, memory=m, network=n, fields=tuple(fields), rows=rows, notes=tuple(notes))


def format_gpu_fit(fit: GpuFit, path: Any = None) -> str:
    """The before/after table `trainplan calibrate` prints for the GPU refit."""
    out = [f"{fit.profile.name} profile (accelerator runs): compute x{fit.compute:.4g}, memory x{fit.memory:.4g}, "
           f"network x{fit.network:.4g}; refit {', '.join(fit.fields)}"]
    for r in fit.rows:
        out.append(f"  {r.run_dir}")
        out.append(f"    {'':<16}{'measured':>11}{'before':>11}{'after':>11}")
        for kind, attr in (("step (wall)", "step_s"), ("matmul", "matmul_s"), ("other", "other_s"),
                           ("communication", "comm_s")):
            key = "wall" if kind == "step (wall)" else kind
            out.append(f"    {kind:<16}{r.measured[key]:>10.4g}s{getattr(r.before, attr):>10.4g}s"
                       f"{getattr(r.after, attr):>10.4g}s")
        out.append(f"    {'peak, GiB':<16}{r.measured['allocated'] / 2**30:>11.4g}{r.before.peak_bytes / 2**30:>11.4g}"
                   f"{r.after.peak_bytes / 2**30:>11.4g}   (allocated; reserved {r.measured['reserved'] / 2**30:.4g})")
    out.append(f"  memory_reserve_bytes {fit.profile.memory_reserve_bytes:,}; "
               f"op_overhead_s {fit.profile.op_overhead_s:.4g}")
    if path is not None:
        out.append(f"  profile written to {path}: plan with --hw {path}")
    out += [f"note: {n}" for n in fit.notes]
    return "\n".join(out)


def observations_from_runs(runs: list[Any], hw: HardwareProfile, capture_model: Any, notes: list[str]
                           ) -> list[GpuObservation]:
    """The runs (`trainplan.executor.calibrate.runs.Run`) that can refit `hw`: run on an accelerator of its
    device type, with a kernel time split, their model a preset `capture_model` captures again
    (`trainplan.executor.calibrate.step_time.CaptureModel`). The others get a line in `notes` (appended to),
    except runs on a cpu (the cpu refit's, `trainplan.executor.calibrate.step_time`, notes those)."""
    from trainplan.executor.calibrate.step_time import StepTimePredictor

    captures: dict = {}
    out = []
    for run in runs:
        rec = run.record
        kind = rec.device.split(" ")[0].split(":")[0]
        if kind == "cpu":  # the cpu refit's (trainplan.executor.calibrate.step_time), which notes the others
            continue
        if kind != hw.device_type:
            notes.append(f"{run.dir}: ran on {rec.device!r}, not a {hw.device_type!r} device like {hw.name!r}; "
                         "not used for its refit")
            continue
        if not rec.kernel_time_s:
            notes.append(f"{run.dir}: no kernel time split in record.json (runs of at least 6 steps on an "
                         "accelerator have one); not used for the GPU refit")
            continue
        pred = StepTimePredictor(run, captures, capture_model)
        if pred.captured is None:
            notes.append(f"{run.dir}: model {run.plan.model!r} is not a preset, so its step cannot be "
                         "re-predicted; not used for the GPU refit")
            continue
        if not rec.same_hardware:
            notes.append(f"{run.dir}: ran on {rec.device!r}, planned for {run.plan.hw!r}; its measurements "
                         f"refit {hw.name!r} all the same")
        graph, numels = pred.captured
        out.append(GpuObservation(run_dir=run.dir, predictor=PartsPredictor(graph, numels, pred.choice),
                                  record=rec))
    return out
