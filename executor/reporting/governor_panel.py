"""The report's governor panel: the held-out loss a run measured beside the governor's last fit,
its band and the stop (`curve_frame`, a DataFrame), drawn on a matplotlib Axes (`plot_governor`).
The fit is `trainplan.costmodels.stopping.curve.CurveFit`; the summary is
`trainplan.costmodels.stopping.rule.Governor.summary`."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from trainplan.costmodels.stopping.curve import CurveFit


def curve_frame(heldout_loss: Iterable[tuple], summary: dict, *, max_steps: int,
                points: int = 200):
    """The report's governor panel as a DataFrame: columns `steps`, `measured` (held-out loss,
    NaN between evaluations), `predicted`, `lower`, `upper` (the last fit and its central
    `summary["confidence"]` band, from its first fitted step on; NaN before and without a fit),
    from 1 to `max_steps` steps.

    `heldout_loss`: `RunRecord.heldout_loss` rows (steps, [tokens,] loss); `summary`:
    `Governor.summary()`. Pure: no file reads, no plotting."""
    grid = np.unique(np.concatenate([np.linspace(1, max_steps, points).round(),
                                     [float(r[0]) for r in heldout_loss]])).astype(int)
    measured = {int(r[0]): float(r[-1]) for r in heldout_loss}
    frame = pd.DataFrame({"steps": grid, "measured": [measured.get(int(s), np.nan) for s in grid]})
    fit = summary.get("fit")
    if fit:
        f = CurveFit.from_dict(fit)
        keep = grid >= f.t_min
        frame["predicted"] = np.where(keep, f.loss_at(grid), np.nan)
        lo, hi = f.band(grid, summary.get("confidence", 0.9))
        frame["lower"], frame["upper"] = np.where(keep, lo, np.nan), np.where(keep, hi, np.nan)
    else:
        frame["predicted"] = frame["lower"] = frame["upper"] = np.nan
    return frame


def plot_governor(ax, frame, summary: dict, *, max_steps: int,
                  final_losses: dict[str, tuple[int, float]] | None = None,
                  predicted_label: str = "predicted stop") -> None:
    """Draw `curve_frame` on a matplotlib Axes: the measured held-out loss, the fitted curve with
    its band, the planned budget, the stop decision, the actual stop and the predicted stop
    (`summary["predicted_stop_step"]`); `final_losses` adds labelled markers, e.g.
    {"governed run": (225, 6.23), "budget run out": (400, 6.52)} (steps, nats/token);
    `predicted_label` names the predicted stop's line (e.g. "predicted stop (plan)" when
    `summary["predicted_stop_step"]` is the plan's prediction rather than the fit's)."""
    m = frame.dropna(subset=["measured"])
    ax.plot(m["steps"], m["measured"], "o", ms=3, color="C0", label="held-out loss (measured)")
    if frame["predicted"].notna().any():
        ax.plot(frame["steps"], frame["predicted"], "-", color="C1", label="fitted curve")
        ax.fill_between(frame["steps"], frame["lower"], frame["upper"], color="C1", alpha=0.25,
                        label=f"{summary.get('confidence', 0.9):.0%} band")
    ax.axvline(max_steps, color="k", ls="-", lw=1, label=f"planned budget ({max_steps} steps)")
    marks = (("cooldown_start", "C3", "--", "stop decided"), ("final_step", "C3", "-", "actual stop"),
             ("predicted_stop_step", "C2", ":", predicted_label))
    for key, color, ls, label in marks:
        v = summary.get(key)
        if v is not None and v < max_steps:
            ax.axvline(v, color=color, ls=ls, lw=1, label=f"{label} ({v})")
    for i, (label, (steps, loss)) in enumerate((final_losses or {}).items()):
        ax.plot([steps], [loss], marker="**D"[i % 3], ms=11, ls="none", color=f"C{4 + i}",
                label=f"{label}: {loss:.3f} at step {steps}")
    ys = m["measured"]
    if len(ys):
        top = float(np.nanmax(np.concatenate([frame["upper"].dropna(), ys.iloc[len(ys) // 10:]])))
        span = max(top - float(ys.min()), 1e-3)
        ax.set_ylim(float(ys.min()) - 0.1 * span, top + 0.1 * span)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
