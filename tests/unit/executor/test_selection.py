"""Data selection: scoring methods, exact-fraction selection, the score cache, the dynamic
selector, and the data-value loss model (`trainplan.costmodels.data.value`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainplan.costmodels.data.fit import fit_local_law, fit_quality
from trainplan.costmodels.data.quality import DEFAULT_QUALITY, QualityFit, selection_quality
from trainplan.costmodels.data.scoring import ScoringFlops, scoring_flops, selection_menu
from trainplan.costmodels.data.value import predicted_loss, subset_loss
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.repetition import effective_tokens
from trainplan.errors import TrainplanError
from trainplan.executor.data import scorers as selection_scorers
from trainplan.executor.data import selection
from trainplan.executor.data.batches import TokenBatches
from trainplan.executor.data.dynamic_selection import DynamicSelector
from trainplan.executor.data.scorers import ReferenceConfig
from trainplan.executor.data.selection import apply_criterion, score_windows, select

VOCAB, SEQ = 64, 16
REF = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
           num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def _one_thread(torch_threads):
    with torch_threads(1):
        yield


@pytest.fixture
def ref(tiny_llama):
    """A 1-layer, hidden-32 Llama over a 64-token vocabulary (random weights)."""
    return tiny_llama(**REF).eval()


def _tokens(n: int = 40 * SEQ + 1, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, VOCAB, n))


def _two_kinds(n_windows: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, is_target_like per window, target tokens): even windows are a cyclic walk over
    tokens 0..15 (like the target), odd windows uniform over 32..63."""
    rng = np.random.default_rng(1)
    toks = np.empty(n_windows * SEQ + 1, dtype=np.int64)
    like = np.zeros(n_windows, dtype=bool)
    for w in range(n_windows):
        if w % 2 == 0:
            toks[w * SEQ:(w + 1) * SEQ] = (rng.integers(0, 16) + np.arange(SEQ)) % 16
            like[w] = True
        else:
            toks[w * SEQ:(w + 1) * SEQ] = rng.integers(32, VOCAB, SEQ)
    toks[-1] = 0
    target = (np.arange(8 * SEQ + 1) * 1 + 3) % 16
    return toks, like, target


# ---- select ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 500), fraction=st.floats(1e-3, 1.0), seed=st.integers(0, 2**16))
def test_select_keeps_exact_fraction(n, fraction, seed):
    scores = np.random.default_rng(seed).normal(size=n)
    keep = select(scores, fraction, seed=seed)
    assert len(keep) == max(1, round(fraction * n))
    assert np.all(np.diff(keep) > 0) and keep[0] >= 0 and keep[-1] < n
    # the kept ones are the top scores
    assert scores[keep].min() >= np.sort(scores)[::-1][len(keep) - 1]


def test_select_is_deterministic_and_ties_follow_the_seed():
    flat = np.zeros(100)
    a, b = select(flat, 0.3, seed=1), select(flat, 0.3, seed=1)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, select(flat, 0.3, seed=2))
    noisy = select(np.arange(100.0), 0.3, seed=5, temperature=1.0)
    assert np.array_equal(noisy, select(np.arange(100.0), 0.3, seed=5, temperature=1.0))
    assert len(noisy) == 30


def test_select_maps_windows_and_feeds_token_batches():
    tokens = _tokens()
    win = np.array([3, 9, 17, 20, 33])
    keep = select(np.array([0.1, 0.9, 0.5, 0.7, 0.2]), 0.6, seed=0, windows=win)
    assert keep.tolist() == [9, 17, 20]
    b = TokenBatches(tokens, seq_len=SEQ, micro_batch=2, keep_indices=keep)
    assert set(b.window_indices(0)) <= {9, 17, 20}


@pytest.mark.parametrize("bad", [dict(scores=[]), dict(scores=[1.0, float("nan")]),
                                 dict(fraction=0.0), dict(fraction=1.5),
                                 dict(windows=np.arange(3))])
def test_select_rejects_bad_input(bad):
    args = dict(scores=[1.0, 2.0], fraction=0.5, windows=None) | bad
    with pytest.raises(TrainplanError):
        select(args["scores"], args["fraction"], seed=0, windows=args["windows"])


def test_criteria():
    raw = np.array([5.0, 1.0, 3.0, 4.0, 2.0])
    assert select(apply_criterion(raw, "high"), 0.4, seed=0).tolist() == [0, 3]
    assert select(apply_criterion(raw, "low"), 0.4, seed=0).tolist() == [1, 4]
    assert select(apply_criterion(raw, "middle"), 0.2, seed=0).tolist() == [2]
    with pytest.raises(TrainplanError, match="criterion"):
        apply_criterion(raw, "median")


