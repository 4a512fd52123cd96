"""The plan-vs-actual report as one self-contained HTML page per run (`write_run_report`), and a
page comparing runs (`write_runs_report`).

The pages are rendered by jinja2 from the templates in `executor/reporting/templates/` (package
data): `base.html.j2` (the layout, with the style sheet `report.css` inlined), `run.html.j2`,
`runs.html.j2` and `macros.html.j2` (a figure, the predictions table, the tolerance note), with
autoescaping on. This module computes what they show: text and numbers formatted, figures drawn.

A page has no external reference: figures are PNGs inlined as `data:image/png;base64,...`, the
style sheet is inline, there is no script. It opens offline in any browser.

Each term of `trainplan.executor.reporting.compare.compare` gets its verdict (`trainplan.executor.reporting.verdicts`:
**held** when |rel_err| is within the term's tolerance, **not held** otherwise, **not measured**
when the run has no measurement). The page opens with one line (`summary_line`), e.g. "7 of 8
predictions held; step time off by +23%".
"""

from __future__ import annotations

import base64
import datetime as _dt
import json
import math
import os
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd
from matplotlib.figure import Figure

from trainplan.executor.record import RunRecord
from trainplan.executor.reporting import figures as F
from trainplan.executor.reporting.compare import compare, format_value
from trainplan.executor.reporting.forecast import forecast_figure
from trainplan.executor.reporting.frames import ReportFrames
from trainplan.executor.reporting.plots import plot_loss, plot_memory, plot_step_time
from trainplan.executor.reporting.verdicts import HELD, NOT_HELD, TOLERANCES, is_bound_plan, summary_line, verdict_frame
from trainplan.planner.plan import Plan

__all__ = ["environment", "render", "write_run_report", "write_runs_report"]


# --- templates and their pieces ---------------------------------------------------------------


