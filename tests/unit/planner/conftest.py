"""Fixtures shared by the planner's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def problems():
    """tiny-llama (4 layers), llama3-8b (32) and llama3-70b (80) on H100s, captured once for the
    session; micro-batches 1 and 4 (those test_solver.py's test_joint_memory_is_evaluates_phase_by_phase
    checks; fewer block shapes to solve menus for in its test_solved_plans_fit_by_their_own_prediction).
    The planning problems are read, never changed (test_polish.py builds its combos from tiny-llama's)."""
    from trainplan.planner.joint.problem import prepare

    return {m: prepare(m, "h100", seq_len=s, micro_batches=(1, 4))
            for m, s in (("tiny-llama", 2048), ("llama3-8b", 8192), ("llama3-70b", 8192))}
