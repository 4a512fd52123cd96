"""AdamW's step temporaries (`trainplan.costmodels.step.memory.adamw_step_temp_bytes`) against MemTracker on
CPU, for each torch implementation, and the executor's optimizer against the step model's."""

from __future__ import annotations

import pytest
import torch

from trainplan.costmodels.step.optimizer_states import (
    ADAMW_IMPLEMENTATION,
    ADAMW_IMPLEMENTATIONS,
    adamw_step_temp_bytes,
)
from trainplan.errors import TrainplanError
from trainplan.executor.measure import measure_memory
from trainplan.executor.optimizers import build_optimizer

SHAPES = [(256, 96), (64, 64), (1000,), (33, 7)]
KWARGS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single_tensor": {"foreach": False}}


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    return ps


@pytest.mark.parametrize("adamw", ADAMW_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adamw_step_temporaries_match_memtracker(adamw, dtype):
    """The second step (states exist) under MemTracker: its peak less parameters, gradients and
    states is the implementation's scratch, to the byte."""
    ps = _params(dtype)
    opt = torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **KWARGS[adamw])
    opt.step()  # states made
    holder = torch.nn.ParameterList(ps)
    peak = measure_memory(opt.step, holder, opt)
    width = torch.empty((), dtype=dtype).element_size()
    numels = [p.numel() for p in ps]
    states = sum(2 * n * width + 4 for n in numels)  # exp_avg, exp_avg_sq, fp32 step
    resident = sum(numels) * width * 2 + states  # parameters, gradients, states
    measured = peak["total"] - resident
    predicted = adamw_step_temp_bytes(adamw, state_bytes=width, largest_numel=max(numels),
                                      local_numel=sum(numels))
    assert measured == predicted, f"{adamw} {dtype}: MemTracker {measured} B of scratch, model {predicted} B"


@pytest.mark.parametrize("bits, precision, dtype", [(32, "fp32", torch.float32), (16, "bf16", torch.bfloat16)])
def test_executor_runs_the_adamw_the_step_model_prices(bits, precision, dtype):
    opt = build_optimizer(_params(dtype), bits, lr=1e-3, precision=precision)
    assert isinstance(opt, torch.optim.AdamW)
    flags = {k: opt.defaults.get(k) for k in ("fused", "foreach")}
    assert flags == {"fused": ADAMW_IMPLEMENTATION == "fused", "foreach": ADAMW_IMPLEMENTATION == "foreach" or None}


def test_unknown_adamw_implementation_is_refused():
    with pytest.raises(TrainplanError, match="adamw='lion'"):
        adamw_step_temp_bytes("lion", state_bytes=4, largest_numel=1, local_numel=1)
