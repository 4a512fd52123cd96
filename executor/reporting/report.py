"""Prediction beside measurement: one table (`compare`), one figure (`plot_report`), one folder
(`report`, which also writes the self-contained `report.html` of `executor.reporting.html`).

Units: memory in bytes (per device, tensor bytes at the peak; the figure shows MiB = 2**20 bytes),
FLOPs per step per device, time in seconds, tokens over all ranks, loss in nats/token.
`rel_err = (predicted - measured) / measured`, NaN when the measurement is 0, NaN or missing.

Times are compared only when the run's device is the plan's target (`RunRecord.same_hardware`);
bytes, FLOPs, tokens and loss are hardware-independent and always compared (DESIGN.md, Measuring).

The figure is built in two steps: pure functions turn a Plan and a RunRecord into DataFrames
(`memory_frame`, `step_time_frame`, `loss_frame`, gathered by `report_frames`), and
`plot_report` draws those frames. Tests check the frames, not pixels.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd

from executor.record import RunRecord

# The figure's frames and drawing live in executor.reporting.frames and executor.reporting.plots;
# every name stays importable from here.
from executor.reporting.frames import CURVE_COLUMNS as CURVE_COLUMNS
from executor.reporting.frames import (
    MEMORY_CATEGORIES,
    ReportFrames,
    _num,
    loss_frame,
    memory_frame,
    report_frames,
    step_time_frame,
)
from executor.reporting.frames import MIB as MIB
from executor.reporting.plots import LIMIT_SCALE as LIMIT_SCALE
from executor.reporting.plots import STEP_TIME_NOTE as STEP_TIME_NOTE
from executor.reporting.plots import _loss_ylim as _loss_ylim
from executor.reporting.plots import _plot_loss as _plot_loss
from executor.reporting.plots import _plot_memory as _plot_memory
from executor.reporting.plots import _plot_step_time as _plot_step_time
from executor.reporting.plots import plot_report
from planner.plan import Plan
from trainplan_errors import PlanMismatchError

__all__ = ["COLUMNS", "MEMORY_CATEGORIES", "ReportFrames", "compare", "format_table",
           "format_value", "load_run", "loss_frame", "memory_frame", "plot_report", "report",
           "report_frames", "step_time_frame"]

COLUMNS = ("term", "predicted", "measured", "unit", "rel_err")
"""Columns of `compare`'s DataFrame, in order."""


