"""Property of the joint solve (issue #40 item 1): no single-knob change of an OPTIMAL plan,
priced by the plan's own model, predicts a lower loss.

The plan's own model: `StepModel.evaluate` for memory (at most the device's usable bytes) and
the step's seconds, the whole budget spent at that step time, and `run_loss` plus the widths'
penalty (`bits_loss_penalty`) for the loss: the numbers the plan prints. The knobs: the
micro-batch with its gradient accumulation (every (SP degree, micro-batch, accumulation) the
space offers, `shapes`), the SP degree, the ZeRO stage, the optimizer width and the data
fraction; the checkpoint per block stays the plan's. Before the fix the default space picked
micro-batch 1-2 where micro-batch 4-8 buys more tokens at a lower spent loss (its table at the
token grid's level was higher).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from trainplan.costmodels.loss.bits import bits_loss_penalty
from trainplan.costmodels.loss.planned import run_loss
from trainplan.modeling.configs import build_from_config
from trainplan.planner.budget import Budget
from trainplan.planner.joint.problem import prepare
from trainplan.planner.joint.solver import solve_joint
from trainplan.planner.joint.space import shapes


@pytest.fixture(scope="module")
def tiny():
    """tiny-llama on an H100 at 512 tokens, captured once."""
    return prepare("tiny-llama", "h100", seq_len=512)


@pytest.fixture(scope="module")
def qwen():
    """The issue's case: a 0.49B Qwen2-like config (Qwen2-0.5B's shape) on an H100 at 4,096
    tokens, where the default search missed micro-batch 8."""
    return prepare(build_from_config({"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
                                "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                                "vocab_size": 151936, "max_position_embeddings": 32768,
                                "tie_word_embeddings": True}, device="meta", name="qwen2-05b"),
                   "h100", seq_len=4096)


def _own_loss(pr, space, budget: Budget, choice, fraction: float, seq_len: int) -> float:
    """The plan's own predicted loss of `choice` spending the whole `budget`; inf when it does
    not fit memory."""
    cost = pr.step_model.evaluate(choice)
    if cost.memory.total > pr.profile.usable_bytes:
        return math.inf
    tokens_per_step = budget.devices // choice.sp_degree * choice.micro_batch * seq_len * choice.grad_accum
    steps = max(1, int(budget.wall_s_for(budget.devices) // cost.time_s))
    pen = bits_loss_penalty(choice.optimizer_bits, choice.activation_bits, precision=space.precision,
                            penalty=pr.law.bits)
    return run_loss(pr.law, pr.graph.n_params, steps=steps, tokens_per_step=tokens_per_step,
                    unique_tokens=max(1.0, fraction * pr.unique)) + pen


@pytest.mark.parametrize(("case", "seq_len", "devices", "budget_kw", "global_batch"), [
    ("tiny", 512, 1, {"device_hours": 0.01}, None),
    ("tiny", 512, 8, {"device_hours": 0.5}, None),
    ("tiny", 512, 8, {"wall_clock_s": 20.0}, None),
    ("tiny", 512, 8, {"device_hours": 0.5}, 65536),
    ("qwen", 4096, 8, {"device_hours": 200.0}, None),  # failed before the fix: micro-batch 2
])
def test_no_single_knob_change_beats_an_optimal_plan(request, case, seq_len, devices, budget_kw, global_batch):
    tiny = request.getfixturevalue(case)
    budget = Budget(devices=devices, **budget_kw)
    space = tiny.space(devices, seq_len, global_batch_tokens=global_batch)
    sol = solve_joint(tiny.step_model, tiny.profile, budget, seq_len=seq_len, space=space,
                      n_params=tiny.graph.n_params, data_tokens=tiny.unique, law=tiny.law, menus=tiny.menus)
    assert sol.status == "OPTIMAL"
    c, f = sol.choice, sol.data_fraction
    own = _own_loss(tiny, space, budget, c, f, seq_len)
    # the plan's printed loss and objective are its own model's
    assert math.isclose(sol.predicted_loss, own, abs_tol=1e-6), (sol.predicted_loss, own)
    assert sol.objective == sol.predicted_loss
    neighbours = [(dataclasses.replace(c, sp_degree=sp, micro_batch=mb, grad_accum=ga), f)
                  for sp, mb, ga in shapes(space, devices=devices, seq_len=seq_len)]
    neighbours += [(dataclasses.replace(c, zero_stage=z), f) for z in space.zero_stages]
    neighbours += [(dataclasses.replace(c, optimizer_bits=b), f) for b in space.optimizer_bits]
    neighbours += [(c, fr) for fr in space.data_fractions]
    assert len(neighbours) > 5
    for n, fr in neighbours:
        theirs = _own_loss(tiny, space, budget, n, fr, seq_len)
        assert theirs >= own - 1e-6, (f"{n.sp_degree=} {n.micro_batch=} {n.grad_accum=} {n.zero_stage=} "
                                      f"{n.optimizer_bits=} fraction {fr}: {theirs:.6f} < plan's {own:.6f}")
