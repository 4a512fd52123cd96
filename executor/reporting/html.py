"""The plan-vs-actual report as one self-contained HTML page per run (`write_run_report`), and a
page comparing runs (`write_runs_report`).

A page has no external reference: figures are PNGs inlined as `data:image/png;base64,...`, the
style sheet is inline, there is no script. It opens offline in any browser.

Each term of `executor.reporting.compare.compare` gets its verdict (`executor.reporting.verdicts`:
**held** when |rel_err| is within the term's tolerance, **not held** otherwise, **not measured**
when the run has no measurement). The page opens with one line (`summary_line`), e.g. "7 of 8
predictions held; step time off by +23%".
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import math
import os
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from executor.record import RunRecord
from executor.reporting import figures as F
from executor.reporting.compare import compare, format_value
from executor.reporting.frames import ReportFrames
from executor.reporting.plots import plot_loss, plot_memory, plot_step_time
from executor.reporting.verdicts import HELD, NOT_HELD, TOLERANCES, summary_line, verdict_frame
from planner.plan import Plan

__all__ = ["CSS", "write_run_report", "write_runs_report"]

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;
max-width:1100px;padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.5em;margin-bottom:.2em} h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
.verdict{font-size:1.35em;font-weight:600;padding:.5em .8em;border-radius:6px;margin:.6em 0}
.verdict.ok{background:#e3f4e3;color:#14591b} .verdict.bad{background:#fbe7e5;color:#8a1c10}
table{border-collapse:collapse;margin:.6em 0} td,th{padding:.25em .7em;border-bottom:1px solid #e6e6e6}
th{text-align:left;background:#f6f6f6} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.held td.v{color:#14591b;font-weight:600} tr.not-held td.v{color:#8a1c10;font-weight:600}
tr.not-held{background:#fff6f5} tr.not-measured td.v,tr.no-prediction td.v{color:#777}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:.2em 1.2em} dt{font-weight:600}
dd{margin:0} figure{margin:1.2em 0} img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{color:#555;font-size:.92em;max-width:900px} .note{color:#555;font-size:.92em}
"""
"""The pages' inline style sheet (no external reference)."""


# --- HTML pieces ------------------------------------------------------------------------------


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _img(fig: Figure, alt: str) -> str:
    data = base64.b64encode(F.png_bytes(fig)).decode("ascii")
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{data}">'


def _figure(fig: Figure, title: str, caption: str) -> str:
    return (f"<figure><h3>{_e(title)}</h3>{_img(fig, title)}"
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _verdict_table(v: pd.DataFrame, with_run: bool = False) -> str:
    head = ["run"] * with_run + ["term", "predicted", "measured", "rel_err", "tolerance", "verdict"]
    rows = []
    for r in v.itertuples(index=False):
        err = F.pct_text(r.rel_err)
        tol = "-" if not math.isfinite(r.tolerance) else f"±{r.tolerance:.0%}"
        mark = {HELD: "✓ held", NOT_HELD: "✗ not held"}.get(r.verdict, r.verdict)
        cells = ([f"<td>{_e(r.run)}</td>"] if with_run else []) + [
            f"<td>{_e(r.label)}</td>", f'<td class="num">{_e(format_value(r.predicted, r.unit))}</td>',
            f'<td class="num">{_e(format_value(r.measured, r.unit))}</td>',
            f'<td class="num">{_e(err)}</td>', f'<td class="num">{_e(tol)}</td>',
            f'<td class="v">{_e(mark)}</td>']
        rows.append(f'<tr class="{r.verdict.replace(" ", "-")}">{"".join(cells)}</tr>')
    return ("<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def _facts(plan: Plan, record: RunRecord, run_dir: Path) -> str:
    d, p, s = plan.decisions, plan.predictions, plan.solver
    ck = {e: d.checkpoint.count(e) for e in dict.fromkeys(d.checkpoint)}
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
        ("solver", f"{s.status} in {s.wall_s:.2f} s (objective {s.objective:.4g}, bound {s.bound:.4g}, "
                   f"seed {s.seed}, time limit {s.time_limit_s:g} s)"),
        ("stop", f"{record.stop_reason or 'unknown'} after {record.steps:,} steps, "
                 f"{record.tokens:,} tokens, {record.wall_s:.0f} s wall"),
        ("run folder", str(run_dir.resolve())),
        ("plan created", plan.created or "-"),
    ]
    notes = [*plan.notes, *record.notes]
    if notes:
        items.append(("notes", "; ".join(notes)))
    return ('<dl class="facts">' + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in items)
            + "</dl>")


