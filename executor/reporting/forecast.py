"""The run as its own pilot, as the executor records it and the report shows it: the online
forecast of the final held-out loss (`trainplan.costmodels.loss.online`) made after each held-out
evaluation (`online_forecast`, kept in `RunRecord.loss_forecast`), the forecasts made at 10%,
30% and 50% of the planned steps beside the measured end (`forecast_rows`, rows of
`trainplan.executor.reporting.compare.compare`), and the figure (`forecast_figure`).
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from trainplan.costmodels.loss.cache import law_from_fields
from trainplan.costmodels.loss.online import FORECAST_FRACTIONS, cooldown_start, forecast_final_loss
from trainplan.executor.record import RunRecord
from trainplan.planner.plan import Plan

__all__ = ["forecast_at", "forecast_figure", "forecast_inputs", "forecast_rows", "forecast_term", "online_forecast",
           "replay_forecast"]

MAX_GAIN = 0.95
"""Largest cooldown gain used (the pilots' fit bounds gamma there, `fit_pilot_law`)."""


def forecast_inputs(plan: Plan, cooldown_gain: float | None = None) -> tuple[float, float | None]:
    """(floor_nats, cooldown_gain) of the plan's law for `forecast_final_loss`: the floor E + A /
    N^alpha of `Predictions.loss_law` (nats/token; a local law has A = 0, its E is the published
    floor the pilots pinned), and the cooldown gain: `cooldown_gain` when given, else the law's
    (`LossLaw.cooldown_gain`, the pilots' gamma), else the pilots' gamma in
    `Predictions.loss_calibration["fit"]` (plans whose law predates the field), else None (no
    pilots: not measured, `trainplan.costmodels.loss.online.UNKNOWN_GAIN_RANGE`). A plan without a
    recorded law: floor 0 (capped by the forecast at 0.9 of the run's lowest loss)."""
    p = plan.predictions
    floor, gain = 0.0, 0.0
    if p.loss_law:
        law = law_from_fields(p.loss_law)
        floor = law.E + (law.A / float(plan.law_n_params) ** law.alpha if law.A else 0.0)
        gain = law.cooldown_gain
    if cooldown_gain is not None:
        gain = cooldown_gain
    elif not gain:
        gamma = (p.loss_calibration or {}).get("fit", {}).get("gamma")
        if not (isinstance(gamma, int | float) and math.isfinite(gamma)):
            return floor, None
        gain = float(gamma)
    return floor, min(max(float(gain), 0.0), MAX_GAIN)


def online_forecast(plan: Plan, record: RunRecord, cooldown_gain: float | None = None
                    ) -> tuple[int, float, float] | None:
    """(steps done, forecast final held-out loss, band half-width), nats/token, at the record's
    latest step, or None while the run has too few points (`forecast_final_loss`).
    `cooldown_gain`: as `forecast_inputs`."""
    floor, gain = forecast_inputs(plan, cooldown_gain)
    d = plan.decisions
    f = forecast_final_loss(record.train_loss, record.heldout_loss, step=record.steps, max_steps=d.max_steps,
                            warmup_steps=d.warmup_steps, floor_nats=floor, cooldown_gain=gain)
    return None if f is None else (f.step, f.final_loss, f.band_nats)


def forecast_at(record: RunRecord, max_steps: int, frac: float) -> tuple[int, float, float] | None:
    """The latest forecast the run made at or before `frac` of `max_steps` steps, or None."""
    made = [tuple(f) for f in record.loss_forecast if f[0] <= frac * max_steps]
    return made[-1] if made else None  # type: ignore[return-value]


def replay_forecast(plan: Plan, record: RunRecord, frac: float, cooldown_gain: float | None = None
                    ) -> tuple[int, float, float] | None:
    """The forecast the run made (or, for a record written before `RunRecord.loss_forecast`, would
    have made) at its latest held-out evaluation at or before `frac` of the planned steps: the
    record cut there and `online_forecast` applied, the same inputs the executor had then.
    `cooldown_gain`: as `forecast_inputs` (the benchmarks give the calibration's gamma for plans
    whose law predates `LossLaw.cooldown_gain`)."""
    d = plan.decisions
    evals = [h for h in record.heldout_loss if h[0] <= frac * d.max_steps]
    if not evals:
        return None
    at = int(evals[-1][0])
    cut = RunRecord(model=record.model, hw_planned=record.hw_planned, device=record.device,
                    same_hardware=record.same_hardware, steps=at, heldout_loss=evals,
                    train_loss=[t for t in record.train_loss if t[0] < at])
    return online_forecast(plan, cut, cooldown_gain)


def forecast_term(frac: float) -> str:
    """The `compare` term of the forecast at `frac`: `final_loss_at_30pct` for 0.3."""
    return f"final_loss_at_{round(100 * frac)}pct"


def forecast_rows(plan: Plan, record: RunRecord) -> list[tuple[str, float, float, str]]:
    """`compare` rows (term, forecast, measured final held-out loss, "nats") for each of
    `FORECAST_FRACTIONS`, for a run that made forecasts and finished its planned steps without a
    governor (the forecast is of the loss at `max_steps`); a fraction with no forecast yet has a
    NaN forecast. No rows for other runs."""
    d = plan.decisions
    measured = record.final_heldout_loss
    if (plan.predictions.predicted_end_step is not None or record.steps != d.max_steps or not record.loss_forecast
            or record.stop_reason not in ("", "budget") or not math.isfinite(measured)):
        return []  # ("": every step done, the record not closed yet: the trackers' final scalars)
    rows = []
    for frac in FORECAST_FRACTIONS:
        made = forecast_at(record, d.max_steps, frac)
        rows.append((forecast_term(frac), math.nan if made is None else float(made[1]), measured, "nats"))
    return rows


def forecast_figure(plan: Plan, record: RunRecord) -> Figure:
    """The forecast final loss against the step it was made at, with its band; the measured
    held-out losses; the planned end, the cooldown's start and (when the run finished) the
    measured final loss; the plan's own prediction made before the run."""
    fig = Figure(figsize=(8, 4.2), layout="constrained")
    ax = fig.subplots()
    d = plan.decisions
    limits = [plan.predictions.final_loss, record.final_heldout_loss]
    if record.loss_forecast:
        s, y, b = (list(c) for c in zip(*record.loss_forecast, strict=True))
        low, high = [v - w for v, w in zip(y, b, strict=True)], [v + w for v, w in zip(y, b, strict=True)]
        ax.fill_between(s, low, high, alpha=0.25, color="C1", label="forecast band")
        ax.plot(s, y, "-", color="C1", label="forecast of the final loss")
        limits += low + high
    if record.heldout_loss:
        ax.plot([h[0] for h in record.heldout_loss], [h[2] for h in record.heldout_loss], "o", ms=3, color="C0",
                label="held-out loss (measured)")
    if math.isfinite(plan.predictions.final_loss):
        ax.axhline(plan.predictions.final_loss, ls=":", color="C2", label="plan's prediction (before the run)")
    if record.steps == d.max_steps and math.isfinite(record.final_heldout_loss):
        ax.axhline(record.final_heldout_loss, ls="--", color="k", lw=1, label="measured final loss")
    ax.axvline(cooldown_start(d.max_steps), ls="-.", color="grey", lw=1, label="cooldown starts")
    for frac in FORECAST_FRACTIONS:
        ax.axvline(frac * d.max_steps, color="grey", lw=0.5, alpha=0.5)
    ax.set_xlim(0, d.max_steps)
    if finite := [v for v in limits if math.isfinite(v)]:  # the forecasts, not the early held-out losses
        lo, hi = min(finite), max(finite)
        pad = 0.15 * (hi - lo) or 0.05
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlabel("optimizer steps done")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=8)
    return fig
