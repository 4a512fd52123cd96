"""Issue #37, item 5: predictions that never pretend: a law near ln(V) is reported as a bound and
still ranks plans; the band widens outside the fitted range (`trainplan.costmodels.loss.bounds`)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from trainplan.costmodels.loss.bounds import KNEE_FRAC, decades_outside, is_bound, soft_ceiling
from trainplan.costmodels.loss.law import BOUND, CHINCHILLA_PARAMS_RANGE, EXTRAPOLATED, PUBLISHED, LossLaw
from trainplan.costmodels.loss.transfer import carry_law

V = 8192
C = math.log(V)


def test_soft_ceiling_is_the_identity_below_the_knee_and_bends_under_ln_v():
    x = np.linspace(0.0, 100.0, 20001)
    y = soft_ceiling(x, C)
    below = x <= KNEE_FRAC * C
    assert np.array_equal(y[below], x[below])
    assert np.all(y < C) and np.all(np.diff(y) > 0)  # strictly increasing, never at the ceiling
    knee = KNEE_FRAC * C
    eps = 1e-6
    slope = (soft_ceiling(knee + eps, C) - knee) / eps
    assert slope == pytest.approx(1.0, abs=1e-4)  # no kink at the knee
    assert soft_ceiling(17.0, C) - soft_ceiling(16.0, C) > 1e-3  # far above, still resolvable (1e-5 nat unit)
    assert float(soft_ceiling(50.0, math.inf)) == 50.0


def test_a_law_far_above_ln_v_is_a_bound_and_still_falls_with_tokens():
    law = LossLaw(vocab_size=V)
    tokens = np.geomspace(1e5, 1e7, 30)
    losses = [law.predict(7.1e6, t) for t in tokens]
    assert all(x < C for x in losses) and np.all(np.diff(losses) < 0)  # no plateau at ln V: not indifferent
    raw = law.predict(7.1e6, 1e6, bounded=False)
    assert raw > 12 and is_bound(raw, law.ceiling)
    assert law.regime(7.1e6, 1e6, raw_loss=raw) == BOUND
    assert law.regime(7.1e6, 1e6) == EXTRAPOLATED  # without the raw value: only the range is judged
    inside = law.predict(1e9, 2e10, bounded=False)
    assert law.regime(1e9, 2e10, raw_loss=inside) == PUBLISHED and law.predict(1e9, 2e10) == inside


def test_the_band_widens_with_the_distance_outside_the_fitted_range():
    law = LossLaw(vocab_size=128256)
    top = CHINCHILLA_PARAMS_RANGE[1]
    tokens = 1e11  # inside the tokens range
    edge = law.band(top, tokens)
    out = [law.band(top * 10**k, tokens) for k in (0.25, 0.5, 1.0, 2.0)]
    assert all(b > edge for b in out) and np.all(np.diff(out) > 0)
    assert out[-1] >= edge * (1 + 2.0)
    assert decades_outside(top * 100, CHINCHILLA_PARAMS_RANGE) == pytest.approx(2.0)
    assert decades_outside(1e9, CHINCHILLA_PARAMS_RANGE) == 0.0
    # inside: the spread of the two published fits alone (Hoffmann's constants carried like this law)
    other = carry_law(dataclasses.replace(LossLaw.hoffmann2022(), vocab_size=law.vocab_size), law.bytes_per_token)
    mine = law.predict(8e9, tokens)
    assert law.band(8e9, tokens) == pytest.approx(max(abs(other.predict(8e9, tokens) - mine), 0.01 * mine))


def test_a_plan_whose_law_is_a_bound_says_so_and_ranks_budgets():
    from trainplan.planner import Budget, solve

    small = solve("tiny-llama", "cpu", Budget(flops=4e13), seq_len=256, vocab_size=V, time_limit_s=5.0)
    twice = solve("tiny-llama", "cpu", Budget(flops=8e13), seq_len=256, vocab_size=V, time_limit_s=5.0)
    for plan in (small, twice):
        assert plan.predictions.loss_regime == BOUND
        assert plan.predictions.final_loss < C
        assert any("is a bound near ln(V)" in w and "not a prediction" in w for w in plan.warnings)
    assert twice.predictions.final_loss < small.predictions.final_loss
    assert small.solver.status == "OPTIMAL"
