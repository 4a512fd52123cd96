"""trainplan.executor.reporting: compare table, frames, report folder, load_run, text table."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from tests.support import MIB, make_plan, make_record
from trainplan.errors import PlanMismatchError
from trainplan.executor.record import RunRecord
from trainplan.executor.reporting.compare import COLUMNS, compare, format_table
from trainplan.executor.reporting.frames import loss_frame, memory_frame, report_frames, step_time_frame
from trainplan.executor.reporting.plots import STEP_TIME_NOTE, plot_report
from trainplan.executor.reporting.report import load_run, report


def cuda_record(**overrides) -> RunRecord:
    return make_record(device="cuda:0 (NVIDIA H200)", peak_memory_bytes={"total": 900 * MIB},
                       **overrides)


# --- compare ----------------------------------------------------------------------------------


def test_compare_columns_rows_and_values():
    df = compare(make_plan(), make_record())
    assert tuple(df.columns) == COLUMNS
    assert list(df["term"]) == [
        "memory_params", "memory_grads", "memory_optimizer", "memory_activations",
        "memory_temporaries", "peak_memory", "flops_per_step", "step_time", "tokens",
        "final_loss"]
    row = df.set_index("term")
    assert row.loc["memory_activations", "rel_err"] == pytest.approx((300 - 400) / 400)
    assert row.loc["memory_params", "rel_err"] == 0.0
    assert math.isnan(row.loc["memory_temporaries", "rel_err"])  # measured 0
    assert row.loc["peak_memory", "predicted"] == 720 * MIB
    assert row.loc["peak_memory", "rel_err"] == pytest.approx(-0.1)
    assert row.loc["flops_per_step", "rel_err"] == pytest.approx(-0.2)
    assert row.loc["step_time", "measured"] == 0.5  # median after two warm-up steps
    assert row.loc["step_time", "rel_err"] == pytest.approx(0.0)
    assert row.loc["tokens", "rel_err"] == pytest.approx(0.25)
    assert row.loc["final_loss", "measured"] == 4.0
    assert row.loc["final_loss", "rel_err"] == pytest.approx(-0.25)
    assert dict(zip(df["term"], df["unit"], strict=False))["flops_per_step"] == "FLOPs"
    assert set(df["unit"]) == {"bytes", "FLOPs", "s", "tokens", "nats"}


def test_compare_drops_step_time_on_other_hardware():
    df = compare(make_plan(), make_record(same_hardware=False))
    assert "step_time" not in set(df["term"])
    assert {"peak_memory", "flops_per_step", "tokens", "final_loss"} <= set(df["term"])


def test_compare_cuda_record_has_only_total_memory():
    df = compare(make_plan(), cuda_record())
    assert not any(t.startswith("memory_") for t in df["term"])
    peak = df.set_index("term").loc["peak_memory"]
    assert (peak["predicted"], peak["measured"]) == (720 * MIB, 900 * MIB)
    assert peak["rel_err"] == pytest.approx(-0.2)


def test_compare_missing_measurements_are_nan():
    rec = RunRecord(model="tiny-llama", hw_planned="h200", device="cpu", same_hardware=True)
    df = compare(make_plan(), rec).set_index("term")
    assert math.isnan(df.loc["peak_memory", "measured"])
    assert math.isnan(df.loc["step_time", "measured"])
    assert math.isnan(df.loc["final_loss", "measured"])
    assert df["rel_err"].isna().all()  # nothing measured: 0 or NaN everywhere


def test_short_run_reports_unmeasured_terms_as_not_measured():
    """A 2-step run never reaches the memory (step 2) or FLOPs (step 3) measurement, nor a
    timed step after the two warm-up steps: those terms are "not measured", not misses (the
    record's defaults are {} and 0 FLOPs; its step times only the warm-up steps')."""
    from trainplan.executor.reporting.verdicts import NOT_MEASURED, summary_line, verdict_frame

    rec = make_record(steps=2, step_times_s=[0.4, 0.5], peak_memory_bytes={}, flops_per_step=0.0)
    v = verdict_frame(compare(make_plan(), rec)).set_index("term")
    assert v.loc["peak_memory", "verdict"] == NOT_MEASURED
    assert v.loc["flops_per_step", "verdict"] == NOT_MEASURED
    assert v.loc["step_time", "verdict"] == NOT_MEASURED
    assert not any(t.startswith("memory_") for t in v.index)
    assert "3 not measured" in summary_line(v.reset_index())


def test_a_run_cut_short_is_compared_at_the_steps_it_ran():
    """Issue #40, item 10: an own loop left after 10 of 2,305 steps read "tokens off by +22950%"
    and compared the loss predicted at 590k tokens with the loss at 2.5k. A run stopped before
    its plan's end gets a `steps` row ("cut short"), its tokens and final loss are predicted at
    the steps it ran, and the summary line says so first."""
    import dataclasses

    from trainplan.costmodels.loss.law import LossLaw
    from trainplan.executor.reporting.compare import loss_at_steps
    from trainplan.executor.reporting.verdicts import CUT_SHORT, HELD, summary_line, verdict_frame

    base = make_plan()
    law = dataclasses.asdict(LossLaw.besiroglu2024())
    plan = dataclasses.replace(base, predictions=dataclasses.replace(base.predictions, loss_law=law))
    rec = make_record(steps=10, tokens=10 * 4096, stop_reason="interrupted")
    df = compare(plan, rec).set_index("term")
    assert (df.loc["steps", "predicted"], df.loc["steps", "measured"]) == (100, 10)
    assert df.loc["tokens", "predicted"] == 10 * 4096 and df.loc["tokens", "rel_err"] == 0.0
    at10 = loss_at_steps(plan, 10)
    assert df.loc["final_loss", "predicted"] == pytest.approx(at10)
    assert at10 > plan.predictions.final_loss  # fewer tokens, a higher loss
    assert loss_at_steps(plan, 100) == pytest.approx(plan.predictions.final_loss)  # the plan's own end
    v = verdict_frame(df.reset_index()).set_index("term")
    assert v.loc["steps", "verdict"] == CUT_SHORT and v.loc["tokens", "verdict"] == HELD
    line = summary_line(v.reset_index())
    assert line.startswith("Run cut short at step 10 of 100"), line
    full = compare(plan, make_record(steps=100, stop_reason="budget")).set_index("term")
    assert "steps" not in full.index and full.loc["final_loss", "predicted"] == plan.predictions.final_loss


# --- frames -----------------------------------------------------------------------------------


def test_memory_frame_in_mib_and_nan_where_unmeasured():
    mf = memory_frame(make_plan(), cuda_record())
    assert list(mf["category"]) == ["params", "grads", "optimizer", "activations",
                                    "temporaries", "total"]
    assert list(mf["predicted_mib"]) == [100, 100, 200, 300, 20, 720]
    assert mf["measured_mib"].iloc[:-1].isna().all()
    assert mf["measured_mib"].iloc[-1] == 900


def test_step_time_frame_stacks_breakdown_beside_median():
    sf = step_time_frame(make_plan(), make_record())
    pred = sf[sf["source"] == "predicted"]
    assert list(pred["component"]) == ["compute", "recompute", "communication"]
    assert pred["seconds"].sum() == pytest.approx(0.5)
    assert sf[sf["source"] == "measured"]["seconds"].tolist() == [0.5]
    empty = step_time_frame(make_plan(step_time_breakdown_s={}), make_record(step_times_s=[]))
    assert empty["component"].tolist() == ["total", "median"]
    assert empty["seconds"].iloc[0] == 0.5 and math.isnan(empty["seconds"].iloc[1])


def test_loss_frame_train_and_heldout():
    lf = loss_frame(make_record())
    assert (lf["split"] == "train").sum() == 80
    held = lf[lf["split"] == "heldout"]
    assert held["step"].tolist() == [40, 80]
    assert held["tokens"].tolist() == [163_840, 327_680]
    assert held["loss"].tolist() == [4.5, 4.0]
    empty = loss_frame(RunRecord(model="m", hw_planned="h200", device="cpu", same_hardware=True))
    assert empty.empty and list(empty.columns) == ["step", "split", "loss", "tokens"]


def test_report_frames_annotations():
    fr = report_frames(make_plan(), make_record(same_hardware=False))
    assert (fr.planned_steps, fr.stop_step, fr.stop_reason) == (100, 80, "marginal_gain")
    assert fr.memory_limit_mib == 1000 and fr.predicted_final_loss == 3.0
    assert not fr.same_hardware
    assert "tiny-llama" in fr.title and "h200" in fr.title and "1 device" in fr.title


def test_plot_report_notes_other_hardware():
    fig = plot_report(report_frames(make_plan(), make_record(same_hardware=False)))
    assert STEP_TIME_NOTE in fig.axes[1].get_title()
    same = plot_report(report_frames(make_plan(), make_record()))
    assert STEP_TIME_NOTE not in same.axes[1].get_title()
    assert len(fig.axes) == 3
    legend = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert any("stop at step 80: marginal_gain" in t for t in legend)


def test_memory_limit_line_only_near_the_bars():
    def legend(plan):
        fig = plot_report(report_frames(plan, make_record()))
        return " ".join(t.get_text() for t in fig.axes[0].get_legend().get_texts())

    assert "usable limit 1,000 MiB" in legend(make_plan())  # 1000 MiB vs 800 MiB bars
    assert "usable limit" not in legend(make_plan(memory_limit_bytes=141 * 2**30))


def test_plot_report_empty_record_does_not_crash():
    rec = RunRecord(model="m", hw_planned="h200", device="cpu", same_hardware=True)
    fig = plot_report(report_frames(make_plan(), rec))
    assert len(fig.axes) == 3


# --- files ------------------------------------------------------------------------------------


def test_report_writes_files_and_load_run_round_trips(tmp_path):
    import matplotlib.image

    plan, rec = make_plan(), cuda_record(same_hardware=False)
    paths = report(plan, rec, tmp_path / "run1", cache_dir=tmp_path / "cache")
    assert set(paths) == {"comparison", "plan", "record", "figure", "html", "summary"}
    assert {p.name for p in paths.values()} == {"comparison.csv", "plan.json", "record.json",
                                                "report.png", "report.html", "summary.json"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())
    img = matplotlib.image.imread(paths["figure"])
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    csv = pd.read_csv(paths["comparison"])
    assert tuple(csv.columns) == COLUMNS
    pd.testing.assert_frame_equal(csv, compare(plan, rec), check_dtype=False)

    plan2, rec2 = load_run(tmp_path / "run1")
    assert plan2 == plan
    assert rec2 == rec


def test_load_run_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(PlanMismatchError, match="nope"):
        load_run(missing)
    run = tmp_path / "run"
    run.mkdir()
    make_plan().to_json(run / "plan.json")
    with pytest.raises(PlanMismatchError, match="record.json"):
        load_run(run)
    (run / "record.json").write_text("{not json")
    with pytest.raises(PlanMismatchError, match="record.json"):
        load_run(run)
    (run / "record.json").write_text('{"model": "m"}')  # missing fields
    with pytest.raises(PlanMismatchError, match="record.json"):
        load_run(run)
    make_record().to_json(run / "record.json")
    (run / "plan.json").write_text('{"format": 99}')
    with pytest.raises(PlanMismatchError, match="plan.json"):
        load_run(run)


# --- text table -------------------------------------------------------------------------------


def test_format_table_units_and_terms():
    df = compare(make_plan(), make_record())
    text = format_table(df)
    for term in df["term"]:
        assert term in text
    assert "720.00 MiB" in text and "800.00 MiB" in text
    assert "2.000e+12 FLOPs" in text
    assert "-10.0%" in text and "+25.0%" in text
    assert "500.00 ms" in text
    assert "409,600 tokens" in text
    assert "4.0000 nats" in text
    lines = text.splitlines()
    assert len(lines) == len(df) + 2
    assert len({len(line) for line in lines}) == 1  # aligned


def test_format_table_gib_and_missing_column():
    df = compare(make_plan(memory_bytes={"total": 3 * 2**30}), cuda_record())
    assert "3.00 GiB" in format_table(df)
    with pytest.raises(ValueError, match="rel_err"):
        format_table(df.drop(columns="rel_err"))