# ---- scoring and the cache -----------------------------------------------------------------


def test_random_scores_deterministic_given_seed(tmp_path):
    t = _tokens()
    a = score_windows(t, seq_len=SEQ, method="random", seed=3, cache_dir=tmp_path)
    b = score_windows(t, seq_len=SEQ, method="random", seed=3, cache_dir=tmp_path, use_cache=False)
    c = score_windows(t, seq_len=SEQ, method="random", seed=4, cache_dir=tmp_path)
    assert a.scores.shape == (40,) and np.array_equal(a.scores, b.scores)
    assert not np.array_equal(a.scores, c.scores) and a.key != c.key
    assert a.flops == 0.0


def test_loss_scores_deterministic_and_equal_to_lm_loss(ref, tmp_path):
    from trainplan.modeling.loss import lm_loss

    t = _tokens()
    a = score_windows(t, seq_len=SEQ, method="loss", reference=ref, criterion="high",
                      batch_size=7, use_cache=False)
    b = score_windows(t, seq_len=SEQ, method="loss", reference=ref, criterion="high",
                      batch_size=16, use_cache=False)
    np.testing.assert_allclose(a.raw, b.raw, rtol=1e-5)
    x, y = TokenBatches(t, seq_len=SEQ, micro_batch=1, keep_indices=[5]).batch(0)
    with torch.no_grad():
        assert a.raw[5] == pytest.approx(lm_loss(ref(input_ids=x).logits, y).item(), rel=1e-5)
    assert np.array_equal(a.scores, a.raw)  # "high": the loss itself
    assert a.scoring_flops > 0 and a.reference_flops == 0


def _counting(monkeypatch, method):
    calls = []
    real = selection_scorers.SCORERS[method]

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setitem(selection_scorers.SCORERS, method, counted)
    return calls


