"""The overlap rule (`trainplan.costmodels.step.overlap`) on synthetic blocks: communication fully hidden,
partly hidden and exposed, under FSDP2's and DDP's schedules, with gradient accumulation."""

from __future__ import annotations

import pytest

from trainplan.costmodels.step import comm
from trainplan.costmodels.step.overlap import Phase, StepTimes, schedule, step_timeline
from trainplan.errors import TrainplanError


def _times(n: int, *, fwd: float, bwd: float, gather: float, reduce: float, root: float = 0.0,
           head: float = 0.0, tail: float = 0.0) -> StepTimes:
    return StepTimes(head_fwd_s=head, head_bwd_s=head, tail_fwd_s=tail, tail_bwd_s=tail,
                     block_fwd_s=(fwd,) * n, block_bwd_s=(bwd,) * n, root_gather_s=root,
                     block_gather_s=(gather,) * n, root_reduce_s=root, block_reduce_s=(reduce,) * n)


def test_schedule_hides_a_collective_behind_later_compute():
    line = schedule([Phase(name="a", compute_s=1.0, issue_after=(("c", 0.5),)),
                     Phase(name="b", compute_s=1.0)])
    assert line.step_s == pytest.approx(2.0)
    assert line.exposed_comm_s == pytest.approx(0.0)
    assert line.comm_s == pytest.approx(0.5)


def test_schedule_waits_for_a_needed_collective():
    line = schedule([Phase(name="a", compute_s=1.0, issue_before=(("g", 3.0),), waits=("g",))])
    assert line.step_s == pytest.approx(4.0)
    assert line.exposed_comm_s == pytest.approx(3.0)


def test_collectives_run_one_at_a_time_in_issue_order():
    line = schedule([Phase(name="a", compute_s=0.0, issue_before=(("x", 1.0), ("y", 1.0))),
                     Phase(name="b", compute_s=0.5, waits=("y",))])
    assert line.step_s == pytest.approx(2.5)


def test_waiting_for_a_collective_never_issued_is_an_error():
    with pytest.raises(TrainplanError, match="waits for"):
        schedule([Phase(name="a", compute_s=1.0, waits=("nope",))])


def test_fsdp_comm_fully_hidden_leaves_only_the_first_gather_and_last_reduce():
    n, fwd, bwd, g, r, tail = 8, 1.0, 2.0, 0.2, 0.4, 0.5
    line = step_timeline(_times(n, fwd=fwd, bwd=bwd, gather=g, reduce=r, tail=tail), zero_stage=3)
    compute = n * (fwd + bwd) + 2 * tail
    assert line.compute_s == pytest.approx(compute)
    # exposed: block 0's gather before its forward (root is 0 here) and block 0's reduce-scatter;
    # the last block's backward gather is prefetched behind the tail
    assert line.step_s == pytest.approx(compute + g + r)
    assert line.comm_s == pytest.approx(n * (2 * g + r))  # ZeRO-3 gathers twice


def test_fsdp_comm_partly_hidden():
    n, fwd, bwd, g, r = 4, 1.0, 1.0, 1.5, 0.0
    line = step_timeline(_times(n, fwd=fwd, bwd=bwd, gather=g, reduce=r), zero_stage=2)
    # ZeRO-2, forward: gathers back to back (1.5 each) while each block computes 1.0 -> the
    # forward ends at 4 * 1.5 + 1.0; backward has nothing to wait for
    assert line.step_s == pytest.approx(n * g + fwd + n * bwd)
    assert 0 < line.exposed_comm_s < line.comm_s


def test_fsdp_comm_exposed_when_compute_is_negligible():
    n, g, r = 4, 1.0, 2.0
    line = step_timeline(_times(n, fwd=0.0, bwd=0.0, gather=g, reduce=r), zero_stage=3)
    assert line.step_s == pytest.approx(line.comm_s)
    assert line.exposed_comm_s == pytest.approx(n * (2 * g + r))


def test_ddp_buckets_overlap_the_backward_and_the_last_is_exposed():
    n, fwd, bwd, r = 6, 1.0, 2.0, 0.5
    t = _times(n, fwd=fwd, bwd=bwd, gather=0.0, reduce=r, root=0.3)
    line = step_timeline(t, zero_stage=0)
    assert line.step_s == pytest.approx(n * (fwd + bwd) + r + 0.3)  # block 0's and the head's
    accumulated = step_timeline(t, zero_stage=0, grad_accum=3)
    # no_sync micro-steps: one all-reduce per optimizer step
    assert accumulated.comm_s == pytest.approx(line.comm_s)
    assert accumulated.step_s == pytest.approx(3 * n * (fwd + bwd) + r + 0.3)


