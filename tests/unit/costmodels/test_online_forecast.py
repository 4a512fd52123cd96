"""The online forecast of a run's final held-out loss (`trainplan.costmodels.loss.online`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainplan.costmodels.loss.online import (
    FORECAST_FRACTIONS,
    MIN_POINTS,
    cooldown_start,
    forecast_final_loss,
)
from trainplan.errors import TrainplanError

E, B, BETA, W, OFFSET = 2.0, 6.0, 0.3, 20, 0.15
MAX_STEPS = 1000


def synthetic(max_steps: int = MAX_STEPS, noise: float = 0.02, seed: int = 0, every: int = 20):
    """A WSD run's training losses (step index, loss) and held-out points (steps done, tokens,
    loss) on L = E + B (t - w/2)^-beta, the held-out OFFSET above, noise on the training losses."""
    rng = np.random.default_rng(seed)
    train = [(i, E + B * max(i + 1 - W / 2, 1) ** -BETA + noise * rng.standard_normal()) for i in range(max_steps)]
    held = [(s, s * 256, E + B * (s - W / 2) ** -BETA + OFFSET) for s in range(every, max_steps + 1, every)]
    return train, held


def truth_constant_rate(max_steps: int = MAX_STEPS) -> float:
    return E + B * (max_steps - W / 2) ** -BETA + OFFSET


@pytest.mark.parametrize("frac", FORECAST_FRACTIONS)
def test_recovers_the_constant_rate_end_from_a_noisy_prefix(frac):
    train, held = synthetic()
    step = int(frac * MAX_STEPS)
    f = forecast_final_loss(train[:step], [h for h in held if h[0] <= step], step=step, max_steps=MAX_STEPS,
                            warmup_steps=W, floor_nats=E)
    assert f is not None and f.step == step
    assert f.final_loss == pytest.approx(truth_constant_rate(), rel=0.01)
    assert f.final_loss == f.constant_rate_loss  # no cooldown gain given
    assert f.offset_nats == pytest.approx(OFFSET, abs=0.03)
    assert abs(f.final_loss - truth_constant_rate()) <= f.band_nats + 0.01


def test_cooldown_gain_takes_its_share_of_the_excess_and_is_in_the_band():
    train, held = synthetic()
    plain = forecast_final_loss(train[:300], held[:15], step=300, max_steps=MAX_STEPS, warmup_steps=W, floor_nats=E)
    cooled = forecast_final_loss(train[:300], held[:15], step=300, max_steps=MAX_STEPS, warmup_steps=W,
                                 floor_nats=E, cooldown_gain=0.1)
    excess = plain.constant_rate_loss - E
    assert cooled.final_loss == pytest.approx(plain.constant_rate_loss - 0.1 * excess)
    assert cooled.band_nats == pytest.approx(plain.band_nats + 0.1 * excess)


def test_the_first_tenth_and_the_cooldown_are_left_out():
    train, held = synthetic()
    step = 600
    base = forecast_final_loss(train[:step], held, step=step, max_steps=MAX_STEPS, warmup_steps=W, floor_nats=E)
    early = [(i, y + (5.0 if i + 1 < math.ceil(0.1 * step) else 0.0)) for i, y in train[:step]]  # a spike
    assert forecast_final_loss(early, held, step=step, max_steps=MAX_STEPS, warmup_steps=W,
                               floor_nats=E).final_loss == pytest.approx(base.final_loss)
    # at the end: cooldown points (which drop below the constant-rate curve) do not move the fit
    start = cooldown_start(MAX_STEPS)
    cooled = [(i, y - (0.3 if i + 1 > start else 0.0)) for i, y in train]
    held_cooled = [(s, t, y - (0.3 if s > start else 0.0)) for s, t, y in held]
    at_start = forecast_final_loss(train[:start], held, step=start, max_steps=MAX_STEPS, warmup_steps=W, floor_nats=E)
    at_end = forecast_final_loss(cooled, held_cooled, step=MAX_STEPS, max_steps=MAX_STEPS, warmup_steps=W,
                                 floor_nats=E)
    assert at_end.final_loss == pytest.approx(at_start.final_loss, rel=1e-3)  # windows start at 10% of each
    assert at_end.points == start - max(2 * W, math.ceil(0.1 * MAX_STEPS)) + 1


def test_none_while_there_are_too_few_points():
    train, held = synthetic()
    assert forecast_final_loss(train[:2 * W + MIN_POINTS - 2], held, step=2 * W + MIN_POINTS - 2,
                               max_steps=MAX_STEPS, warmup_steps=W, floor_nats=E) is None
    assert forecast_final_loss(train[:300], [], step=300, max_steps=MAX_STEPS, warmup_steps=W, floor_nats=E) is None
    assert forecast_final_loss([], [], step=0, max_steps=MAX_STEPS, warmup_steps=W, floor_nats=E) is None


def test_nan_losses_are_skipped():
    train, held = synthetic()
    bad = [(i, math.nan if i % 7 == 0 else y) for i, y in train[:400]]
    f = forecast_final_loss(bad, held[:20], step=400, max_steps=MAX_STEPS, warmup_steps=W, floor_nats=E)
    assert f is not None and math.isfinite(f.final_loss) and math.isfinite(f.band_nats)


def test_the_band_narrows_as_the_run_goes():
    train, held = synthetic(noise=0.05)
    bands = [forecast_final_loss(train[:s], [h for h in held if h[0] <= s], step=s, max_steps=MAX_STEPS,
                                 warmup_steps=W, floor_nats=E).band_nats for s in (100, 300, 500)]
    assert bands[0] > bands[1] > bands[2] > 0


@pytest.mark.parametrize("kw, needle", [({"cooldown_gain": 1.0}, "cooldown_gain"),
                                        ({"cooldown_gain": -0.1}, "cooldown_gain"),
                                        ({"floor_nats": -1.0}, "floor_nats"),
                                        ({"floor_nats": math.nan}, "floor_nats")])
def test_bad_input_is_named(kw, needle):
    train, held = synthetic()
    args = dict(step=300, max_steps=MAX_STEPS, warmup_steps=W, floor_nats=E) | kw
    with pytest.raises(TrainplanError, match=needle):
        forecast_final_loss(train[:300], held, **args)


def test_cooldown_start_matches_the_executor_schedule():
    from types import SimpleNamespace

    from trainplan.executor.apply.applied import lr_at

    for max_steps in (7, 10, 99, 1000):
        start = cooldown_start(max_steps)
        plan = SimpleNamespace(decisions=SimpleNamespace(max_steps=max_steps, warmup_steps=1, lr=1.0))
        # every step done up to `start` ran at the peak rate; the steps after the next one are cooled
        assert all(lr_at(i, plan) == 1.0 for i in range(1, start + 1))
        assert all(lr_at(i, plan) < 1.0 for i in range(start + 1, max_steps))


def test_a_floor_the_run_is_already_below_is_capped():
    train, held = synthetic()
    f = forecast_final_loss(train[:300], held[:15], step=300, max_steps=MAX_STEPS, warmup_steps=W, floor_nats=10.0)
    lowest = min(y for i, y in train[30:300])
    assert f is not None and f.floor_nats == pytest.approx(0.9 * lowest)
    assert math.isfinite(f.final_loss) and f.final_loss > f.floor_nats


def test_an_unmeasured_cooldown_gain_takes_the_middle_of_its_range_into_the_band():
    from trainplan.costmodels.loss.online import UNKNOWN_GAIN_RANGE

    train, held = synthetic()
    plain = forecast_final_loss(train[:300], held[:15], step=300, max_steps=MAX_STEPS, warmup_steps=W, floor_nats=E)
    unknown = forecast_final_loss(train[:300], held[:15], step=300, max_steps=MAX_STEPS, warmup_steps=W,
                                  floor_nats=E, cooldown_gain=None)
    excess, mid = plain.constant_rate_loss - E, sum(UNKNOWN_GAIN_RANGE) / 2
    assert unknown.final_loss == pytest.approx(plain.constant_rate_loss - mid * excess)
    assert unknown.band_nats == pytest.approx(plain.band_nats + mid * excess)
