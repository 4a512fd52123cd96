"""A global batch and gradient accumulation: `solve(..., global_batch_tokens=N)` plans train
exactly N tokens per optimizer step (dp_degree x micro_batch x seq_len x grad_accum), the solver
setting the accumulation with the micro-batch; bad N is a typed error naming it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from trainplan.costmodels.checkpoint_sets import resolve
from trainplan.costmodels.step.model import Choice
from trainplan.errors import BudgetError
from trainplan.planner.api import plan_for_choice
from trainplan.planner.budget import Budget, check_global_batch_tokens
from trainplan.planner.joint.combos import accumulated_grad_bytes, make_combo, micro_step, phase_peaks
from trainplan.planner.joint.frontier import frontier_for
from trainplan.planner.joint.problem import prepare, solve_problem
from trainplan.planner.joint.space import default_space, grad_accum_for, shapes
from trainplan.planner.plan import Plan, edited_layout

SEQ = 256
MICRO_BATCHES = (1, 2, 4, 8)
N = SEQ * 8
"""One device: micro_batch x grad_accum = 8."""
BUDGET = Budget(devices=1, device_hours=0.01)


def tokens_per_step(d) -> int:
    return d.dp_degree * d.micro_batch * d.seq_len * d.grad_accum


# ---------------------------------------------------------------- the space, no capture


def test_grad_accum_is_the_whole_number_of_micro_steps():
    kw = dict(devices=8, sp_degree=2, micro_batch=2, seq_len=1024)  # 4 x 2 x 1024 = 8192 tokens
    assert grad_accum_for(None, **kw) == 1
    assert grad_accum_for(8 * 8192, **kw) == 8
    assert grad_accum_for(8192, **kw) == 1
    assert grad_accum_for(8 * 8192 + 1024, **kw) is None  # not whole
    assert grad_accum_for(4096, **kw) is None  # less than one micro-step


def test_shapes_keep_the_micro_batches_that_divide_the_global_batch():
    space = default_space(devices=4, seq_len=1024, n_heads=8, n_kv_heads=4, precision="bf16-mixed",
                          micro_batches=MICRO_BATCHES, global_batch_tokens=16 * 1024)
    got = shapes(space, devices=4, seq_len=1024)
    assert got and all((4 // sp) * mb * 1024 * ga == 16 * 1024 for sp, mb, ga in got), got
    assert (1, 4, 1) in got and (1, 1, 4) in got and (2, 8, 1) in got
    assert not any(sp == 1 and mb == 8 for sp, mb, _ in got)  # 4 x 8 x 1024 is past the batch
    plain = dataclasses.replace(space, global_batch_tokens=None)
    assert {ga for _, _, ga in shapes(plain, devices=4, seq_len=1024)} == {1}
    assert len(shapes(plain, devices=4, seq_len=1024)) == len(space.sp_degrees) * len(MICRO_BATCHES)


@pytest.mark.parametrize("n, nearest", [(1000, "global batches are 896 and 1024 tokens"),
                                        (100, "global batch is 128 tokens")])
def test_a_global_batch_nothing_divides_names_the_nearest_valid_ones(n, nearest):
    space = default_space(devices=1, seq_len=128, n_heads=8, n_kv_heads=4, precision="fp32",
                          micro_batches=(1, 2, 4, 8, 16), global_batch_tokens=n)
    with pytest.raises(BudgetError) as e:
        shapes(space, devices=1, seq_len=128)
    msg = str(e.value)
    assert f"global_batch_tokens={n} " in msg and f"the nearest valid {nearest}" in msg, msg


@pytest.mark.parametrize("bad", [0, -4096, 1.5, 4e6, True, "4M", 2**41])
def test_a_bad_global_batch_is_a_typed_error_naming_it(bad):
    with pytest.raises(BudgetError) as e:
        check_global_batch_tokens(bad)
    assert f"global_batch_tokens={bad!r}" in str(e.value) and "whole number of tokens" in str(e.value)


def test_a_good_global_batch_passes():
    assert check_global_batch_tokens(None) is None
    assert check_global_batch_tokens(4 * 2**20) == 4 * 2**20


# ---------------------------------------------------------------- solves of tiny-llama


@pytest.fixture(scope="module")
def problem():
    # one width and no checkpointing on one device: the micro-batch is the only memory lever
    return prepare("tiny-llama", "h100", seq_len=SEQ, micro_batches=MICRO_BATCHES, policies=("none",),
                   optimizer_bits=(32,), global_batch_tokens=N)


@pytest.fixture(scope="module")
def free(problem) -> Plan:
    return solve_problem(problem, BUDGET, time_limit_s=2)


def test_every_plan_trains_the_global_batch_per_optimizer_step(free):
    d, p = free.decisions, free.predictions
    assert tokens_per_step(d) == N == p.tokens_per_step, d
    assert d.grad_accum == N // (d.micro_batch * SEQ) >= 1
    assert d.max_tokens == d.max_steps * N == p.total_tokens
    assert d.max_steps == math.ceil(d.max_tokens / N)
    assert edited_layout(free) is None and free.predictions.made_for["grad_accum"] == d.grad_accum


def test_grad_accum_round_trips_through_the_plan_json(free, tmp_path):
    free.to_json(tmp_path / "plan.json")
    back = Plan.from_json(tmp_path / "plan.json")
    assert back.decisions.grad_accum == free.decisions.grad_accum
    assert back.predictions.tokens_per_step == N
    raw = json.loads(free.to_json())  # a plan written before the field: one micro-step per step
    del raw["decisions"]["grad_accum"]
    del raw["predictions"]["made_for"]["grad_accum"]
    raw["predictions"]["tokens_per_step"] = free.decisions.micro_batch * SEQ
    old = Plan.from_json(json.dumps(raw))
    assert old.decisions.grad_accum == 1 and edited_layout(old) is None


def test_without_a_global_batch_each_optimizer_step_is_one_micro_step(problem):
    plan = solve_problem(problem, BUDGET, time_limit_s=2, global_batch_tokens=None)
    d = plan.decisions
    assert d.grad_accum == 1 and plan.predictions.tokens_per_step == d.micro_batch * SEQ


def _joint_peak(problem, mb: int) -> float:
    """The joint model's peak bytes of the micro-batch `mb` plan (every block on `none`)."""
    sm = problem.step_model
    L = len(sm.blocks)
    base = Choice(sp_degree=1, zero_stage=0, micro_batch=mb, seq_len=SEQ, policies=("none",) * L,
                  precision=problem.precision, optimizer_bits=32, devices=1, grad_accum=N // (mb * SEQ))
    combo = make_combo(sm, base, {"none": resolve("none")})
    return max(phase_peaks(combo, {"none": L}, ["none"]).values())


def test_under_a_memory_cap_a_smaller_micro_batch_accumulates_more(problem, free):
    """Capped between the micro-batch 2 and 4 plans' bytes, the solver takes micro-batch 2 or 1
    and accumulates 4 or 8 micro-steps: the same tokens per step, fewer activations."""
    small, large = _joint_peak(problem, 2), _joint_peak(problem, 4)
    assert small < large
    capped = solve_problem(problem, BUDGET, time_limit_s=2, memory_limit_bytes=(small + large) / 2)
    d = capped.decisions
    assert d.micro_batch <= 2 and d.grad_accum == N // (d.micro_batch * SEQ) >= 4, d
    assert tokens_per_step(d) == N == capped.predictions.tokens_per_step
    assert capped.predictions.memory_bytes["total"] <= (small + large) / 2
    if free.decisions.micro_batch > 2:  # the free plan took a larger micro-batch: fewer micro-steps
        assert free.decisions.grad_accum < d.grad_accum


def test_the_joint_model_holds_the_accumulated_gradients(problem):
    sm = problem.step_model
    L = len(sm.blocks)
    one = Choice(sp_degree=1, zero_stage=0, micro_batch=2, seq_len=SEQ, policies=("none",) * L,
                 precision=problem.precision, optimizer_bits=32, devices=1)
    four = dataclasses.replace(one, grad_accum=4)
    assert accumulated_grad_bytes(sm, one) == 0.0
    assert accumulated_grad_bytes(sm, four) == sm.model_states(one).grads > 0
    assert micro_step(four) == one
    c1, c4 = (make_combo(sm, c, {"none": resolve("none")}) for c in (one, four))
    assert c4.memory.base_bytes == c1.memory.base_bytes + sm.model_states(one).grads
    assert c4.tokens_per_step == 4 * c1.tokens_per_step
    assert c4.menu["none"].block_s == pytest.approx(4 * c1.menu["none"].block_s)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_the_joint_model_prices_an_optimizer_step_as_evaluate_does(problem, zero_stage):
    """With 4 micro-steps on 2 devices, each checkpoint mix: the joint model's peak bytes are
    `StepModel.evaluate`'s, its seconds and FLOPs per optimizer step `StepModel.runtime`'s."""
    sm = problem.step_model
    L = len(sm.blocks)
    base = Choice(sp_degree=1, zero_stage=zero_stage, micro_batch=2, seq_len=SEQ, policies=("none",) * L,
                  precision=problem.precision, optimizer_bits=32, devices=2, grad_accum=4)
    entries = ["none", "full"]
    combo = make_combo(sm, base, {e: resolve(e) for e in entries})
    for counts in ({"none": L, "full": 0}, {"none": 1, "full": L - 1}, {"none": 0, "full": L}):
        order = sorted(entries, key=lambda e: combo.menu[e].retained_bytes)
        choice = dataclasses.replace(base, policies=tuple(e for e in order for _ in range(counts[e])))
        cost = sm.evaluate(choice)
        assert max(phase_peaks(combo, counts, order).values()) == pytest.approx(cost.memory.total, rel=1e-9)
        seconds = combo.fixed_s + sum(n * combo.menu[e].block_s for e, n in counts.items())
        assert seconds == pytest.approx(cost.time_s, rel=1e-9)
        flops = sum(n * combo.menu[e].step_flops for e, n in counts.items()) / L
        assert flops == pytest.approx(cost.flops, rel=1e-9)


def test_the_frontier_keeps_the_global_batch(problem):
    fr = frontier_for(problem, BUDGET, budget_fractions=(0.5, 1.0), memory_steps=1, time_limit_s=2,
                      ladder_time_limit_s=0.2)
    t = fr.table
    assert ((t["micro_batch"] * t["grad_accum"] * SEQ) == N).all(), t


def test_a_plan_for_a_fixed_choice_counts_its_micro_steps():
    plan = plan_for_choice("tiny-llama", "h100", seq_len=SEQ, micro_batch=2, grad_accum=3, max_steps=5)
    d, p = plan.decisions, plan.predictions
    assert d.grad_accum == 3 and p.tokens_per_step == 2 * SEQ * 3 and d.max_tokens == 5 * 2 * SEQ * 3
    assert edited_layout(plan) is None
    edited = dataclasses.replace(plan, decisions=dataclasses.replace(d, grad_accum=1))
    assert f"tokens_per_step={2 * SEQ * 3} is not micro_batch=2" in (edited_layout(edited) or "")
