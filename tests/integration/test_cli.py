"""trainplan.planner.cli.main: bad input exits 2 (an infeasible budget 3) with one `trainplan: error:` line and
no traceback; profiles; solve --json writes a loadable plan."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainplan.hardware_profiles import known_names
from trainplan.planner.cli.main import main
from trainplan.planner.plan import Plan

ACCELERATORS = ("a100", "a100-40gb", "h100", "h200", "mi300a", "mi300x")
TINY = ["solve", "--model", "tiny-llama", "--hw", "cpu", "--seq-len", "128"]


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{err}"
    assert lines[0].startswith("trainplan: error: "), lines[0]
    assert "Traceback" not in err, err
    return lines[0]


ERRORS = {
    "unknown hw": (["solve", "--model", "tiny-llama", "--hw", "h800", "--budget-seconds", "60"],
                   ["unknown hardware 'h800'", *ACCELERATORS, "cpu", "mi300"]),
    "unknown preset": (["solve", "--model", "llama9-1t", "--hw", "h100", "--budget-seconds", "60"],
                       ["unknown model preset 'llama9-1t'", "llama3-70b", "tiny-llama"]),
    "zero budget": (TINY + ["--budget-seconds", "0"], ["wall_clock_s=0.0", "positive"]),
    "negative budget": (TINY + ["--budget-device-hours", "-1"], ["device_hours=-1.0"]),
    "nan budget": (TINY + ["--budget-flops", "nan"], ["flops=nan"]),
    "zero devices": (TINY + ["--devices", "0", "--budget-seconds", "60"], ["devices=0"]),
    "zero seq_len": (["solve", "--model", "tiny-llama", "--hw", "cpu", "--seq-len", "0",
                      "--budget-seconds", "60"], ["seq_len=0"]),
    "infeasible memory": (["solve", "--model", "llama3.1-405b", "--hw", "a100", "--seq-len", "131072",
                           "--budget-device-hours", "100"], ["memory", "GiB", "a100"]),
    "budget below a step": (TINY + ["--budget-device-hours", "1e-9"], ["step"]),
    "missing plan file": (["run", "/nonexistent/plan.json", "--out", "/nonexistent/out"],
                          ["cannot read plan"]),
}


INFEASIBLE = {"infeasible memory", "budget below a step"}  # exit status 3


@pytest.mark.parametrize("argv, needles", ERRORS.values(), ids=ERRORS.keys())
def test_bad_input_exits_2_with_one_line(capsys, argv, needles, request):
    rc = main(argv)
    out, err = capsys.readouterr()
    expected = 3 if request.node.callspec.id in INFEASIBLE else 2
    assert rc == expected, f"exit status {rc}, expected {expected}; stderr: {err}"
    line = _one_error_line(err)
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"


def test_binary_plan_file_exits_2(capsys, tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xff\xfe\x00\x81 not a plan")
    try:
        rc = main(["run", str(path), "--out", str(tmp_path / "out")])
    except Exception as e:  # what the user sees as a traceback
        pytest.fail(f"{type(e).__name__} escaped main(): {e}")
    assert rc == 2
    _one_error_line(capsys.readouterr().err)


def test_unknown_hw_in_a_subprocess_has_no_traceback():
    out = subprocess.run([sys.executable, "-m", "trainplan", "solve", "--model", "tiny-llama",
                          "--hw", "h800", "--budget-seconds", "60"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr)
    # library warnings (e.g. bitsandbytes on a CPU-only machine) may precede the error line
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("trainplan:")]
    assert len(lines) == 1 and lines[0].startswith("trainplan: error: unknown hardware 'h800'"), out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    for name in known_names():
        assert name in lines[0], (name, lines[0])


def test_two_budgets_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--budget-seconds", "60", "--budget-flops", "1e15"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_devices_3_for_tiny_llama_is_pure_data_parallel(capsys, tmp_path):
    """8 heads and 4 KV heads admit no SP degree 3, but SP degree 1 always fits: 3 data-parallel
    ranks, not an error."""
    rc = main(TINY + ["--devices", "3", "--budget-seconds", "600", "--json", str(tmp_path / "p.json")])
    assert rc == 0, capsys.readouterr().err
    d = Plan.from_json(tmp_path / "p.json").decisions
    assert (d.devices, d.sp_degree, d.dp_degree) == (3, 1, 3), d


@pytest.mark.parametrize("argv", [["profiles"], ["profiles", "--no-cpu"]], ids=["default", "no-cpu"])
def test_profiles_lists_the_accelerators_without_measuring(capsys, argv, monkeypatch):
    import trainplan.hardware_profiles

    def no_cpu(*a, **k):
        raise AssertionError("the cpu profile was loaded or measured")

    monkeypatch.setattr(trainplan.hardware_profiles, "load_cpu", no_cpu)
    assert main(argv) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.strip().splitlines()[1:]]
    assert names == list(ACCELERATORS), out
    assert "cpu" not in names


def test_solve_json_writes_a_loadable_plan(capsys, tmp_path):
    path = tmp_path / "p.json"
    assert main(TINY + ["--budget-seconds", "600", "--json", str(path), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert f"plan written to {path}" in out and "plan: tiny-llama" in out, out
    plan = Plan.from_json(path)
    assert plan.model == "tiny-llama" and plan.hw == "cpu" and plan.solver.seed == 3
    assert plan.decisions.seq_len == 128 and plan.budget["wall_clock_s"] == 600.0
    assert f"max_steps={plan.decisions.max_steps:,}" in out, out


def test_an_interrupted_run_or_demo_says_how_to_continue(tmp_path, capsys):
    """`run` and `demo` share the early-stop message: one line, the out folder shell-quoted."""
    import types

    from trainplan.planner.cli.commands import RunStoppedEarly, check_run_ended

    plan = types.SimpleNamespace(decisions=types.SimpleNamespace(max_steps=290))
    out = tmp_path / "a run"
    done = types.SimpleNamespace(stop_reason="budget", steps=290, checkpoint="")
    check_run_ended(plan, done, out)
    check_run_ended(plan, types.SimpleNamespace(stop_reason="marginal_gain", steps=9, checkpoint=""), out)
    stopped = types.SimpleNamespace(stop_reason="interrupted", steps=30, checkpoint=str(out / "checkpoint"))
    with pytest.raises(RunStoppedEarly) as e:
        check_run_ended(plan, stopped, out)
    assert "interrupted after 30 of 290 steps" in str(e.value)
    assert f"trainplan run --out '{out}' --resume" in str(e.value)



def test_the_command_starts_without_importing_torch():
    """`import trainplan.planner.cli.main` (what the `trainplan` entry point runs before `main`) leaves torch to
    the commands, inside `main`'s handler: a Ctrl-C while torch loads is one line and exit 130,
    not a traceback; `from trainplan.planner import solve` still works."""
    code = ("import sys, trainplan.planner.cli.main; assert 'torch' not in sys.modules, 'torch imported'; "
            "from trainplan.planner import solve; assert solve.__module__ == 'trainplan.planner.api'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_max_seq_len_plans_the_longest_sequence_the_budget_buys(capsys, tmp_path):
    """`trainplan solve --max-seq-len`: the plan is at the longest multiple of 1024 tokens with a
    plan for the budget (on this CPU one step of tiny-llama at 8K tokens takes seconds, so a
    5-second budget ends well below the 64M ceiling), and says so in its notes."""
    out = tmp_path / "plan.json"
    assert main(["solve", "--model", "tiny-llama", "--hw", "cpu", "--budget-seconds", "5", "--max-seq-len",
                 "--json", str(out)]) == 0
    plan = Plan.from_json(out)
    seq = plan.decisions.seq_len
    assert seq % 1024 == 0 and 1024 <= seq < 2**26, seq
    assert any(n.startswith(f"longest sequence: {seq} tokens") for n in plan.notes), plan.notes
    assert f"seq_len {seq}" in capsys.readouterr().out
