"""The long-context knobs in the cost models (issue #25): region keys of the tiled variants,
what a tiled loss costs in FLOPs, activation offload's device and host bytes, and the default
chunk counts."""

from __future__ import annotations

import dataclasses

import pytest

from trainplan.costmodels.graph import poly_at, variant_key
from trainplan.costmodels.step.model import Choice, StepModel
from trainplan.costmodels.step.offload import host_limit_bytes
from trainplan.errors import TrainplanError
from trainplan.hardware_profiles import load
from trainplan.planner.capture.regions import parse_key
from trainplan.planner.joint.space import check_chunk_options, check_offload_options, default_tiling


def _choice(sm: StepModel, **kw) -> Choice:
    base = dict(sp_degree=1, zero_stage=0, micro_batch=2, seq_len=256, policies=("full",) * len(sm.blocks),
                precision="fp32", optimizer_bits=32, devices=1)
    return Choice(**(base | kw))


@pytest.mark.parametrize("key, parsed", [
    ("block0", ("block0", False, 32, 1)), ("tail@l64", ("tail", False, 32, 64)),
    ("block1@mp@m4@a8", ("block1", True, 8, 4)), ("head@a16", ("head", False, 16, 1))])
def test_region_keys_round_trip(key, parsed):
    region, mp, bits, chunks = parsed
    assert parse_key(key) == parsed
    assert variant_key(region, mixed_precision=mp, activation_bits=bits, chunks=chunks) == key


@pytest.mark.parametrize("key", ["tail@m4", "block0@l4", "block0@x", "@mp"])
def test_malformed_region_keys_are_not_regions(key):
    with pytest.raises(KeyError):
        parse_key(key)


def test_tiled_loss_costs_one_more_head_forward(step_model):
    """The tiled tail recomputes each chunk's logits in the backward: 2 x b x s x h x V FLOPs more
    (the LM head's matmul; torch's FLOP formulas count matmuls and attention), and its peak is
    lower at a sequence where the logits dominate."""
    sm = step_model
    b, s = 2, 512
    plain, tiled = sm.regions["tail"], sm.regions["tail@l8"]
    flops = [sum(poly_at(d["flops"], b, s) for _, d in r.graph.nodes(data=True)) for r in (plain, tiled)]
    hidden, vocab = 64, 512  # tests/conftest.py TINY_LLAMA
    assert flops[1] - flops[0] == pytest.approx(2 * b * s * hidden * vocab, rel=1e-12)
    c = _choice(sm, seq_len=s, micro_batch=b, policies=("none",) * len(sm.blocks))
    assert sm.tail_memory(dataclasses.replace(c, loss_chunks=8)).bwd_peak.total < sm.tail_memory(c).bwd_peak.total


def test_tiled_mlp_runs_under_none_and_full_only(step_model):
    c = _choice(step_model, mlp_chunks=4, policies=("save_matmuls",) * len(step_model.blocks))
    with pytest.raises(TrainplanError, match="mlp_chunks=4 runs with the checkpoint entries none and full"):
        step_model.evaluate(c)


def test_offload_moves_checkpointed_inputs_to_host_on_a_discrete_device(step_model):
    """On h100 (host memory over PCIe) each fully checkpointed block keeps its input in host
    memory: retained bytes less the input, one input more in flight in its peaks, the inputs'
    bytes on the host; a block on `none` moves nothing. On the cpu profile (unified memory)
    nothing leaves the device."""
    h100 = StepModel(step_model.regions, step_model.blocks, step_model.param_numels, load("h100"),
                     n_heads=step_model.n_heads, n_kv_heads=step_model.n_kv_heads, head_dim=step_model.head_dim)
    n = len(h100.blocks)
    c = _choice(h100, policies=("full",) * (n - 1) + ("none",))
    on = dataclasses.replace(c, offload=True)
    plain, moved = h100.block_memory(c, 0, "full"), h100.block_memory(on, 0, "full")
    x = plain.input_bytes
    assert x == 2 * 256 * 64 * 4  # b x s x hidden, fp32
    assert moved.retained == pytest.approx(plain.retained - x)
    assert moved.bwd_peak.total == pytest.approx(plain.bwd_peak.total + x)
    assert h100.block_memory(on, n - 1, "none") == h100.block_memory(c, n - 1, "none")
    assert h100.evaluate(on).host_bytes == pytest.approx((n - 1) * x)
    assert h100.evaluate(c).host_bytes == 0
    assert host_limit_bytes(h100.hw) == h100.hw.host_memory_bytes / h100.hw.devices_per_node
    cpu_on = dataclasses.replace(_choice(step_model), offload=True)
    assert step_model.evaluate(cpu_on).host_bytes == 0
    assert step_model.block_memory(cpu_on, 0, "full").retained == step_model.block_memory(
        _choice(step_model), 0, "full").retained


def test_default_tiling_sizes_a_chunk_near_the_hidden_states():
    """llama3.1-8b under bf16: fp32 logits of 128,256 tokens over bf16 hidden states of 4,096 are
    62.6 x larger (64 chunks); an MLP 14,336 wide is 3.5 x (4 chunks); offload where host memory
    is apart from the device's."""
    got = default_tiling(vocab_size=128256, hidden_size=4096, intermediate_size=14336, act_bytes=2,
                         unified_memory=False)
    assert got == dict(loss_chunks=(1, 64), mlp_chunks=(1, 4), offload=(False, True))
    assert default_tiling(vocab_size=512, hidden_size=64, intermediate_size=176, act_bytes=4,
                          unified_memory=True)["offload"] == (False,)


@pytest.mark.parametrize("bad", [(3,), (), (0,), (2.0,), (True,)])
def test_chunk_options_must_be_powers_of_two(bad):
    with pytest.raises(TrainplanError, match="loss_chunks="):
        check_chunk_options(bad, "loss_chunks")


@pytest.mark.parametrize("bad", [(), (1,), ("yes",)])
def test_offload_options_must_be_bools(bad):
    with pytest.raises(TrainplanError, match="offload="):
        check_offload_options(bad)
