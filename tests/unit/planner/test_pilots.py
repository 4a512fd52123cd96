"""Issue #23: `solve` calibrates its loss law on pilot runs by itself where they cost at most 10%
of the budget, charges them to it, caches the fit and records what it did (the pilots' training
replaced by a stand-in that follows a known law: the rule, the charge and the cache are what is
tested here; `benchmarks/loss.py` trains them for real)."""

from __future__ import annotations

import dataclasses
import types

import pytest

import trainplan.planner.pilots as pilots
from trainplan.costmodels.loss.law import LOCAL, LossLaw
from trainplan.costmodels.loss.pilots import PILOT_BUDGET_FRAC, PilotResult
from trainplan.costmodels.loss.planned import run_loss
from trainplan.planner import Budget, solve
from trainplan.planner.joint.problem import prepare

TRUTH = LossLaw(E=3.0, A=0.0, B=40.0, beta=0.3, b_crit_tokens=3000.0)
"""The stand-in pilots' law; its E is replaced by the floor the planner pins (the published law's
E + A / N^alpha for the model: `trainplan.planner.pilots.calibrate`)."""
CORPUS = types.SimpleNamespace(sha256="test-corpus", tokenizer_path="")
DATA_TOKENS = 1_373_953


@pytest.fixture
def fake_pilots(monkeypatch):
    """Pilots that 'train' instantly along TRUTH; the list of the specs each call ran."""
    calls, truths = [], []

    def run(pr, model, specs, corpus, lr, seed, progress):
        calls.append(specs)
        truth = dataclasses.replace(TRUTH, E=pr.law.E + pr.law.A / pr.graph.n_params ** pr.law.alpha)
        truths.append(truth)
        out = []
        for s in specs:
            w = s.warmup_steps
            eff = s.tokens_per_step / (1 + s.tokens_per_step / truth.b_crit_tokens)
            steps = tuple(k for k in range(s.eval_every, s.steps, s.eval_every) if k >= s.eval_from)
            losses = tuple(truth.E + truth.B * ((k - w / 2) * eff) ** -truth.beta for k in steps)
            final = truth.E + truth.B * ((s.steps - w / 2) * eff) ** -truth.beta
            out.append(PilotResult(spec=s, steps=steps, losses=losses, final_loss=final, wall_s=1.0))
        return out

    monkeypatch.setattr(pilots, "_run_pilots", run)
    run.truths = truths
    return calls


def pilots_truth(calls) -> LossLaw:
    return pilots._run_pilots.truths[-1]


def _solve(budget_flops: float, cache, **kw):
    return solve("tiny-llama", "cpu", Budget(flops=budget_flops), seq_len=256, data_tokens=DATA_TOKENS,
                 data=CORPUS, cache_dir=str(cache), data_methods=("random",), time_limit_s=5.0, **kw)


def test_solve_runs_pilots_charges_them_and_records_the_fit(fake_pilots, tmp_path, cpu_profile):
    plan = _solve(1e14, tmp_path)  # pilots at micro-batches 1 and 8: the critical batch is fitted
    cal = plan.predictions.loss_calibration
    assert len(fake_pilots) == 1 and cal["ran"] and plan.predictions.loss_regime == LOCAL
    assert 0 < cal["pilot_flops"] <= PILOT_BUDGET_FRAC * 1e14 and cal["charged"] == cal["pilot_flops"]
    # the plan spends the budget the pilots left: its steps' FLOPs fit 1e14 - pilots, not 1e14
    spent = plan.decisions.max_steps * plan.predictions.flops_per_step
    assert spent <= 1e14 - cal["pilot_flops"] + plan.predictions.flops_per_step
    assert cal["fit"]["b_crit_tokens"] == pytest.approx(TRUTH.b_crit_tokens, rel=0.05)
    # the plan predicts with the fitted law, which is TRUTH
    assert plan.predictions.final_loss == pytest.approx(
        run_loss(pilots_truth(fake_pilots), plan.model_n_params, steps=plan.decisions.max_steps,
                        tokens_per_step=plan.predictions.tokens_per_step), rel=1e-3)


def test_a_cached_fit_is_reused_for_a_smaller_budget_and_charged_nothing(fake_pilots, tmp_path, cpu_profile):
    _solve(4e13, tmp_path)
    plan = _solve(2e13, tmp_path)
    cal = plan.predictions.loss_calibration
    assert len(fake_pilots) == 1 and not cal["ran"] and cal["charged"] == 0.0 and "reused" in cal["why"]
    assert plan.predictions.loss_regime == LOCAL
    _solve(8e13, tmp_path)  # a larger budget: its own pilots (the fit would extrapolate further)
    assert len(fake_pilots) == 2


def test_no_pilots_where_they_would_cost_more_than_a_tenth(fake_pilots, tmp_path, cpu_profile):
    plan = _solve(1e13, tmp_path)
    assert not fake_pilots and not plan.predictions.loss_calibration["ran"]
    assert "does not buy" in plan.predictions.loss_calibration["why"]
    assert plan.predictions.loss_regime != LOCAL and plan.predictions.final_loss <= 9.0110  # ln(8192)


def test_no_pilots_without_a_corpus_or_for_another_device(fake_pilots, tmp_path, cpu_profile):
    plan = solve("tiny-llama", "cpu", Budget(flops=4e13), seq_len=256, data_tokens=DATA_TOKENS,
                 data_methods=("random",), time_limit_s=5.0)
    assert not fake_pilots and plan.predictions.loss_calibration == {}
    pr = prepare("tiny-llama", "h100", seq_len=256, data_tokens=DATA_TOKENS)
    got = pilots.calibrated(pr, "tiny-llama", Budget(flops=4e13), CORPUS, enabled=True, lr=3e-3, seed=0)
    assert got[2]["ran"] is False and "not on h100" in got[2]["why"] and not fake_pilots
