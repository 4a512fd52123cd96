"""trainplan's planner: capture, cost models in use, the joint CP-SAT model, `Plan`, CLI.

    >>> from trainplan.planner import solve, Budget
    >>> plan = solve("llama3-70b", hw="mi300", budget=Budget(device_hours=5000, devices=8),
    ...              seq_len=131072)
"""

from trainplan.errors import TrainplanError
from trainplan.planner.budget import Budget
from trainplan.planner.plan import Decisions, Plan, Predictions, SolverFacts

__all__ = ["Budget", "Decisions", "Plan", "Predictions", "SolverFacts", "TrainplanError",  # noqa: F822
           "solve"]


def __getattr__(name: str):
    # `solve` imports torch (model capture): loaded on first use, so that `import trainplan.planner.cli.main`
    # (the `trainplan` command) starts without it and a Ctrl-C during that import is the
    # command's own (one line, exit 130), not a traceback
    if name == "solve":
        from trainplan.planner.api import solve

        return solve
    raise AttributeError(f"module 'trainplan.planner' has no attribute {name!r}")
