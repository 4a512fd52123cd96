"""trainplan's planner: capture, cost models in use, the joint CP-SAT model, `Plan`, CLI.

    >>> from planner import solve, Budget
    >>> plan = solve("llama3-70b", hw="mi300", budget=Budget(device_hours=5000, devices=8),
    ...              seq_len=131072)
"""

from planner.api import solve
from planner.budget import Budget
from hardware_profiles.errors import TrainplanError
from planner.plan import Decisions, Plan, Predictions, SolverFacts

__all__ = ["Budget", "Decisions", "Plan", "Predictions", "SolverFacts", "TrainplanError", "solve"]
