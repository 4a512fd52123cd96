"""The report's extra figures, each built from a DataFrame by a pure function (tests check the
frames and the plotted data, not pixels), plus the few readers that find their inputs.

- `rank_memory_frame` / `rank_memory_figure`: peak memory per rank, predicted vs measured.
- `predicted_loss_frame` (pure) and `plan_loss_curves` (reads the local law file): the predicted
  loss curve with a band, drawn on the loss panel of `trainplan.executor.reporting.plots`.
- `read_governor_summary` / `governor_figure`: a governed run's held-out loss with the
  governor's fitted curve and band, the planned budget, the predicted and the actual stop.
- `frontier_frame` / `frontier_figure`: the Pareto frontier of plans with the chosen one marked,
  from a run folder's `frontier.csv` (written by the planner when it computes a frontier).
- `append_calibration_history` / `read_calibration_history` / `calibration_figure`: prediction
  error before and after each calibration, kept in `<cache root>/calibration_history.csv`.
- `error_figure`: rel_err per term (one or several runs) against each term's tolerance.
- `png_bytes`: a Figure as PNG bytes, without the PNG's software/URL metadata.

Units: memory in MiB (2**20 bytes) on the axes, loss in nats/token, errors in percent.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import math
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from trainplan.costmodels.loss.bits import bits_loss_penalty
from trainplan.costmodels.loss.cache import law_path, load_local_law, read_local_law_file
from trainplan.costmodels.loss.law import LossLaw, learning_curve
from trainplan.executor.record import RunRecord
from trainplan.executor.reporting.frames import MIB
from trainplan.executor.reporting.governor_panel import curve_frame, plot_governor
from trainplan.hardware_profiles.cache import cache_root
from trainplan.planner.plan import Plan

__all__ = ["CALIBRATION_COLUMNS", "CALIBRATION_HISTORY", "LOSS_BAND_REL", "append_calibration_history",
           "calibration_figure", "calibration_history_path", "error_figure", "frontier_figure",
           "frontier_frame", "governor_figure", "pct_text", "plan_loss_curves", "png_bytes",
           "predicted_loss_frame", "rank_memory_figure", "rank_memory_frame",
           "read_calibration_history", "read_governor_summary"]

GIB = 2**30
"""Bytes per GiB (the frontier figure's memory unit)."""

LOSS_BAND_REL = 0.02
"""Half-width of the predicted loss band, as a fraction of the loss, when the law carries no
fit residuals (a published law)."""

CURVE_POINTS = 200
"""Steps sampled along a predicted loss curve."""

CALIBRATION_HISTORY = "calibration_history.csv"
"""File name of the calibration history under the trainplan cache root."""

CALIBRATION_COLUMNS = ("date", "term", "rel_err_before", "rel_err_after")
"""Columns of the calibration history; rel_err = (predicted - measured) / measured."""

PLAN_LAW_PREFIX = "loss law: "
"""How `trainplan.planner.api` names the plan's loss law in `Plan.notes`."""


def png_bytes(fig: Figure, dpi: int = 100) -> bytes:
    """`fig` as PNG bytes; the `Software` text chunk (which holds matplotlib's URL) is left out."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


# --- memory per rank --------------------------------------------------------------------------


def rank_memory_frame(plan: Plan, record: RunRecord) -> pd.DataFrame:
    """Peak memory per rank in MiB: columns `rank, predicted_mib, measured_mib`.

    The plan predicts one device's total, so `predicted_mib` is the same on every rank;
    `measured_mib` is `record.per_rank_peak_bytes[rank]`. Empty when no rank was measured.
    """
    pred = float(plan.predictions.memory_bytes.get("total", math.nan)) / MIB
    measured = [float(b) / MIB for b in record.per_rank_peak_bytes]
    return pd.DataFrame({"rank": list(range(len(measured))), "predicted_mib": [pred] * len(measured),
                         "measured_mib": measured}).astype({"rank": "int64", "predicted_mib": "float64",
                                                            "measured_mib": "float64"})


def rank_memory_figure(frame: pd.DataFrame) -> Figure:
    """Grouped bars per rank: predicted total beside measured peak (`rank_memory_frame`), each
    measured bar labelled with the prediction's rel_err on that rank."""
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.subplots()
    x, w = frame["rank"].to_numpy(), 0.4
    ax.bar(x - w / 2, frame["predicted_mib"], w, label="predicted total")
    bars = ax.bar(x + w / 2, frame["measured_mib"], w, label="measured peak")
    errs = (frame["predicted_mib"] - frame["measured_mib"]) / frame["measured_mib"]
    ax.bar_label(bars, [f"rel_err {pct_text(e)}" for e in errs], fontsize="small")
    ax.set_xticks(x, [f"rank {r}" for r in x])
    ax.set_ylabel("MiB per device")
    ax.set_title("peak memory per rank")
    ax.legend(fontsize="small", loc="lower right")
    return fig


# --- predicted loss curve ---------------------------------------------------------------------


def predicted_loss_frame(plan: Plan, law: LossLaw, *, label: str, band_nats: float | None = None,
                         band_rel: float = LOSS_BAND_REL, points: int = CURVE_POINTS) -> pd.DataFrame:
    """The loss `law` predicts along the plan's run, from step 1 to `Decisions.max_steps`.

    Columns `curve, step, tokens, loss, lower, upper` (loss in nats/token; `curve` is `label` on
    every row). Same formula as the planner: `learning_curve` on tokens = step x tokens per step
    with the run's unique data (data_tokens x data_fraction, Muennighoff et al. 2023 eq. 5), plus
    `bits_loss_penalty` of its bits (the law's fitted penalties, if any). The band is loss +-
    `band_nats` when given (e.g. the law fit's RMS residual), else loss x (1 +- `band_rel`).
    """
    d, p = plan.decisions, plan.predictions
    steps = np.unique(np.linspace(1, max(1, d.max_steps), min(points, max(1, d.max_steps))).round())
    tokens = steps * max(1, p.tokens_per_step)
    unique = max(1.0, float(plan.data_tokens) * float(d.data_fraction))
    loss = learning_curve(tokens, law=law, n_params=plan.law_n_params, unique_tokens=unique)
    loss = loss + bits_loss_penalty(d.optimizer_bits, d.activation_bits, precision=d.precision,
                                    penalty=law.bits)
    half = np.full_like(loss, band_nats) if band_nats is not None else np.abs(loss) * band_rel
    return pd.DataFrame({"curve": label, "step": steps.astype("int64"), "tokens": tokens,
                         "loss": loss, "lower": loss - half, "upper": loss + half})


def _plan_law_source(plan: Plan) -> str:
    return next((n[len(PLAN_LAW_PREFIX):] for n in plan.notes if n.startswith(PLAN_LAW_PREFIX)), "")


def plan_loss_curves(plan: Plan, cache_dir: str | Path | None = None) -> pd.DataFrame:
    """Predicted loss curves for the report's loss panel (`predicted_loss_frame` rows, concatenated;
    empty when no law is known). Reads the local law file, so not pure.

    The plan stores its law's source, not its constants. When that source is one of the
    published laws (`LossLaw.besiroglu2024`, `hoffmann2022`) the plan's curve is redrawn exactly,
    +- `LOSS_BAND_REL`. When a local law exists for (model, vocab_size)
    (`trainplan.costmodels.loss.cache.load_local_law`) its curve is drawn too, +- its fit's RMS residual
    (else +- `LOSS_BAND_REL`), labelled as the plan's law or as one fitted after the plan.
    """
    source = _plan_law_source(plan)
    curves = []
    published = {law.source: law for law in (LossLaw.besiroglu2024(), LossLaw.hoffmann2022())}
    if source in published:
        curves.append(predicted_loss_frame(plan, published[source], label=(
            f"plan's law (published), ±{LOSS_BAND_REL:.0%}")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            local = load_local_law(plan.model, plan.vocab_size, cache_dir)
        except Exception:  # a bad model name or vocab: no local law to draw
            local = None
    if local is not None:
        rms = None
        try:
            fit = read_local_law_file(law_path(plan.model, plan.vocab_size, cache_dir)).get("fit", {})
            rms = float(fit["rms_residual_nats"]) if math.isfinite(fit["rms_residual_nats"]) else None
        except Exception:  # no residuals stored: relative band
            pass
        band = f"±{rms:.3f} nats (1 RMS residual)" if rms is not None else f"±{LOSS_BAND_REL:.0%}"
        whose = "plan's law (local fit)" if local.source == source else "local law, fitted after the plan"
        curves.append(predicted_loss_frame(plan, local, label=f"{whose}, {band}", band_nats=rms))
    if not curves:
        return pd.DataFrame(columns=["curve", "step", "tokens", "loss", "lower", "upper"])
    return pd.concat(curves, ignore_index=True)


# --- the governor ---------------------------------------------------------------------------


def read_governor_summary(run_dir: str | Path) -> dict | None:
    """The run's `governor.json` (`trainplan.executor.governor.GovernedLoop.write`), or None when the run
    had no governor or the file cannot be read."""
    try:
        summary = json.loads((Path(run_dir) / "governor.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def governor_figure(plan: Plan, record: RunRecord, summary: dict) -> Figure:
    """The governed run's loss figure: held-out loss as measured, the governor's last fitted
    curve with its band, the planned budget, the stop decision, the actual stop and the plan's
    predicted stop (`Predictions.predicted_stop_step`; the fit's own when the plan has none),
    with the predicted and the actual final loss marked at their steps.

    `summary`: `read_governor_summary` of the run's folder."""
    d, p = plan.decisions, plan.predictions
    planned = getattr(p, "predicted_stop_step", None)
    s = dict(summary) | ({"predicted_stop_step": planned} if planned is not None else {})
    finals: dict[str, tuple[int, float]] = {}
    if math.isfinite(record.final_heldout_loss):
        finals[f"actual end ({record.stop_reason or 'running'})"] = (record.steps,
                                                                     record.final_heldout_loss)
    if p.predicted_end_step is not None and p.predicted_end_loss is not None:
        finals["predicted end (plan)"] = (p.predicted_end_step, p.predicted_end_loss)
    fig = Figure(figsize=(8, 6), layout="constrained")
    ax = fig.subplots()
    plot_governor(ax, curve_frame(record.heldout_loss, s, max_steps=d.max_steps), s,
                  max_steps=d.max_steps, final_losses=finals,
                  predicted_label="predicted stop (plan)" if planned is not None else "predicted stop (fit)")
    ax.set_title(f"compute governor: threshold {d.governor_threshold:.3g} nats/step, "
                 f"stop: {s.get('reason') or 'none'}")
    return fig


# --- Pareto frontier --------------------------------------------------------------------------


def frontier_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """Normalise a frontier table for `frontier_figure`.

    Input columns: `memory_bytes`, `cost_device_hours` or `time_s`, `loss` (nats/token),
    `chosen` (bool; the plan that was picked). Output columns `memory_gib, cost, cost_label,
    loss, chosen`, sorted by cost; `cost_label` names the cost axis with its unit.

    Raises:
        ValueError: a required column is missing (named in the message).
    """
    cost_col = next((c for c in ("cost_device_hours", "time_s") if c in frame.columns), None)
    missing = [c for c in ("memory_bytes", "loss", "chosen") if c not in frame.columns]
    if cost_col is None:
        missing.append("cost_device_hours or time_s")
    if missing:
        raise ValueError(f"frontier frame lacks columns {missing}; has {list(frame.columns)}")
    chosen = frame["chosen"].map(lambda v: str(v).strip().lower() in ("true", "1", "yes"))
    out = pd.DataFrame({
        "memory_gib": frame["memory_bytes"].astype(float) / GIB,
        "cost": frame[cost_col].astype(float),
        "cost_label": "device-hours" if cost_col == "cost_device_hours" else "time (s)",
        "loss": frame["loss"].astype(float),
        "chosen": chosen.astype(bool),
    })
    return out.sort_values("cost", kind="stable").reset_index(drop=True)


def frontier_figure(frame: pd.DataFrame) -> Figure:
    """Two panels of the frontier (`frontier_frame`'s input or output): predicted loss against
    cost, and against peak memory per device. Frontier points are joined in cost order; the
    chosen plan is a red star in both panels."""
    f = frame if "memory_gib" in frame.columns else frontier_frame(frame)
    fig = Figure(figsize=(11, 4), layout="constrained")
    axes = fig.subplots(1, 2)
    label = f["cost_label"].iloc[0] if len(f) else "cost"
    for ax, x, xlabel in ((axes[0], "cost", label), (axes[1], "memory_gib", "GiB per device")):
        ax.plot(f[x], f["loss"], "o-" if x == "cost" else "o", color="C0", markersize=4,
                label="frontier plans")
        pick = f[f["chosen"]]
        ax.plot(pick[x], pick["loss"], "*", color="C3", markersize=14, label="chosen plan")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("predicted loss (nats/token)")
        ax.legend(fontsize="small")
    axes[0].set_title("loss vs cost")
    axes[1].set_title("loss vs memory")
    fig.suptitle("Pareto frontier (predicted)")
    return fig


# --- calibration history ----------------------------------------------------------------------


def calibration_history_path(cache_dir: str | Path | None = None) -> Path:
    """`<cache root>/calibration_history.csv` (cache root: `cache_dir`, else
    `trainplan.hardware_profiles.cache.cache_root()`)."""
    return cache_root(cache_dir) / CALIBRATION_HISTORY


def append_calibration_history(rows: Iterable[Mapping], cache_dir: str | Path | None = None) -> Path:
    """Append calibration outcomes to the history file; returns its path.

    Each row is a mapping with `term` (e.g. `step_time`, `final_loss`), `rel_err_before` and
    `rel_err_after` (prediction error of that term on the calibration runs with the old and the
    new constants, (predicted - measured) / measured) and optionally `date` (ISO 8601; default
    now, UTC). For `trainplan.executor.calibrate.calibration` to call after a refit.

    Raises:
        ValueError: a row lacks `term`, `rel_err_before` or `rel_err_after`.
    """
    now = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    records = []
    for i, row in enumerate(rows):
        missing = [c for c in CALIBRATION_COLUMNS[1:] if c not in row]
        if missing:
            raise ValueError(f"calibration history row {i} lacks {missing}: {dict(row)}")
        records.append({"date": str(row.get("date") or now), "term": str(row["term"]),
                        "rel_err_before": float(row["rel_err_before"]),
                        "rel_err_after": float(row["rel_err_after"])})
    path = calibration_history_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(records, columns=list(CALIBRATION_COLUMNS)).to_csv(
        path, mode="a", header=not path.exists() or path.stat().st_size == 0, index=False)
    return path


def read_calibration_history(cache_dir: str | Path | None = None) -> pd.DataFrame | None:
    """The history as a DataFrame (`CALIBRATION_COLUMNS`, in file order), or None when there is
    no file, it cannot be read, lacks a column or is empty."""
    path = calibration_history_path(cache_dir)
    try:
        df = pd.read_csv(path)
    except (OSError, ValueError, pd.errors.ParserError):
        return None
    if df.empty or any(c not in df.columns for c in CALIBRATION_COLUMNS):
        return None
    return df[list(CALIBRATION_COLUMNS)].reset_index(drop=True)


def calibration_figure(frame: pd.DataFrame) -> Figure:
    """|prediction error| in percent per calibration, one panel per term: an open circle before,
    a filled one after, joined by a line. x is the calibration's order (labelled by date)."""
    terms = list(dict.fromkeys(frame["term"]))
    fig = Figure(figsize=(5 * max(1, len(terms)), 3.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, max(1, len(terms))))
    for ax, term in zip(axes, terms, strict=False):
        t = frame[frame["term"] == term].reset_index(drop=True)
        x = np.arange(len(t))
        before = 100 * t["rel_err_before"].abs().to_numpy(dtype=float)
        after = 100 * t["rel_err_after"].abs().to_numpy(dtype=float)
        ax.vlines(x, np.minimum(before, after), np.maximum(before, after), color="gray", linewidth=1)
        ax.plot(x, before, "o", markerfacecolor="none", color="C3", label="before")
        ax.plot(x, after, "o", color="C2", label="after")
        ax.set_xticks(x, [str(d)[:10] for d in t["date"]], rotation=30, ha="right")
        ax.set_ylabel("|rel_err| (%)")
        ax.set_ylim(bottom=0)
        ax.set_title(term)
        ax.legend(fontsize="small")
    fig.suptitle("calibration history: prediction error before and after each calibration")
    return fig


# --- error per term ---------------------------------------------------------------------------


def error_figure(frame: pd.DataFrame) -> Figure:
    """Horizontal bars of rel_err (percent, symmetric-log axis) per term, one bar per run.

    `frame` has columns `run, term, label, rel_err, tolerance, verdict`
    (`trainplan.executor.reporting.verdicts.verdict_frame`). The green band around 0 is each term's tolerance.
    One run: bars green when held, red when not; several runs: one colour per run, not-held bars
    hatched. Each bar is annotated with its value; a term without a finite rel_err reads its
    verdict (`not measured`, or `exact (0)` for a held prediction of 0).
    """
    terms = list(dict.fromkeys(frame["term"]))
    runs = list(dict.fromkeys(frame["run"]))
    labels = dict(zip(frame["term"], frame["label"], strict=False))
    tol = dict(zip(frame["term"], frame["tolerance"], strict=False))
    fig = Figure(figsize=(9, 0.9 + len(terms) * (0.32 + 0.22 * len(runs))), layout="constrained")
    ax = fig.subplots()
    h = 0.8 / max(1, len(runs))
    finite = frame["rel_err"].abs().replace([np.inf], np.nan).dropna()
    reach = max(5.0, 150 * float(finite.max()) if len(finite) else 5.0)
    for i, term in enumerate(terms):
        y0 = len(terms) - 1 - i
        ax.fill_between([-100 * tol[term], 100 * tol[term]], y0 - 0.45, y0 + 0.45, color="C2",
                        alpha=0.15, linewidth=0, label="tolerance" if i == 0 else None)
        for j, run in enumerate(runs):
            row = frame[(frame["term"] == term) & (frame["run"] == run)]
            if row.empty:
                continue
            y = y0 + 0.4 - h * (j + 0.5)
            err, verdict = float(row["rel_err"].iloc[0]), str(row["verdict"].iloc[0])
            held = verdict == "held"
            if not math.isfinite(err):
                ax.text(0, y, "  exact (0)" if held else f"  {verdict}", va="center",
                        fontsize="small")
                continue
            color = ("C2" if held else "C3") if len(runs) == 1 else f"C{j % 10}"
            ax.barh(y, 100 * err, h * 0.9, color=color, hatch=None if held or len(runs) == 1 else "//",
                    label=run if len(runs) > 1 and i == 0 else None)
            ax.text(100 * err, y, f" {pct_text(err)} ", va="center", fontsize="small",
                    ha="left" if err >= 0 else "right")
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(-reach, reach)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g}%" if v else "0"))
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(terms)), [labels[t] for t in reversed(terms)])
    ax.set_xlabel("rel_err = (predicted - measured) / measured (symmetric log scale)")
    ax.set_title("prediction error per term")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14),
              ncol=min(4, 1 + len(runs)), frameon=False)
    return fig


def pct_text(x: float) -> str:
    """A relative error as a signed percent with enough digits to show its size:
    0.2345 -> `+23.4%`, -4.5e-6 -> `-0.00045%`, NaN -> `-`."""
    if not math.isfinite(x):
        return "-"
    p = 100 * x
    return f"{p:+.1f}%" if abs(p) >= 1 or p == 0 else f"{p:+.2g}%"