def test_fsdp_gathers_and_reduces_in_every_micro_step():
    t = _times(3, fwd=1.0, bwd=1.0, gather=0.1, reduce=0.1)
    one = step_timeline(t, zero_stage=3)
    four = step_timeline(t, zero_stage=3, grad_accum=4)
    assert four.comm_s == pytest.approx(4 * one.comm_s)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_grad_accum_must_be_a_positive_integer(bad):
    with pytest.raises(TrainplanError, match="grad_accum"):
        step_timeline(_times(1, fwd=1, bwd=1, gather=0, reduce=0), zero_stage=3, grad_accum=bad)


@pytest.fixture(scope="module")
def tiny_h100():
    """tiny-llama captured at bf16-mixed (autocast and `@mp` regions), on the h100 profile."""
    from trainplan.costmodels.step.model import StepModel
    from trainplan.hardware_profiles import load
    from trainplan.planner.capture.setup import capture_model

    g, _, numels = capture_model("tiny-llama", "bf16-mixed", vocab_size=2048)
    return StepModel(g.regions, g.blocks, numels, load("h100"), n_heads=g.n_heads,
                     n_kv_heads=g.n_kv_heads, head_dim=g.head_dim)


def test_step_model_overlap_is_at_most_the_no_overlap_bound(tiny_h100):
    from trainplan.costmodels.step.model import Choice, StepModel

    sm = tiny_h100
    bound = StepModel(sm.regions, sm.blocks, sm.param_numels, sm.hw, n_heads=sm.n_heads,
                      n_kv_heads=sm.n_kv_heads, head_dim=sm.head_dim, overlap=False)
    for devices, zero in ((8, 3), (64, 3), (64, 2), (16, 0)):
        c = Choice(sp_degree=1, zero_stage=zero, micro_batch=1, seq_len=256,
                   policies=("full",) * len(sm.blocks), precision="bf16-mixed", optimizer_bits=32,
                   devices=devices)
        over, summed = sm.runtime(c), bound.runtime(c)
        assert summed.comm_s == pytest.approx(over.comm_total_s)
        assert 0 <= over.comm_s <= summed.comm_s
        assert over.time_s <= summed.time_s
        two = sm.runtime(Choice(**{**_fields(c), "grad_accum": 2}))
        assert two.flops == pytest.approx(2 * over.flops)


def _fields(c) -> dict:
    return {f: getattr(c, f) for f in c.__dataclass_fields__}


def test_mixed_precision_policy_halves_gathered_bytes_and_keeps_fp32_reduce(tiny_h100):
    """bf16-mixed at ZeRO 2/3 over several devices runs FSDP2's MixedPrecisionPolicy: bf16
    all-gathers (2 bytes per parameter, half the autocast layout's fp32) and fp32 gradient
    reduce-scatters; DDP (ZeRO 0/1) keeps autocast over fp32 parameters."""
    from trainplan.costmodels.step.model import Choice

    sm = tiny_h100
    kw = dict(sp_degree=1, micro_batch=1, seq_len=256, policies=("none",) * len(sm.blocks),
              precision="bf16-mixed", optimizer_bits=32, devices=16)
    z3, z0 = Choice(zero_stage=3, **kw), Choice(zero_stage=0, **kw)
    assert sm.mixed_precision_policy(z3) and not sm.mixed_precision_policy(z0)
    assert (sm.gather_bytes_per_param(z3), sm.reduce_bytes_per_param(z3)) == (2, 4)
    assert sm.region_for(z3, "block0") == "block0@mp" and sm.region_for(z0, "block0") == "block0"
    layout = sm.fsdp_layout(z3)
    assert layout.block_param_bytes[0] == pytest.approx(2 * sm.block_numel("bf16-mixed", "block0"))
    assert layout.reduce_upcast == 2


def test_multi_node_ring_runs_at_the_nodes_nic_bandwidth(tiny_h100):
    """Across nodes a ring's bus bandwidth is devices_per_node NICs (NCCL's channels x
    per-channel speed), at most the intra-node link's."""
    hw = tiny_h100.hw
    inter = comm.link_for(hw, 2 * hw.devices_per_node)
    assert inter.bandwidth_bytes_per_s == min(hw.intra_node_bandwidth_bytes_per_s,
                                              hw.devices_per_node * hw.inter_node_bandwidth_bytes_per_s)
    assert comm.link_for(hw, hw.devices_per_node).bandwidth_bytes_per_s == hw.intra_node_bandwidth_bytes_per_s
