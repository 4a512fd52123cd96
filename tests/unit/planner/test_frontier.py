"""trainplan.planner.joint.frontier: the Pareto frontier has no dominated plans, holds the chosen plan (the one
`solve` returns), and reaches the CLI (frontier.csv/.png) and the run folder."""

from __future__ import annotations

import pandas as pd
import pytest

from trainplan.planner.api import solve
from trainplan.planner.budget import Budget
from trainplan.planner.cli.frontier_files import copy_frontier, write_frontier
from trainplan.planner.joint.frontier import OBJECTIVES, format_frontier, frontier, non_dominated

BUDGET = Budget(flops=4e12)
TINY = dict(seq_len=256, data_tokens=10**6)


def _dominated_by_any(frame: pd.DataFrame) -> list[tuple[int, int]]:
    """(i, j) pairs where row j dominates row i, brute force."""
    out = []
    v = frame[list(OBJECTIVES)].to_numpy(dtype=float)
    for i in range(len(v)):
        for j in range(len(v)):
            if i != j and (v[j] <= v[i]).all() and (v[j] < v[i]).any():
                out.append((i, j))
    return out


def test_non_dominated_on_a_built_table():
    f = pd.DataFrame({"memory_bytes": [1, 2, 1, 3, 1], "cost_device_hours": [5, 1, 5, 1, 6],
                      "loss": [3.0, 3.0, 3.0, 2.0, 2.0]})
    # row 2 equals row 0 (the first stays); row 1 beats row 3 on memory but not on loss
    assert non_dominated(f).tolist() == [True, True, False, True, True]
    f.loc[5] = [1, 1, 2.0]  # better than or equal to everything
    assert non_dominated(f).tolist() == [False] * 5 + [True]


@pytest.fixture(scope="module")
def tiny_frontier():
    return frontier("tiny-llama", "cpu", BUDGET, **TINY)


def test_tiny_frontier_has_no_dominated_points(tiny_frontier):
    t = tiny_frontier.table
    assert len(t) >= 2 and tiny_frontier.solved >= len(t)
    assert set(OBJECTIVES) | {"time_s", "chosen", "dominated", "micro_batch", "checkpoint"} <= set(t.columns)
    free = t[~t["dominated"]].reset_index(drop=True)
    assert _dominated_by_any(free) == [], free
    assert t["chosen"].sum() == 1
    assert (t["dominated"] <= t["chosen"]).all()  # only the chosen plan may be dominated
    assert (t["cost_device_hours"].diff().dropna() >= 0).all()  # sorted by cost
    assert "GiB/device" in format_frontier(t)


def test_chosen_row_is_the_plan_solve_returns(tiny_frontier):
    plan = solve("tiny-llama", "cpu", BUDGET, **TINY)
    assert tiny_frontier.plan.decisions == plan.decisions
    row = tiny_frontier.table[tiny_frontier.table["chosen"]].iloc[0]
    p = plan.predictions
    assert row["loss"] == pytest.approx(p.final_loss) and row["memory_bytes"] == pytest.approx(p.memory_bytes["total"])
    assert row["cost_device_hours"] == pytest.approx(p.device_hours)
    # every frontier plan spends at most the full budget and fits the device
    assert (tiny_frontier.table["budget_fraction"] <= 1.0).all()


def test_write_frontier_is_read_by_the_report_figure(tiny_frontier, tmp_path):
    from trainplan.executor.reporting.figures import frontier_figure, frontier_frame

    files = write_frontier(tiny_frontier, tmp_path / "f")
    assert files["csv"].is_file() and files["png"].stat().st_size > 1000
    frame = frontier_frame(pd.read_csv(files["csv"]))
    assert len(frame) == len(tiny_frontier.table) and frame["chosen"].sum() == 1
    frontier_figure(frame)


def test_cli_solve_frontier_writes_beside_the_plan_and_run_copies_it(tmp_path, capsys):
    from trainplan.planner.cli.main import main

    plan = tmp_path / "p" / "plan.json"
    plan.parent.mkdir()
    rc = main(["solve", "--model", "tiny-llama", "--hw", "cpu", "--seq-len", "256",
               "--budget-flops", "4e12", "--frontier", "--json", str(plan)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Pareto frontier:" in out and (plan.parent / "frontier.csv").is_file()
    assert (plan.parent / "frontier.png").is_file()
    run = tmp_path / "run"
    run.mkdir()
    copy_frontier(plan, run)
    assert (run / "frontier.csv").read_bytes() == (plan.parent / "frontier.csv").read_bytes()


@pytest.mark.slow
def test_8b_frontier_on_8_h100_is_non_dominated():
    """A coarser search space than the default (micro-batches 1, 2 and 4; the built-in checkpoint
    entries without the per-block CP-SAT menus): each solve of the ladder then takes well under
    a second. (The default space's time is a benchmark figure:
    `frontier_s_llama3_8b` in benchmarks/solve_speed.py.)"""
    fr = frontier("llama3-8b", "h100", Budget(devices=8, device_hours=1000), seq_len=8192,
                  micro_batches=(1, 2, 4), policies=("none", "save_matmuls", "save_attention", "full"))
    assert fr.plan.solver.status == "OPTIMAL", fr.plan.solver
    free = fr.table[~fr.table["dominated"]].reset_index(drop=True)
    assert _dominated_by_any(free) == []
    assert len(fr.table) >= 4, fr.table
