"""Fixtures shared by the cost models' unit tests."""

from __future__ import annotations

import pytest

from trainplan.costmodels.step.model import StepModel
from trainplan.planner.capture.graph import capture


@pytest.fixture(scope="module")
def step_model(tiny_llama, cpu_profile) -> StepModel:
    """The step model of tiny-llama (captured on the meta device) on the test cpu profile."""
    model = tiny_llama(device="meta")
    g = capture(model)
    numels = tuple(p.numel() for p in model.parameters())
    return StepModel(g.regions, g.blocks, numels, cpu_profile, n_heads=g.n_heads,
                     n_kv_heads=g.n_kv_heads, head_dim=g.head_dim)
