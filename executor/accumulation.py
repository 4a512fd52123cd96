"""Gradient accumulation: one optimizer step of `grad_accum` micro-steps, each a forward and
backward of one micro-batch whose loss is divided by `grad_accum`, so that the gradients summed
over the micro-steps are the whole batch's mean (`accumulate_gradients`, called by
`trainplan.executor.train.run` once per optimizer step, before the optimizer step).

The collectives per micro-step are the rule `trainplan.costmodels.step.model.StepModel` prices
(`trainplan.costmodels.step.overlap`): DDP (ZeRO 0/1, `trainplan.executor.parallel.zero.apply_zero`) all-reduces
once per optimizer step, in the last micro-step, its earlier ones under `no_sync()`; FSDP2 (ZeRO
2/3) reduce-scatters every micro-step into the sharded gradients (its default).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from trainplan.modeling.torch_private import get_current_dispatch_mode_stack


def accumulation_sync(model, *, zero_stage: int, world: int, last: bool) -> AbstractContextManager:
    """The context of one micro-step's forward and backward: DDP's `no_sync()` (ZeRO 0/1 over
    more than one process, where `model` is the DDP wrapper) for every micro-step but the `last`;
    otherwise none (one process, or FSDP2, which reduce-scatters every micro-step)."""
    if last or world == 1 or zero_stage >= 2:
        return nullcontext()
    return model.no_sync()


def reset_memory_tracker_modules() -> None:
    """Clear the module statistics of a `MemTracker` measuring this step, if one is
    (`trainplan.executor.measure.measure_memory`): it refuses a module's second forward in one tracking
    ("does not support memory tracking for multiple iterative calls", torch 2.13), and its
    `reset_mod_stats` is the remedy it names. Its peak snapshot, which the record reads, stays."""
    for mode in get_current_dispatch_mode_stack():
        reset = getattr(mode, "reset_mod_stats", None)
        if callable(reset):
            reset()


def accumulate_gradients(forward: Callable[[int], torch.Tensor], *, grad_accum: int, model, zero_stage: int,
                         world: int) -> float:
    """Run micro-steps j = 0 .. grad_accum - 1: `forward(j)` returns micro-step j's loss (a
    scalar, nats/token, its graph alive), whose backward accumulates into the gradients, scaled
    by 1 / grad_accum (not at all when it is 1), under `accumulation_sync`. Returns the mean of
    the micro-steps' losses (nats/token): the optimizer step's loss."""
    losses = []
    for j in range(grad_accum):
        if j:
            reset_memory_tracker_modules()
        with accumulation_sync(model, zero_stage=zero_stage, world=world, last=j == grad_accum - 1):
            loss = forward(j)
            (loss / grad_accum if grad_accum > 1 else loss).backward()
        losses.append(loss.item())
    return sum(losses) / grad_accum
