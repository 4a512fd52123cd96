"""Prediction beside measurement: one table (`compare`) and its text for the terminal
(`format_table`, `format_value`).

Units: memory in bytes (per device, tensor bytes at the peak), FLOPs per step per device, time in
seconds, tokens over all ranks, loss in nats/token. `rel_err = (predicted - measured) / measured`,
NaN when the measurement is 0, NaN or missing.

Times are compared only when the run's device is the plan's target (`RunRecord.same_hardware`);
bytes, FLOPs, tokens and loss are hardware-independent and always compared (DESIGN.md, Measuring).
Whether each prediction held is `trainplan.executor.reporting.verdicts`.
"""

from __future__ import annotations

import math

import pandas as pd

from trainplan.costmodels.loss.cache import law_from_fields
from trainplan.costmodels.loss.planned import run_loss
from trainplan.executor.record import RunRecord
from trainplan.executor.reporting.forecast import forecast_rows
from trainplan.executor.reporting.frames import MEMORY_CATEGORIES, float_or_nan
from trainplan.planner.plan import Plan

__all__ = ["COLUMNS", "compare", "format_table", "format_value", "loss_at_steps"]

COLUMNS = ("term", "predicted", "measured", "unit", "rel_err")
"""Columns of `compare`'s DataFrame, in order."""
GOVERNOR_STOPS = ("marginal_gain",)
"""Stop reasons of a run its compute governor ended: a stop the plan meant, not a run cut short."""


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
    last held-out loss; a governed plan predicts it at its predicted end step), and for a run
    that finished its planned steps without a governor `final_loss_at_10pct`, `_30pct`, `_50pct`
    (the run's own forecast of its final loss made at that share of the steps,
    `trainplan.executor.reporting.forecast.forecast_rows`).
    A run that stopped before the plan's end (interrupted, a wall-clock budget, a user's own loop
    left early; not a governed plan, nor a stop of its governor, `GOVERNOR_STOPS`) gets a `steps`
    row (planned, run), and its `tokens` and `final_loss` are predicted at the steps it ran
    (`loss_at_steps`), not at the plan's end (issue #40, item 10: 10 of 2,305 steps once read
    "tokens off by +22950%").
    A missing measurement is NaN ("not measured", not a miss); `rel_err` is NaN when the
    measurement is 0 or NaN. Runs too short for the fixed measured steps (`measure.measured_step`)
    leave a zero total peak, zero FLOPs or only warm-up step times: those are missing too.
    """
    pred, measured_mem = plan.predictions, record.peak_memory_bytes
    measured_total = float_or_nan(measured_mem.get("total")) or math.nan
    rows: list[tuple[str, float, float, str]] = [
        (f"memory_{cat}", float_or_nan(pred.memory_bytes.get(cat)), float_or_nan(measured_mem[cat]), "bytes")
        for cat in MEMORY_CATEGORIES if cat in measured_mem and measured_total > 0]
    rows.append(("peak_memory", float_or_nan(pred.memory_bytes.get("total")), measured_total, "bytes"))
    rows.append(("flops_per_step", float_or_nan(pred.flops_per_step),
                 float_or_nan(record.flops_per_step) or math.nan, "FLOPs"))
    if record.same_hardware:
        timed = float_or_nan(record.median_step_time_s) if len(record.step_times_s) > 2 else math.nan
        rows.append(("step_time", float_or_nan(pred.step_time_s), timed, "s"))
    end = getattr(pred, "predicted_end_step", None)  # a governed plan: where it ends, its loss there
    steps = plan.decisions.max_steps
    # stopped before the plan's end, not by its governor (see below)
    # (a record still running, no stop reason yet, is compared with the plan's end)
    cut = (end is None and 0 < record.steps < steps and bool(record.stop_reason)
           and record.stop_reason not in GOVERNOR_STOPS)
    tokens = pred.total_tokens if end is None else end * pred.tokens_per_step
    loss = pred.final_loss if end is None else pred.predicted_end_loss
    if cut:
        rows.append(("steps", float(steps), float(record.steps), "steps"))
        tokens, loss = record.steps * pred.tokens_per_step, loss_at_steps(plan, record.steps)
    rows.append(("tokens", float_or_nan(tokens), float_or_nan(record.tokens), "tokens"))
    if end is not None:
        rows.append(("end_step", float(end), float(record.steps), "steps"))
    rows.append(("final_loss", float_or_nan(loss), float_or_nan(record.final_heldout_loss), "nats"))
    rows += forecast_rows(plan, record)
    df = pd.DataFrame(rows, columns=list(COLUMNS[:4]))
    df["rel_err"] = [_rel_err(p, m) for p, m in zip(df["predicted"], df["measured"], strict=False)]
    return df


def loss_at_steps(plan: Plan, steps: int) -> float:
    """The plan's predicted final loss (nats/token) moved to a run of `steps` optimizer steps:
    `Predictions.final_loss` plus the difference of the plan's own law (`Predictions.loss_law`,
    `trainplan.costmodels.loss.planned.run_loss`, same batch, warmup and unique tokens) between
    `steps` and the planned `max_steps`, so the plan's data-quality and bits terms carry over.
    The law describes a finished run (its cooldown included); a run stopped at `steps` never
    cooled down, so it is expected at or above this. NaN for a plan without a recorded law."""
    d, p = plan.decisions, plan.predictions
    if not p.loss_law or not math.isfinite(p.final_loss):
        return math.nan
    law = law_from_fields(p.loss_law)
    unique = max(1.0, d.data_fraction * plan.data_tokens) if plan.data_tokens else None
    def at(k: int) -> float:
        return run_loss(law, plan.law_n_params, steps=k, tokens_per_step=p.tokens_per_step, unique_tokens=unique,
                        warmup_steps=d.warmup_steps)

    return p.final_loss + at(steps) - at(d.max_steps)


# --- text table -------------------------------------------------------------------------------


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def format_value(x, unit: str) -> str:
    """One value of `compare`'s table in its unit, as `format_table` prints it: bytes in binary
    units (B, KiB, MiB, GiB, TiB), FLOPs in scientific notation, seconds as s or ms, tokens with
    thousands separators, loss in nats; `-` for a missing value."""
    x = float_or_nan(x)
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
             "-" if math.isnan(float_or_nan(r.rel_err)) else f"{float_or_nan(r.rel_err):+.1%}")
            for r in df.itertuples(index=False)]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells) -> str:
        return "  ".join([cells[0].ljust(widths[0])]
                         + [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=False)])

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, body)])
