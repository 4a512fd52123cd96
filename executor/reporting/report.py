"""One run's report folder (`report`), a folder comparing runs (`compare_runs`), and reading a run
folder back (`load_run`).

`report` writes `compare`'s table (`trainplan.executor.reporting.compare`), the plan and the record, the
figure (`trainplan.executor.reporting.frames` turns a Plan and a RunRecord into DataFrames,
`trainplan.executor.reporting.plots` draws them; tests check the frames, not pixels) and the self-contained
`report.html` of `trainplan.executor.reporting.html` with the verdicts of `trainplan.executor.reporting.verdicts`.

Units: memory in bytes (per device, tensor bytes at the peak; the figure shows MiB = 2**20 bytes),
FLOPs per step per device, time in seconds, tokens over all ranks, loss in nats/token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib
import pandas as pd

from trainplan.errors import PlanMismatchError
from trainplan.executor.record import RunRecord
from trainplan.executor.reporting.compare import compare
from trainplan.executor.reporting.figures import plan_loss_curves
from trainplan.executor.reporting.frames import report_frames
from trainplan.executor.reporting.html import write_run_report, write_runs_report
from trainplan.executor.reporting.plots import plot_report
from trainplan.executor.reporting.verdicts import TOLERANCES, is_bound_plan, summary_line, verdict_frame
from trainplan.planner.plan import Plan

__all__ = ["compare_runs", "load_run", "report"]


def report(plan: Plan, record: RunRecord, out: str | Path, *,
           cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Write the report into the folder `out` (created if needed).

    Files: `comparison.csv` (`compare`'s table), `plan.json`, `record.json`, `report.png`
    (`plot_report`), `report.html` (self-contained: verdict per term, the plan's decisions and
    every figure embedded; `trainplan.executor.reporting.html`) and `summary.json` (the verdicts).
    Returns their paths under the keys `comparison`, `plan`, `record`, `figure`, `html`,
    `summary`. `cache_dir` is the trainplan cache root read for the local loss law and the
    calibration history (default `trainplan.hardware_profiles.cache.cache_root()`); a
    `frontier.csv` in `out` adds the Pareto frontier figure.
    Raises OSError when `out` cannot be written.
    """
    if "matplotlib.pyplot" not in sys.modules:  # switching under a live pyplot closes its figures
        matplotlib.use("Agg")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"comparison": out / "comparison.csv", "plan": out / "plan.json",
             "record": out / "record.json", "figure": out / "report.png"}
    compare(plan, record).to_csv(paths["comparison"], index=False)
    plan.to_json(paths["plan"])
    record.to_json(paths["record"])
    frames = report_frames(plan, record, predicted_loss=plan_loss_curves(plan, cache_dir))
    plot_report(frames).savefig(paths["figure"], dpi=110, metadata={"Software": None})
    paths.update(write_run_report(plan, record, out, frames=frames, cache_dir=cache_dir))
    return paths


def load_run(run_dir: str | Path) -> tuple[Plan, RunRecord]:
    """Read `plan.json` and `record.json` from a run (or report) folder.

    Raises:
        PlanMismatchError: the folder or a file is missing, unreadable, not JSON, or not a
            trainplan plan/record; the message names the path.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlanMismatchError(f"run folder {str(run_dir)!r} does not exist or is not a folder")
    texts = {}
    for name in ("plan.json", "record.json"):
        path = run_dir / name
        try:
            texts[name] = path.read_text()
            if not isinstance(json.loads(texts[name]), dict):
                raise ValueError("not a JSON object")
        except OSError as e:
            raise PlanMismatchError(f"cannot read {str(path)!r}: {e.strerror}; is {str(run_dir)!r} the "
                                    "--out folder of `trainplan run` or `trainplan demo`?") from None
        except (UnicodeDecodeError, ValueError) as e:
            raise PlanMismatchError(f"cannot read {str(path)!r}: {e}") from None
    try:
        plan = Plan.from_json(texts["plan.json"])
    except PlanMismatchError as e:
        raise PlanMismatchError(f"{str(run_dir / 'plan.json')!r}: {e}") from None
    try:
        record = RunRecord.from_json(texts["record.json"])
    except (TypeError, ValueError, KeyError) as e:
        raise PlanMismatchError(
            f"{str(run_dir / 'record.json')!r} is not a trainplan run record: {e}") from None
    return plan, record


def _run_labels(run_dirs: list[Path]) -> list[str]:
    names = [p.resolve().name or str(p) for p in run_dirs]
    return names if len(set(names)) == len(names) else [str(p) for p in run_dirs]


def compare_runs(run_dirs: list[str | Path], out: str | Path, *, rebuild: bool = True,
                 cache_dir: str | Path | None = None) -> dict[str, Path]:
    """A report comparing runs: `report.html` (`trainplan.executor.reporting.html.write_runs_report`),
    `comparison.csv` (one row per run and term, with tolerance and verdict) and `summary.json`
    (each run's verdict line) in `out`.

    With `rebuild`, each run's own report is rewritten first (`report`).
    Returns the paths under `html`, `comparison`, `summary`.

    Raises:
        PlanMismatchError: a run folder cannot be read (`load_run`; the message names it).
    """
    dirs = [Path(p) for p in run_dirs]
    runs = [load_run(p) for p in dirs]  # fail before writing anything
    labels = _run_labels(dirs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    verdicts, overview = [], []
    for label, run_dir, (plan, record) in zip(labels, dirs, runs, strict=False):
        if rebuild:
            report(plan, record, run_dir, cache_dir=cache_dir)
        v = verdict_frame(compare(plan, record), run=label, bound=is_bound_plan(plan))
        verdicts.append(v)
        overview.append((label, run_dir, plan, record, summary_line(v, record.same_hardware)))
    allv = pd.concat(verdicts, ignore_index=True)
    paths = {"html": out / "report.html", "comparison": out / "comparison.csv",
             "summary": out / "summary.json"}
    allv.to_csv(paths["comparison"], index=False)
    paths["summary"].write_text(json.dumps(
        {"runs": [{"run": label, "dir": str(d.resolve()), "summary": line}
                  for label, d, _, _, line in overview], "tolerances": TOLERANCES},
        indent=2, allow_nan=False) + "\n")
    paths["html"] = write_runs_report(overview, allv, out)
    return paths
