"""The data subset wired in: the planner chooses the scoring method with the kept fraction
(`trainplan.planner.data_choice`), and `trainplan.executor.train.run` trains on exactly the windows the method
selects (static: scored once; dynamic: re-scored every K steps), resuming to the same selection
and losses. Selection determinism, the exact fraction, the score cache and the law fits are in
tests/unit/executor/test_selection.py."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import numpy as np
import pytest
import torch

from trainplan.costmodels.data.quality import DEFAULT_QUALITY, QualityFit
from trainplan.costmodels.data.quality_cache import load_quality_fits, quality_path, save_quality_fits
from trainplan.costmodels.loss.bits import bits_loss_penalty
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.planned import run_loss
from trainplan.errors import TrainplanError
from trainplan.planner import data_choice, options
from trainplan.planner.data_choice import (
    check_data_methods,
    choose_data_method,
    data_options,
    known_quality,
    predicted_scoring_flops,
    with_data_method,
)
from trainplan.planner.plan import Decisions, Plan, Predictions, SolverFacts

LAW = LossLaw.besiroglu2024()
FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def _plan(*, steps: int = 1000, tokens_per_step: int = 4096, flops_per_step: float = 1e12,
          data_tokens: int = 2_000_000, n_params: int = 10_000_000, seq_len: int = 128,
          fraction: float = 1.0, model: str = "m") -> Plan:
    """A plan without a solve: just the numbers the data choice reads."""
    d = Decisions(devices=1, sp_degree=1, dp_degree=1, zero_stage=0,
                  micro_batch=tokens_per_step // seq_len, seq_len=seq_len, activation_checkpoint=("none",),
                  precision="fp32", optimizer_bits=32, data_fraction=fraction,
                  data_method="random", max_tokens=steps * tokens_per_step, max_steps=steps)
    loss = run_loss(LAW, n_params, steps=steps, tokens_per_step=tokens_per_step,
                    unique_tokens=fraction * data_tokens, warmup_steps=d.warmup_steps) + bits_loss_penalty(32)
    p = Predictions(memory_bytes={"total": 1.0}, memory_phase="x", memory_limit_bytes=2.0,
                    step_time_s=0.1, step_time_breakdown_s={}, flops_per_step=flops_per_step,
                    model_flops_per_step=flops_per_step, tokens_per_step=tokens_per_step,
                    total_tokens=steps * tokens_per_step, device_hours=0.1 * steps / 3600,
                    final_loss=loss, mfu=0.5)
    return Plan(model=model, model_n_params=n_params, model_n_layers=1, hw="h100",
                budget={"devices": 1}, data_tokens=data_tokens, vocab_size=512, decisions=d,
                predictions=p, solver=SolverFacts(status="OPTIMAL", objective=0.0, bound=0.0,
                                                  wall_s=0.0, seed=0, time_limit_s=1.0))


def _by_hand(plan: Plan, method: str, fit: QualityFit) -> tuple[float, float]:
    """(best loss, its fraction) of `method` computed straight from the law, independently of
    `data_options`."""
    d, p = plan.decisions, plan.predictions
    flops = predicted_scoring_flops(plan, method)
    steps = d.max_steps - (math.ceil(flops / p.flops_per_step) if flops else 0)
    best = (math.inf, None)
    if steps < 1:  # the scoring costs the whole budget
        return best
    for f in FRACTIONS:
        if method != "random" and f == 1.0:
            continue
        loss = run_loss(LAW, plan.model_n_params, steps=steps, tokens_per_step=p.tokens_per_step,
                        unique_tokens=f * plan.data_tokens, quality=fit.q(f)) + bits_loss_penalty(d.optimizer_bits)
        best = min(best, (loss, f))
    return best


# ---- planner: the method choice -------------------------------------------------------------


@pytest.mark.parametrize("a", [0.0, 0.02, 0.1, 0.5, 2.0])
@pytest.mark.parametrize("flops_per_step", [1e7, 3e9, 1e12])
def test_picks_a_method_exactly_when_its_gain_beats_its_scoring_cost(a, flops_per_step):
    plan = _plan(flops_per_step=flops_per_step, data_tokens=400_000)
    fit = QualityFit(method="loss", a=a, b=1.0)
    rand, rand_f = _by_hand(plan, "random", DEFAULT_QUALITY["random"])
    sel, sel_f = _by_hand(plan, "loss", fit)
    out = choose_data_method(plan, LAW, methods=("random", "loss"), fits={"loss": fit})
    d = out.decisions
    if sel < rand:
        assert (d.data_method, d.data_fraction) == ("loss", sel_f)
        charge = math.ceil(predicted_scoring_flops(plan, "loss") / flops_per_step)
        assert d.max_steps == plan.decisions.max_steps - charge >= 1
        assert d.max_tokens == d.max_steps * plan.predictions.tokens_per_step
        assert out.predictions.final_loss == pytest.approx(sel)
        assert out.predictions.scoring_flops == predicted_scoring_flops(plan, "loss") > 0
        assert any("trainplan.planner.data_choice" in n for n in out.notes)
    else:
        assert out is plan  # random wins: the solver's own plan, untouched
        assert rand_f == 1.0 and rand == pytest.approx(plan.predictions.final_loss)


def test_constructed_cases_both_ways():
    # the same multiplier (loss, q(f) = 1 + (1 - f)) at two scoring prices: 79 steps of 1,000
    # charged -> worth it; 263 steps -> random keeps the whole corpus and budget
    fit = {"loss": QualityFit(method="loss", a=1.0, b=1.0)}
    cheap = _plan(flops_per_step=1e9, data_tokens=400_000)
    dear = _plan(flops_per_step=3e8, data_tokens=400_000)
    out = choose_data_method(cheap, LAW, fits=fit)
    assert (out.decisions.data_method, out.decisions.data_fraction) == ("loss", 0.5)
    assert out.decisions.max_steps == 1000 - 79
    assert choose_data_method(dear, LAW, fits=fit) is dear
    # a method whose subset is worth a random one (q = 1) never pays for scoring, however cheap
    useless = {"dsir": QualityFit(method="dsir", a=0.0)}
    assert choose_data_method(_plan(flops_per_step=1e12), LAW, fits=useless).decisions \
        .data_method == "random"


def test_random_at_fraction_one_and_random_only():
    plan = _plan(flops_per_step=1e12)
    fit = {"dsir": QualityFit(method="dsir", a=50.0, b=1.0)}
    # only fraction 1 on the grid: selecting everything is no selection
    assert choose_data_method(plan, LAW, fractions=(1.0,), fits=fit) is plan
    assert all(o.method == "random" for o in data_options(plan, LAW, fractions=(1.0,), fits=fit))
    # ("random",) keeps today's behaviour
    assert choose_data_method(plan, LAW, methods=("random",), fits=fit) is plan
    # no corpus size: nothing to score
    from trainplan.planner.budget import UNLIMITED_DATA_TOKENS

    unlimited = dataclasses.replace(plan, data_tokens=UNLIMITED_DATA_TOKENS)
    assert choose_data_method(unlimited, LAW, fits=fit) is unlimited


def test_idempotent_and_reversible():
    plan = _plan(flops_per_step=1e12, data_tokens=400_000)
    fit = {"dsir": QualityFit(method="dsir", a=2.0, b=1.0)}
    once = choose_data_method(plan, LAW, fits=fit)
    assert once.decisions.data_method == "dsir"
    twice = choose_data_method(once, LAW, fits=fit)
    assert twice.decisions == once.decisions and twice.predictions == once.predictions
    back = choose_data_method(once, LAW, methods=("random",))  # the whole budget again
    assert back.decisions.data_method == "random"
    assert back.decisions.max_steps == plan.decisions.max_steps
    assert back.predictions.scoring_flops == 0.0


def test_known_quality_rules(tmp_path):
    small, large = 1e7, 7e10
    assert set(known_quality("m", 512, small, options.DEFAULT_DATA_METHODS,
                             cache_dir=tmp_path)) == {"random"}
    big = known_quality("m", 512, large, options.DEFAULT_DATA_METHODS, cache_dir=tmp_path)
    assert big["loss"] == DEFAULT_QUALITY["loss"] and big["dsir"].a == 0.0
    fit = QualityFit(method="dsir", a=1.3, b=1.0, n_points=2, source="pilot")
    path = save_quality_fits([fit], model="m", vocab_size=512, corpus="pool", cache_dir=tmp_path)
    assert path == quality_path("m", 512, tmp_path)
    got = load_quality_fits("m", 512, tmp_path)["dsir"]
    assert (got.a, got.b, got.n_points) == (1.3, 1.0, 2) and "corpus pool" in got.source
    assert known_quality("m", 512, small, ["dsir"], cache_dir=tmp_path)["dsir"].a == 1.3
    override = QualityFit(method="dsir", a=0.1)
    assert known_quality("m", 512, small, ["dsir"], fits={"dsir": override},
                         cache_dir=tmp_path)["dsir"] is override
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring cached quality fits"):
        assert load_quality_fits("m", 512, tmp_path) == {}


def test_check_data_methods():
    assert check_data_methods("dsir,loss") == ("random", "dsir", "loss")
    assert check_data_methods(("random",)) == ("random",)
    for bad in ("", "bogus", ("random", "perplexity")):
        with pytest.raises(TrainplanError, match="known: random"):
            check_data_methods(bad)


def test_target_windows_mirror_the_executor():
    from trainplan.executor.data.dynamic_selection import TARGET_WINDOWS

    assert data_choice.TARGET_WINDOWS == TARGET_WINDOWS


def test_with_data_method_keeps_steps_and_predicts_quality():
    plan = _plan(fraction=0.5)
    fit = {"loss": QualityFit(method="loss", a=1.0, b=1.0)}
    out = with_data_method(plan, "loss", law=LAW, fits=fit)
    assert out.decisions.max_steps == plan.decisions.max_steps
    assert out.decisions.data_method == "loss" and out.predictions.scoring_flops > 0
    assert out.predictions.final_loss < plan.predictions.final_loss
    dyn = with_data_method(plan, "loss", selection_every_steps=100, law=LAW, fits=fit)
    assert dyn.decisions.selection_every_steps == 100
    assert dyn.predictions.final_loss == pytest.approx(plan.predictions.final_loss)  # q = 1
    assert Plan.from_json(dyn.to_json()) == dyn
    with pytest.raises(TrainplanError):
        with_data_method(plan, "loss", selection_every_steps=-1)


def test_solve_chooses_the_method_with_the_fraction(cpu_profile):
    from trainplan.planner.api import solve
    from trainplan.planner.budget import Budget

    fit = {"dsir": QualityFit(method="dsir", a=3.0, b=1.0)}
    plan = solve("tiny-llama", cpu_profile, Budget(flops=2e13), seq_len=64, vocab_size=512,
                 data_tokens=200_000, micro_batches=(4,), policies=("none",),
                 optimizer_bits=(32,), time_limit_s=5.0, data_quality=fit,
                 law=LossLaw(E=1.0, A=0.0, B=20.0, beta=0.3))  # below ln(512): the published law is clipped there
    d = plan.decisions
    assert (d.data_method, d.data_fraction) != ("random", 1.0)
    assert d.data_method == "dsir" and d.data_fraction < 1.0
    base = choose_data_method(plan, methods=("random",))  # the solver's random plan
    charge = math.ceil(plan.predictions.scoring_flops / plan.predictions.flops_per_step)
    assert base.decisions.max_steps == d.max_steps + charge
    assert plan.predictions.final_loss < base.predictions.final_loss


def test_cli_rejects_unknown_data_method(capsys):
    from trainplan.planner.cli.main import main

    rc = main(["solve", "--model", "tiny-llama", "--hw", "cpu", "--budget-flops", "1e12",
               "--data-methods", "random,perplexity"])
    assert rc == 2
    assert "unknown 'perplexity'" in capsys.readouterr().err


# ---- executor: a run on the selected windows ------------------------------------------------

STEPS, SEQ, MB = 6, 64, 2
WORDS = ["the", "king", "is", "dead", "long", "live", "the", "queen", "now", "is", "the", "winter", "of",
         "our", "discontent", "made", "glorious", "summer", "by", "this", "sun", "of", "york", "and", "all",
         "the", "clouds", "that", "lowered", "upon", "our", "house"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from trainplan.executor.data.batches import load_corpus

    rng = random.Random(3)
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(15)) for _ in range(600))
                    + "\n", encoding="utf-8")
    return load_corpus([path], vocab_size=512)


@pytest.fixture
def spy(monkeypatch):
    """Every (kept windows, windows read) of `TokenBatches.window_indices` calls."""
    from trainplan.executor.data.batches import TokenBatches

    calls = []
    orig = TokenBatches.window_indices

    def wrapped(self, step):
        out = orig(self, step)
        calls.append((self.kept_windows.copy(), out.copy()))
        return out

    monkeypatch.setattr(TokenBatches, "window_indices", wrapped)
    return calls


def _fixed(cpu_profile, corpus, **kw):
    from trainplan.planner.api import plan_for_choice

    return plan_for_choice("tiny-llama", cpu_profile, seq_len=SEQ, micro_batch=MB,
                           max_steps=STEPS, vocab_size=corpus.vocab_size,
                           data_tokens=corpus.n_train_tokens, **kw)


def _run(plan, corpus, out, **kw):
    from trainplan.executor.train import run

    torch.use_deterministic_algorithms(True)
    try:
        return run(plan, data=corpus, out=out, device="cpu", progress=False, **kw)
    finally:
        torch.use_deterministic_algorithms(False)


def _close(a, b):
    return [s for s, _ in a] == [s for s, _ in b] and all(
        math.isclose(x, y, rel_tol=1e-6) for (_, x), (_, y) in zip(a, b, strict=False))


def test_static_dsir_run_trains_on_exactly_the_selected_windows_and_resumes(
        cpu_profile, corpus, spy, tmp_path, one_thread):
    from trainplan.executor.data.batches import heldout_batches
    from trainplan.executor.data.dynamic_selection import target_slice
    from trainplan.executor.data.selection import score_windows, select
    from trainplan.executor.train import eval_batches

    plan = _fixed(cpu_profile, corpus, data_fraction=0.5, data_method="dsir")
    assert plan.decisions.data_method == "dsir" and plan.predictions.scoring_flops > 0
    held = heldout_batches(corpus.heldout_tokens, seq_len=SEQ, micro_batch=MB,
                           max_batches=eval_batches(MB, SEQ, heldout_len=len(corpus.heldout_tokens)))
    target = target_slice(corpus.heldout_tokens, seq_len=SEQ,
                          skip_windows=sum(len(x) for x, _ in held))
    scores = score_windows(corpus.train_tokens, seq_len=SEQ, method="dsir", target_tokens=target,
                           seed=0, vocab_size=corpus.vocab_size)
    want = select(scores.scores, 0.5, seed=0, windows=scores.windows)
    assert len(want) == round(0.5 * len(scores.windows))

    full = _run(plan, corpus, tmp_path / "full")
    kept = {tuple(k) for k, _ in spy}
    assert kept == {tuple(want)}, "the run's sampler keeps other windows than dsir selected"
    read = np.concatenate([w for _, w in spy])
    assert np.isin(read, want).all() and len(read) == STEPS * MB
    assert full.selection_flops == pytest.approx(scores.flops) and full.selection_flops > 0
    assert any(n.startswith("data selection: dsir kept") for n in full.notes), full.notes
    full_reads = read.copy()

    # interrupted after 3 steps and resumed: the same windows, losses and charge
    spy.clear()
    stopped = _run(plan, corpus, tmp_path / "run", stop_after_steps=3)
    assert stopped.stop_reason == "interrupted"
    resumed = _run(plan, corpus, tmp_path / "run", resume=True)
    assert resumed.steps == STEPS and _close(resumed.train_loss, full.train_loss)
    assert resumed.selection_flops == full.selection_flops
    assert np.array_equal(np.concatenate([w for _, w in spy]), full_reads)
    assert sum(n.startswith("data selection:") for n in resumed.notes) == 1


def test_dynamic_loss_selection_rescores_every_k_steps_and_resumes(
        cpu_profile, corpus, spy, tmp_path, one_thread):
    every = 2
    plan = _fixed(cpu_profile, corpus, data_fraction=0.5, data_method="loss",
                  selection_every_steps=every)
    full = _run(plan, corpus, tmp_path / "full")
    log = json.loads((tmp_path / "full" / "selection.json").read_text())
    assert [e["step"] for e in log["entries"]] == [0, 2, 4]
    n_windows = (corpus.n_train_tokens - 1) // SEQ
    assert all(len(e["keep"]) == round(0.5 * n_windows) for e in log["entries"])
    assert log["entries"][0]["flops"] == 0 and all(e["flops"] > 0 for e in log["entries"][1:])
    assert full.selection_flops == pytest.approx(sum(e["flops"] for e in log["entries"]))
    # each step reads from the selection made at or before it
    kept_at = {}
    for k, _ in spy:
        kept_at.setdefault(tuple(k), None)
    assert [list(k) for k in kept_at] == [e["keep"] for e in log["entries"]]

    stopped = _run(plan, corpus, tmp_path / "run", stop_after_steps=3)
    assert stopped.stop_reason == "interrupted"
    resumed = _run(plan, corpus, tmp_path / "run", resume=True)
    assert _close(resumed.train_loss, full.train_loss)
    assert resumed.selection_flops == pytest.approx(full.selection_flops)
    again = json.loads((tmp_path / "run" / "selection.json").read_text())
    assert again["entries"] == log["entries"]
