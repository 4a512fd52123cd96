"""trainplan.executor.reporting.html and trainplan.executor.reporting.figures: verdicts, the summary line, the
figures' data, the
self-contained report.html (also rendered in headless Chromium), comparing runs, the CLI."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from tests.support import MIB, make_plan, make_record
from trainplan.costmodels.loss.bits import bits_loss_penalty
from trainplan.costmodels.loss.cache import save_local_law
from trainplan.costmodels.loss.law import LossLaw
from trainplan.executor.reporting.compare import compare
from trainplan.executor.reporting.figures import (
    CALIBRATION_COLUMNS,
    append_calibration_history,
    calibration_figure,
    error_figure,
    frontier_figure,
    frontier_frame,
    pct_text,
    plan_loss_curves,
    predicted_loss_frame,
    rank_memory_figure,
    rank_memory_frame,
    read_calibration_history,
)
from trainplan.executor.reporting.frames import report_frames
from trainplan.executor.reporting.html import environment, render
from trainplan.executor.reporting.plots import plot_report
from trainplan.executor.reporting.report import compare_runs, report
from trainplan.executor.reporting.verdicts import TOLERANCES, summary_line, term_label, tolerance, verdict_frame
from trainplan.planner.cli.main import main

DATA_PNG = re.compile(r'<img[^>]*\bsrc="data:image/png;base64,([A-Za-z0-9+/=]*)"')


def close_plan(**pred):
    """A plan whose predictions match `close_record` except step time (+25%) and loss (-10%)."""
    mem = {"params": 100 * MIB, "grads": 100 * MIB, "optimizer": 200 * MIB,
           "activations": 400 * MIB, "temporaries": 0.0, "total": 800 * MIB}
    return make_plan(**({"memory_bytes": mem, "flops_per_step": 2.5e12, "total_tokens": 327_680,
                         "step_time_s": 0.625, "final_loss": 3.6} | pred))


def close_record(**kw):
    return make_record(**({"device": "h200", "steps": 80} | kw))


def pngs(text: str) -> list[bytes]:
    return [base64.b64decode(m) for m in DATA_PNG.findall(text)]


def png_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "PNG"
        return im.size


# --- verdicts ---------------------------------------------------------------------------------


def test_tolerances_and_labels():
    assert tolerance("memory_activations") == tolerance("peak_memory") == TOLERANCES["memory"] == 0.03
    assert (tolerance("flops_per_step"), tolerance("step_time"), tolerance("final_loss")) == \
        (0.03, 0.10, 0.05)
    assert math.isnan(tolerance("something_else"))
    assert term_label("memory_grads") == "memory: grads"
    assert term_label("flops_per_step") == "FLOPs per step"


def test_verdict_frame_and_summary_line():
    v = verdict_frame(compare(close_plan(), close_record()), run="r1").set_index("term")
    assert v.loc["memory_temporaries", "verdict"] == "held"  # 0 predicted, 0 measured
    assert v.loc["peak_memory", "verdict"] == "held"
    assert v.loc["step_time", "verdict"] == "not held"  # +25% > 10%
    assert v.loc["final_loss", "verdict"] == "not held"  # -10% > 5%
    assert (v["run"] == "r1").all() and v.loc["tokens", "tolerance"] == 0.01
    line = summary_line(v.reset_index())
    assert line == "8 of 10 predictions held; step time off by +25%, final loss off by -10%"

    ok = verdict_frame(compare(close_plan(step_time_s=0.52, final_loss=3.9), close_record()))
    assert summary_line(ok) == "All 10 predictions held"


def test_verdict_edge_cases():
    # predicted 20 MiB of temporaries, measured 0: not held, said with both numbers
    v = verdict_frame(compare(close_plan(memory_bytes={"temporaries": 20 * MIB, "total": 800 * MIB}),
                              close_record(same_hardware=False, heldout_loss=[])))
    by = v.set_index("term")["verdict"]
    assert by["memory_temporaries"] == "not held" and by["memory_params"] == "no prediction"
    assert by["final_loss"] == "not measured"
    line = summary_line(v, same_hardware=False)
    assert "memory: temporaries predicted 20.00 MiB, measured 0" in line
    assert line.endswith("; 1 not measured; 4 no prediction; step time not compared (other hardware)")
    assert "step_time" not in set(v["term"])


def test_pct_text():
    assert (pct_text(0.2345), pct_text(-4.5e-6), pct_text(0.0), pct_text(math.nan)) == \
        ("+23.4%", "-0.00045%", "+0.0%", "-")


# --- figures from frames ----------------------------------------------------------------------


def test_rank_memory_frame_and_figure():
    rec = close_record(per_rank_peak_bytes=[790 * MIB, 810 * MIB])
    f = rank_memory_frame(close_plan(), rec)
    assert f["rank"].tolist() == [0, 1]
    assert f["predicted_mib"].tolist() == [800, 800] and f["measured_mib"].tolist() == [790, 810]
    heights = [p.get_height() for p in rank_memory_figure(f).axes[0].patches]
    assert heights == [800, 800, 790, 810]
    assert rank_memory_frame(close_plan(), close_record()).empty


def test_predicted_loss_frame_ends_at_the_plans_prediction():
    law = LossLaw.besiroglu2024()
    plan = make_plan()  # 100 steps x 4096 tokens, 1M unique tokens, 32-bit Adam
    f = predicted_loss_frame(plan, law, label="x")
    assert f["step"].iloc[0] == 1 and f["step"].iloc[-1] == 100 and f["step"].is_monotonic_increasing
    assert f["tokens"].iloc[-1] == 409_600
    want = law.predict(plan.model_n_params, 409_600, unique_tokens=1_000_000)
    assert f["loss"].iloc[-1] == pytest.approx(want + bits_loss_penalty(32))
    assert f["loss"].is_monotonic_decreasing
    assert np.allclose(f["upper"] - f["loss"], 0.02 * f["loss"])
    g = predicted_loss_frame(plan, law, label="y", band_nats=0.1)
    assert np.allclose(g["upper"] - g["lower"], 0.2)


def test_plan_loss_curves_published_and_local(tmp_path):
    law = LossLaw.besiroglu2024()
    plan = make_plan()
    assert plan_loss_curves(plan, tmp_path).empty  # no note, no local law
    plan = dataclasses.replace(plan, notes=(f"loss law: {law.source}",))
    published = plan_loss_curves(plan, tmp_path)
    assert published["curve"].unique().tolist() == ["plan's law (published), ±2%"]
    local = LossLaw(E=2.0, A=0.0, B=50.0, beta=0.3, source="fitted to test runs")
    save_local_law(local, model="tiny-llama", vocab_size=256, fit={"rms_residual_nats": 0.05},
                   cache_dir=tmp_path)
    both = plan_loss_curves(plan, tmp_path)
    names = both["curve"].unique().tolist()
    assert names[0] == "plan's law (published), ±2%"
    assert names[1] == "local law, fitted after the plan, ±0.050 nats (1 RMS residual)"
    loc = both[both["curve"] == names[1]]
    assert np.allclose(loc["upper"] - loc["loss"], 0.05)
    # drawn on the loss panel, with the planned budget
    fig = plot_report(report_frames(plan, make_record(), predicted_loss=both))
    legend = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert f"predicted: {names[1]}" in legend and "planned budget: 100 steps" in legend


def test_frontier_frame_and_figure():
    raw = pd.DataFrame({"memory_bytes": [3 * 2**30, 2**30, 2 * 2**30], "time_s": [30.0, 10.0, 20.0],
                        "loss": [3.0, 3.4, 3.2], "chosen": ["False", "False", "True"]})
    f = frontier_frame(raw)
    assert f["cost"].tolist() == [10, 20, 30] and f["memory_gib"].tolist() == [1, 2, 3]
    assert f["chosen"].tolist() == [False, True, False] and f["cost_label"].iloc[0] == "time (s)"
    fig = frontier_figure(raw)
    for ax, x in zip(fig.axes, (20.0, 2.0), strict=False):
        star = [ln for ln in ax.lines if ln.get_label() == "chosen plan"][0]
        assert star.get_xydata().tolist() == [[x, 3.2]]
    with pytest.raises(ValueError, match="cost_device_hours or time_s"):
        frontier_frame(raw.drop(columns="time_s"))


def test_calibration_history_append_read_and_figure(tmp_path):
    assert read_calibration_history(tmp_path) is None
    path = append_calibration_history([{"term": "step_time", "rel_err_before": 0.3, "rel_err_after": 0.02,
                                        "date": "2026-01-01"},
                                       {"term": "final_loss", "rel_err_before": -0.2,
                                        "rel_err_after": 0.01, "date": "2026-01-01"}], tmp_path)
    append_calibration_history([{"term": "step_time", "rel_err_before": 0.1, "rel_err_after": -0.05}],
                               tmp_path)
    assert path == tmp_path / "calibration_history.csv"
    assert path.read_text().count("rel_err_before") == 1  # one header
    h = read_calibration_history(tmp_path)
    assert tuple(h.columns) == CALIBRATION_COLUMNS and len(h) == 3
    fig = calibration_figure(h)
    assert [ax.get_title() for ax in fig.axes] == ["step_time", "final_loss"]
    before, after = fig.axes[0].lines
    assert before.get_ydata().tolist() == pytest.approx([30, 10])
    assert after.get_ydata().tolist() == pytest.approx([2, 5])
    with pytest.raises(ValueError, match="rel_err_after"):
        append_calibration_history([{"term": "x", "rel_err_before": 0.1}], tmp_path)


def test_error_figure_bars_are_percent_rel_err():
    v = verdict_frame(compare(close_plan(), close_record()), run="r")
    ax = error_figure(v).axes[0]
    widths = sorted(round(p.get_width(), 6) for p in ax.patches if p.get_width() != 0)
    assert widths == [-10.0, 25.0]
    colors = {round(p.get_width()): p.get_facecolor()[:3] for p in ax.patches if p.get_width()}
    assert colors[25] == colors[-10] != (0.0, 0.0, 0.0)  # both not held: same (red) colour


# --- report.html ------------------------------------------------------------------------------


def test_report_html_is_self_contained_with_numbers_and_images(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame({"memory_bytes": [2**30, 2 * 2**30], "cost_device_hours": [1.0, 0.5],
                  "loss": [3.0, 3.3], "chosen": [True, False]}).to_csv(run / "frontier.csv", index=False)
    append_calibration_history([{"term": "step_time", "rel_err_before": 0.3, "rel_err_after": 0.0}],
                               tmp_path / "cache")
    rec = close_record(per_rank_peak_bytes=[800 * MIB, 805 * MIB], world_size=2)
    files = report(close_plan(), rec, run, cache_dir=tmp_path / "cache")
    text = files["html"].read_text()
    assert "http://" not in text and "https://" not in text
    assert re.findall(r'(?:src|href)="(?!data:)([^"]+)"', text) == \
        ["comparison.csv", "summary.json", "plan.json", "record.json", "report.png"]  # beside it
    assert "8 of 10 predictions held; step time off by +25%, final loss off by -10%" in text
    assert "800.00 MiB" in text and "+25.0%" in text and "not held" in text
    assert "OPTIMAL" in text and "governor" in text and str(run.resolve()) in text
    images = pngs(text)
    # error, memory, per rank, step time, loss, frontier, calibration history
    assert len(images) == len(DATA_PNG.findall(text)) == text.count("<img") == 7
    assert all(png_size(b)[0] > 100 for b in images)
    summary = json.loads(files["summary"].read_text())
    assert (summary["held"], summary["compared"]) == (8, 10)
    assert summary["summary"].startswith("8 of 10")


def test_report_templates_are_package_data_and_escape_what_they_show():
    assert {"base.html.j2", "run.html.j2", "runs.html.j2", "macros.html.j2", "report.css"} <= \
        set(environment().list_templates())
    evil = "<script>alert('x')</script>"
    text = render("run.html.j2", title=evil, verdict_line="All 1 predictions held", verdict_ok=True,
                  facts=[("notes", evil)], rows=[], tolerances="", figures=[], figure_notes=[evil])
    assert "<script>" not in text and text.count("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;") == 4
    assert text.startswith("<!DOCTYPE html>") and "td.num{text-align:right" in text  # the style sheet inlined
    assert '<p id="verdict" class="verdict ok">All 1 predictions held</p>' in text


def test_compare_runs_and_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINPLAN_CACHE_DIR", str(tmp_path / "cache"))
    dirs = []
    for name, plan in (("a", close_plan()), ("b", close_plan(step_time_s=0.5))):
        dirs.append(tmp_path / name)
        report(plan, close_record(), dirs[-1])
    files = compare_runs(dirs, tmp_path / "cmp", rebuild=False)
    csv = pd.read_csv(files["comparison"])
    assert len(csv) == 20 and csv["run"].unique().tolist() == ["a", "b"]
    assert csv.groupby("run")["verdict"].apply(lambda s: (s == "held").sum()).tolist() == [8, 9]
    text = files["html"].read_text()
    assert "2 runs: 17 of 20 predictions held" in text and len(pngs(text)) == 1
    assert 'href="../a/report.html"' in text and "https://" not in text

    assert main(["report", str(dirs[0]), str(dirs[1]), "--out", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert "9 of 10 predictions held; final loss off by -10%" in out
    assert (tmp_path / "cli" / "report.html").is_file() and "2 runs compared" in out
    (dirs[0] / "report.html").unlink()
    assert main(["report", str(dirs[0])]) == 0
    assert (dirs[0] / "report.html").is_file()


# --- headless Chromium ------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium")
PROBE = ("<script>window.addEventListener('load',()=>{for(const i of document.images){"
         "i.setAttribute('data-natural-width',String(i.naturalWidth));}"
         "document.body.setAttribute('data-probed','yes');});</script></body>")


@pytest.mark.skipif(CHROMIUM is None, reason=(
    "headless Chromium not installed: `apt-get install -y chromium` (Debian) to check that "
    "report.html renders offline with every image loaded"))
def test_report_html_renders_in_headless_chromium(tmp_path):
    files = report(close_plan(), close_record(), tmp_path / "run", cache_dir=tmp_path / "cache")
    text = files["html"].read_text()
    n_images = len(pngs(text))
    # a copy with a probe that records, after load, what the browser decoded of each image
    probed = tmp_path / "run" / "probed.html"
    probed.write_text(text.replace("</body>", PROBE))
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
           probed.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    dom = proc.stdout
    assert proc.returncode == 0 and 'data-probed="yes"' in dom, (proc.returncode, proc.stderr[-2000:])
    widths = [int(w) for w in re.findall(r'data-natural-width="(\d+)"', dom)]
    assert len(widths) == n_images == 4 and all(w > 100 for w in widths), widths
    for data in pngs(dom):
        assert png_size(data)[0] > 100
    for needle in ("8 of 10 predictions held; step time off by +25%, final loss off by -10%",
                   "800.00 MiB", "+25.0%", "not held", "OPTIMAL"):
        assert needle in dom, needle
