"""The governor benchmark's figure (`benchmarks/governor.py`): one seed's held-out losses, the
plan's predicted curve and band, budget, predicted and decided stops, final losses; and the
predicted against the decided stop step."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainplan.executor.record import RunRecord


def figure(base_plan, base: RunRecord, runs: list[tuple], curve, rows: list[dict], path: Path,
           seed: int) -> None:
    from matplotlib.figure import Figure

    d = base_plan.decisions
    n = d.max_steps
    c = curve.for_run(tokens_per_step=base_plan.predictions.tokens_per_step,
                      unique_tokens=base_plan.data_tokens * d.data_fraction)
    fig = Figure(figsize=(13, 6.5))
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ax.plot([r[0] for r in base.heldout_loss], [r[-1] for r in base.heldout_loss], "-", color="0.55",
            lw=1.2, label=f"budget run out: {base.final_heldout_loss:.3f} at {base.steps}")
    s = np.arange(max(d.warmup_steps, 1), n + 1)
    lo, hi = c.band(s, 0.9)
    ax.plot(s, c.loss_with_early(s), "--", color="k", lw=1, label="plan's predicted curve (pilots)")
    ax.fill_between(s, np.maximum(lo, 0), hi, color="k", alpha=0.1, label="90% band of its fit")
    for i, ((thr, rec, _summary), row) in enumerate(zip(runs, rows, strict=False)):
        col = f"C{i}"
        ax.plot([r[0] for r in rec.heldout_loss], [r[-1] for r in rec.heldout_loss], "-", color=col, lw=1,
                label=f"governed {thr:g}: stop {row['stop_step_decided']} (predicted "
                      f"{row['stop_step_predicted']}), end {rec.steps}, {rec.final_heldout_loss:.3f}")
        ax.axvline(row["stop_step_predicted"], color=col, ls=":", lw=1)
        ax.axvline(row["stop_step_decided"], color=col, ls="--", lw=1)
        ax.plot([rec.steps], [rec.final_heldout_loss], "D", color=col, ms=6)
        bx.errorbar([row["stop_step_decided"]], [row["stop_step_predicted"]], fmt="o", color=col,
                    yerr=[[row["stop_step_predicted"] - row["stop_step_predicted_q25"]],
                          [row["stop_step_predicted_q75"] - row["stop_step_predicted"]]],
                    label=f"{thr:g} nats/step: {row['stop_step_rel_err']:.0%}")
    ax.axvline(n, color="k", lw=1, label=f"planned budget ({n} steps)")
    ys = [r[-1] for r in base.heldout_loss if r[0] >= 2 * d.warmup_steps]
    ax.set_ylim(min(ys) - 0.15, max(ys) + 0.1)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("dotted: predicted stop, dashed: decided stop, diamond: final loss", fontsize="small")
    ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
    top = max(max(r["stop_step_decided"], r["stop_step_predicted_q75"]) for r in rows) * 1.15
    xs = np.array([0, top])
    bx.plot(xs, xs, "k-", lw=1, label="predicted = decided")
    bx.fill_between(xs, 0.85 * xs, 1.15 * xs, color="C2", alpha=0.15, label="within 15%")
    bx.set_xlim(0, top)
    bx.set_ylim(0, top)
    bx.set_xlabel("stop step decided by the governor (live run)")
    bx.set_ylabel("stop step predicted by the plan (median, quartiles)")
    bx.legend(fontsize="small", loc="upper left")
    fig.suptitle(f"governor: tiny-llama, {d.data_fraction:g} of the corpus, {n}-step budget, seed {seed}",
                 fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
