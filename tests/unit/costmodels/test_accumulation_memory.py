"""Gradient accumulation in the memory model (`trainplan.costmodels.step.memory.step_phases`): from the second
micro-step on the parameters hold the gradients of the earlier ones and autograd adds each new
gradient into them in place, so a step's gradients are counted once, not held + made so far (which
put a hidden-256 Llama's plan 7.8% over MemTracker; measured in
tests/integration/test_grad_accum_memory.py)."""

from __future__ import annotations

import pytest

from trainplan.costmodels.step.memory import step_phases
from trainplan.costmodels.step.model import Choice, StepModel


def _choice(sm: StepModel, policy: str, grad_accum: int, zero_stage: int = 0, devices: int = 1) -> Choice:
    return Choice(sp_degree=1, zero_stage=zero_stage, micro_batch=2, seq_len=64,
                  policies=(policy,) * len(sm.blocks), precision="fp32", optimizer_bits=32,
                  devices=devices, grad_accum=grad_accum)


@pytest.mark.parametrize("policy", ["none", "full"])
@pytest.mark.parametrize("zero_stage, devices", [(0, 1), (1, 2)])
def test_accumulated_gradients_are_counted_once(step_model, policy, zero_stage, devices):
    """In no phase of an accumulating step do gradients exceed the accumulated ones plus the one
    gradient being added (MemTracker labels it GRAD as it arrives); and the step's peak is at least
    the one-micro-step peak, at most that plus the accumulated gradients."""
    sm = step_model
    one, two = (_choice(sm, policy, ga, zero_stage, devices) for ga in (1, 2))
    states = sm.model_states(two)
    blocks = [sm.block_memory(two, i, policy) for i in range(len(sm.blocks))]
    phases = step_phases(sm.head_memory(two), blocks, sm.tail_memory(two), states,
                         held_grad_bytes=states.grads)
    largest_grad = max(r.grad_bytes for r in (*blocks, sm.head_memory(two), sm.tail_memory(two)))
    assert max(m.grads for m in phases) <= states.grads + largest_grad
    peak_one, peak_two = sm.evaluate(one).memory.total, sm.evaluate(two).memory.total
    assert peak_one <= peak_two <= peak_one + states.grads
    assert max(phases, key=lambda m: m.total).total == peak_two


def test_the_first_micro_step_is_priced_without_gradients(step_model):
    """An accumulating step's phases start with the first micro-step's, which holds no gradients
    yet (the optimizer step before it set them to None): the same as a one-micro-step step's."""
    sm = step_model
    one, two = (_choice(sm, "none", ga) for ga in (1, 2))
    args = [sm.head_memory(one), [sm.block_memory(one, i, "none") for i in range(len(sm.blocks))],
            sm.tail_memory(one), sm.model_states(one)]
    first = step_phases(*args)
    both = step_phases(*args, held_grad_bytes=sm.model_states(two).grads)
    assert both[:len(first) - 1] == first[:-1]  # the optimizer step is last in both
    assert both[-1] == first[-1]
