"""trainplan.executor.reporting.forecast: the run's own forecast of its final loss, in the
comparison table, the verdicts and the HTML report."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tests.support import make_plan, make_record
from trainplan.costmodels.loss.cache import law_fields
from trainplan.costmodels.loss.law import LossLaw
from trainplan.executor.record import RunRecord
from trainplan.executor.reporting.compare import compare
from trainplan.executor.reporting.forecast import (
    forecast_at,
    forecast_figure,
    forecast_inputs,
    online_forecast,
    replay_forecast,
)
from trainplan.executor.reporting.verdicts import HELD, NOT_HELD, term_label, tolerance, verdict_frame

STEPS, W, E = 1000, 20, 2.0


def forecast_plan(gamma: float | None = 0.05, **pred):
    plan = make_plan(loss_law=law_fields(LossLaw(E=E, A=0.0, B=6.0, beta=0.3, local=True)),
                     loss_calibration={} if gamma is None else {"fit": {"gamma": gamma}}, **pred)
    d = dataclasses.replace(plan.decisions, max_steps=STEPS, warmup_steps=W)
    return dataclasses.replace(plan, decisions=d)


def finished_record(plan, every: int = 20, seed: int = 0) -> RunRecord:
    """A finished run on L = E + 6 (t - w/2)^-0.3 (+ noise), its held-out 0.1 above, a cooldown
    that removes 5% of the excess, the executor's forecast after each evaluation."""
    rng = np.random.default_rng(seed)

    def curve(t: float) -> float:
        return E + 6.0 * max(t - W / 2, 1.0) ** -0.3

    rec = make_record(steps=0, train_loss=[], heldout_loss=[], stop_reason="")
    for i in range(STEPS):
        rec.steps = i + 1
        rec.train_loss.append((i, curve(i + 1) + 0.02 * rng.standard_normal()))
        if rec.steps % every == 0:
            held = curve(rec.steps) + 0.1
            if rec.steps == STEPS:
                held -= 0.05 * (held - E)
            rec.heldout_loss.append((rec.steps, rec.steps * 4096, held))
            if (made := online_forecast(plan, rec)) is not None:
                rec.loss_forecast.append(made)
    rec.tokens, rec.stop_reason = STEPS * 4096, "budget"
    return rec


def test_inputs_come_from_the_plans_law_and_its_pilots():
    assert forecast_inputs(forecast_plan()) == (E, 0.05)
    assert forecast_inputs(forecast_plan(gamma=None)) == (E, None)  # no pilots: not measured
    assert forecast_inputs(forecast_plan(gamma=3.0))[1] == 0.95  # clipped
    assert forecast_inputs(make_plan()) == (0.0, None)  # an old plan without a recorded law
    own = make_plan(loss_law=law_fields(LossLaw(E=E, A=0.0, local=True, cooldown_gain=0.02)),
                    loss_calibration={"fit": {"gamma": 0.05}})
    assert forecast_inputs(own) == (E, 0.02)  # the law's own gain first
    assert forecast_inputs(own, cooldown_gain=0.1) == (E, 0.1)  # a given one over both
    published = make_plan(loss_law=law_fields(LossLaw()))
    law = LossLaw()
    assert forecast_inputs(published)[0] == pytest.approx(law.E + law.A / 1_000_000 ** law.alpha)


def test_the_forecast_is_replayable_and_lands_near_the_end():
    plan = forecast_plan()
    rec = finished_record(plan)
    assert rec.loss_forecast and all(s % 20 == 0 for s, _, _ in rec.loss_forecast)
    at30 = forecast_at(rec, STEPS, 0.3)
    assert at30[0] == 300
    assert replay_forecast(plan, rec, 0.3) == pytest.approx(at30, rel=1e-12)
    assert abs(at30[1] - rec.final_heldout_loss) / rec.final_heldout_loss < 0.01
    assert forecast_at(rec, STEPS, 0.01) is None and replay_forecast(plan, rec, 0.01) is None


