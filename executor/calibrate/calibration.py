"""`trainplan calibrate RUN_DIR...`: refit the local cpu profile, an accelerator's profile and
the loss law from real runs.

Four refits, each from what `trainplan.executor.train.run` wrote into a run folder (`plan.json`,
`record.json`, loaded and checked by `trainplan.executor.calibrate.runs`):

**Step time** (runs with `record.same_hardware` planned for `cpu` only): see
`trainplan.executor.calibrate.step_time` (ratio or two-factor fit of the cpu profile's throughput).

**Accelerator profile** (runs on CUDA/ROCm with a kernel time split): see
`trainplan.executor.calibrate.gpu` (matmul, memory and network efficiencies, per-op overhead and memory
reserve). The profile refit is the runs' plan's (`--hw` to name another, or a profile file);
it is written as a profile file (`trainplan.hardware_profiles.profile_file`), by default
`<first such run>/<name>-calibrated.toml`, for `--hw FILE`.

**Loss law** per (model, vocabulary size): L(D) = E + B / D**beta fitted to the runs' held-out
curves, see `trainplan.executor.calibrate.law`. The law is written to `<cache>/laws/<model>-v<vocab_size>.json`
with its points and residuals (`trainplan.costmodels.loss.cache`); `trainplan.planner.api.solve` uses it for the cpu
profile.

**Bits penalties** (`trainplan.executor.calibrate.bits`): runs that differ only in their bits refit the
loss penalties of the lower-precision settings, stored with the law (`LossLaw.bits`); the law
itself is then fitted to the full-width runs.

Nothing is written unless every run folder loads and every law of a model with runs planned for
the cpu has enough points (for models run on accelerators only, a law without enough points is
left as it was, with a note: a short profiling run refits the profile alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainplan.costmodels.loss.bits import COMPONENTS, components
from trainplan.costmodels.loss.cache import save_local_law
from trainplan.errors import TrainplanError, UnknownNameError
from trainplan.executor.calibrate.bits import fit_bits_penalty
from trainplan.executor.calibrate.gpu import GpuFit, fit_gpu_profile, format_gpu_fit, observations_from_runs
from trainplan.executor.calibrate.law import LawFit, fit_law
from trainplan.executor.calibrate.runs import Run, check_timed_steps, load_run_folder
from trainplan.executor.calibrate.step_time import CaptureModel, StepTimeRow, calibrate_step_time
from trainplan.executor.reporting.figures import append_calibration_history
from trainplan.hardware_profiles import HardwareProfile
from trainplan.hardware_profiles import load as load_profile
from trainplan.hardware_profiles.cpu import save_profile
from trainplan.hardware_profiles.profile_file import write_profile_file

__all__ = ["CalibrationResult", "calibrate", "format_result"]


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
    """Where the calibrated cpu profile was written (None when unchanged)."""
    laws: tuple[LawFit, ...]
    """One fitted law per (model, vocab_size), with the file it was written to."""
    notes: tuple[str, ...]
    """Lines on runs left out of the step-time fit and on fits to doubt."""
    gpu: GpuFit | None = None
    """The accelerator profile's refit (`trainplan.executor.calibrate.gpu`); None when no run qualified."""
    gpu_profile_path: Path | None = None
    """Where the refit accelerator profile was written (None when none was)."""


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


def _gpu_base(runs: list[Run], hw: str | HardwareProfile | None) -> HardwareProfile | None:
    """The accelerator profile to refit: `hw` (a name, a profile file or a profile), else the
    plan's profile of the runs made on an accelerator; None when there is neither.

    Raises:
        TrainplanError: those runs were planned for different profiles, or for one read from a
            file (`trainplan.hardware_profiles.load` does not know its name): give `hw`.
    """
    if hw is not None:
        return load_profile(hw)
    planned = sorted({r.plan.hw for r in runs if not r.record.device.startswith("cpu") and r.plan.hw != "cpu"})
    if not planned:
        return None
    if len(planned) > 1:
        raise TrainplanError(f"the accelerator runs were planned for {', '.join(map(repr, planned))}: refit one "
                             "profile at a time (calibrate their runs apart), or name it with --hw")
    try:
        return load_profile(planned[0])
    except UnknownNameError:
        raise TrainplanError(f"the accelerator runs were planned for {planned[0]!r}, a profile read from a file: "
                             f"give that file with --hw FILE.toml to refit it") from None


