"""trainplan.planner.joint.explain: an infeasible budget names its binding constraint with both numbers, and
every suggested change re-solves feasible; cases built so that memory, then the budget, binds."""

from __future__ import annotations

import re

import pytest

from trainplan.errors import InfeasibleError
from trainplan.planner.api import solve
from trainplan.planner.budget import Budget
from trainplan.planner.cli.main import main

MIB, GIB = 2**20, 2**30
TINY = dict(seq_len=256, micro_batches=(1, 2, 4), optimizer_bits=(32, 8))


def _infeasible(*args, **kwargs) -> InfeasibleError:
    with pytest.raises(InfeasibleError) as err:
        solve(*args, **kwargs)
    return err.value


def _resolve(s, model, hw, budget: Budget, kwargs: dict):
    """Re-solve with suggestion `s` applied; returns the plan (raises if infeasible)."""
    kw = dict(kwargs)
    if s.change == "devices":
        budget = Budget(devices=int(s.value), **{budget.kind: getattr(budget, budget.kind)})
    elif s.change == "seq_len":
        kw["seq_len"] = int(s.value)
    elif s.change == "memory":
        kw["memory_limit_bytes"] = s.value
    elif s.change == "budget":
        budget = Budget(devices=budget.devices, **{budget.kind: s.value})
    return solve(model, hw, budget, explain=False, **kw)


@pytest.fixture(scope="module")
def memory_case():
    """tiny-llama at 4096 tokens under a 300 MiB cap: the lightest plan (micro-batch 1, 8-bit
    AdamW, full checkpointing) needs about 450 MiB; at 2048 tokens about 250 MiB. The long-context
    knobs are held off: a tiled loss and MLP would fit it (`test_long_context_solve.py`)."""
    kwargs = dict(TINY, seq_len=4096, memory_limit_bytes=300 * MIB, loss_chunks=(1,), mlp_chunks=(1,))
    budget = Budget(wall_clock_s=3600)
    return kwargs, budget, _infeasible("tiny-llama", "cpu", budget, **kwargs)


def test_memory_binding_names_memory_with_both_numbers(memory_case):
    kwargs, budget, err = memory_case
    msg = str(err)
    assert err.binding == "memory", msg
    m = re.search(r"needs ([\d.e+]+) GiB but the memory cap allows ([\d.e+]+) GiB usable", msg)
    assert m, msg
    need, cap = float(m.group(1)), float(m.group(2))
    assert cap == pytest.approx(300 * MIB / GIB, rel=0.01), msg
    assert need > cap, msg
    ex = err.explanation
    assert ex.needed > ex.available == pytest.approx(300 * MIB), ex
    assert "\n" not in msg


def test_memory_binding_suggestions_resolve_feasible(memory_case):
    kwargs, budget, err = memory_case
    kinds = {s.change for s in err.suggestions}
    assert {"memory", "seq_len"} <= kinds, err.suggestions
    assert "budget" not in kinds, err.suggestions  # a larger budget cannot fix memory
    assert "smallest change that fits" in str(err) and err.suggestions[0].text in str(err)
    for s in err.suggestions:
        plan = _resolve(s, "tiny-llama", "cpu", budget, kwargs)
        assert plan.predictions.memory_bytes["total"] <= plan.predictions.memory_limit_bytes
        assert s.factor >= 1.0
    seq = next(s for s in err.suggestions if s.change == "seq_len")
    assert seq.value == 2048, seq  # the longest halving that fits
    mem = next(s for s in err.suggestions if s.change == "memory")
    assert mem.value >= err.explanation.needed  # at least the lightest plan's peak
    assert err.suggestions == tuple(sorted(err.suggestions, key=lambda s: (not s.practical, s.factor)))


