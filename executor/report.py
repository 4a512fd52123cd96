"""Prediction beside measurement: one table (`compare`), one figure (`plot_report`), one folder
(`report`, which also writes the self-contained `report.html` of `executor.html_report`).

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
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from executor.record import RunRecord
from hardware_profiles.errors import PlanMismatchError
from planner.plan import Plan

__all__ = ["COLUMNS", "MEMORY_CATEGORIES", "ReportFrames", "compare", "format_table",
           "format_value", "load_run", "loss_frame", "memory_frame", "plot_report", "report",
           "report_frames", "step_time_frame"]

COLUMNS = ("term", "predicted", "measured", "unit", "rel_err")
"""Columns of `compare`'s DataFrame, in order."""

MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
"""Per-category memory terms (MemTracker's categories; on CUDA only `total` is measured)."""

MIB = 2**20
"""Bytes per MiB (figure unit for memory)."""

LIMIT_SCALE = 3.0
"""Draw the usable-memory limit only when it is at most this many times the tallest bar."""

STEP_TIME_NOTE = "different hardware: times not compared"

CURVE_COLUMNS = ("curve", "step", "tokens", "loss", "lower", "upper")
"""Columns of the predicted loss curves (`executor.figures.predicted_loss_frame`)."""


def _num(x) -> float:
    """`x` as a float; NaN for None or a non-number."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


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
    `tokens` (all ranks), for a governed plan `stop_step` (the step the run is predicted to end
    at, its governor's cooldown included, vs the steps it ran), `final_loss` (nats/token, the
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
        rows.append(("stop_step", float(end), float(record.steps), "steps"))
    rows.append(("final_loss", _num(pred.final_loss if end is None else pred.predicted_end_loss),
                 _num(record.final_heldout_loss), "nats"))
    df = pd.DataFrame(rows, columns=list(COLUMNS[:4]))
    df["rel_err"] = [_rel_err(p, m) for p, m in zip(df["predicted"], df["measured"])]
    return df


# --- frames for the figure --------------------------------------------------------------------


def memory_frame(plan: Plan, record: RunRecord) -> pd.DataFrame:
    """Memory per device by category, in MiB.

    Columns `category, predicted_mib, measured_mib`; one row per category in
    `MEMORY_CATEGORIES` then `total`. A category the run did not measure has measured NaN
    (on CUDA every row but `total`); one the plan did not predict has predicted NaN.
    """
    cats = [*MEMORY_CATEGORIES, "total"]
    return pd.DataFrame({
        "category": cats,
        "predicted_mib": [_num(plan.predictions.memory_bytes.get(c)) / MIB for c in cats],
        "measured_mib": [_num(record.peak_memory_bytes.get(c)) / MIB for c in cats],
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
    order = [k for k in ("compute", "recompute", "communication") if k in breakdown]
    order += [k for k in breakdown if k not in order]
    rows = [("predicted", k, _num(breakdown[k])) for k in order]
    if not rows:
        rows = [("predicted", "total", _num(plan.predictions.step_time_s))]
    rows.append(("measured", "median", _num(record.median_step_time_s)))
    return pd.DataFrame(rows, columns=["source", "component", "seconds"])


def loss_frame(record: RunRecord) -> pd.DataFrame:
    """The loss curve, long format.

    Columns `step, split, loss, tokens`: `split == "train"` rows from `record.train_loss`
    (tokens NaN), `split == "heldout"` rows from `record.heldout_loss` (tokens seen so far).
    Loss in nats/token. Empty (with those columns) when nothing was recorded.
    """
    rows = [(int(s), "train", _num(loss), math.nan) for s, loss in record.train_loss]
    rows += [(int(s), "heldout", _num(loss), _num(tok)) for s, tok, loss in record.heldout_loss]
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
    """Predicted loss curves (`executor.figures.predicted_loss_frame` rows): curve, step, tokens,
    loss, lower, upper. Empty when the law behind the plan is not known."""


def report_frames(plan: Plan, record: RunRecord, *,
                  predicted_loss: pd.DataFrame | None = None) -> ReportFrames:
    """The frames and annotations of the report figure (pure; no I/O). `predicted_loss`:
    curves from `executor.figures.plan_loss_curves` (which reads the local law file)."""
    loss = loss_frame(record)
    stop_step = record.steps
    if stop_step <= 0 and not loss.empty:
        stop_step = int(loss["step"].max())
    d = plan.decisions
    title = (f"{plan.model} on {plan.hw} x {d.devices} device{'s' if d.devices != 1 else ''}"
             f" (ran on {record.device}, world size {record.world_size})")
    return ReportFrames(
        memory=memory_frame(plan, record), step_time=step_time_frame(plan, record), loss=loss,
        title=title, memory_limit_mib=_num(plan.predictions.memory_limit_bytes) / MIB,
        same_hardware=bool(record.same_hardware),
        predicted_final_loss=_num(plan.predictions.final_loss), planned_steps=int(d.max_steps),
        stop_step=int(stop_step), stop_reason=record.stop_reason or "unknown",
        predicted_loss=(predicted_loss if predicted_loss is not None
                        else pd.DataFrame(columns=list(CURVE_COLUMNS))))


def _plot_memory(ax, frames: ReportFrames) -> None:
    mem, width = frames.memory, 0.4
    x = list(range(len(mem)))
    ax.bar([i - width / 2 for i in x], mem["predicted_mib"].fillna(0), width, label="predicted")
    measured = mem["measured_mib"]
    ax.bar([i + width / 2 for i, m in zip(x, measured) if pd.notna(m)],
           measured.dropna(), width, label="measured")
    ax.set_xticks(x, mem["category"], rotation=30, ha="right")
    ax.set_ylabel("MiB per device")
    ax.set_title("memory at peak")
    tallest = pd.concat([mem["predicted_mib"], measured]).max()
    limit = frames.memory_limit_mib
    if math.isfinite(limit) and pd.notna(tallest) and 0 < limit <= LIMIT_SCALE * tallest:
        ax.axhline(limit, color="black", linestyle=":", label=f"usable limit {limit:,.0f} MiB")
    ax.legend(fontsize="small")


def _plot_step_time(ax, frames: ReportFrames) -> None:
    st = frames.step_time
    bottom = 0.0
    for _, row in st[st["source"] == "predicted"].iterrows():
        ax.bar(0, row["seconds"], 0.6, bottom=bottom, label=f"predicted {row['component']}")
        bottom += row["seconds"] if pd.notna(row["seconds"]) else 0.0
    measured = st.loc[st["source"] == "measured", "seconds"]
    if not measured.empty and pd.notna(measured.iloc[0]):
        ax.bar(1, measured.iloc[0], 0.6, color="gray",
               hatch=None if frames.same_hardware else "//", label="measured median")
    ax.set_xticks([0, 1], ["predicted", "measured"])
    ax.set_ylabel("s per step")
    ax.set_title("step time" if frames.same_hardware else f"step time\n({STEP_TIME_NOTE})")
    top = max(bottom, measured.max() if not measured.empty else 0.0)
    if pd.notna(top) and top > 0:
        ax.set_ylim(0, 1.45 * top)  # room for the legend above the bars
    ax.legend(fontsize="small", loc="upper center", ncol=2)


def _plot_loss(ax, frames: ReportFrames) -> None:
    lf = frames.loss
    train, held = lf[lf["split"] == "train"], lf[lf["split"] == "heldout"]
    if not train.empty:
        ax.plot(train["step"], train["loss"], linewidth=0.7, label="train")
    if not held.empty:
        ax.plot(held["step"], held["loss"], "o", markersize=4, label="held-out")
    curves = frames.predicted_loss
    for i, (name, c) in enumerate(curves.groupby("curve", sort=False)):
        color = ("C3", "C4", "C5")[i % 3]
        ax.plot(c["step"], c["loss"], color=color, linewidth=1.2, label=f"predicted: {name}")
        ax.fill_between(c["step"], c["lower"], c["upper"], color=color, alpha=0.15, linewidth=0)
    if frames.planned_steps > 0:
        ax.axvline(frames.planned_steps, color="gray", linestyle="--", linewidth=0.8,
                   label=f"planned budget: {frames.planned_steps} steps")
    if math.isfinite(frames.predicted_final_loss):
        ax.axhline(frames.predicted_final_loss, color="C3", linestyle="--", linewidth=1,
                   label=f"predicted final {frames.predicted_final_loss:.3f}"
                         f" (step {frames.planned_steps})")
        ax.plot([frames.planned_steps], [frames.predicted_final_loss], "*", color="C3",
                markersize=9)
    if frames.stop_step > 0:
        ax.axvline(frames.stop_step, color="black", linewidth=0.8,
                   label=f"stop at step {frames.stop_step}: {frames.stop_reason}")
    if lf.empty:
        ax.text(0.5, 0.5, "no loss recorded", transform=ax.transAxes, ha="center")
    _loss_ylim(ax, frames)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("loss")
    ax.legend(fontsize="small")


def _loss_ylim(ax, frames: ReportFrames) -> None:
    """Fit the y axis to the measured losses, the predicted final loss and the curves' ends:
    a law's curve starts far above any measurement and would flatten the rest."""
    curves = frames.predicted_loss
    ends = curves.groupby("curve", sort=False).tail(1)
    values = pd.concat([frames.loss["loss"], ends["lower"], ends["upper"],
                        pd.Series([frames.predicted_final_loss])]).astype(float)
    values = values[values.map(math.isfinite)]
    if len(values) and not curves.empty:
        lo, hi = float(values.min()), float(values.max())
        pad = 0.08 * (hi - lo) if hi > lo else 0.1 * abs(hi) or 1.0
        ax.set_ylim(lo - pad, hi + pad)