def calibrate(run_dirs: list[str | Path], *, capture_model: CaptureModel, cache_dir: str | Path | None = None,
              verbose: bool = True, time_basis: str = "wall", hw: str | HardwareProfile | None = None,
              profile_out: str | Path | None = None) -> CalibrationResult:
    """Refit the local cpu profile (step time) and loss law(s) from real runs; see the module
    docstring for the method.

    Args:
        run_dirs: run folders, each with `plan.json` and `record.json`.
        capture_model: captures a preset's model to re-predict its step time
            (`trainplan.executor.calibrate.step_time.CaptureModel`; the command line passes
            `trainplan.planner.capture.setup.capture_model`).
        cache_dir: trainplan cache root for this call (cpu profile and laws); default
            `trainplan.hardware_profiles.cache.cache_root()`.
        verbose: print a before/after table.
        time_basis: "wall" (default: the median step's wall time) or "cpu" (its process CPU
            time, `RunRecord.step_cpu_times_s`: for one-thread runs on a machine other jobs
            share, the step without their load; benchmarks/accuracy.py uses it).
        hw: the accelerator profile to refit from the runs on an accelerator (a name, a path
            ending in .toml, or a profile); default: their plan's.
        profile_out: where to write the refit accelerator profile (TOML); default
            `<first run used>/<name>-calibrated.toml`.

    Writes the calibrated cpu profile (`trainplan.hardware_profiles.cpu.save_profile`, when some run was a
    cpu run on this cpu) and one law file per (model, vocab_size) (`trainplan.costmodels.loss.cache`).
    Loading the cpu profile measures the machine first if it has no cached profile (seconds).

    Raises:
        TrainplanError: no run folders; a folder missing, without plan.json/record.json or
            unreadable (named); fewer than `trainplan.executor.calibrate.law.MIN_POINTS` usable held-out
            points for a law (the message gives the count found and the count needed); a cpu run
            with fewer than `trainplan.executor.calibrate.runs.MIN_TIMED_STEPS` timed steps; accelerator
            runs planned for several profiles, or for a profile file, without `hw`; an unknown
            `hw` or a bad profile file. Nothing is written then.
        OutputPathError: the refit accelerator profile cannot be written to `profile_out`.
    """
    if time_basis not in ("wall", "cpu"):
        raise TrainplanError(f"time_basis={time_basis!r}: use 'wall' or 'cpu'")
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    if not run_dirs:
        raise TrainplanError("calibrate needs at least one run folder")
    runs = [load_run_folder(d) for d in run_dirs]
    check_timed_steps(runs)
    notes: list[str] = []
    base = _gpu_base(runs, hw)
    gpu = None
    if base is not None and base.device_type != "cpu":
        observations = observations_from_runs(runs, base, capture_model, notes)
        if observations:
            gpu = fit_gpu_profile(base, observations)
            notes += gpu.notes
        else:
            notes.append(f"no run refits the {base.name!r} profile (runs on a {base.device_type!r} device with a "
                         "kernel time split, their model a preset); it is unchanged")
    with _cache_env(cache_dir):
        groups: dict[tuple[str, int], list[Run]] = {}
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
            try:
                law, fit_record, fit = fit_law(*key, full or group)
            except TrainplanError as e:
                if any(r.plan.hw == "cpu" for r in group):
                    raise
                notes.append(f"{key[0]} v{key[1]}: loss law not refit ({e})")
                continue
            if bits is not None:
                law = dataclasses.replace(law, bits=bits)
                fit = dataclasses.replace(fit, law=law)
                fit_record = fit_record | {"bits": bits_record}
            fitted.append((key, law, fit_record, fit))
        step = calibrate_step_time(runs, notes, capture_model, time_basis)
        profile_path = gpu_path = None
        if gpu is not None:
            gpu_path = write_profile_file(
                gpu.profile, profile_out or Path(gpu.rows[0].run_dir) / f"{gpu.profile.name}-calibrated.toml",
                header=f"{gpu.profile.name} refit by trainplan calibrate from "
                       f"{', '.join(r.run_dir for r in gpu.rows)}.\n"
                       "Plan with it: trainplan solve --hw THIS-FILE.toml ...")
        if step.profile is not None:
            profile_path = save_profile(step.profile)
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
        step_time=step.rows, step_time_method=step.method, ratio=step.ratio,
        compute_scale=step.compute, memory_scale=step.memory, scaled_fields=step.fields,
        profile=step.profile, profile_path=profile_path, laws=tuple(laws), notes=tuple(notes), gpu=gpu,
        gpu_profile_path=gpu_path)
    _record_history(result, cache_dir)
    if verbose:
        print(format_result(result))
    return result


def _record_history(result: CalibrationResult, cache_dir) -> None:
    """Append this calibration's before/after errors to the history the HTML report plots."""
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
    elif result.gpu is None:
        out.append("step time: no run on this cpu planned for cpu; cpu profile unchanged")
    if result.gpu is not None:
        out.append(format_gpu_fit(dataclasses.replace(result.gpu, notes=()), result.gpu_profile_path))
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
            out.append("  bits penalties, nats: " + ", ".join(
                f"{c.removesuffix('_nats')} {getattr(law.bits, c):.4g}" for c in COMPONENTS))
        out.append(f"  written to {f.path}")
    out += [f"note: {n}" for n in result.notes]
    return "\n".join(out)