def _tolerance_note() -> str:
    tol = ", ".join(f"{k.replace('_', ' ')} ±{v:.0%}" for k, v in TOLERANCES.items())
    return (f'<p class="note">A prediction holds when |rel_err| is within its tolerance ({_e(tol)}); '
            "rel_err = (predicted - measured) / measured. Memory is tensor bytes per device at the "
            "peak, FLOPs per device per step, tokens over all ranks, loss in nats/token.</p>")


def _page(title: str, body: list[str]) -> str:
    generated = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body)
            + f'\n<p class="note">Generated by trainplan at {_e(generated)}.</p>\n</body></html>\n')


def _verdict_block(line: str, verdicts: pd.DataFrame) -> str:
    ok = bool(len(verdicts)) and not (verdicts["verdict"] == NOT_HELD).any()
    return f'<p id="verdict" class="verdict {"ok" if ok else "bad"}">{_e(line)}</p>'


def _json_ready(v: pd.DataFrame) -> list[dict]:
    return [{k: (None if isinstance(x, float) and not math.isfinite(x) else x) for k, x in row.items()}
            for row in v.to_dict("records")]


# --- one run ----------------------------------------------------------------------------------


def _panel(draw, frames: ReportFrames, size=(8, 4.2)) -> Figure:
    fig = Figure(figsize=size, layout="constrained")
    draw(fig.subplots(), frames)
    return fig


def _run_figures(plan: Plan, record: RunRecord, frames: ReportFrames, verdicts: pd.DataFrame,
                 run_dir: Path, cache_dir) -> tuple[list[str], list[str]]:
    """(figure blocks, notes on figures that could not be drawn)."""
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

    `frames`: `executor.reporting.frames.report_frames` of this plan and record. Returns the paths
    under `html` and `summary`. Called by `executor.reporting.report.report`, which writes the other
    files.
    """
    out = Path(out)
    verdicts = verdict_frame(compare(plan, record))
    line = summary_line(verdicts, record.same_hardware)
    figs, fig_notes = _run_figures(plan, record, frames, verdicts, out, cache_dir)
    d = plan.decisions
    title = f"{plan.model} on {plan.hw} x {d.devices}: plan vs actual"
    body = [f"<h1>{_e(title)}</h1>", _verdict_block(line, verdicts), _facts(plan, record, out),
            "<h2>Predictions</h2>", _verdict_table(verdicts), _tolerance_note(),
            "<h2>Figures</h2>", *figs, *(f'<p class="note">{_e(n)}</p>' for n in fig_notes),
            '<h2>Files</h2><p class="note">Beside this page: <a href="comparison.csv">comparison.csv'
            '</a> (the table), <a href="summary.json">summary.json</a> (verdicts), <a href="plan.json">'
            'plan.json</a>, <a href="record.json">record.json</a>, <a href="report.png">report.png</a>.</p>']
    paths = {"html": out / "report.html", "summary": out / "summary.json"}
    paths["html"].write_text(_page(title, body), encoding="utf-8")
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
    linked by its path relative to `out`. Called by `executor.reporting.report.compare_runs`,
    which writes the other files.
    """
    rows = "".join(
        f"<tr><td>{_e(label)}</td><td>{_e(p.model)}</td><td>{_e(p.hw)} x {p.decisions.devices}</td>"
        f"<td>{_e(r.device)}</td><td>{_e(r.stop_reason or 'unknown')} after {r.steps:,} steps</td>"
        f"<td>{_e(line)}</td></tr>" for label, _, p, r, line in runs)
    held = int((verdicts["verdict"] == HELD).sum())
    n = int(verdicts["verdict"].isin([HELD, NOT_HELD]).sum())
    line = f"{len(runs)} runs: {held} of {n} predictions held"
    title = f"trainplan: {len(runs)} runs compared"
    body = [f"<h1>{_e(title)}</h1>", _verdict_block(line, verdicts),
            "<h2>Runs</h2><table><thead><tr><th>run</th><th>model</th><th>planned for</th>"
            f"<th>ran on</th><th>stop</th><th>verdict</th></tr></thead><tbody>{rows}</tbody></table>",
            _figure(F.error_figure(verdicts), "Prediction error per term and run",
                    "One bar per run: (predicted - measured) / measured; the green band is the "
                    "term's tolerance. Hatched bars are predictions that did not hold."),
            "<h2>Predictions</h2>", _verdict_table(verdicts, with_run=True), _tolerance_note(),
            '<h2>Run reports</h2><ul>' + "".join(
                f'<li><a href="{_e(Path(os.path.relpath(d / "report.html", out)).as_posix())}">'
                f"{_e(label)}</a>: {_e(str((d / 'report.html').resolve()))}</li>"
                for label, d, *_ in runs) + "</ul>"]
    path = out / "report.html"
    path.write_text(_page(title, body), encoding="utf-8")
    return path
