"""The report figure's data: pure functions from a Plan and a RunRecord to DataFrames
(`memory_frame`, `step_time_frame`, `loss_frame`), gathered with the figure's annotations into
`ReportFrames` by `report_frames`. No I/O and no drawing (`trainplan.executor.reporting.plots` draws them).

Memory in MiB = 2**20 bytes per device, time in seconds, loss in nats/token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from trainplan.executor.record import RunRecord
from trainplan.planner.plan import Plan

__all__ = ["CURVE_COLUMNS", "MEMORY_CATEGORIES", "MIB", "ReportFrames", "float_or_nan", "loss_frame",
           "memory_frame", "report_frames", "step_time_frame"]

MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
"""Per-category memory terms (MemTracker's categories; on CUDA only `total` is measured)."""

MIB = 2**20
"""Bytes per MiB (figure unit for memory)."""

CURVE_COLUMNS = ("curve", "step", "tokens", "loss", "lower", "upper")
"""Columns of the predicted loss curves (`trainplan.executor.reporting.figures.predicted_loss_frame`)."""


def float_or_nan(x) -> float:
    """`x` as a float; NaN for None or a non-number (a term the plan or the run does not have)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def memory_frame(plan: Plan, record: RunRecord) -> pd.DataFrame:
    """Memory per device by category, in MiB.

    Columns `category, predicted_mib, measured_mib`; one row per category in
    `MEMORY_CATEGORIES` then `total`. A category the run did not measure has measured NaN
    (on CUDA every row but `total`); one the plan did not predict has predicted NaN.
    """
    cats = [*MEMORY_CATEGORIES, "total"]
    return pd.DataFrame({
        "category": cats,
        "predicted_mib": [float_or_nan(plan.predictions.memory_bytes.get(c)) / MIB for c in cats],
        "measured_mib": [float_or_nan(record.peak_memory_bytes.get(c)) / MIB for c in cats],
    })


def step_time_frame(plan: Plan, record: RunRecord) -> pd.DataFrame:
    """Step time in seconds, predicted by component beside the measured median.

    Columns `source, component, seconds`. `source == "predicted"` rows are the plan's
    `step_time_breakdown_s` (compute, recompute, communication, in that order, then any other
    key); a single `total` row when the breakdown is empty. One `source == "measured"` row,
    component `median` (median step wall time after warm-up; NaN when no step was timed).
    Whether the two are comparable is `RunRecord.same_hardware`, not part of this frame.
    """
    breakdown = dict(plan.predictions.step_time_breakdown_s)
    order: list[str] = [k for k in ("compute", "recompute", "communication") if k in breakdown]
    order += [k for k in breakdown if k not in order]
    rows: list[tuple[str, str, float]] = [("predicted", k, float_or_nan(breakdown[k])) for k in order]
    if not rows:
        rows = [("predicted", "total", float_or_nan(plan.predictions.step_time_s))]
    rows.append(("measured", "median", float_or_nan(record.median_step_time_s)))
    return pd.DataFrame(rows, columns=["source", "component", "seconds"])


def loss_frame(record: RunRecord) -> pd.DataFrame:
    """The loss curve, long format.

    Columns `step, split, loss, tokens`: `split == "train"` rows from `record.train_loss`
    (tokens NaN), `split == "heldout"` rows from `record.heldout_loss` (tokens seen so far).
    Loss in nats/token. Empty (with those columns) when nothing was recorded.
    """
    rows = [(int(s), "train", float_or_nan(loss), math.nan) for s, loss in record.train_loss]
    rows += [(int(s), "heldout", float_or_nan(loss), float_or_nan(tok)) for s, tok, loss in record.heldout_loss]
    df = pd.DataFrame(rows, columns=["step", "split", "loss", "tokens"])
    return df.astype({"step": "int64", "split": "object", "loss": "float64", "tokens": "float64"})


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportFrames:
    """Everything `plot_report` draws: three frames and the scalars that annotate them."""

    memory: pd.DataFrame
    """`memory_frame`: category, predicted_mib, measured_mib."""
    step_time: pd.DataFrame
    """`step_time_frame`: source, component, seconds."""
    loss: pd.DataFrame
    """`loss_frame`: step, split, loss, tokens."""
    title: str
    memory_limit_mib: float
    """Usable memory per device (MiB), `Predictions.memory_limit_bytes`."""
    same_hardware: bool
    """False: the step-time panel says times are not compared."""
    predicted_final_loss: float
    """nats/token."""
    planned_steps: int
    """`Decisions.max_steps`: where the predicted final loss is placed."""
    stop_step: int
    """Steps the run took (its last step)."""
    stop_reason: str
    predicted_loss: pd.DataFrame = field(
        default_factory=lambda: pd.DataFrame(columns=list(CURVE_COLUMNS)))
    """Predicted loss curves (`trainplan.executor.reporting.figures.predicted_loss_frame` rows): curve, step, tokens,
    loss, lower, upper. Empty when the law behind the plan is not known."""


def report_frames(plan: Plan, record: RunRecord, *,
                  predicted_loss: pd.DataFrame | None = None) -> ReportFrames:
    """The frames and annotations of the report figure (pure; no I/O). `predicted_loss`:
    curves from `trainplan.executor.reporting.figures.plan_loss_curves` (which reads the local law file)."""
    loss = loss_frame(record)
    stop_step = record.steps
    if stop_step <= 0 and not loss.empty:
        stop_step = int(loss["step"].max())
    d = plan.decisions
    title = (f"{plan.model} on {plan.hw} x {d.devices} device{'s' if d.devices != 1 else ''}"
             f" (ran on {record.device}, world size {record.world_size})")
    return ReportFrames(
        memory=memory_frame(plan, record), step_time=step_time_frame(plan, record), loss=loss,
        title=title, memory_limit_mib=float_or_nan(plan.predictions.memory_limit_bytes) / MIB,
        same_hardware=bool(record.same_hardware),
        predicted_final_loss=float_or_nan(plan.predictions.final_loss), planned_steps=int(d.max_steps),
        stop_step=int(stop_step), stop_reason=record.stop_reason or "unknown",
        predicted_loss=(predicted_loss if predicted_loss is not None
                        else pd.DataFrame(columns=list(CURVE_COLUMNS))))
