"""Issue #23: the loss law where the product plans: bounded by ln(V), carried per byte to another
tokenizer, batch size through the critical batch, and the pilot-cost rule."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from trainplan.costmodels.loss.batch import (
    KAPLAN_BYTES_PER_TOKEN,
    batch_efficiency,
    critical_batch_tokens,
    min_steps,
)
from trainplan.costmodels.loss.law import EXTRAPOLATED, LOCAL, PUBLISHED, LossLaw, learning_curve
from trainplan.costmodels.loss.pilots import (
    MIN_PILOT_STEPS,
    PILOT_BUDGET_FRAC,
    PilotResult,
    PilotSpec,
    design_pilots,
    fit_pilot_law,
)
from trainplan.costmodels.loss.planned import run_loss, warmup_steps_for
from trainplan.costmodels.loss.transfer import MASSIVETEXT_BYTES_PER_TOKEN, carry_law, per_byte
from trainplan.errors import TrainplanError

# ---- the ln(V) bound ------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [256, 8192, 128256])
def test_no_prediction_is_above_the_uniform_guess(vocab):
    law = LossLaw(vocab_size=vocab)
    for n, d in ((1e5, 1e3), (7.1e6, 1.2e6), (1e6, 1.0), (7e10, 1.4e12)):
        for g in (None, 256, 4e6):
            assert law.predict(n, d, batch_tokens=g) <= math.log(vocab) + 1e-12
    curve = learning_curve(np.geomspace(1, 1e12, 50), law=law, n_params=1e6)
    assert np.all(curve <= math.log(vocab) + 1e-12)
    # the published law at a 7M model on 1M tokens is far above ln(8192) = 9.01 unbounded
    assert LossLaw().predict(7.1e6, 1.2e6) > 12 and law.predict(7.1e6, 1.2e6) <= math.log(vocab)


def test_the_bound_does_not_touch_predictions_below_it():
    law, bounded = LossLaw(), LossLaw(vocab_size=128256)
    assert bounded.predict(7e10, 1.4e12) == pytest.approx(law.predict(7e10, 1.4e12), rel=1e-12)


def test_bad_vocab_is_one_clear_error():
    with pytest.raises(TrainplanError, match="vocab_size must be a whole number >= 2"):
        LossLaw(vocab_size=1)


# ---- regimes ----------------------------------------------------------------------------------


def test_regime_says_published_inside_the_fitted_range_and_extrapolated_outside():
    law = LossLaw()
    assert law.regime(1e9, 2e10) == PUBLISHED  # 1B parameters, 20B tokens: inside Hoffmann's runs
    assert law.regime(7.1e6, 1.2e6) == EXTRAPOLATED  # the demo's model: far below 70M parameters
    assert law.regime(4e11, 1.5e13) == EXTRAPOLATED  # 405B on 15T tokens: above both ranges
    assert dataclasses.replace(law, local=True).regime(7.1e6, 1.2e6) == LOCAL


def test_published_band_is_the_spread_of_the_two_published_fits():
    law = LossLaw()
    pred, band = law.predict(1e9, 2e10), law.band(1e9, 2e10)
    assert band == pytest.approx(max(abs(LossLaw.hoffmann2022().predict(1e9, 2e10) - pred), 0.01 * pred))
    assert 0 < band < 0.2 * pred


# ---- the tokenizer normalization on two tokenizers of one corpus ----------------------------


@pytest.fixture(scope="module")
def two_tokenizations(tmp_path_factory):
    """One corpus (the default, Shakespeare's plays) cut by two byte-level BPEs: 1024 and 8192 tokens."""
    from trainplan.executor.data.batches import load_corpus
    from trainplan.executor.data.text_bytes import corpus_bytes_per_token

    cache = tmp_path_factory.mktemp("bpe")
    out = {}
    for vocab in (1024, 8192):
        c = load_corpus(vocab_size=vocab, cache_dir=cache if vocab == 1024 else None)
        out[vocab] = (len(c.train_tokens) + len(c.heldout_tokens), corpus_bytes_per_token(c))
    return out


def test_bytes_per_token_is_measured_from_the_text(two_tokenizations):
    (n_small, bpt_small), (n_big, bpt_big) = two_tokenizations[1024], two_tokenizations[8192]
    assert 1.5 < bpt_small < bpt_big < 6.0  # the larger vocabulary packs more bytes per token
    # the same text: tokens x bytes per token agree to the split's rounding
    assert n_small * bpt_small == pytest.approx(n_big * bpt_big, rel=0.01)


def test_a_carried_law_predicts_the_same_loss_per_byte_on_both_tokenizers(two_tokenizations):
    (_, bpt_small), (_, bpt_big) = two_tokenizations[1024], two_tokenizations[8192]
    small, big = carry_law(LossLaw(), bpt_small), carry_law(LossLaw(), bpt_big)
    text_bytes = 4e10  # the same bytes of training text, counted in each tokenizer's tokens
    for n in (1e8, 1e9):
        a = per_byte(small.predict(n, text_bytes / bpt_small), bpt_small)
        b = per_byte(big.predict(n, text_bytes / bpt_big), bpt_big)
        source = per_byte(LossLaw().predict(n, text_bytes / MASSIVETEXT_BYTES_PER_TOKEN),
                          MASSIVETEXT_BYTES_PER_TOKEN)
        assert a == pytest.approx(b, rel=1e-9) and a == pytest.approx(source, rel=1e-9)
    # per token the smaller vocabulary's loss is lower (fewer bytes per prediction)
    assert small.predict(1e9, text_bytes / bpt_small) < big.predict(1e9, text_bytes / bpt_big)
    # the fitted range is carried too: tokens of the local tokenizer
    assert small.tokens_range[0] == pytest.approx(LossLaw().tokens_range[0] * MASSIVETEXT_BYTES_PER_TOKEN / bpt_small)


# ---- the critical batch: its limits ------------------------------------------------------------


def test_small_batch_every_token_counts_and_steps_are_what_it_pays():
    b_crit = 1e5
    law = LossLaw(E=1.0, A=0.0, B=50.0, beta=0.3, b_crit_tokens=b_crit)
    tokens = 1e9
    tiny, small = law.predict(1e6, tokens, batch_tokens=1.0), law.predict(1e6, tokens, batch_tokens=10.0)
    assert tiny == pytest.approx(law.predict(1e6, tokens), rel=1e-5)  # tokens matter, not the batch
    assert small == pytest.approx(tiny, rel=1e-4)
    # ... and the steps to reach that loss grow as the batch shrinks: S = S_min (1 + B_crit / B)
    for b in (10.0, 100.0):
        steps = tokens / b
        assert steps / min_steps(steps, b, b_crit) == pytest.approx(1 + b_crit / b)


def test_large_batch_only_steps_count_and_tokens_are_what_it_pays():
    b_crit = 1e5
    law = LossLaw(E=1.0, A=0.0, B=50.0, beta=0.3, b_crit_tokens=b_crit)
    steps = 1e4
    at_10x, at_100x = (law.predict(1e6, steps * b, batch_tokens=b) for b in (1e6, 1e7))
    # the same steps at 10x the batch (10x the tokens) buy almost nothing more: E_min -> S B_crit
    assert at_10x - at_100x < 0.1 * (law.predict(1e6, steps * 1e4, batch_tokens=1e4) - at_10x)
    assert batch_efficiency(1e9, b_crit) == pytest.approx(b_crit / 1e9, rel=1e-3)
    # at equal tokens, a batch far over the critical one is much worse
    assert law.predict(1e6, 1e10, batch_tokens=1e7) > law.predict(1e6, 1e10, batch_tokens=1e3) + 0.05


def test_kaplan_critical_batch_as_printed_and_growing_as_loss_falls():
    assert critical_batch_tokens(1.0) == pytest.approx(2.1e8)  # B_* at L = 1 in their units
    assert critical_batch_tokens(2.0) > critical_batch_tokens(3.0) > critical_batch_tokens(6.0)
    # carried per byte: the same bytes per step whatever the tokenizer
    loss_per_byte = 0.6
    a = critical_batch_tokens(loss_per_byte * 3.0, bytes_per_token=3.0) * 3.0
    b = critical_batch_tokens(loss_per_byte * KAPLAN_BYTES_PER_TOKEN) * KAPLAN_BYTES_PER_TOKEN
    assert a == pytest.approx(b, rel=1e-9)


def test_run_loss_counts_the_warmup_and_batch_of_a_planned_run():
    law = LossLaw(E=2.0, A=0.0, B=30.0, beta=0.3, b_crit_tokens=2000.0, vocab_size=8192)
    assert warmup_steps_for(5) == 1 and warmup_steps_for(150) == 15 and warmup_steps_for(10_000) == 20
    got = run_loss(law, 7e6, steps=290, tokens_per_step=4096)
    x = (290 - 10) * 4096 / (1 + 4096 / 2000.0)
    assert got == pytest.approx(2.0 + 30.0 * x ** -0.3, rel=1e-9)
    # at equal tokens the smaller batch is predicted lower here (B_crit 2000 tokens)
    assert run_loss(law, 7e6, steps=4640, tokens_per_step=256) < got


# ---- the pilot-cost rule --------------------------------------------------------------------------


COST = {1: 8.6e9, 2: 1.72e10, 4: 3.44e10, 8: 6.9e10, 16: 1.38e11}  # FLOPs per step of tiny-llama at s256


def test_pilots_cost_at_most_a_tenth_of_the_budget():
    for budget in (4e13, 1e14, 1e15):
        specs = design_pilots(budget, cost_per_step=COST, seq_len=256)
        assert specs is not None and len(specs) == 2
        assert sum(s.cost for s in specs) <= PILOT_BUDGET_FRAC * budget * (1 + 1e-12)
        assert specs[0].micro_batch == 1 and all(s.steps >= MIN_PILOT_STEPS for s in specs)
        assert all(s.eval_from >= int(0.3 * s.steps) for s in specs)  # the early transient is not evaluated
    # the second pilot measures a batch at least 4x larger once the budget buys it steps there
    assert design_pilots(4e13, cost_per_step=COST, seq_len=256)[1].micro_batch == 1
    assert design_pilots(1e14, cost_per_step=COST, seq_len=256)[1].micro_batch == 8
    assert design_pilots(1e15, cost_per_step=COST, seq_len=256)[1].micro_batch == 16


def test_no_pilots_where_a_tenth_of_the_budget_buys_too_few_steps():
    assert design_pilots(1e13, cost_per_step=COST, seq_len=256) is None


def test_bad_pilot_inputs_are_one_clear_error():
    with pytest.raises(TrainplanError, match="budget must be > 0"):
        design_pilots(0.0, cost_per_step=COST, seq_len=256)
    with pytest.raises(TrainplanError, match="cost_per_step is empty"):
        design_pilots(1e13, cost_per_step={}, seq_len=256)


def _synthetic(law: LossLaw, gamma: float, specs: list[PilotSpec]) -> list[PilotResult]:
    """Pilots whose points follow the fit's model exactly (module docstring of trainplan.costmodels.loss.pilots)."""
    out = []
    b_c = law.B / (1 - gamma)
    for s in specs:
        w = s.warmup_steps
        steps = tuple(k for k in range(s.eval_every, s.steps, s.eval_every) if k >= s.eval_from)
        eff = s.tokens_per_step / (1 + s.tokens_per_step / law.b_crit_tokens)
        losses = tuple(law.E + b_c * ((k - w / 2) * eff) ** -law.beta for k in steps)
        final = law.E + law.B * ((s.steps - w / 2) * eff) ** -law.beta
        out.append(PilotResult(spec=s, steps=steps, losses=losses, final_loss=final))
    return out


def test_pilot_fit_recovers_a_known_law():
    truth = LossLaw(E=3.0, A=0.0, B=40.0, beta=0.35, b_crit_tokens=1500.0)
    specs = design_pilots(1e14, cost_per_step=COST, seq_len=256)
    law, record = fit_pilot_law(_synthetic(truth, 0.1, specs), vocab_size=8192)
    assert law.local and law.regime(7e6, 1e6) == LOCAL
    for steps, g in ((290, 4096), (4640, 256), (1160, 1024)):
        assert run_loss(law, 7e6, steps=steps, tokens_per_step=g) == pytest.approx(
            run_loss(truth, 7e6, steps=steps, tokens_per_step=g), rel=1e-3)
    assert record["gamma"] == pytest.approx(0.1, abs=0.02)
    assert law.cooldown_gain == record["gamma"]  # carried with the law: the run's online forecast uses it


def test_pilots_at_one_batch_keep_kaplans_critical_batch():
    truth = LossLaw(E=3.0, A=0.0, B=40.0, beta=0.35, b_crit_tokens=1e12)
    specs = [PilotSpec(name=n, micro_batch=1, steps=k, tokens_per_step=256, cost=0.0)
             for n, k in (("a", 200), ("b", 80))]
    law, record = fit_pilot_law(_synthetic(truth, 0.1, specs))
    assert law.b_crit_tokens is None and record["b_crit_tokens"] is None
    assert law.predict(7e6, 1e6) == pytest.approx(truth.predict(7e6, 1e6), rel=1e-3)
