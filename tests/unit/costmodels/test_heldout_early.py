"""The planner's simulated held-out curve starts as the pilots measured it (`HeldoutCurve.
early_offsets`, `loss_with_early`) and carries the pilots' scatter about the fit
(`sim_noise_nats`): the stop prediction's third protocol (`benchmarks/governor.py`)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from tests.support import TPS, TRUE, U
from trainplan.costmodels.stopping.heldout_curve import EARLY_OFFSET_MAX_NATS, HeldoutCurve, PilotCurve
from trainplan.costmodels.stopping.heldout_fit import fit_heldout_curve
from trainplan.costmodels.stopping.rule import Governor
from trainplan.errors import TrainplanError

SETTINGS = dict(refit_every=10, min_points=8, confidence=0.9)


def dip(s):
    """A real curve's start below eq. (1) extrapolated backwards (the benchmark's pilots: 0.5
    nats at the end of warm-up, none from step 70): nats, <= 0."""
    s = np.asarray(s, dtype=float)
    return np.where(s < 70, -0.5 * (1.0 - s / 70.0), 0.0)


def pilot(unique, max_steps, every, *, seed=0, noise=0.005):
    """A synthetic pilot of TRUE + dip: the first 20% of its points kept apart as early points
    (as `trainplan.executor.governor.pilot_curve` does)."""
    c = TRUE.for_run(tokens_per_step=TPS, unique_tokens=unique)
    s = np.arange(every, int(0.8 * max_steps) + 1, every)[2:]
    y = c.loss_at(s) + dip(s) + np.random.default_rng(seed).normal(0.0, noise, s.size)
    k = int(0.2 * s.size)
    return PilotCurve(steps=tuple(s[k:].astype(float)), losses=tuple(y[k:]), tokens_per_step=TPS,
                      unique_tokens=unique, early_steps=tuple(s[:k].astype(float)), early_losses=tuple(y[:k]))


@pytest.fixture(scope="module")
def pilots():
    return [pilot(None, 400, 10), pilot(U / 2, 200, 5, seed=1), pilot(0.75 * U, 300, 5, seed=2)]


@pytest.fixture(scope="module")
def plan400():
    """tiny-llama on the cpu profile: 400 steps of 1,024 tokens on TRUE's 40,960-token subset."""
    from trainplan.planner.api import plan_for_choice

    return plan_for_choice("tiny-llama", "cpu", seq_len=128, micro_batch=8, max_steps=400, vocab_size=8192,
                           data_tokens=400_000, data_fraction=U / 400_000)


@pytest.fixture(scope="module")
def fit(pilots):
    return fit_heldout_curve(pilots)


def test_the_curve_starts_at_the_nearest_pilots_measured_losses(pilots, fit):
    """At a pilot's early steps the simulated curve is that pilot's measured loss (moved to its
    own subset); from its first fitted step on it is eq. (1); the pilot is the one nearest in
    unique tokens (a fresh run takes the fresh pilot); JSON keeps the offsets."""
    assert {r[0] for r in fit.early_offsets} == {0.0, U / 2, 0.75 * U}
    for p in pilots:
        at = fit.for_run(tokens_per_step=TPS, unique_tokens=p.unique_tokens)
        e = np.array(p.early_steps)
        assert at.loss_with_early(e) == pytest.approx(np.array(p.early_losses), abs=1e-9)
        later = np.arange(p.steps[0], 400, 5)
        assert np.array_equal(at.loss_with_early(later), at.loss_at(later))
    near = fit.for_run(tokens_per_step=TPS, unique_tokens=0.8 * U)  # nearest: the 3/4 pilot
    three_q = pilots[2]
    assert near.early_offset(three_q.early_steps[0]) == pytest.approx(
        three_q.early_losses[0] - float(fit.for_run(tokens_per_step=TPS, unique_tokens=0.75 * U)
                                        .loss_at(three_q.early_steps[0])), abs=1e-9)
    assert near.early_offset(5.0) == 0.0  # before the pilot's first early point
    assert HeldoutCurve.from_dict(json.loads(json.dumps(fit.to_dict()))) == fit
    assert np.all(dataclasses.replace(fit, early_offsets=()).early_offset(np.arange(1, 100)) == 0.0)


def test_sim_noise_is_the_larger_of_the_fits_residual_and_the_second_difference_noise(fit):
    assert fit.sim_noise_nats == max(fit.rms_nats, fit.noise_nats)
    assert dataclasses.replace(fit, rms_nats=0.0).sim_noise_nats == fit.noise_nats


@pytest.mark.parametrize("row", [(0.0, 10.0, math.nan), (0.0, 10.0, EARLY_OFFSET_MAX_NATS + 1),
                                 (-1.0, 10.0, 0.1),
                                 (0.0, 0.0, 0.1), (0.0, 10.0), (0.0, True, 0.1)])
