"""Reuse of finished benchmark runs (`--reuse` of benchmarks/bits.py and benchmarks/governor.py)."""

from __future__ import annotations

from pathlib import Path


def reusable_record(plan, run_dir: Path, reasons: tuple[str, ...] = ("budget",)):
    """The `RunRecord` of the run in `run_dir` when it ran `plan`'s decisions and ended for one
    of `reasons` (a finished run), else None (missing, unreadable or different: run it again)."""
    from trainplan.errors import TrainplanError
    from trainplan.executor.reporting.report import load_run

    try:
        old, rec = load_run(run_dir)[:2]
    except TrainplanError:
        return None
    return rec if old.decisions == plan.decisions and rec.stop_reason in reasons else None
