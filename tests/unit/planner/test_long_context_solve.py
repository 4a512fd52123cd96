"""The long-context knobs in the joint plan (issue #25): chosen only where they pay, found for
the longest sequence a budget trains, kept in the plan file, refused when they cannot run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trainplan.errors import InfeasibleError, PlanMismatchError, TrainplanError
from trainplan.planner.api import plan_for_choice, solve, solve_longest
from trainplan.planner.budget import Budget
from trainplan.planner.plan import Plan

MIB = 2**20
KNOBS = dict(loss_chunks=(1, 4, 16), mlp_chunks=(1, 4))


def _long(plan: Plan) -> tuple:
    d = plan.decisions
    return d.loss_chunks, d.mlp_chunks, d.offload


def test_a_sequence_that_fits_untiled_is_not_tiled(tiny_llama):
    """Nothing tiles where the plan fits with every block unchecked, even with the knobs searched
    wherever they may pay: they only add time."""
    plan = solve(tiny_llama(device="meta"), "cpu", Budget(wall_clock_s=600), seq_len=256, **KNOBS)
    assert set(plan.decisions.activation_checkpoint) == {"none"}
    assert _long(plan) == (1, 1, False)


def test_tiles_where_memory_binds_and_the_plan_fits_its_cap(tiny_llama):
    """At 16K tokens under a 110 MiB cap no untiled plan fits (full checkpointing: 118 MiB, its
    peak in the loss head): the solver tiles, and the plan it returns fits the cap by its own
    prediction."""
    cap = 110 * MIB
    model = tiny_llama(device="meta")
    with pytest.raises(InfeasibleError):
        solve(model, "cpu", Budget(wall_clock_s=10**6), seq_len=16384, memory_limit_bytes=cap, explain=False,
              loss_chunks=(1,), mlp_chunks=(1,))
    plan = solve(model, "cpu", Budget(wall_clock_s=10**6), seq_len=16384, memory_limit_bytes=cap, explain=False)
    assert plan.decisions.loss_chunks > 1, _long(plan)
    assert plan.predictions.memory_bytes["total"] <= cap
    assert any("tiled loss" in n for n in plan.notes), plan.notes
    back = Plan.from_json(plan.to_json())
    assert _long(back) == _long(plan)


def test_longest_sequence_is_the_last_that_fits(tiny_llama):
    cap = 24 * MIB
    model = tiny_llama(device="meta")
    plan = solve_longest(model, "cpu", Budget(wall_clock_s=600), memory_limit_bytes=cap, up_to=2**16)
    seq = plan.decisions.seq_len
    assert seq % 1024 == 0 and plan.predictions.memory_bytes["total"] <= cap
    assert any(n.startswith(f"longest sequence: {seq} tokens") for n in plan.notes), plan.notes
    with pytest.raises(InfeasibleError):
        solve(model, "cpu", Budget(wall_clock_s=600), seq_len=seq + 1024, memory_limit_bytes=cap, explain=False)


def test_a_tiled_mlp_under_a_selective_entry_is_refused(tiny_llama):
    with pytest.raises(TrainplanError, match="mlp_chunks=4 runs with the checkpoint entries none and full"):
        plan_for_choice(tiny_llama(device="meta"), "cpu", seq_len=128, micro_batch=1,
                        activation_checkpoint="save_matmuls",
                        mlp_chunks=4)


@pytest.mark.parametrize("knob, value", [("loss_chunks", 0), ("mlp_chunks", 2.5), ("offload", "yes")])
def test_bad_knob_values_are_refused_with_their_name(tiny_llama, knob, value):
    with pytest.raises(TrainplanError, match=knob):
        plan_for_choice(tiny_llama(device="meta"), "cpu", seq_len=128, micro_batch=1, **{knob: value})


def test_plan_file_refuses_a_tiled_mlp_with_a_selective_entry(tiny_llama):
    plan = plan_for_choice(tiny_llama(device="meta"), "cpu", seq_len=128, micro_batch=1, activation_checkpoint="full",
                           mlp_chunks=4)
    data = json.loads(plan.to_json())
    data["decisions"]["activation_checkpoint"] = ["save_matmuls"] * len(data["decisions"]["activation_checkpoint"])
    with pytest.raises(PlanMismatchError, match="mlp_chunks=4"):
        Plan.from_json(json.dumps(data))
    old = json.loads(plan.to_json())
    for key in ("loss_chunks", "mlp_chunks", "offload"):  # a plan written before the knobs
        del old["decisions"][key]
        del old["predictions"]["made_for"][key]
    assert _long(Plan.from_json(json.dumps(old))) == (1, 1, False)
    assert dataclasses.asdict(plan.decisions)["mlp_chunks"] == 4


def test_one_value_is_a_menu_of_one_and_a_string_is_refused(tiny_llama):
    """`offload=True` and `loss_chunks=8` read as (True,) and (8,): values the solver may choose,
    beside the plan without them (which wins where it fits)."""
    model = tiny_llama(device="meta")
    plan = solve(model, "cpu", Budget(wall_clock_s=600), seq_len=256, loss_chunks=8, offload=True)
    assert _long(plan) == (1, 1, False)
    with pytest.raises(TrainplanError, match="offload='yes' is not valid"):
        solve(model, "cpu", Budget(wall_clock_s=600), seq_len=256, offload="yes")


@pytest.mark.parametrize("knobs, needle", [(dict(loss_chunks=1024), "loss_chunks=1024 is more chunks than"),
                                           (dict(mlp_chunks=3), "mlp_chunks=3 is not valid")])
def test_chunk_counts_beyond_the_tokens_or_not_powers_of_two_are_refused(tiny_llama, knobs, needle):
    with pytest.raises(TrainplanError, match=needle):
        plan_for_choice(tiny_llama(device="meta"), "cpu", seq_len=256, micro_batch=1, **knobs)


def test_longest_sequence_with_a_global_batch_is_refused(tiny_llama):
    with pytest.raises(TrainplanError, match="a global batch and the longest sequence cannot be planned together"):
        solve_longest(tiny_llama(device="meta"), "cpu", Budget(wall_clock_s=600), global_batch_tokens=8192)
