"""A user's own training loop on `trainplan.executor.apply_plan` (tests/integration/_own_loop.py,
docs/where_you_train.md's "Your own training loop", public API only): on 1 process and on 2 (one torchrun launch, gloo,
FSDP2), each rank's measured peak memory within 1% of the plan's prediction, FLOPs per step as
predicted, and trainplan's report reading the loop's folder (`trainplan report OUT`)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from trainplan.executor.parallel.launch import run_torchrun
from trainplan.executor.reporting.compare import compare
from trainplan.executor.reporting.report import load_run
from trainplan.planner.cli.main import main as cli

RTOL = 0.01
LAUNCH_TIMEOUT_S = 300  # a hang guard on loaded cores

_spec = importlib.util.spec_from_file_location("_own_loop", Path(__file__).with_name("_own_loop.py"))
own_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(own_loop)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, torch_threads) -> Path:
    out = tmp_path_factory.mktemp("own_loop") / "run"
    with torch_threads(1):
        own_loop.main(str(out))
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("own_loop_2")
    run_torchrun("tests.integration._own_loop", [str(base / "run"), "2"], 2, timeout_s=LAUNCH_TIMEOUT_S,
                 log_dir=base / "logs")
    return base / "run"


def _check_run(out: Path, world: int) -> None:
    plan, record = load_run(out)  # the folder the report reads
    predicted = plan.predictions.memory_bytes["total"]
    assert record.world_size == world and len(record.per_rank_peak_bytes) == world, record.per_rank_peak_bytes
    for rank, peak in enumerate(record.per_rank_peak_bytes):
        assert math.isclose(peak, predicted, rel_tol=RTOL), (
            f"rank {rank}: measured {peak:,.0f} B, predicted {predicted:,.0f} B "
            f"({peak / predicted - 1:+.2%}); measured {record.peak_memory_bytes}, "
            f"predicted {plan.predictions.memory_bytes}")
    assert record.flops_per_step == pytest.approx(plan.predictions.flops_per_step, rel=1e-9)
    assert (record.stop_reason, record.steps) == ("budget", plan.decisions.max_steps)
    assert [s for s, _ in record.train_loss] == list(range(plan.decisions.max_steps))
    assert record.tokens == plan.predictions.total_tokens
    assert len(record.heldout_loss) == 1 and math.isfinite(record.final_heldout_loss)
    assert len(record.step_times_s) == plan.decisions.max_steps - 2  # steps 2, 3: memory, FLOPs
    table = compare(plan, record).set_index("term")
    assert abs(table.loc["peak_memory", "rel_err"]) < RTOL


def test_own_loop_on_one_process_measures_the_planned_peak(one_process, capsys):
    _check_run(one_process, world=1)
    plan, _ = load_run(one_process)
    assert plan.model == "LlamaForCausalLM" and plan.decisions.checkpoint_block_ops["block0"]["layers"] == [0, 1]
    assert cli(["report", str(one_process)]) == 0
    printed = capsys.readouterr().out
    assert "peak_memory" in printed and (one_process / "report.html").exists()


@pytest.mark.slow
def test_own_loop_on_two_processes_measures_the_planned_peak(two_processes):
    """FSDP2 (ZeRO-3) over two gloo ranks, the same loop: every rank's peak within 1%."""
    _check_run(two_processes, world=2)
    plan, _ = load_run(two_processes)
    assert (plan.decisions.devices, plan.decisions.zero_stage) == (2, 3)
