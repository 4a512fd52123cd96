"""`trainplan solve --global-batch-tokens N`: the plan JSON trains N tokens per optimizer step,
its gradient accumulation printed and written beside the micro-batch."""

from __future__ import annotations

from trainplan.planner.cli.main import main
from trainplan.planner.plan import Plan

TINY = ["solve", "--model", "tiny-llama", "--hw", "cpu", "--seq-len", "128", "--budget-seconds", "600",
        "--time-limit", "2", "--data-methods", "random"]


def test_the_global_batch_flag_round_trips_into_the_plan_json(capsys, tmp_path, cpu_profile):
    path = tmp_path / "plan.json"
    assert main(TINY + ["--global-batch-tokens", "4096", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    d = Plan.from_json(path).decisions
    assert d.dp_degree * d.micro_batch * d.seq_len * d.grad_accum == 4096, d
    assert Plan.from_json(path).predictions.tokens_per_step == 4096
    assert f"micro_batch={d.micro_batch} grad_accum={d.grad_accum} " in out, out
    assert "4,096 tokens" in out, out
