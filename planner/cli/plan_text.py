"""The plan as the `trainplan` command line prints it (`print_plan`): decisions, memory, step,
run, governor, solver and warnings, one block of lines on stdout, by `trainplan solve` and
`trainplan demo`.
"""

from __future__ import annotations

import contextlib
import io
import sys

from trainplan.planner.plan import Plan
from trainplan.planner.plan_text import plan_summary

__all__ = ["plan_text_sink", "print_plan"]


def plan_text_sink(json: str | None, quiet: bool) -> contextlib.AbstractContextManager:
    """Where `trainplan solve`'s readable output (the plan, the files written, the frontier) goes,
    given its `--json` and `-q`: nowhere with `-q` when the plan is written as JSON (to a file, or
    alone on stdout with `--json -`); on stderr with `--json -`; else on stdout (without `--json`
    the readable plan is solve's only output, so `-q` keeps it)."""
    if quiet and json is not None:
        return contextlib.redirect_stdout(io.StringIO())
    return contextlib.redirect_stdout(sys.stderr) if json == "-" else contextlib.nullcontext()


def print_plan(plan: Plan) -> None:
    """Print `plan` as `trainplan solve` shows it (`trainplan.planner.plan_text.plan_summary`:
    decisions, memory, step, run, governor, solver and its warnings, one line each)."""
    print(plan_summary(plan))