def test_a_curve_file_with_a_bad_early_offset_is_refused(fit, row):
    raw = fit.to_dict() | {"early_offsets": [list(row)]}
    with pytest.raises(TrainplanError, match=r"^early_offsets\[0\].* must be "):
        HeldoutCurve.from_dict(raw)


def test_the_measured_start_moves_the_predicted_stop_to_where_the_governor_decides(fit, plan400):
    """A real run whose start lies below eq. (1) decides later at a high threshold than the
    governor simulated over eq. (1) alone (a more convex curve); with the pilots' measured start
    the plan's prediction (simulated without noise, so the start is all that differs) is closer
    to the replayed decisions, and within 15% of them."""
    from trainplan.planner.governor import with_governor

    plan0 = plan400
    assert (plan0.decisions.warmup_steps, plan0.predictions.tokens_per_step) == (20, TPS)
    s = np.arange(10, 401, 10)
    for thr in (3e-3, 1e-3):
        decided = []
        for seed in range(5):
            y = TRUE.loss_at(s) + dip(s) + np.random.default_rng(100 + seed).normal(0.0, 0.005, s.size)
            dec = Governor(threshold_nats_per_step=thr, max_steps=400, warmup_steps=20, **SETTINGS).replay(
                heldout_loss=list(zip(s.tolist(), y.tolist(), strict=False)))
            decided.append(dec.decided_at if dec.reason == "marginal_gain" else 400)
        actual = float(np.median(decided))
        kw = dict(threshold_nats_per_step=thr, eval_every=10, governor_settings=SETTINGS, runs=5, noise_nats=0.0)
        with_start = with_governor(plan0, curve=fit, **kw).predictions.predicted_stop_step
        bare = with_governor(plan0, curve=dataclasses.replace(fit, early_offsets=()), **kw)
        bare = bare.predictions.predicted_stop_step
        assert abs(with_start - actual) < abs(bare - actual), (thr, with_start, bare, decided)
        assert abs(with_start - actual) <= 0.15 * actual, (thr, with_start, decided)


def test_the_curve_records_its_pilots_model_and_a_plan_of_another_is_refused(pilots, plan400):
    """The pilots' model and vocabulary go into the curve; with_governor refuses a curve of
    another model or vocabulary (its constants and nats per token are theirs); pilots of two
    models are not fitted together; a curve without them (an older file) is taken as it is."""
    from trainplan.planner.governor import with_governor

    tagged = [dataclasses.replace(p, model="tiny-llama", vocab_size=8192) for p in pilots]
    fit = fit_heldout_curve(tagged)
    assert (fit.model, fit.vocab_size) == ("tiny-llama", 8192)
    assert HeldoutCurve.from_dict(json.loads(json.dumps(fit.to_dict()))) == fit
    kw = dict(threshold_nats_per_step=1e-3, eval_every=10, governor_settings=SETTINGS, runs=1, noise_nats=0.0)
    assert with_governor(plan400, curve=fit, **kw).predictions.predicted_stop_step < 400
    for other in (dict(model="llama3-8b"), dict(vocab_size=128256)):
        with pytest.raises(TrainplanError, match="fit pilots of this model and vocabulary"):
            with_governor(plan400, curve=dataclasses.replace(fit, **other), **kw)
    with pytest.raises(TrainplanError, match="different models or vocabularies"):
        fit_heldout_curve([*tagged[:2], dataclasses.replace(tagged[2], model="qwen2.5-7b")])
    old = {k: v for k, v in fit.to_dict().items() if k not in ("model", "vocab_size", "early_offsets")}
    assert HeldoutCurve.from_dict(old).model == "" and HeldoutCurve.from_dict(old).early_offsets == ()
    for bad in (dict(model=5), dict(vocab_size=-1), dict(vocab_size=8192.5)):
        with pytest.raises(TrainplanError, match="model=|vocab_size="):
            HeldoutCurve.from_dict(fit.to_dict() | bad)


@pytest.mark.parametrize("bad, needle", [(dict(E=1e300), "E=1e+300 must be a finite number in [0, 100]"),
                                         (dict(B=1e300), "B=1e+300 must be a finite number in [0, 100]"),
                                         (dict(unique_tokens=math.nan), "unique_tokens=nan"),
                                         (dict(unique_tokens=-5.0), "unique_tokens=-5.0"),
                                         (dict(n_points="x"), "n_points='x'"), (dict(source=5), "source=5")])
def test_a_curve_file_with_an_impossible_constant_is_refused(fit, bad, needle):
    """Constants no pilot fit gives are refused where a curve is read (a B of 1e300 overflowed in
    the governor's fit; an E of 1e300 printed an end loss of 1e300 nats)."""
    with pytest.raises(TrainplanError, match=re.escape(needle)):
        HeldoutCurve.from_dict(fit.to_dict() | bad)
    cov = [list(r) for r in fit.cov]
    cov[0][0] = math.nan
    with pytest.raises(TrainplanError, match="not NaN"):
        HeldoutCurve.from_dict(fit.to_dict() | {"cov": cov})
