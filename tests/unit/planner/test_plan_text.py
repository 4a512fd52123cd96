"""Issue #40, item 13: `print(plan)` once dumped the dataclass's repr; `str(plan)` is the block of
lines `trainplan solve` prints (`trainplan.planner.plan_text.plan_summary`), `repr` every field."""

from __future__ import annotations


def test_str_of_a_plan_is_what_solve_prints(capsys):
    from tests.support import make_plan
    from trainplan.planner.cli.plan_text import print_plan

    plan = make_plan()
    print_plan(plan)
    printed = capsys.readouterr().out
    assert str(plan) + "\n" == printed
    assert str(plan).startswith("plan: ") and "\n  solver: " in str(plan) and "\n  memory/device: " in str(plan)
    assert repr(plan).startswith("Plan(model=")