def _rel_err(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; NaN when measured is 0, NaN or infinite."""
    if not math.isfinite(measured) or measured == 0:
        return math.nan
    return (predicted - measured) / measured


def compare(plan: Plan, record: RunRecord) -> pd.DataFrame:
    """Prediction beside measurement, one row per term.

    Columns `term, predicted, measured, unit, rel_err`. Rows, in order:
    `memory_<category>` (bytes; only categories the record measured: on CUDA only the total),
    `peak_memory` (bytes, predicted total vs measured total), `flops_per_step` (FLOPs per device),
    `step_time` (s, predicted vs median measured after warm-up; if `record.same_hardware`),
    `tokens` (all ranks), for a governed plan `end_step` (the step the run is predicted to end
    at, its governor's cooldown included, vs the steps it ran; the predicted and decided stop
    themselves are in the plan and the run's governor.json), `final_loss` (nats/token, the
    last held-out loss; a governed plan predicts it at its predicted end step).
    A missing measurement is NaN ("not measured", not a miss); `rel_err` is NaN when the
    measurement is 0 or NaN. Runs too short for the fixed measured steps (`measure.measured_step`)
    leave a zero total peak, zero FLOPs or only warm-up step times: those are missing too.
    """
    pred, measured_mem = plan.predictions, record.peak_memory_bytes
    measured_total = _num(measured_mem.get("total")) or math.nan
    rows: list[tuple[str, float, float, str]] = [
        (f"memory_{cat}", _num(pred.memory_bytes.get(cat)), _num(measured_mem[cat]), "bytes")
        for cat in MEMORY_CATEGORIES if cat in measured_mem and measured_total > 0]
    rows.append(("peak_memory", _num(pred.memory_bytes.get("total")), measured_total, "bytes"))
    rows.append(("flops_per_step", _num(pred.flops_per_step), _num(record.flops_per_step) or math.nan,
                 "FLOPs"))
    if record.same_hardware:
        timed = _num(record.median_step_time_s) if len(record.step_times_s) > 2 else math.nan
        rows.append(("step_time", _num(pred.step_time_s), timed, "s"))
    end = getattr(pred, "predicted_end_step", None)  # a governed plan: where it ends, its loss there
    tokens = pred.total_tokens if end is None else end * pred.tokens_per_step
    rows.append(("tokens", _num(tokens), _num(record.tokens), "tokens"))
    if end is not None:
        rows.append(("end_step", float(end), float(record.steps), "steps"))
    rows.append(("final_loss", _num(pred.final_loss if end is None else pred.predicted_end_loss),
                 _num(record.final_heldout_loss), "nats"))
    df = pd.DataFrame(rows, columns=list(COLUMNS[:4]))
    df["rel_err"] = [_rel_err(p, m) for p, m in zip(df["predicted"], df["measured"], strict=False)]
    return df


# --- files ------------------------------------------------------------------------------------


def report(plan: Plan, record: RunRecord, out: str | Path, *,
           cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Write the report into the folder `out` (created if needed).

    Files: `comparison.csv` (`compare`'s table), `plan.json`, `record.json`, `report.png`
    (`plot_report`), `report.html` (self-contained: verdict per term, the plan's decisions and
    every figure embedded; `executor.reporting.html`) and `summary.json` (the verdicts).
    Returns their paths under the keys `comparison`, `plan`, `record`, `figure`, `html`,
    `summary`. `cache_dir` is the trainplan cache root read for the local loss law and the
    calibration history (default $TRAINPLAN_CACHE_DIR, else ~/.cache/trainplan); a
    `frontier.csv` in `out` adds the Pareto frontier figure.
    Raises OSError when `out` cannot be written.
    """
    import matplotlib

    from executor.reporting.figures import plan_loss_curves
    from executor.reporting.html import write_run_report

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


# --- text table -------------------------------------------------------------------------------


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def format_value(x, unit: str) -> str:
    x = _num(x)
    if math.isnan(x):
        return "-"
    if unit == "bytes":
        return _fmt_bytes(x)
    if unit == "FLOPs":
        return f"{x:.3e} FLOPs"
    if unit == "s":
        return f"{x * 1e3:.2f} ms" if abs(x) < 1 else f"{x:.3f} s"
    if unit == "tokens":
        return f"{x:,.0f} tokens"
    if unit == "nats":
        return f"{x:.4f} nats"
    return f"{x:.4g} {unit}".rstrip()


def format_table(df: pd.DataFrame) -> str:
    """`compare`'s DataFrame as an aligned text table for the terminal.

    Bytes in binary units (B, KiB, MiB, GiB, TiB), FLOPs in scientific notation, seconds as s
    or ms, tokens with thousands separators, loss in nats, rel_err as a signed percent;
    a missing value prints as `-`.

    Raises:
        ValueError: `df` lacks one of `compare`'s columns (named in the message).
    """
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"format_table needs columns {list(COLUMNS)}; missing {missing}")
    header = ("term", "predicted", "measured", "rel_err")
    body = [(str(r.term), format_value(r.predicted, r.unit), format_value(r.measured, r.unit),
             "-" if math.isnan(_num(r.rel_err)) else f"{_num(r.rel_err):+.1%}")
            for r in df.itertuples(index=False)]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells) -> str:
        return "  ".join([cells[0].ljust(widths[0])]
                         + [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=False)])

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, body)])
