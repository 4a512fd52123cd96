"""The report figure: `plot_report` draws `ReportFrames` (`trainplan.executor.reporting.frames`) as three
panels, memory by category (`plot_memory`), step time (`plot_step_time`) and the loss curve
(`plot_loss`), on an unattached matplotlib Figure; the HTML report (`trainplan.executor.reporting.html`) draws
each panel on its own. Tests check the frames, not pixels.
"""

from __future__ import annotations

import math

import pandas as pd
from matplotlib.figure import Figure

from trainplan.executor.reporting.frames import ReportFrames

__all__ = ["LIMIT_SCALE", "STEP_TIME_NOTE", "plot_loss", "plot_memory", "plot_report", "plot_step_time"]

LIMIT_SCALE = 3.0
"""Draw the usable-memory limit only when it is at most this many times the tallest bar."""

STEP_TIME_NOTE = "different hardware: times not compared"
"""The step-time panel's note when the run's device is not the plan's (`RunRecord.same_hardware`)."""


def plot_memory(ax, frames: ReportFrames) -> None:
    """Draw the memory panel on the matplotlib Axes `ax`: predicted beside measured MiB per device
    by category (`ReportFrames.memory`), with the usable limit when it is within `LIMIT_SCALE`
    times the tallest bar."""
    mem, width = frames.memory, 0.4
    x = list(range(len(mem)))
    ax.bar([i - width / 2 for i in x], mem["predicted_mib"].fillna(0), width, label="predicted")
    measured = mem["measured_mib"]
    ax.bar([i + width / 2 for i, m in zip(x, measured, strict=False) if pd.notna(m)],
           measured.dropna(), width, label="measured")
    ax.set_xticks(x, mem["category"], rotation=30, ha="right")
    ax.set_ylabel("MiB per device")
    ax.set_title("memory at peak")
    tallest = pd.concat([mem["predicted_mib"], measured]).max()
    limit = frames.memory_limit_mib
    if math.isfinite(limit) and pd.notna(tallest) and 0 < limit <= LIMIT_SCALE * tallest:
        ax.axhline(limit, color="black", linestyle=":", label=f"usable limit {limit:,.0f} MiB")
    ax.legend(fontsize="small")


def plot_step_time(ax, frames: ReportFrames) -> None:
    """Draw the step-time panel on `ax`: the predicted components stacked (seconds per step)
    beside the measured median, hatched and noted (`STEP_TIME_NOTE`) on other hardware."""
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


def plot_loss(ax, frames: ReportFrames) -> None:
    """Draw the loss panel on `ax` (nats/token against steps): train and held-out loss as
    measured, the predicted curves with their bands, the planned budget with the predicted final
    loss, and the step the run stopped at with its reason."""
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
    plot_memory(axes[0], frames)
    plot_step_time(axes[1], frames)
    plot_loss(axes[2], frames)
    fig.suptitle(frames.title)
    return fig