@pytest.mark.parametrize("budget", [Budget(flops=1e9), Budget(device_hours=1e-7)])
def test_budget_binding_names_the_budget(budget):
    err = _infeasible("tiny-llama", "cpu", budget, **TINY)
    msg = str(err)
    assert err.binding == "budget", msg
    assert "budget binds" in msg and "step" in msg, msg
    assert f"{budget.kind}={getattr(budget, budget.kind):g}" in msg, msg
    assert err.explanation.needed > err.explanation.available == getattr(budget, budget.kind)
    bigger = next(s for s in err.suggestions if s.change == "budget")
    assert bigger.value >= err.explanation.needed
    plan = _resolve(bigger, "tiny-llama", "cpu", budget, TINY)
    assert plan.decisions.max_steps >= 1


def test_more_devices_fix_a_70b_model_on_one_gpu():
    """llama3-70b does not fit one H100 (its weights and Adam states alone are ~1 TB); ZeRO
    over more devices does: the suggestion names the device count and re-solves feasible."""
    budget = Budget(devices=1, device_hours=5000)
    kwargs = dict(seq_len=4096)
    err = _infeasible("llama3-70b", "h100", budget, **kwargs)
    assert err.binding == "memory" and "h100 has" in str(err), str(err)
    dev = next(s for s in err.suggestions if s.change == "devices")
    assert dev.value > 1 and dev.value & (dev.value - 1) == 0, dev  # a power of two
    # fits with the built-in checkpoint entries alone, so also in the whole space (the
    # per-block CP-SAT menus would only add to the re-solve's time)
    builtins = ("none", "save_matmuls", "save_attention", "full")
    plan = _resolve(dev, "llama3-70b", "h100", budget, dict(kwargs, policies=builtins))
    assert plan.decisions.devices == dev.value
    # the smallest: half as many devices is not enough
    if dev.value > 2:
        with pytest.raises(InfeasibleError):
            solve("llama3-70b", "h100", Budget(devices=int(dev.value) // 2, device_hours=5000),
                  explain=False, policies=builtins, **kwargs)


def test_cli_prints_the_explanation_on_one_line(capsys):
    rc = main(["solve", "--model", "tiny-llama", "--hw", "cpu", "--seq-len", "256",
               "--budget-flops", "1e9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3 and len(err) == 1, err  # infeasible
    assert err[0].startswith("trainplan: error: the compute budget binds"), err[0]
    assert "smallest change that fits (re-solved): a budget of flops=" in err[0], err[0]


def test_explain_false_keeps_the_solver_message():
    with pytest.raises(InfeasibleError) as err:
        solve("tiny-llama", "cpu", Budget(flops=1e9), explain=False, **TINY)
    assert "buys less than one step" in str(err.value)
    assert not hasattr(err.value, "suggestions")


def test_time_limit_before_any_plan_asks_for_a_longer_limit(monkeypatch, capsys):
    """When the time limit ends the search before any plan is found (here: no single-entry plan
    to start from, as when only mixed checkpointing fits, and a 1 ms limit), nothing is known to
    bind: the message says so and asks for a longer limit, without an explanation's re-solves.
    (tiny-llama: a 1 ms search ends before any plan just as llama3-8b's does.)"""
    import trainplan.planner.joint.solver

    monkeypatch.setattr(trainplan.planner.joint.solver, "uniform_start", lambda *a, **k: None)
    args = ["solve", "--model", "tiny-llama", "--hw", "h100", "--devices", "3", "--seq-len", "2048",
            "--budget-device-hours", "100"]
    rc = main(args + ["--time-limit", "0.001"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3 and len(err) == 1, err  # infeasible: no plan
    assert "no plan found within the solver time limit of 0.001 deterministic s" in err[0], err[0]
    assert "raise --time-limit" in err[0] and "binds" not in err[0], err[0]
    with pytest.raises(InfeasibleError) as e:
        solve("tiny-llama", "h100", Budget(devices=3, device_hours=100), seq_len=2048, time_limit_s=0.001)
    assert e.value.binding == "time limit" and not hasattr(e.value, "suggestions")
    assert main(args + ["--time-limit", "0.5"]) == 0  # a longer limit finds one