def test_cache_hit_and_invalidation(ref, tmp_path, monkeypatch):
    calls = _counting(monkeypatch, "loss")
    t = _tokens()
    kw = dict(seq_len=SEQ, method="loss", reference=ref, cache_dir=tmp_path)
    first = score_windows(t, **kw)
    again = score_windows(t, **kw)
    assert len(calls) == 1 and again.cached and not first.cached
    assert np.array_equal(first.raw, again.raw) and again.flops == first.flops > 0
    assert len(list((tmp_path / "scores").glob("*.npy"))) == 1
    # the criterion re-ranks cached losses: no re-score
    score_windows(t, **kw, criterion="high")
    assert len(calls) == 1
    # a changed corpus re-scores
    t2 = t.clone()
    t2[7] = (t2[7] + 1) % VOCAB
    assert not score_windows(t2, **kw).cached
    assert len(calls) == 2
    # changed settings re-score: windows, seq_len, reference weights
    score_windows(t, **kw, windows=[0, 1, 2])
    score_windows(t, **{**kw, "seq_len": SEQ // 2})
    with torch.no_grad():
        ref.lm_head.weight[0, 0] += 1e-3
    score_windows(t, **kw)
    assert len(calls) == 5
    score_windows(t, **kw)
    assert len(calls) == 5


def test_cache_invalidation_influence_settings(ref, tmp_path, monkeypatch):
    calls = _counting(monkeypatch, "influence")
    toks, _, target = _two_kinds(8)
    kw = dict(seq_len=SEQ, method="influence", reference=ref, target_tokens=target,
              cache_dir=tmp_path)
    score_windows(toks, **kw)
    score_windows(toks, **kw)
    assert len(calls) == 1
    score_windows(toks, **kw, rank=4)
    score_windows(toks, **kw, seed=1)  # other projection matrices
    score_windows(toks, **{**kw, "target_tokens": target[::-1].copy()})
    assert len(calls) == 4


def test_unreadable_cache_file_is_rescored(ref, tmp_path, monkeypatch):
    calls = _counting(monkeypatch, "loss")
    t = _tokens()
    first = score_windows(t, seq_len=SEQ, method="loss", reference=ref, cache_dir=tmp_path)
    (tmp_path / "scores" / f"{first.key}.npy").write_bytes(b"garbage")
    again = score_windows(t, seq_len=SEQ, method="loss", reference=ref, cache_dir=tmp_path)
    assert len(calls) == 2 and not again.cached
    np.testing.assert_array_equal(first.raw, again.raw)


def test_influence_shape_and_target_like_windows_score_higher(ref):
    toks, like, target = _two_kinds(32)
    s = score_windows(toks, seq_len=SEQ, method="influence", reference=ref, target_tokens=target,
                      use_cache=False)
    assert s.scores.shape == (32,) and np.all(np.abs(s.scores) <= 1 + 1e-6)
    assert s.scores[like].min() > s.scores[~like].max()
    keep = select(s.scores, 0.5, seed=0)
    assert np.all(like[keep])
    assert s.scoring_flops > 0


def test_influence_projection_preserves_gradient_geometry(ref):
    """Projected inner products track the exact per-example gradient inner products (JL)."""
    toks, _, _ = _two_kinds(6)
    starts = np.arange(6) * SEQ
    kw = dict(seq_len=SEQ, batch_size=6, seed=0, grad_blocks=1)
    full, _ = selection_scorers.projected_gradients(ref, toks, starts, rank=10**6, **kw)
    proj, _ = selection_scorers.projected_gradients(ref, toks, starts, rank=16, **kw)
    # exact per-example gradients by autograd, one window at a time
    mods = selection_scorers.grad_layers(ref, 1)
    exact = []
    for i in range(6):
        x = torch.from_numpy(toks[starts[i]:starts[i] + SEQ][None])
        y = torch.from_numpy(toks[starts[i] + 1:starts[i] + SEQ + 1][None])
        loss = torch.nn.functional.cross_entropy(ref(input_ids=x).logits[0], y[0])
        exact.append(torch.cat([g.flatten() for g in torch.autograd.grad(
            loss, [m.weight for m in mods])]).numpy())
    exact = np.stack(exact)
    np.testing.assert_allclose(full @ full.T, exact @ exact.T, rtol=1e-3, atol=1e-6)
    cos = lambda g: (g / np.linalg.norm(g, axis=1, keepdims=True)) @ (  # noqa: E731
        g / np.linalg.norm(g, axis=1, keepdims=True)).T
    assert np.abs(cos(proj) - cos(exact)).max() < 0.35
    assert proj.shape[1] < full.shape[1]


def test_dsir_prefers_target_like_windows():
    toks, like, target = _two_kinds(32)
    s = score_windows(toks, seq_len=SEQ, method="dsir", target_tokens=target, use_cache=False)
    assert s.scores[like].min() > s.scores[~like].max()
    assert s.scoring_flops > 0 and s.reference_flops == 0


def test_target_required():
    with pytest.raises(TrainplanError, match="target_tokens"):
        score_windows(_tokens(), seq_len=SEQ, method="dsir")
    with pytest.raises(TrainplanError, match="unknown scoring method"):
        score_windows(_tokens(), seq_len=SEQ, method="perplexity")


def test_trained_reference_is_cached_and_shared(tmp_path, monkeypatch):
    trained = []
    real = selection.train_reference

    def counted(*a, **k):
        trained.append(1)
        return real(*a, **k)

    monkeypatch.setattr(selection, "train_reference", counted)
    toks, like, target = _two_kinds(16)
    cfg = ReferenceConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, steps=3, micro_batch=4,
                          train_fraction=0.5)
    a = score_windows(toks, seq_len=SEQ, method="loss", reference=cfg, vocab_size=VOCAB,
                      cache_dir=tmp_path)
    b = score_windows(toks, seq_len=SEQ, method="influence", reference=cfg, vocab_size=VOCAB,
                      target_tokens=target, cache_dir=tmp_path)
    assert len(trained) == 1
    assert a.reference_flops == b.reference_flops > 0
    assert a.flops == a.scoring_flops + a.reference_flops
    # cached scores need no reference at all, and report the FLOPs they cost
    for f in (tmp_path / "references").glob("*.pt"):
        f.unlink()
    c = score_windows(toks, seq_len=SEQ, method="loss", reference=cfg, vocab_size=VOCAB,
                      cache_dir=tmp_path)
    assert len(trained) == 1 and c.cached and c.flops == a.flops


def test_counted_flops_match_analytic(ref):
    """FlopCounterMode on the first batch, scaled, agrees with costmodels' formula."""
    t = _tokens(64 * SEQ + 1)
    s = score_windows(t, seq_len=SEQ, method="loss", reference=ref, batch_size=16,
                      use_cache=False)
    n = selection_scorers.matmul_params(ref)
    pred = scoring_flops("loss", 64, SEQ, n, n_layers=1, hidden=32)
    assert s.scoring_flops == pytest.approx(pred.total, rel=0.05)
    toks, _, target = _two_kinds(16)
    s = score_windows(toks, seq_len=SEQ, method="influence", reference=ref, target_tokens=target,
                      rank=8, grad_blocks=1, use_cache=False)
    layers = [(m.out_features, m.in_features) for m in selection_scorers.grad_layers(ref, 1)]
    pred = scoring_flops("influence", 16, SEQ, n, n_layers=1, hidden=32, target_windows=8,
                         grad_layers=layers, projection_rank=8)
    assert s.scoring_flops == pytest.approx(pred.total, rel=0.25)


# ---- dynamic selection ----------------------------------------------------------------------


def test_dynamic_selector_cadence(ref):
    t = _tokens()
    sel = DynamicSelector("loss", 0.25, 3, tokens=t, seq_len=SEQ, seed=0)
    got = {step: sel.maybe_rescore(step, ref) for step in range(10)}
    assert [s for s, k in got.items() if k is not None] == [0, 3, 6, 9]
    assert all(len(k) == 10 for k in got.values() if k is not None)
    assert [h["step"] for h in sel.history] == [0, 3, 6, 9]
    assert sel.history[0]["flops"] == 0 and sel.flops_spent == pytest.approx(
        3 * sel.history[1]["flops"])
    # with the same model the loss ranking is the same, so nothing changes between rescoring
    assert sel.history[2]["changed"] == 0
    state = sel.state_dict()
    other = DynamicSelector("loss", 0.25, 3, tokens=t, seq_len=SEQ, seed=0)
    other.load_state_dict(state)
    assert np.array_equal(other.keep, sel.keep) and other.maybe_rescore(10, ref) is None


def test_dynamic_random_and_initial_keep(ref):
    t = _tokens()
    sel = DynamicSelector("random", 0.5, 2, tokens=t, seq_len=SEQ, seed=0,
                          initial_keep=np.arange(20))
    assert sel.maybe_rescore(0, ref).tolist() == list(range(20))
    assert sel.maybe_rescore(1, ref) is None
    k2 = sel.maybe_rescore(2, ref)
    assert len(k2) == 20 and not np.array_equal(k2, np.arange(20))
    assert sel.flops_spent == 0
    with pytest.raises(TrainplanError, match="irreducible"):
        DynamicSelector("loss", 0.5, 2, tokens=t, seq_len=SEQ, criterion="reducible")
    red = DynamicSelector("loss", 0.5, 2, tokens=t, seq_len=SEQ, criterion="reducible",
                          irreducible=np.zeros(40))
    red.maybe_rescore(0, ref)
    assert len(red.maybe_rescore(2, ref)) == 20


# ---- trainplan.costmodels.data.value ------------------------------------------------------------------


def test_quality_form():
    assert selection_quality(1.0, 3.0, 2.0) == 1.0
    assert selection_quality(0.5, 0.9, 1.0) == pytest.approx(1.45)
    assert DEFAULT_QUALITY["loss"].q(0.5) == pytest.approx(1.45)
    assert DEFAULT_QUALITY["influence"].q(0.1) == 1.0
    with pytest.raises(TrainplanError, match="fraction"):
        selection_quality(0.0, 1.0, 1.0)
    with pytest.raises(TrainplanError, match="a"):
        QualityFit(method="loss", a=-1.5)


def test_predicted_loss_matches_law_and_subset_loss():
    law = LossLaw(E=3.0, A=0.0, B=300.0, beta=0.4)
    d = effective_tokens(1e6, 2e5)
    assert predicted_loss(law, 1e7, 1e6, 2e5, 1.3) == pytest.approx(3.0 + 300.0 / (1.3 * d) ** 0.4)
    fit = QualityFit(method="loss", a=0.6, b=1.0)
    got = subset_loss(law, 1e7, 1e6, 1e6, 0.2, fit, offset=-0.1)
    assert got == pytest.approx(predicted_loss(law, 1e7, 1e6, 2e5, 1.48) - 0.1)
    # a random subset is never better than the whole corpus (repetition only hurts)
    assert subset_loss(law, 1e7, 1e6, 1e6, 0.2) > subset_loss(law, 1e7, 1e6, 1e6, 1.0)


@pytest.mark.parametrize("a,b", [(0.8, 2.0), (2.5, 0.7), (-0.3, 1.0)])
def test_fit_quality_recovers_known_constants(a, b):
    law = LossLaw(E=2.5, A=0.0, B=800.0, beta=0.45)
    fractions = [0.05, 0.1, 0.2, 0.35, 0.5, 0.75]
    tokens = [4e6, 4e6, 3.5e6, 3.5e6, 3e6, 3e6]
    truth = QualityFit(method="loss", a=a, b=b)
    losses = [subset_loss(law, 7e6, t, 2e6, f, truth, offset=-0.05)
              for f, t in zip(fractions, tokens, strict=False)]
    fit = fit_quality(fractions, losses, law, n_params=7e6, tokens_seen=tokens,
                      corpus_tokens=2e6, method="loss", offset=-0.05)
    assert fit.a == pytest.approx(a, rel=1e-4, abs=1e-5)
    assert fit.b == pytest.approx(b, rel=1e-4)
    assert fit.max_rel_err < 1e-6 and fit.n_points == 6
    pinned = fit_quality(fractions[:1], losses[:1], law, n_params=7e6, tokens_seen=tokens[:1],
                         corpus_tokens=2e6, offset=-0.05, fix_b=b)
    assert pinned.a == pytest.approx(a, rel=1e-4, abs=1e-5) and pinned.b == b


def test_fit_quality_needs_informative_points():
    law = LossLaw(E=2.5, A=0.0, B=800.0, beta=0.45)
    with pytest.raises(TrainplanError, match="fraction < 1"):
        fit_quality([1.0, 0.5], [3.0, 3.1], law, n_params=1e7, tokens_seen=1e6, corpus_tokens=1e6)
    with pytest.raises(TrainplanError, match="equal length"):
        fit_quality([0.5, 0.2], [3.0], law, n_params=1e7, tokens_seen=1e6, corpus_tokens=1e6)


def test_fit_local_law_recovers_constants_from_synthetic_curves():
    truth = LossLaw(E=3.2, A=0.0, B=950.0, beta=0.42)
    seen, unique, losses = [], [], []
    for u in (2e4, 1e5, 1e6):  # data-constrained curves: repetition bends the small ones
        for t in np.geomspace(1e4, 4e6, 12):
            seen.append(t)
            unique.append(u)
            losses.append(truth.predict(7e6, t, unique_tokens=u))
    law = fit_local_law(7e6, seen, unique, losses)
    assert pytest.approx(3.2, rel=1e-3) == law.E
    assert pytest.approx(950.0, rel=2e-2) == law.B
    assert law.beta == pytest.approx(0.42, rel=2e-3)
    assert law.A == 0.0 and law.r_d_star == 15.4


def test_scoring_flops_parts_and_menu():
    assert scoring_flops("random", 100, 128, 1e6).total == 0
    loss = scoring_flops("loss", 100, 128, 1e6, reference_train_tokens=1e5)
    assert loss.forward_flops == 2e6 * 100 * 128
    assert loss.reference_train_flops == 6e6 * 1e5
    inf = scoring_flops("influence", 100, 128, 1e6, target_windows=10,
                        grad_layers=[(64, 32)], projection_rank=8)
    assert inf.backward_flops == inf.forward_flops == 2e6 * 110 * 128
    assert inf.projection_flops == (2 * (64 * 8 + 32 * 8) + 2 * 64) * 110 * 128
    assert (loss + inf).total == pytest.approx(loss.total + inf.total)
    assert isinstance(loss + inf, ScoringFlops)
    with pytest.raises(TrainplanError, match="unknown scoring method"):
        scoring_flops("less", 1, 1, 1.0)
    menu = selection_menu(DEFAULT_QUALITY, [0.25, 1.0], corpus_tokens=1e6,
                          scoring={"loss": 5e12})
    pairs = {(o.method, o.fraction) for o in menu}
    assert ("random", 1.0) in pairs and ("loss", 1.0) not in pairs and ("loss", 0.25) in pairs
    loss_opt = next(o for o in menu if o.method == "loss")
    assert loss_opt.scoring_flops == 5e12 and loss_opt.quality == pytest.approx(1.675)
    assert math.isclose(loss_opt.unique_tokens, 2.5e5)


def test_default_reference_flops_predicted_before_scoring(tmp_path):
    """The planner's pre-scoring charge (`reference_scoring_flops`, defaults mirroring
    ReferenceConfig) agrees with what scoring with the default reference counts."""
    from trainplan.costmodels.data.scoring import reference_scoring_flops

    toks, _, target = _two_kinds(16)
    cfg = ReferenceConfig(steps=2)
    kw = dict(seq_len=SEQ, reference=cfg, vocab_size=VOCAB, target_tokens=target,
              cache_dir=tmp_path)
    for method in ("loss", "influence"):
        s = score_windows(toks, method=method, **kw)
        pred = reference_scoring_flops(method, 16, SEQ, VOCAB, train_steps=2, target_windows=8)
        assert s.reference_flops == pytest.approx(pred.reference_train_flops, rel=0.1)
        assert s.scoring_flops == pytest.approx(pred.total - pred.reference_train_flops,
                                                rel=0.25)
