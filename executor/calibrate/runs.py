"""The runs `trainplan calibrate` refits from: loading and checking run folders.

A run folder is what `trainplan.executor.train.run` wrote: `plan.json` and `record.json`, read by
`trainplan.executor.reporting.report.load_run`. The refits (`trainplan.executor.calibrate.law`,
`trainplan.executor.calibrate.step_time`, `trainplan.executor.calibrate.bits`) take the loaded `Run`s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainplan.errors import TrainplanError
from trainplan.executor.record import RunRecord
from trainplan.executor.reporting.report import load_run
from trainplan.planner.plan import Plan

__all__ = ["MIN_TIMED_STEPS", "Run", "check_timed_steps", "load_run_folder", "rms"]

MIN_TIMED_STEPS = 3
"""Timed steps a cpu run needs before its step time calibrates the cpu profile: the first two
are warm-up (`RunRecord.median_step_time_s` skips them), so at least one more."""


@dataclass(frozen=True, slots=True)
class Run:
    """One finished run to calibrate on: its folder (as given), plan and record."""

    dir: str
    plan: Plan
    record: RunRecord


def load_run_folder(run_dir: str | Path) -> Run:
    """The run in `run_dir`.

    Raises:
        TrainplanError: the folder is missing or not a folder, or has no `plan.json` or no
            `record.json` (named in the message).
        PlanMismatchError: a file is unreadable or not a trainplan plan/record (`load_run`).
    """
    p = Path(run_dir)
    if not p.is_dir():
        raise TrainplanError(f"run folder {str(p)!r} does not exist or is not a folder; pass the "
                             f"--out folder of `trainplan run` or `trainplan demo`")
    missing = [n for n in ("plan.json", "record.json") if not (p / n).is_file()]
    if missing:
        raise TrainplanError(f"run folder {str(p)!r} has no {' and no '.join(missing)}: not a "
                             f"finished trainplan run (`trainplan run` writes both)")
    plan, record = load_run(p)
    return Run(str(p), plan, record)


def check_timed_steps(runs: list[Run]) -> None:
    """Refuse runs too short to time: a cpu run on this cpu with fewer than MIN_TIMED_STEPS
    timed steps would rewrite the profile from warm-up steps alone (or from nothing).

    Raises:
        TrainplanError: names the run folder, its timed steps and the steps needed.
    """
    for run in runs:
        rec = run.record
        n = len(rec.step_times_s)
        if rec.same_hardware and run.plan.hw == "cpu" and n < MIN_TIMED_STEPS:
            raise TrainplanError(
                f"run folder {run.dir!r} has {n} timed step{'s' if n != 1 else ''}; calibrating "
                f"the cpu profile needs runs of at least {MIN_TIMED_STEPS} (the first "
                f"{MIN_TIMED_STEPS - 1} are warm-up): train longer, or leave this run out. "
                "Nothing was written")


def rms(x: np.ndarray) -> float:
    """Root mean square of `x` (relative or log errors over the runs' points, or residuals in
    nats); NaN when `x` is empty."""
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else math.nan