@cache
def environment() -> jinja2.Environment:
    """The templates' jinja2 environment: package data of `trainplan.executor.reporting`, autoescaped,
    an undefined name an error (`jinja2.StrictUndefined`)."""
    return jinja2.Environment(loader=jinja2.PackageLoader("trainplan.executor.reporting", "templates"),
                              autoescape=True, undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def render(template: str, **context: Any) -> str:
    """`template` (`run.html.j2`, `runs.html.j2`) rendered with `context` and the time now
    (`generated`, UTC)."""
    generated = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    return environment().get_template(template).render(generated=generated, **context)


def _figure(fig: Figure, title: str, caption: str) -> dict[str, str]:
    """A figure as the `figure` macro shows it: title, caption, the PNG in base64."""
    return {"title": title, "caption": caption,
            "png_base64": base64.b64encode(F.png_bytes(fig)).decode("ascii")}


def _verdict_rows(v: pd.DataFrame) -> list[dict[str, str]]:
    """The `verdict_table` macro's rows: each term's cells as text, its verdict's CSS class."""
    rows = []
    for r in v.itertuples(index=False):
        rows.append({
            "run": str(r.run), "label": str(r.label), "css_class": r.verdict.replace(",", "").replace(" ", "-"),
            "predicted": format_value(r.predicted, r.unit), "measured": format_value(r.measured, r.unit),
            "rel_err": F.pct_text(r.rel_err),
            "tolerance": "-" if not math.isfinite(r.tolerance) else f"±{r.tolerance:.0%}",
            "verdict": {HELD: "✓ held", NOT_HELD: "✗ not held"}.get(r.verdict, r.verdict)})
    return rows


def _facts(plan: Plan, record: RunRecord, run_dir: Path) -> list[tuple[str, str]]:
    d, p, s = plan.decisions, plan.predictions, plan.solver
    ck = {e: d.activation_checkpoint.count(e) for e in dict.fromkeys(d.activation_checkpoint)}
    dev = f"{d.devices} device{'s' if d.devices != 1 else ''}"
    ran = (f"{record.device}, world size {record.world_size}: "
           + ("the plan's hardware, times compared" if record.same_hardware
              else f"not the plan's {plan.hw}, times not compared"))
    items = [
        ("model", f"{plan.model}: {plan.model_n_params:,} parameters, {plan.model_n_layers} layers, "
                  f"vocabulary {plan.vocab_size:,}"),
        ("planned for", f"{plan.hw} x {dev}; budget {', '.join(f'{k}={v}' for k, v in plan.budget.items())}"),
        ("ran on", ran),
        ("parallelism", f"sp_degree {d.sp_degree}, dp_degree {d.dp_degree}, ZeRO stage {d.zero_stage}"),
        ("batch", f"micro-batch {d.micro_batch} x seq_len {d.seq_len}, {d.grad_accum} micro-step"
                  f"{'s' if d.grad_accum != 1 else ''} per step ({p.tokens_per_step:,} tokens per step)"),
        ("precision", f"{d.precision}, optimizer states {d.optimizer_bits}-bit"),
        ("checkpointing", ", ".join(f"{n} block{'s' if n != 1 else ''} {e}" for e, n in ck.items())),
        ("data", f"{d.data_fraction:g} of {plan.data_tokens:,} unique tokens ({d.data_method})"),
        ("stopping budget", f"{d.max_tokens:,} tokens = {d.max_steps:,} steps; governor threshold "
                            f"{d.governor_threshold:g} nats/step"),
        ("solver", f"{s.status} in {s.wall_s:.2f} s wall (limit {s.time_limit_s:g} deterministic s; objective "
                   f"{s.objective:.4g} nats predicted loss, bound {s.bound:.4g}, seed {s.seed})"),
        ("stop", f"{record.stop_reason or 'unknown'} after {record.steps:,} steps, "
                 f"{record.tokens:,} tokens, {record.wall_s:.0f} s wall"),
        ("run folder", str(run_dir.resolve())),
        ("plan created", plan.created or "-"),
    ]
    notes = [*plan.notes, *record.notes]
    if notes:
        items.append(("notes", "; ".join(notes)))
    return items


def _tolerances() -> str:
    return ", ".join(f"{k.replace('_', ' ')} ±{v:.0%}" for k, v in TOLERANCES.items())


def _verdict_ok(verdicts: pd.DataFrame) -> bool:
    return bool(len(verdicts)) and not (verdicts["verdict"] == NOT_HELD).any()


def _json_ready(v: pd.DataFrame) -> list[dict]:
    return [{k: (None if isinstance(x, float) and not math.isfinite(x) else x) for k, x in row.items()}
            for row in v.to_dict("records")]


# --- one run ----------------------------------------------------------------------------------


def _panel(draw, frames: ReportFrames, size=(8, 4.2)) -> Figure:
    fig = Figure(figsize=size, layout="constrained")
    draw(fig.subplots(), frames)
    return fig


def _run_figures(plan: Plan, record: RunRecord, frames: ReportFrames, verdicts: pd.DataFrame,
                 run_dir: Path, cache_dir) -> tuple[list[dict[str, str]], list[str]]:
    """(figures as `_figure` gives them, notes on figures that could not be drawn)."""
    blocks, notes = [], []
    blocks.append(_figure(F.error_figure(verdicts), "Prediction error per term",
                          "Each bar is (predicted - measured) / measured. The green band is the "
                          "term's tolerance: a bar inside it is a prediction that held."))
    blocks.append(_figure(_panel(plot_memory, frames), "Memory per category",
                          "Tensor bytes per device at the peak, predicted beside measured (on "
                          "CUDA only the total is measured). The dotted line is the usable limit."))
    ranks = F.rank_memory_frame(plan, record)
    if len(ranks) > 1:
        blocks.append(_figure(F.rank_memory_figure(ranks), "Memory per rank",
                              "Each rank's measured peak beside the plan's per-device total."))
    blocks.append(_figure(_panel(plot_step_time, frames, (6, 4.2)), "Step time",
                          "Predicted compute, recompute and communication, stacked, beside the "
                          "measured median step (after two warm-up steps). Only comparable on the "
                          "plan's hardware."))
    blocks.append(_figure(_panel(plot_loss, frames, (9, 4.6)), "Loss",
                          "Training and held-out loss as measured; the predicted curve with its "
                          "band where the law is known; the star is the predicted final loss at "
                          "the planned budget; the solid line is where the run stopped and why."))
    if record.loss_forecast:
        blocks.append(_figure(forecast_figure(plan, record), "Online forecast of the final loss",
                              "After each held-out evaluation the run forecasts its own final loss from its "
                              "curve so far (its first 10% and the cooldown left out, the floor from the "
                              "plan's law, the pilots' cooldown gain, or 0-20% of the excess without "
                              "pilots), with its band; the dotted line is the plan's prediction made "
                              "before the run, the dashed one the measured "
                              "final loss; thin lines mark 10%, 30% and 50% of the steps."))
    governed = F.read_governor_summary(run_dir)
    if governed is not None:
        blocks.append(_figure(F.governor_figure(plan, record, governed), "Compute governor",
                              "Held-out loss with the governor's fitted curve and band, the planned "
                              "budget, where it decided to stop, where the run ended (after the "
                              "cooldown) and the plan's predicted stop."))
    frontier = run_dir / "frontier.csv"
    if frontier.is_file():
        try:
            blocks.append(_figure(F.frontier_figure(F.frontier_frame(pd.read_csv(frontier))),
                                  "Pareto frontier", "Plans no other plan beats on cost, memory "
                                  "and loss at once; the star is the plan this run executed."))
        except (ValueError, OSError, pd.errors.ParserError) as e:
            notes.append(f"frontier.csv not drawn: {e}")
    history = F.read_calibration_history(cache_dir)
    if history is not None:
        blocks.append(_figure(F.calibration_figure(history), "Calibration history",
                              "Prediction error of each term on the calibration runs with the "
                              "constants before (open) and after (filled) each calibration."))
    return blocks, notes


def write_run_report(plan: Plan, record: RunRecord, out: str | Path, *, frames: ReportFrames,
                     cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Write `report.html` (self-contained) and `summary.json` (verdicts) into `out`.

    `frames`: `trainplan.executor.reporting.frames.report_frames` of this plan and record. Returns the paths
    under `html` and `summary`. Called by `trainplan.executor.reporting.report.report`, which writes the other
    files.
    """
    out = Path(out)
    verdicts = verdict_frame(compare(plan, record), bound=is_bound_plan(plan))
    line = summary_line(verdicts, record.same_hardware)
    figs, fig_notes = _run_figures(plan, record, frames, verdicts, out, cache_dir)
    page = render("run.html.j2", title=f"{plan.model} on {plan.hw} x {plan.decisions.devices}: plan vs actual",
                  verdict_line=line, verdict_ok=_verdict_ok(verdicts), facts=_facts(plan, record, out),
                  rows=_verdict_rows(verdicts), tolerances=_tolerances(), figures=figs, figure_notes=fig_notes)
    paths = {"html": out / "report.html", "summary": out / "summary.json"}
    paths["html"].write_text(page, encoding="utf-8")
    summary = {"summary": line, "held": int((verdicts["verdict"] == HELD).sum()),
               "compared": int(verdicts["verdict"].isin([HELD, NOT_HELD]).sum()),
               "same_hardware": bool(record.same_hardware), "tolerances": TOLERANCES,
               "terms": _json_ready(verdicts.drop(columns="run"))}
    paths["summary"].write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return paths


# --- several runs -----------------------------------------------------------------------------


def write_runs_report(runs: list[tuple[str, Path, Plan, RunRecord, str]], verdicts: pd.DataFrame,
                      out: Path) -> Path:
    """Write `out/report.html`, the page comparing runs, and return its path.

    `runs`: per run (label, run folder, plan, record, its `summary_line`); `verdicts`: the runs'
    `verdict_frame`s concatenated (column `run` is the label). Each run's own `report.html` is
    linked by its path relative to `out`. Called by `trainplan.executor.reporting.report.compare_runs`,
    which writes the other files.
    """
    held = int((verdicts["verdict"] == HELD).sum())
    n = int(verdicts["verdict"].isin([HELD, NOT_HELD]).sum())
    rows = [{"label": label, "model": p.model, "planned_for": f"{p.hw} x {p.decisions.devices}",
             "device": r.device, "stop": f"{r.stop_reason or 'unknown'} after {r.steps:,} steps",
             "verdict": line, "href": Path(os.path.relpath(d / "report.html", out)).as_posix(),
             "report_path": str((d / "report.html").resolve())}
            for label, d, p, r, line in runs]
    error = _figure(F.error_figure(verdicts), "Prediction error per term and run",
                    "One bar per run: (predicted - measured) / measured; the green band is the "
                    "term's tolerance. Hatched bars are predictions that did not hold.")
    page = render("runs.html.j2", title=f"trainplan: {len(runs)} runs compared",
                  verdict_line=f"{len(runs)} runs: {held} of {n} predictions held",
                  verdict_ok=_verdict_ok(verdicts), runs=rows, error_figure=error,
                  rows=_verdict_rows(verdicts), tolerances=_tolerances())
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
