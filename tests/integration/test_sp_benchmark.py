"""The SP benchmark's and the context table's bookkeeping, without training or capturing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sp():
    return _load("sp")


@pytest.fixture(scope="module")
def ctx():
    return _load("context_table")


@pytest.mark.parametrize("quick, n", [(True, 5), (False, 21)])
def test_grid_has_an_sp1_reference_for_every_length(sp, quick, n):
    cases = sp.grid(quick)
    assert len(cases) == n
    for c in cases:
        assert c["seq_len"] % c["sp_degree"] == 0
        assert any(r["seq_len"] == c["seq_len"] and r["sp_degree"] == 1 for r in cases)
    assert {c["sp_degree"] for c in cases} == {1, 2, 4}


def _row(seq, p, zero, losses, t, err):
    return dict(seq_len=seq, sp_degree=p, zero_stage=zero, train_loss=json.dumps(losses),
                step_time_measured=t, step_time_predicted=2 * t, step_time_rel_err=1.0,
                per_rank_peak_memory_max_abs_rel_err=err, flops_per_step_rel_err=0.0,
                stop_reason="budget", steps=len(losses))


def test_loss_diff_is_relative_to_sp1_at_the_same_length(sp):
    df = pd.DataFrame([
        _row(512, 1, 0, [10.0, 8.0], 1.0, 0.0),
        _row(512, 2, 0, [10.0, 8.08], 0.5, 0.1),
        _row(512, 4, 3, [10.1, 8.0], 0.25, -0.3),
    ])
    out = sp.add_loss_diffs(df)
    assert out["loss_max_rel_diff_vs_sp1"].tolist() == pytest.approx([0.0, 0.01, 0.01])
    assert out["step_time_ratio_vs_sp1_measured"].tolist() == pytest.approx([1.0, 0.5, 0.25])
    s = sp.summarize(out, quick=True)
    assert s["sp_loss_max_rel_diff"] == pytest.approx(0.01)
    assert s["per_rank_peak_memory_max_rel_err"] == pytest.approx(0.3)
    assert s["per_rank_peak_memory_max_rel_err_zero3"] == pytest.approx(0.3)
    for key in ("quick", "machine", "torch", "date"):
        assert key in s


@pytest.mark.parametrize("limit_tokens, expected", [(0, 0), (1024, 1024), (5000, 4096),
                                                    (70_000, 69_632)])
def test_max_context_bisection(ctx, monkeypatch, limit_tokens, expected):
    """Memory grows with length; the search returns the longest multiple of 1024 that fits."""
    def fake_plan(hw, seq_len, **knobs):
        return SimpleNamespace(predictions=SimpleNamespace(
            memory_bytes={"total": float(seq_len)}, memory_limit_bytes=float(limit_tokens)))

    monkeypatch.setattr(ctx, "plan_at", fake_plan)
    tokens, plan, _ = ctx.max_context("h100", sp_degree=8, activation_checkpoint="full", zero_stage=3)
    assert tokens == expected
    assert (plan is None) == (expected == 0)