def plot_report(frames: ReportFrames) -> Figure:
    """Three panels: memory by category, step time, loss curve. Returns an unattached Figure
    (no pyplot state; save it with `fig.savefig`)."""
    fig = Figure(figsize=(16, 5), layout="constrained")
    axes = fig.subplots(1, 3)
    _plot_memory(axes[0], frames)
    _plot_step_time(axes[1], frames)
    _plot_loss(axes[2], frames)
    fig.suptitle(frames.title)
    return fig


# --- files ------------------------------------------------------------------------------------


def report(plan: Plan, record: RunRecord, out: str | Path, *,
           cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Write the report into the folder `out` (created if needed).

    Files: `comparison.csv` (`compare`'s table), `plan.json`, `record.json`, `report.png`
    (`plot_report`), `report.html` (self-contained: verdict per term, the plan's decisions and
    every figure embedded; `executor.html_report`) and `summary.json` (the verdicts).
    Returns their paths under the keys `comparison`, `plan`, `record`, `figure`, `html`,
    `summary`. `cache_dir` is the trainplan cache root read for the local loss law and the
    calibration history (default $TRAINPLAN_CACHE_DIR, else ~/.cache/trainplan); a
    `frontier.csv` in `out` adds the Pareto frontier figure.
    Raises OSError when `out` cannot be written.
    """
    import matplotlib

    from executor.figures import plan_loss_curves
    from executor.html_report import write_run_report

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
        except (OSError, UnicodeDecodeError, ValueError) as e:
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
                         + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])])

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, body)])