def test_compare_rows_and_verdicts_for_a_finished_run():
    plan = forecast_plan()
    rec = finished_record(plan)
    df = compare(plan, rec)
    terms = list(df["term"])
    assert terms[-4:] == ["final_loss", "final_loss_at_10pct", "final_loss_at_30pct", "final_loss_at_50pct"]
    v = verdict_frame(df).set_index("term")
    assert v.loc["final_loss_at_30pct", "label"] == "final loss forecast at 30%"
    assert v.loc["final_loss_at_30pct", "tolerance"] == 0.02
    assert v.loc["final_loss_at_30pct", "verdict"] == HELD
    bad = dataclasses.replace(rec, loss_forecast=[(s, f + 0.5, b) for s, f, b in rec.loss_forecast])
    assert verdict_frame(compare(plan, bad)).set_index("term").loc["final_loss_at_30pct", "verdict"] == NOT_HELD
    assert tolerance("final_loss_at_50pct") == 0.02 and term_label("final_loss_at_10pct").endswith("10%")


@pytest.mark.parametrize("change", ["governed", "interrupted", "unfinished"])
def test_no_forecast_rows_for_runs_that_did_not_end_at_the_plans_end(change):
    plan = forecast_plan()
    rec = finished_record(plan)
    if change == "governed":
        plan = dataclasses.replace(plan, predictions=dataclasses.replace(plan.predictions, predicted_end_step=900,
                                                                         predicted_end_loss=2.3))
    elif change == "interrupted":
        rec = dataclasses.replace(rec, stop_reason="interrupted")
    else:
        rec = dataclasses.replace(rec, steps=STEPS // 2)
    assert not any(t.startswith("final_loss_at_") for t in compare(plan, rec)["term"])


def test_a_fraction_without_a_forecast_yet_is_no_prediction():
    plan = forecast_plan()
    rec = finished_record(plan)
    rec = dataclasses.replace(rec, loss_forecast=[f for f in rec.loss_forecast if f[0] > 0.2 * STEPS])
    row = verdict_frame(compare(plan, rec)).set_index("term").loc["final_loss_at_10pct"]
    assert math.isnan(row["predicted"]) and row["verdict"] == "no prediction"


def test_figure_and_html_report(tmp_path):
    from trainplan.executor.reporting.report import report

    plan = forecast_plan()
    rec = finished_record(plan)
    fig = forecast_figure(plan, rec)
    lo, hi = fig.axes[0].get_ylim()
    assert lo < rec.final_heldout_loss < hi and hi - lo < 1.0  # scaled to the forecasts, not the first losses
    html = report(plan, rec, tmp_path / "run", cache_dir=tmp_path / "cache")["html"].read_text()
    assert "Online forecast of the final loss" in html and "final loss forecast at 30%" in html
    plain = report(plan, dataclasses.replace(rec, loss_forecast=[]), tmp_path / "run2",
                   cache_dir=tmp_path / "cache")["html"].read_text()
    assert "Online forecast of the final loss" not in plain


def test_a_bound_is_shown_and_not_judged():
    from trainplan.costmodels.loss.law import BOUND
    from trainplan.executor.reporting.verdicts import BOUND_ONLY, is_bound_plan, summary_line

    plan = make_plan(loss_regime=BOUND, final_loss=6.0)
    rec = make_record()  # measured 4.0: a miss of +50% if it were a prediction
    assert is_bound_plan(plan) and not is_bound_plan(make_plan())
    v = verdict_frame(compare(plan, rec), bound=is_bound_plan(plan))
    assert v.set_index("term").loc["final_loss", "verdict"] == BOUND_ONLY
    line = summary_line(v)
    assert "final loss off" not in line and "final loss a bound near ln(V), not judged" in line
    assert "final loss off by +50%" in summary_line(verdict_frame(compare(plan, rec)))
