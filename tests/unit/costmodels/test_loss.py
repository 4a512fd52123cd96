"""trainplan.costmodels.loss.law: Chinchilla law, data-constrained effective tokens, fit, bits penalties."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainplan.costmodels.loss.bits import BitsPenalty, bits_loss_penalty
from trainplan.costmodels.loss.law import (
    LossLaw,
    learning_curve,
)
from trainplan.costmodels.loss.repetition import effective_params, effective_tokens
from trainplan.errors import TrainplanError

# --- known values ---------------------------------------------------------------------------


def test_chinchilla_70b_hoffmann_constants():
    law = LossLaw.hoffmann2022()
    expected = 1.69 + 406.4 / 70e9**0.34 + 410.7 / 1.4e12**0.28
    got = law.predict(70e9, 1.4e12)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got == pytest.approx(1.94, abs=0.005)


def test_named_constructors():
    b = LossLaw.besiroglu2024()
    assert (b.E, b.A, b.B, b.alpha, b.beta) == (1.8172, 482.01, 2085.43, 0.3478, 0.3658)
    assert b == LossLaw()
    h = LossLaw.hoffmann2022()
    assert (h.E, h.A, h.B, h.alpha, h.beta) == (1.69, 406.4, 410.7, 0.34, 0.28)
    assert (b.r_d_star, b.r_n_star) == (15.4, 5.3)


def test_frozen():
    with pytest.raises(AttributeError):
        LossLaw().E = 2.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs", [{"E": -0.1}, {"A": -1.0}, {"B": -1.0}, {"alpha": -0.1}, {"beta": -0.1},
               {"r_d_star": 0.0}, {"r_n_star": -1.0}, {"E": float("nan")}, {"cooldown_gain": 1.0},
               {"cooldown_gain": -0.1}]
)
def test_bad_law_fields(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(TrainplanError, match=name):
        LossLaw(**kwargs)


# --- effective tokens -----------------------------------------------------------------------


@pytest.mark.parametrize("seen", [0.0, 1e6, 5e8, 1e9])
def test_effective_tokens_identity_without_repetition(seen):
    assert effective_tokens(seen, 1e9) == seen


def test_effective_tokens_formula_and_limit():
    u, r = 1e9, 15.4
    seen = 5 * u  # R_D = 4 repetitions
    assert effective_tokens(seen, u) == pytest.approx(u + u * r * (1 - math.exp(-4 / r)))
    assert effective_tokens(u * 1e6, u) == pytest.approx(u * (1 + r), rel=1e-9)
    assert effective_tokens(u * 1e6, u, r_star=2.0) == pytest.approx(3 * u, rel=1e-9)
    # Muennighoff et al.: 4 epochs are worth nearly as much as fresh data
    assert effective_tokens(4 * u, u) / (4 * u) > 0.9


def test_effective_params_mirrors_tokens():
    assert effective_params(1e9, 2e9) == 1e9
    assert effective_params(1e15, 1e9) == pytest.approx(1e9 * (1 + 5.3), rel=1e-6)


@pytest.mark.parametrize("args", [(-1.0, 1e9), (1e9, 0.0), (1e9, 1e9, 0.0), (float("inf"), 1.0)])
def test_effective_tokens_bad_inputs(args):
    with pytest.raises(TrainplanError):
        effective_tokens(*args)


# --- predict --------------------------------------------------------------------------------


def test_predict_uses_effective_tokens_and_quality():
    law = LossLaw()
    u = 1e10
    assert law.predict(1e9, 4e10, unique_tokens=u) == pytest.approx(
        law.predict(1e9, effective_tokens(4e10, u))
    )
    assert law.predict(1e9, 4e10, unique_tokens=u) > law.predict(1e9, 4e10)
    assert law.predict(1e9, 1e10, quality=2.0) == pytest.approx(law.predict(1e9, 2e10))
    assert law.predict(1e9, 1e10, quality=2.0) < law.predict(1e9, 1e10)


@pytest.mark.parametrize(
    "args,kwargs",
    [((0, 1e9), {}), ((1e9, 0), {}), ((1e9, 1e9), {"unique_tokens": 0}),
     ((1e9, 1e9), {"quality": 0}), ((float("nan"), 1e9), {})],
)
def test_predict_bad_inputs(args, kwargs):
    with pytest.raises(TrainplanError):
        LossLaw().predict(*args, **kwargs)


@settings(max_examples=200, deadline=None)
@given(
    n=st.floats(1e6, 1e12),
    d=st.floats(1e6, 1e13),
    extra=st.floats(0.0, 1e13),
    unique=st.one_of(st.none(), st.floats(1e6, 1e12)),
    quality=st.floats(0.1, 10.0),
)
def test_more_tokens_never_raise_loss(n, d, extra, unique, quality):
    law = LossLaw()
    assert law.predict(n, d + extra, unique, quality) <= law.predict(n, d, unique, quality)


@settings(max_examples=100, deadline=None)
@given(d=st.floats(1e6, 1e13), u=st.floats(1e6, 1e12), more=st.floats(1.0, 100.0))
def test_more_unique_tokens_never_raise_loss(d, u, more):
    law = LossLaw.hoffmann2022()
    assert law.predict(1e9, d, u * more) <= law.predict(1e9, d, u) + 1e-12


def test_learning_curve_matches_predict_and_decreases():
    law = LossLaw()
    tokens = np.geomspace(1e8, 1e11, 50)
    curve = learning_curve(tokens, law=law, n_params=1e9, unique_tokens=1e10)
    assert curve.shape == tokens.shape
    assert np.all(np.diff(curve) <= 0)
    for t, c in zip(tokens[::7], curve[::7], strict=False):
        assert c == pytest.approx(law.predict(1e9, t, unique_tokens=1e10), rel=1e-12)
    with pytest.raises(TrainplanError):
        learning_curve(np.array([0.0, 1e9]), law=law, n_params=1e9)


# --- fit ------------------------------------------------------------------------------------


def _grid(law: LossLaw):
    n, d = np.meshgrid(np.geomspace(5e7, 1e10, 6), np.geomspace(1e9, 5e11, 6))
    n, d = n.ravel(), d.ravel()
    return n, d, np.array([law.predict(a, b) for a, b in zip(n, d, strict=False)])


@pytest.mark.parametrize("law", [LossLaw.besiroglu2024(), LossLaw.hoffmann2022()])
def test_fit_recovers_constants(law):
    fitted = LossLaw.fit(*_grid(law))
    for name in LossLaw.FIT_NAMES:
        assert getattr(fitted, name) == pytest.approx(getattr(law, name), rel=0.02), name


def test_fit_with_fixed_parameters():
    law = LossLaw.hoffmann2022()
    fitted = LossLaw.fit(*_grid(law), fix={"alpha": 0.34, "beta": 0.28})
    assert (fitted.alpha, fitted.beta) == (0.34, 0.28)
    for name in ("E", "A", "B"):
        assert getattr(fitted, name) == pytest.approx(getattr(law, name), rel=0.02), name


def test_fit_single_model_size_folds_size_term_into_e():
    law = LossLaw()
    n = np.full(10, 1e8)
    d = np.geomspace(1e9, 1e11, 10)
    losses = np.array([law.predict(a, b) for a, b in zip(n, d, strict=False)])
    with pytest.warns(UserWarning, match="folded into E"):
        fitted = LossLaw.fit(n, d, losses)
    assert fitted.A == 0.0
    assert pytest.approx(law.E + law.A / 1e8**law.alpha, rel=0.02) == fitted.E
    assert pytest.approx(law.B, rel=0.02) == fitted.B
    assert fitted.beta == pytest.approx(law.beta, rel=0.02)
    assert fitted.predict(1e8, 3e10) == pytest.approx(law.predict(1e8, 3e10), rel=1e-4)
    # with A and alpha pinned, E itself is identifiable and no warning is raised
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pinned = LossLaw.fit(n, d, losses, fix={"A": law.A, "alpha": law.alpha})
    assert pytest.approx(law.E, rel=0.02) == pinned.E


def test_fit_errors():
    n, d, losses = _grid(LossLaw())
    with pytest.raises(TrainplanError, match="unknown name"):
        LossLaw.fit(n, d, losses, fix={"gamma": 1.0})
    with pytest.raises(TrainplanError, match="length"):
        LossLaw.fit(n, d[:-1], losses)
    with pytest.raises(TrainplanError, match="positive"):
        LossLaw.fit(n, d, -losses)
    with pytest.raises(TrainplanError, match="at least 5"):
        LossLaw.fit(n[::7][:3], d[::7][:3], losses[::7][:3])
    with pytest.raises(TrainplanError, match="E is pinned"):
        LossLaw.fit(np.full(6, 1e8), d[::6], losses[::6], fix={"E": 1.8})


def test_fit_single_token_count_folds_data_term():
    law = LossLaw()
    n = np.geomspace(1e8, 1e10, 8)
    d = np.full(8, 2e10)
    losses = np.array([law.predict(a, b) for a, b in zip(n, d, strict=False)])
    with pytest.warns(UserWarning, match="B/tokens"):
        fitted = LossLaw.fit(n, d, losses)
    assert fitted.B == 0.0
    assert fitted.alpha == pytest.approx(law.alpha, rel=0.02)
    assert fitted.predict(3e9, 2e10) == pytest.approx(law.predict(3e9, 2e10), rel=1e-4)


# --- bits penalty ---------------------------------------------------------------------------


def test_bits_penalty_defaults_and_order():
    assert bits_loss_penalty(32) == 0.0
    assert bits_loss_penalty(32, 16, 32) == 0.0
    p8, p4 = bits_loss_penalty(8), bits_loss_penalty(4)
    assert 0.0 <= p8 <= 0.005
    assert p4 >= p8
    assert bits_loss_penalty(8, 8) == pytest.approx(p8 + BitsPenalty().activation_8bit_nats)


def test_bits_penalty_is_refittable():
    custom = BitsPenalty(optimizer_8bit_nats=0.03)
    assert bits_loss_penalty(8, penalty=custom) == 0.03
    with pytest.raises(TrainplanError, match="optimizer_4bit_nats"):
        BitsPenalty(optimizer_4bit_nats=-1.0)


@pytest.mark.parametrize(
    "args,valid",
    [((2,), "[32, 16, 8, 4]"), ((8, 4), "[32, 16, 8]"), ((8, 16, 8), "[32, 16]"), ((True,), "[32")],
)
def test_bits_penalty_unsupported(args, valid):
    with pytest.raises(TrainplanError) as err:
        bits_loss_penalty(*args)
    assert valid in str(err.value)
