"""`trainplan.executor.apply_plan` on one process: the blocks found, the op check against the plan's captured
blocks (a model that differs is refused with its first mismatching op), the learning-rate
schedule and the loss. The user's whole loop, measured against the plan, is
tests/integration/test_own_loop.py."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import trainplan.executor
from trainplan.errors import PlanMismatchError
from trainplan.executor.apply.applied import lr_at
from trainplan.executor.apply.checkpointing import LAYOUT_OPS, block_ops, find_blocks
from trainplan.executor.record import RunRecord
from trainplan.planner.api import plan_for_choice

CHECKPOINT = ("none", "full")  # layer 1 checkpointed: its ops are checked


@pytest.fixture(scope="module")
def plan(tiny_llama):
    return plan_for_choice(tiny_llama(), "cpu", seq_len=32, micro_batch=2, activation_checkpoint=CHECKPOINT,
                           max_steps=10)


class _Scaled(nn.Module):
    """An activation with one op more than the plan's: silu(x) * 1.0."""

    def forward(self, x):
        return nn.functional.silu(x) * 1.0


def test_apply_plan_returns_what_a_loop_needs(plan, tiny_llama):
    applied = trainplan.executor.apply_plan(plan, tiny_llama())
    assert isinstance(applied, trainplan.executor.AppliedPlan)
    assert (applied.micro_batch, applied.grad_accum, applied.seq_len, applied.max_steps) == (2, 1, 32, 10)
    assert (applied.device, applied.rank, applied.world, applied.dp_rank) == (torch.device("cpu"), 0, 1, 0)
    assert isinstance(applied.optimizer, torch.optim.AdamW)
    lrs = []
    for _ in range(plan.decisions.max_steps):
        lrs.append(applied.optimizer.param_groups[0]["lr"])
        applied.optimizer.step()
        applied.scheduler.step()
    assert lrs == pytest.approx([lr_at(s, plan) for s in range(plan.decisions.max_steps)], rel=1e-12)
    x = torch.randint(0, 512, (2, 32))
    loss = applied.loss(x, x)
    assert loss.ndim == 0 and loss.requires_grad and 5.0 < loss.item() < 7.5  # about ln(512) = 6.24


def test_a_loop_that_first_steps_the_scheduler_after_the_optimizer_starts_at_lr_at_0(plan, tiny_llama):
    plan = dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, warmup_steps=4))
    applied = trainplan.executor.apply_plan(plan, tiny_llama(), check_ops=False)
    opt, lrs = applied.optimizer, []
    for _ in range(3):
        opt.step()  # the scheduler is first touched after the first optimizer step
        lrs.append(opt.param_groups[0]["lr"])
        applied.scheduler.step()
    assert lrs == pytest.approx([lr_at(s, plan) for s in range(3)], rel=1e-12)
    assert lrs[0] < plan.decisions.lr  # warmup, not the peak


def test_a_micro_batch_of_another_shape_is_refused(plan, tiny_llama):
    applied = trainplan.executor.apply_plan(plan, tiny_llama(), check_ops=False)
    for shape in [(4, 32), (2, 64), (32,)]:
        x = torch.zeros(shape, dtype=torch.long)
        with pytest.raises(PlanMismatchError, match=rf"x of shape {re.escape(str(shape))} .*"
                                                    r"\(micro_batch, seq_len\) = \(2, 32\)"):
            applied.loss(x, x)
    with pytest.raises(PlanMismatchError, match=r"y of shape \(2, 31\)"):
        applied.loss(torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 31, dtype=torch.long))


def test_the_checked_ops_are_the_captured_ones(plan, tiny_llama):
    model = tiny_llama()
    name, blocks = find_blocks(model, 2)
    got = block_ops(model, blocks, [1], seq_len=32, device=torch.device("cpu"))
    assert name == "model.layers" and got[1] == plan.decisions.checkpoint_block_ops["block0"]["ops"]


def test_a_block_with_another_activation_is_refused_at_its_first_other_op(plan, tiny_llama):
    ops = [op for op in plan.decisions.checkpoint_block_ops["block0"]["ops"] if op not in LAYOUT_OPS]
    at = ops.index("aten.silu.default")
    with pytest.raises(PlanMismatchError) as e:
        trainplan.executor.apply_plan(plan, tiny_llama(hidden_act="gelu"))
    msg = str(e.value)
    assert (f"model.layers.1 is not the block the plan was captured from (block0, {len(ops)} ops): compute op {at} of "
            "its forward is aten.gelu.default, the plan expects aten.silu.default") in msg, msg
    assert "\n" not in msg


def test_a_block_with_one_op_more_is_refused_at_that_op(plan, tiny_llama):
    model = tiny_llama()
    model.model.layers[1].mlp.act_fn = _Scaled()
    ops = [op for op in plan.decisions.checkpoint_block_ops["block0"]["ops"] if op not in LAYOUT_OPS]
    at = ops.index("aten.silu.default") + 1
    with pytest.raises(PlanMismatchError, match=rf"model\.layers\.1 .* compute op {at} of its forward is "
                                                rf"aten\.mul\.Tensor, the plan expects {ops[at]}"):
        trainplan.executor.apply_plan(plan, model)


def test_a_block_that_is_not_checkpointed_is_not_checked(plan, tiny_llama):
    model = tiny_llama()
    model.model.layers[0].mlp.act_fn = _Scaled()  # layer 0 runs without a checkpoint: no keys to match
    trainplan.executor.apply_plan(plan, model)


def test_blocks_are_found_by_the_plan_s_layer_count(plan, tiny_llama):
    class Wrapped(nn.Module):  # a user's wrapper: the blocks are not at model.layers
        def __init__(self):
            super().__init__()
            self.lm = tiny_llama()

    name, blocks = find_blocks(Wrapped(), 2)
    assert name == "lm.model.layers" and len(blocks) == 2
    with pytest.raises(PlanMismatchError, match=r"the plan has 2 layers but LlamaForCausalLM has no nn.ModuleList "
                                                r"of 2 blocks \(its module lists and lengths: model.layers \(3\)\)"):
        trainplan.executor.apply_plan(plan, tiny_llama(num_hidden_layers=3))


def test_measure_writes_the_plan_and_a_record_however_the_loop_ends(plan, tiny_llama, tmp_path):
    applied = trainplan.executor.apply_plan(plan, tiny_llama())
    with pytest.raises(RuntimeError, match="the user's bug"), applied.measure(tmp_path) as m:
        assert (tmp_path / "plan.json").exists()
        m.step(lambda: 6.0)
        raise RuntimeError("the user's bug")
    record = RunRecord.from_json(tmp_path / "record.json")
    assert (record.stop_reason, record.steps, record.train_loss) == ("error", 1, [(0, 6.0)])
    assert record.tokens == 2 * 32 and "RuntimeError in step 1: the user's bug" in record.notes[0]
    with applied.measure(tmp_path / "short") as m:
        m.step(lambda: 6.0)
    record = RunRecord.from_json(tmp_path / "short" / "record.json")
    assert record.stop_reason == "interrupted" and "ended after 1 of 10 steps" in record.notes[0]
