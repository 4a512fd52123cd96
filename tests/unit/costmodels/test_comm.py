"""trainplan.costmodels.step.comm: alpha-beta collective times, Ulysses all-to-all bytes, ZeRO collectives."""

from __future__ import annotations

import numpy as np
import pytest

from trainplan.costmodels.step.comm import (
    ULYSSES_PER_STEP_FACTOR,
    Collective,
    Link,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    reduce_scatter_s,
    ulysses_all_to_all_bytes,
    ulysses_comm_bytes_per_layer,
    valid_sp_degrees,
    zero_comm_bytes,
)
from trainplan.errors import TrainplanError

LINK = Link(bandwidth_bytes_per_s=100e9, latency_s=5e-6, efficiency=0.8)
FUNCS = [all_reduce_s, all_gather_s, reduce_scatter_s, all_to_all_s]

# Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128.
LLAMA = dict(micro_batch=2, seq_len=8192, n_heads=32, n_kv_heads=8, head_dim=128,
             bytes_per_element=2)


@pytest.mark.parametrize("fn", FUNCS)
def test_single_rank_and_empty_buffer_cost_nothing(fn):
    assert fn(1e9, 1, LINK) == 0.0
    assert fn(0, 8, LINK) == 0.0


def test_formulas_at_n8():
    bw, lat, n, b = 100e9 * 0.8, 5e-6, 8, 1e9
    assert all_reduce_s(b, n, LINK) == pytest.approx(2 * 7 / 8 * b / bw + 2 * 7 * lat)
    assert all_gather_s(b, n, LINK) == pytest.approx(7 / 8 * b / bw + 7 * lat)
    assert reduce_scatter_s(b, n, LINK) == pytest.approx(7 / 8 * b / bw + 7 * lat)
    assert all_to_all_s(b, n, LINK) == pytest.approx(7 / 8 * b / bw + 7 * lat)
    # all-reduce = reduce-scatter + all-gather
    assert all_reduce_s(b, n, LINK) == pytest.approx(
        reduce_scatter_s(b, n, LINK) + all_gather_s(b, n, LINK)
    )


def test_numpy_integers_accepted():
    assert all_gather_s(1e9, np.int64(8), LINK) == all_gather_s(1e9, 8, LINK)


@pytest.mark.parametrize("fn", FUNCS)
@pytest.mark.parametrize("nbytes,n", [(1e6, 0), (1e6, -2), (-1.0, 4), (float("nan"), 4),
                                      (1e6, 2.5), (1e6, True)])
def test_bad_inputs(fn, nbytes, n):
    with pytest.raises(TrainplanError):
        fn(nbytes, n, LINK)


@pytest.mark.parametrize(
    "kwargs,field",
    [({"bandwidth_bytes_per_s": 0, "latency_s": 0}, "bandwidth"),
     ({"bandwidth_bytes_per_s": 1e9, "latency_s": -1}, "latency"),
     ({"bandwidth_bytes_per_s": 1e9, "latency_s": 0, "efficiency": 0}, "efficiency"),
     ({"bandwidth_bytes_per_s": 1e9, "latency_s": 0, "efficiency": 1.5}, "efficiency")],
)
def test_bad_link(kwargs, field):
    with pytest.raises(TrainplanError, match=field):
        Link(**kwargs)


# --- Ulysses --------------------------------------------------------------------------------


def test_ulysses_bytes_kv_heads_divisible():
    got = ulysses_all_to_all_bytes(sp_degree=4, **LLAMA)
    local_tokens = 2 * 8192 // 4
    assert got["q"] == got["out"] == local_tokens * 32 * 128 * 2
    assert got["k"] == got["v"] == local_tokens * 8 * 128 * 2


def test_ulysses_gqa_replicates_kv_heads_up_to_p():
    got = ulysses_all_to_all_bytes(sp_degree=16, **LLAMA)
    local_tokens = 2 * 8192 // 16
    assert got["k"] == got["v"] == local_tokens * 16 * 128 * 2  # 8 KV heads replicated to 16
    assert got["q"] == local_tokens * 32 * 128 * 2


def test_ulysses_fwd_bwd_total():
    fwd = sum(ulysses_all_to_all_bytes(sp_degree=8, **LLAMA).values())
    assert ulysses_comm_bytes_per_layer(sp_degree=8, backward=False, **LLAMA) == fwd
    assert ulysses_comm_bytes_per_layer(sp_degree=8, **LLAMA) == ULYSSES_PER_STEP_FACTOR * fwd == 2 * fwd


