"""The compute governor: its curve fit, its stopping rule and the governed loop.

Synthetic learning curves (no training): the curve fit recovers a known power law; the governor
stops near the analytic stop step when the threshold is reachable and runs the budget out when
it is not, stops at once on NaN, on divergence, soon on a flat curve and on a rising one; a
higher threshold never stops later (hypothesis). Real tiny-llama runs through
`trainplan.executor.train.run`: a governed run stops after its cooldown with a complete record, governor
summary and checkpoint (and the report's rows and figure); the plan's threshold alone turns the
governor on; an interrupted governed run resumes to the same stop; a diverging run stops with
`diverged` (or `nan`). The planner's side (threshold, predicted stop, calibrated curve):
tests/unit/planner/test_governor_planner.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainplan.costmodels.stopping.curve import fit_curve, marginal_gain
from trainplan.costmodels.stopping.prediction import predict_stop_step, predict_stop_step_from_curve
from trainplan.costmodels.stopping.rule import Governor
from trainplan.costmodels.stopping.schedule import lr_multiplier
from trainplan.errors import TrainplanError

EVERY = 5  # held-out evaluation every this many steps
LAW = dict(E=3.0, A=20.0, alpha=0.5, t0=1.0)


def law_loss(s, E, A, alpha, t0):
    return E + A * (np.asarray(s, dtype=float) + t0) ** -alpha


def analytic_stop(thr, E, A, alpha, t0):
    """Where -dL/dt = alpha A (t + t0)^(-alpha-1) falls to thr."""
    return (alpha * A / thr) ** (1.0 / (1.0 + alpha)) - t0


def heldout_curve(max_steps, *, noise=0.005, seed=0, **law):
    law = {**LAW, **law}
    rng = np.random.default_rng(seed)
    s = np.arange(EVERY, max_steps + 1, EVERY)
    return list(zip(s.tolist(), (law_loss(s, **law) + rng.normal(0.0, noise, s.size)).tolist(), strict=False))


def governed(thr, max_steps=2000, **kw):
    return Governor(threshold_nats_per_step=thr, max_steps=max_steps, refit_every=10, **kw)


# -- the curve math -------------------------------------------------------------------------
def test_fit_recovers_a_known_power_law():
    pts = heldout_curve(400, noise=0.003)
    t, y = np.array(pts).T
    fit = fit_curve(t, y)
    assert fit.success
    assert pytest.approx(LAW["E"], abs=0.1) == fit.E, fit
    assert fit.alpha == pytest.approx(LAW["alpha"], rel=0.1), fit
    truth = LAW["A"] * ((401.0) ** -0.5 - (411.0) ** -0.5)
    mean, lo, hi = marginal_gain(fit, 400, 10, confidence=0.99)
    assert lo <= truth * 1.02 and truth * 0.98 <= hi, (lo, truth, hi)
    band_lo, band_hi = fit.band([100, 400, 4000])
    assert np.all(band_lo <= fit.loss_at([100, 400, 4000])) and np.all(band_hi >= band_lo)
    assert band_hi[2] - band_lo[2] > band_hi[1] - band_lo[1]  # wider when extrapolating
    fitted_t0 = fit_curve(t, y, t0=None)
    assert fitted_t0.param_names[-1] == "t0" and pytest.approx(LAW["E"], abs=0.2) == fitted_t0.E
    json.dumps(fit.to_dict())


def test_predicted_stop_step_matches_the_closed_form():
    thr = 1e-3
    exact = analytic_stop(thr, **LAW)
    pts = heldout_curve(300, noise=0.002)
    t, y = np.array(pts).T
    assert predict_stop_step(fit_curve(t, y), thr) == pytest.approx(exact, rel=0.05)
    from_curve = predict_stop_step_from_curve(lambda s: float(law_loss(s, **LAW)), thr, 10**6)
    assert from_curve == pytest.approx(exact, abs=2)
    assert predict_stop_step_from_curve(lambda s: float(law_loss(s, **LAW)), thr, 100) == 100
    assert predict_stop_step_from_curve(lambda s: 5.0, thr, 100) == 1  # flat: stop at once


@pytest.mark.parametrize("steps, losses, match", [
    ([1, 2], [3.0, 2.0], "at least 3"),
    ([1, 2, 3], [3.0, 2.0], "differ in length"),
    ([1, 2, 3], [3.0, math.nan, 2.0], "finite"),
    ([-1, 2, 3], [3.0, 2.5, 2.0], ">= 0"),
    ([1, 2, 3], [3.0, -2.5, 2.0], ">= 0"),
])
def test_fit_rejects_bad_points(steps, losses, match):
    with pytest.raises(TrainplanError, match=match):
        fit_curve(steps, losses)


# -- the governor on synthetic curves ---------------------------------------------------------
@pytest.mark.parametrize("thr", [1e-3, 3e-4])
def test_stops_near_the_analytic_step_when_the_threshold_is_reachable(thr):
    exact = analytic_stop(thr, **LAW)
    gov = governed(thr)
    dec = gov.replay(heldout_loss=heldout_curve(2000))
    assert dec.reason == "marginal_gain" and dec.end_now
    assert abs(dec.cooldown_start - exact) / exact < 0.15, (dec.cooldown_start, exact)
    assert dec.cooldown_start >= exact - 2 * EVERY  # conservative: the upper bound, not the mean
    assert dec.final_step == dec.cooldown_start + math.ceil(dec.cooldown_start / 4)
    assert dec.predicted_stop_step == pytest.approx(exact, rel=0.15)
    json.dumps(gov.summary())


@pytest.mark.parametrize("seed", range(3))
def test_noise_delays_the_stop_and_never_brings_it_forward(seed):
    exact = analytic_stop(1e-3, **LAW)
    dec = governed(1e-3, max_steps=1000).replay(heldout_loss=heldout_curve(1000, noise=0.05, seed=seed))
    assert dec.reason == "marginal_gain" and exact <= dec.cooldown_start < 1.4 * exact, (exact, dec)


def test_runs_the_budget_out_while_the_curve_still_drops_fast():
    thr = 1e-6  # analytic stop near step 46,000; the budget is 1,000
    dec = governed(thr, max_steps=1000).replay(heldout_loss=heldout_curve(1000))
    assert dec.reason == "budget" and dec.final_step == 1000 and dec.cooldown_start is None


def test_a_zero_threshold_disables_the_marginal_gain_rule():
    dec = governed(0.0, max_steps=300).replay(heldout_loss=heldout_curve(300, E=5.0, A=0.0))
    assert dec.reason == "budget" and dec.steps == 300


def test_flat_curve_stops_on_marginal_gain_soon_after_min_points():
    gov = governed(1e-4, min_points=8)
    flat = [(s, 5.0 + e) for s, e in zip(range(EVERY, 2001, EVERY),
                                          np.random.default_rng(1).normal(0, 0.01, 400), strict=False)]
    dec = gov.replay(heldout_loss=flat)
    assert dec.reason == "marginal_gain"
    # the first fit needs 8 points at steps >= fit_from x steps: step 55; allow a few refits
    assert dec.decided_at <= 150, dec.decided_at
    assert abs(dec.gain_per_step[0]) < 1e-4


def test_a_rising_heldout_loss_stops_on_the_trend():
    # overfitting on repeated data: down to a minimum near step 470, then up; the power law plus
    # floor cannot rise, the straight-line trend through the last half of the steps sees it
    rng = np.random.default_rng(2)
    s = np.arange(EVERY, 1001, EVERY)
    mean = law_loss(s, **LAW) + 2e-6 * np.maximum(s - 300, 0) ** 2
    y = mean + rng.normal(0, 0.01, s.size)
    dec = governed(1e-5, max_steps=1000).replay(heldout_loss=list(zip(s.tolist(), y.tolist(), strict=False)))
    lowest = int(s[np.argmin(mean)])
    assert dec.reason == "marginal_gain" and lowest < dec.decided_at < 1.6 * lowest, (lowest, dec)
    assert dec.trend_per_step[2] < 1e-5
    # decided on a rising loss: no cooldown (it would anneal towards the repeated data), ends now
    assert dec.trend_per_step[0] <= 0 and dec.cooldown_start is None
    assert dec.end_now and dec.final_step == dec.decided_at


def u_shaped(max_steps=1000, seed=2):
    """Held-out losses that fall to a minimum near step 470 and rise after (overfitting)."""
    s = np.arange(EVERY, max_steps + 1, EVERY)
    mean = law_loss(s, **LAW) + 2e-6 * np.maximum(s - 300, 0) ** 2
    y = mean + np.random.default_rng(seed).normal(0, 0.01, s.size)
    return list(zip(s.tolist(), y.tolist(), strict=False))


def test_a_stop_on_a_falling_loss_cools_down_and_one_on_a_rising_loss_does_not():
    # 3e-3 nats/step is reached on the way down: the trend still falls, the cooldown runs
    falling = governed(3e-3, max_steps=1000)
    dec = falling.replay(heldout_loss=u_shaped())
    assert dec.reason == "marginal_gain" and dec.trend_per_step[0] > 0
    assert dec.cooldown_start == dec.decided_at and dec.final_step == dec.decided_at + math.ceil(dec.decided_at / 4)
    assert not falling.summary()["cooldown_skipped"]
    # 1e-5 is reached only once the loss rises: ends at once ...
    rising = governed(1e-5, max_steps=1000)
    dec = rising.replay(heldout_loss=u_shaped())
    assert dec.final_step == dec.decided_at and rising.summary()["cooldown_skipped"]
    assert rising.lr_multiplier(dec.decided_at - 1) == 1.0  # no decay before the end
    # ... unless told to cool down anyway (the same decision step, a cooldown after it)
    always = governed(1e-5, max_steps=1000, skip_cooldown_when_rising=False)
    dec2 = always.replay(heldout_loss=u_shaped())
    assert dec2.decided_at == dec.decided_at and dec2.final_step == dec.decided_at + math.ceil(dec.decided_at / 4)
    with pytest.raises(TrainplanError, match="skip_cooldown_when_rising"):
        governed(1e-5, skip_cooldown_when_rising="yes")


def test_nan_train_loss_stops_at_once():
    gov = governed(1e-4)
    for s in range(1, 31):
        gov.observe_train(s, 9.0 - 0.01 * s)
        assert not gov.decide(s).stop
    gov.observe_train(31, math.nan)
    dec = gov.decide(31)
    assert (dec.stop, dec.end_now, dec.reason, dec.final_step) == (True, True, "nan", 31)
    assert gov.decide(32).reason == "nan"  # it stays stopped


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_heldout_loss_stops_with_nan(bad):
    gov = governed(1e-4)
    gov.observe_heldout(5, bad)
    assert gov.decide(5).reason == "nan"


def test_nan_during_the_cooldown_ends_the_run_at_once():
    gov = governed(1e-3)
    dec = gov.replay(heldout_loss=heldout_curve(2000), until=500)
    assert dec.reason == "marginal_gain" and not dec.end_now
    gov.observe_train(dec.steps + 1, math.nan)
    dec = gov.decide(dec.steps + 1)
    assert dec.reason == "nan" and dec.end_now


def test_divergence_stops_after_patience_and_a_spike_does_not():
    rng = np.random.default_rng(0)
    down = [6.0 - 1.5 * (1 - math.exp(-s / 60)) + rng.normal(0, 0.02) for s in range(1, 201)]
    spike = down[:150] + [30.0] + down[151:]  # one bad batch: the EMA returns at once
    gov = governed(0.0, max_steps=10_000, divergence_factor=1.5, patience=10, window=10)
    assert not gov.replay(train_loss=list(enumerate(spike))).stop
    blowup = down + [down[-1] * math.exp(0.05 * k) for k in range(1, 200)]
    gov = governed(0.0, max_steps=10_000, divergence_factor=1.5, patience=10, window=10)
    dec = gov.replay(train_loss=list(enumerate(blowup)))
    assert dec.reason == "diverged" and dec.end_now
    first_above = next(s for s in range(200, 400) if blowup[s] > 1.5 * min(down))
    assert first_above < dec.steps < first_above + 40, (first_above, dec.steps)


def test_lr_multiplier_is_wsd_cooldown_triggered_by_the_stop():
    gov = governed(1e-3)
    assert gov.lr_multiplier(10) == 1.0
    dec = gov.replay(heldout_loss=heldout_curve(2000), until=600)
    s, n = dec.cooldown_start, dec.final_step
    assert gov.lr_multiplier(s - 1) == 1.0 and gov.lr_multiplier(s) == 1.0
    assert gov.lr_multiplier((s + n) // 2) == pytest.approx(0.5, abs=0.02)
    assert gov.lr_multiplier(n - 1) == pytest.approx(max(0.05, 1 / (n - s)))
    assert lr_multiplier(5, {"cooldown_start": None, "final_step": None}) == 1.0


def test_for_plan_replay_of_a_record_and_the_report_frame():
    from types import SimpleNamespace

    from trainplan.executor.reporting.governor_panel import curve_frame, plot_governor

    plan = SimpleNamespace(decisions=SimpleNamespace(governor_threshold=1e-3, max_steps=2000,
                                                     warmup_steps=20))
    gov = Governor.for_plan(plan, refit_every=10)
    assert (gov.threshold_nats_per_step, gov.max_steps, gov.warmup_steps) == (1e-3, 2000, 20)
    held = [(s, s * 1024, v) for s, v in heldout_curve(2000)]  # RunRecord.heldout_loss rows
    train = [(s - 1, v + 0.1) for s, v in heldout_curve(2000)]  # 0-based step index
    dec = gov.replay(train, held)
    assert dec.reason == "marginal_gain" and gov.final_step == dec.final_step
    summary = json.loads(json.dumps(gov.summary()))
    assert summary["decided_at"] == dec.cooldown_start and summary["history"]
    frame = curve_frame(held, summary, max_steps=2000)
    assert list(frame.columns) == ["steps", "measured", "predicted", "lower", "upper"]
    fitted = frame[frame["steps"] >= summary["fit"]["t_min"]]
    assert fitted["predicted"].notna().all() and (fitted["lower"] <= fitted["upper"]).all()
    assert frame.loc[frame["steps"] < summary["fit"]["t_min"], "predicted"].isna().all()
    assert frame["measured"].notna().sum() == len(held)
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    plot_governor(ax, frame, summary, max_steps=2000)
    assert {ln.get_label() for ln in ax.get_lines()} >= {"fitted curve", "planned budget (2000 steps)"}


def test_rejects_bad_settings():
    with pytest.raises(TrainplanError, match="threshold_nats_per_step"):
        Governor(threshold_nats_per_step=-1.0, max_steps=10)
    with pytest.raises(TrainplanError, match="min_points"):
        Governor(threshold_nats_per_step=1e-3, max_steps=10, min_points=2)
    with pytest.raises(TrainplanError, match="confidence"):
        Governor(threshold_nats_per_step=1e-3, max_steps=10, confidence=1.0)


@settings(max_examples=10, deadline=None)
@given(alpha=st.floats(0.2, 1.5), A=st.floats(2.0, 50.0), seed=st.integers(0, 2**16),
       thr_lo=st.floats(1e-5, 3e-3), factor=st.floats(1.0, 10.0))
def test_a_higher_threshold_never_stops_later(alpha, A, seed, thr_lo, factor):
    pts = heldout_curve(400, noise=0.005, seed=seed, A=A, alpha=alpha)
    lo = Governor(threshold_nats_per_step=thr_lo, max_steps=400, refit_every=20).replay(heldout_loss=pts)
    hi = Governor(threshold_nats_per_step=thr_lo * factor, max_steps=400,
                  refit_every=20).replay(heldout_loss=pts)
    assert hi.steps <= lo.steps and hi.final_step <= lo.final_step, (lo, hi)


@pytest.fixture(scope="module")
def small_plan():
    """tiny-llama on the cpu profile, a 12,800-token subset of a 400k-token corpus repeated."""
    from trainplan.planner.api import plan_for_choice

    return plan_for_choice("tiny-llama", "cpu", seq_len=128, micro_batch=8, max_steps=2000,
                           vocab_size=8192, data_tokens=400_000, data_fraction=0.032)


# -- the loop helper ----------------------------------------------------------------------------
def test_the_loop_is_inert_without_a_governor(small_plan):
    from trainplan.costmodels.stopping.schedule import GOVERNED_EVALS
    from trainplan.executor.governor import GovernedLoop

    loop = GovernedLoop.for_run(small_plan)
    assert not loop.on and loop.lr(399) == 1.0 and not loop.eval_due(400)
    assert loop.end(2000) == 2000 and loop.reason == "" and loop.ended == ""
    assert GovernedLoop.default_eval_every(small_plan) == 200  # run's old default, max_steps // 10
    on = GovernedLoop.for_run(small_plan, governed(1e-3))
    assert on.on and GovernedLoop.default_eval_every(small_plan, on.gov) == 2000 // GOVERNED_EVALS


# -- real governed runs: record and checkpoint complete, resume, NaN and divergence -------------
@pytest.fixture()
def tiny_run(tmp_path, cpu_profile, torch_threads):
    """`go(out, governor=None, threshold=1.0, lr=None, **run_kwargs) -> RunRecord`: a real
    tiny-llama run (vocab 512, seq_len 64, 40-step budget) on a small corpus, one torch thread;
    also returns the plan as `go.plan`."""
    import dataclasses
    import random

    from trainplan.executor.data.batches import load_corpus
    from trainplan.executor.train import run
    from trainplan.planner.api import plan_for_choice
    from trainplan.planner.governor import with_governor

    rng = random.Random(0)
    words = ["the", "king", "is", "dead", "long", "live", "the", "queen", "now", "is", "the", "winter", "of",
             "our", "discontent"]
    path = tmp_path / "tiny.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(15)) for _ in range(600)) + "\n",
                    encoding="utf-8")
    corpus = load_corpus([path], vocab_size=512)
    base = plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=2, max_steps=40,
                           vocab_size=corpus.vocab_size)

    def go(out, governor=None, threshold=1.0, lr=None, **kw):
        d = dataclasses.replace(base.decisions, lr=lr or base.decisions.lr)
        go.plan = with_governor(dataclasses.replace(base, decisions=d), threshold_nats_per_step=threshold)
        with torch_threads(1):
            return run(go.plan, data=corpus, out=tmp_path / out, progress=False, governor=governor, **kw)

    return go


def test_a_governed_run_ends_with_a_complete_record_and_checkpoint(tmp_path, tiny_run):
    """A real tiny-llama run whose governor stops it (a threshold of 1 nat per step: the first
    fit stops it) ends after its cooldown with the held-out loss measured at the stop, the
    record says `marginal_gain`, and the checkpoint at the final step loads."""
    import torch

    from trainplan.executor.apply.applied import lr_at
    from trainplan.executor.checkpoint import CHECKPOINT_DIR, LATEST, latest_checkpoint, load_checkpoint
    from trainplan.executor.optimizers import build_optimizer
    from trainplan.executor.record import RunRecord
    from trainplan.modeling.presets import build_model

    gov = Governor(threshold_nats_per_step=1.0, max_steps=40, warmup_steps=4, refit_every=2, min_points=4)
    rec = tiny_run("run", governor=gov, eval_every=2)
    plan = tiny_run.plan
    dec = gov.decide(rec.steps)
    assert rec.stop_reason == "marginal_gain" and dec.reason == "marginal_gain", (rec.stop_reason, rec.notes)
    assert rec.steps == dec.final_step == gov.final_step < plan.decisions.max_steps
    assert dec.cooldown_start < dec.final_step  # the cooldown ran
    assert gov.lr_multiplier(rec.steps - 1) < 0.5 and lr_at(rec.steps - 1, plan) == plan.decisions.lr
    assert rec.heldout_loss[-1][0] == rec.steps  # the final loss is measured at the stop
    assert [s for s, _ in rec.train_loss] == list(range(rec.steps))
    assert any(n.startswith("governor: stop (marginal_gain)") for n in rec.notes), rec.notes
    assert RunRecord.from_json(tmp_path / "run" / "record.json") == rec
    summary = json.loads((tmp_path / "run" / "governor.json").read_text())
    assert summary["reason"] == "marginal_gain" and summary["final_step"] == rec.steps
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt is not None and ckpt.name == f"step-{rec.steps:06d}", ckpt
    assert (tmp_path / "run" / CHECKPOINT_DIR / LATEST).read_text().strip() == ckpt.name
    fresh = build_model(plan.model, device="cpu", vocab_size=plan.vocab_size, seed=123)
    opt = build_optimizer(fresh.parameters(), bits=plan.decisions.optimizer_bits, lr=plan.decisions.lr)
    meta = load_checkpoint(ckpt, fresh, opt, dev=torch.device("cpu"))
    assert meta["steps"] == rec.steps and meta["record"].stop_reason == "marginal_gain"
    assert len(opt.state) == len(list(fresh.parameters())), "optimizer state missing"
    # the report: predicted beside actual stop and final loss, and the governor's figure
    from trainplan.executor.reporting.compare import compare
    from trainplan.executor.reporting.figures import governor_figure, read_governor_summary

    table = compare(plan, rec).set_index("term")
    assert table.loc["end_step", "measured"] == rec.steps
    assert table.loc["end_step", "predicted"] == plan.predictions.predicted_end_step
    assert table.loc["final_loss", "predicted"] == plan.predictions.predicted_end_loss
    fig = governor_figure(plan, rec, read_governor_summary(tmp_path / "run"))
    labels = {ln.get_label() for ln in fig.axes[0].get_lines()}
    assert {"fitted curve", "planned budget (40 steps)", f"actual stop ({rec.steps})"} <= labels, labels
    # the published law predicts no stop within 40 steps: the plan's end is the budget
    assert plan.predictions.predicted_stop_step == plan.predictions.predicted_end_step == 40
    assert any(lb.startswith("predicted end (plan)") for lb in labels), labels
    assert read_governor_summary(tmp_path) is None
    from trainplan.executor.reporting.report import report

    html = report(plan, rec, tmp_path / "run")["html"].read_text()
    assert "Compute governor" in html
    assert "governed end step" in html


class _Rising(Governor):
    """A governor that sees a held-out loss no longer falling whenever it decides (a real tiny
    run does not overfit within 40 steps), and may stop from step `from_step` on only."""

    rising = property(lambda self: self.skip_cooldown_when_rising)
    from_step = 17

    def decide(self, steps):
        self.threshold_nats_per_step = 1.0 if steps >= self.from_step else 0.0
        return super().decide(steps)


def test_a_governed_run_that_ends_at_once_measures_its_loss_and_checkpoints(tmp_path, tiny_run):
    """A stop decided on a held-out loss that no longer falls ends the real run at once, between
    two evaluations (every 3 steps, refits every 2): no cooldown, the held-out loss measured at
    the stop all the same, a complete record and a checkpoint at the final step."""
    from trainplan.executor.checkpoint import latest_checkpoint
    from trainplan.executor.record import RunRecord

    gov = _Rising(threshold_nats_per_step=1.0, max_steps=40, warmup_steps=4, refit_every=2, min_points=4)
    # first fit at an evaluation (step 15), the next ones every 2 steps: it decides at step 17
    rec = tiny_run("at-once", governor=gov, eval_every=3)
    dec = gov.decide(rec.steps)
    assert rec.stop_reason == "marginal_gain" and dec.cooldown_start is None, (rec.stop_reason, rec.notes)
    assert rec.steps == dec.decided_at == dec.final_step < 40
    assert rec.steps % 3 != 0  # decided between evaluations: the loop measured the loss at the stop
    assert gov.lr_multiplier(rec.steps - 1) == 1.0  # no decay was run
    assert rec.heldout_loss[-1][0] == rec.steps and rec.final_heldout_loss == rec.heldout_loss[-1][-1]
    assert [s for s, _ in rec.train_loss] == list(range(rec.steps))
    assert any("ends at once, no cooldown" in n for n in rec.notes), rec.notes
    assert RunRecord.from_json(tmp_path / "at-once" / "record.json") == rec
    summary = json.loads((tmp_path / "at-once" / "governor.json").read_text())
    assert summary["cooldown_skipped"] and summary["final_step"] == rec.steps
    ckpt = latest_checkpoint(tmp_path / "at-once")
    assert ckpt is not None and ckpt.name == f"step-{rec.steps:06d}", ckpt


def test_the_plan_threshold_governs_and_an_interrupted_governed_run_resumes_to_the_same_stop(tiny_run):
    """The plan's threshold alone turns the governor on (defaults: evaluations every step of the
    40-step budget, first fit once 8 exist). Interrupted during its cooldown and resumed, the run
    replays the governor's state and ends where the uninterrupted run ends; resuming the ended
    run trains nothing."""
    whole = tiny_run("whole")
    assert whole.stop_reason == "marginal_gain" and whole.steps < 40, (whole.stop_reason, whole.notes)
    decided = next(int(n.split("after ")[1].split(" steps")[0]) for n in whole.notes
                   if n.startswith("governor: stop"))
    part = tiny_run("part", stop_after_steps=decided + 1)
    assert part.stop_reason == "interrupted" and part.steps == decided + 1
    resumed = tiny_run("part", resume=True)
    assert (resumed.stop_reason, resumed.steps) == ("marginal_gain", whole.steps)
    assert [s for s, _ in resumed.train_loss] == list(range(whole.steps))
    assert resumed.final_heldout_loss == pytest.approx(whole.final_heldout_loss, rel=1e-4)
    again = tiny_run("part", resume=True)
    assert (again.stop_reason, again.steps, len(again.train_loss)) == ("marginal_gain", whole.steps,
                                                                        whole.steps)


def test_a_governed_run_that_diverges_stops_with_diverged(tmp_path, tiny_run):
    """A learning rate of 10 blows the loss up; the governor stops the run (`diverged`, or
    `nan` if the loss overflows first), the record is written and TrainingDivergedError raised;
    with no threshold the loop still runs the checks."""
    from trainplan.errors import TrainingDivergedError
    from trainplan.executor.record import RunRecord

    gov = Governor(threshold_nats_per_step=0.0, max_steps=40, divergence_factor=1.2, patience=3, window=2)
    with pytest.raises(TrainingDivergedError, match="diverged|nan"):
        tiny_run("blowup", governor=gov, threshold=0.0, lr=10.0)
    rec = RunRecord.from_json(tmp_path / "blowup" / "record.json")
    assert rec.stop_reason in ("diverged", "nan") and rec.steps < 40, (rec.stop_reason, rec.train_loss)
    assert gov.decide(rec.steps).reason == rec.stop_reason


def test_replay_jumps_between_events_and_decides_as_the_step_by_step_loop():
    """`Governor.replay` calls `decide` only where the decision can change (observations, the
    refit due after an evaluation, the budget, a cooldown's end); over random series (evaluation
    and refit periods, thresholds, budgets, a NaN, a rising tail) it returns what deciding after
    every step returns, and a 10^8-step budget with 50 evaluations replays at once."""
    import warnings

    from trainplan.costmodels.stopping.rule import Decision

    def every_step(gov, train, held, last):
        dec = Decision(stop=False, reason="", end_now=False, steps=0)
        for s in range(1, last + 1):
            if s in train:
                gov.observe_train(s, train[s])
            if s in held:
                gov.observe_heldout(s, held[s])
            dec = gov.decide(s)
            if dec.end_now:
                break
        return dec

    def key(d):
        return (d.stop, d.reason, d.end_now, d.steps, d.decided_at, d.final_step, d.cooldown_start)

    rng = np.random.default_rng(0)
    reasons = set()
    for _ in range(60):
        n, ev, rf = int(rng.integers(40, 300)), int(rng.integers(1, 30)), int(rng.integers(1, 25))
        s = np.arange(ev, n + 1, ev)
        rise = 0.0005 * np.maximum(s - rng.integers(50, 250), 0) if rng.random() < 0.5 else 0.0
        y = 3 + 2 * (s + 1.0) ** -0.5 + rng.normal(0, 0.01, s.size) + rise
        held = {int(a): float(b) for a, b in zip(s, y, strict=False)}
        train = {i + 1: 3 + 2 * (i + 2) ** -0.5 for i in range(n)} if rng.random() < 0.5 else {}
        if train and rng.random() < 0.3:
            train[int(rng.integers(1, n))] = math.nan
        kw = dict(threshold_nats_per_step=float(10 ** rng.uniform(-4, -1.5)), max_steps=n - int(rng.integers(0, 3)),
                  refit_every=rf, min_points=int(rng.integers(4, 9)), warmup_steps=int(rng.integers(0, 20)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            jumped = Governor(**kw).replay([(k - 1, v) for k, v in train.items()], list(held.items()))
            stepped = every_step(Governor(**kw), train, held, max([*train, *held]))
        assert key(jumped) == key(stepped), (kw, ev, key(jumped), key(stepped))
        reasons.add(jumped.reason)
    assert {"marginal_gain", "nan", "budget"} <= reasons, reasons
    n = 10**8
    s = np.arange(n // 50, n + 1, n // 50)
    dec = Governor(threshold_nats_per_step=1e-30, max_steps=n).replay(
        heldout_loss=list(zip(s.tolist(), (3 + 2 * (s + 1.0) ** -0.5).tolist(), strict=False)))
    assert dec.reason == "budget" and dec.steps == n