@pytest.mark.parametrize(
    "overrides,message",
    [({"sp_degree": 3}, "sp_degree=3 does not divide seq_len=8192"),
     ({"sp_degree": 64, "seq_len": 8192}, "sp_degree=64 does not divide n_heads=32"),
     ({"sp_degree": 4, "n_heads": 24, "n_kv_heads": 6, "seq_len": 4800},
      "sp_degree=4 must divide n_kv_heads=6"),
     ({"sp_degree": 12, "n_heads": 24, "n_kv_heads": 8, "seq_len": 4800},
      "sp_degree=12 must be a multiple of n_kv_heads=8")],
)
def test_ulysses_divisibility_errors(overrides, message):
    kwargs = {**LLAMA, **overrides}
    with pytest.raises(TrainplanError, match=message) as err:
        ulysses_all_to_all_bytes(**kwargs)
    valid = valid_sp_degrees(kwargs["seq_len"], kwargs["n_heads"], kwargs["n_kv_heads"])
    assert f"valid sp_degree: {valid}" in str(err.value)
    assert kwargs["sp_degree"] not in valid


def test_valid_sp_degrees():
    assert valid_sp_degrees(8192, 32, 8) == [1, 2, 4, 8, 16, 32]
    assert valid_sp_degrees(4800, 24, 6) == [1, 2, 3, 6, 12, 24]
    assert valid_sp_degrees(4800, 24, 8) == [1, 2, 4, 8, 24]
    with pytest.raises(TrainplanError, match="multiple of n_kv_heads"):
        valid_sp_degrees(4096, 32, 6)
    with pytest.raises(TrainplanError, match="seq_len"):
        valid_sp_degrees(0, 32, 8)


# --- ZeRO -----------------------------------------------------------------------------------


def _zero(stage, n=8, grad=2, param=2):
    return zero_comm_bytes(7e9, stage=stage, dp_degree=n, grad_bytes_per_param=grad,
                           param_bytes_per_param=param)


def _volume(colls):
    return sum(c.sent_bytes for c in colls.values())


def _time(colls, link):
    return sum(c.time_s(link) for c in colls.values())


def test_zero_collective_kinds():
    assert {k: c.kind for k, c in _zero(0).items()} == {"grads": "all_reduce"}
    for stage in (1, 2):
        assert {k: c.kind for k, c in _zero(stage).items()} == {
            "grads": "reduce_scatter", "params_after_step": "all_gather"}
    assert sorted(c.kind for c in _zero(3).values()) == ["all_gather", "all_gather", "reduce_scatter"]
    assert all(c.nbytes == 7e9 * 2 and c.n_ranks == 8 for c in _zero(3).values())


def test_zero_stage3_is_1_5x_stage0():
    assert _volume(_zero(3)) / _volume(_zero(0)) == pytest.approx(1.5)
    assert _volume(_zero(1)) == pytest.approx(_volume(_zero(0)))
    assert _volume(_zero(2)) == pytest.approx(_volume(_zero(0)))
    no_latency = Link(bandwidth_bytes_per_s=100e9, latency_s=0.0)
    assert _time(_zero(3), no_latency) / _time(_zero(0), no_latency) == pytest.approx(1.5)
    # Psi = 7e9, 2 bytes: DP volume is 2 * (n-1)/n * Psi * 2 bytes per rank
    assert _volume(_zero(0)) == pytest.approx(2 * 7 / 8 * 7e9 * 2)


def test_zero_single_rank_is_free():
    for stage in range(4):
        colls = _zero(stage, n=1)
        assert _volume(colls) == 0.0 and _time(colls, LINK) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [{"stage": 4}, {"stage": -1}, {"stage": True}, {"dp_degree": 0}, {"dp_degree": 2.0},
     {"grad_bytes_per_param": -2}, {"n_params": -1.0}],
)
def test_zero_bad_inputs(kwargs):
    base = dict(n_params=1e9, stage=2, dp_degree=8, grad_bytes_per_param=2, param_bytes_per_param=2)
    base.update(kwargs)
    with pytest.raises(TrainplanError):
        zero_comm_bytes(base.pop("n_params"), **base)


def test_collective_validation():
    with pytest.raises(TrainplanError, match="broadcast"):
        Collective(kind="broadcast", nbytes=1.0, n_ranks=2)
    c = Collective(kind="all_to_all", nbytes=8e6, n_ranks=4)
    assert c.time_s(LINK) == all_to_all_s(8e6, 4, LINK)
    assert c.sent_bytes == pytest.approx(6e6)
