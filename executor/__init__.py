"""trainplan's executor: applies a Plan to a real torch training run and measures it.

    >>> from trainplan import executor
    >>> record = executor.run(plan, model, data, out="runs/r1")   # real torch training
    >>> executor.compare(plan, record)                            # DataFrame: term, predicted, measured, unit, rel_err
    >>> executor.report(plan, record, out="runs/r1")              # CSV, JSON, PNG figure and report.html

Or apply a plan to your own model and training loop, and still get the report:

    >>> applied = executor.apply_plan(plan, model)                # checkpoint sets, DDP/ZeRO/FSDP2, SP
    >>> with applied.measure("runs/mine") as m: ...               # m.step(train_step) per step

The public API: `run` (`trainplan.executor.train.run`), `apply_plan` (`trainplan.executor.apply.applied.apply_plan`,
returning a `trainplan.executor.apply.applied.AppliedPlan`), `compare`
(`trainplan.executor.reporting.compare.compare`),
`report` (`trainplan.executor.reporting.report.report`) and the `RunRecord` they read and write
(`trainplan.executor.record.RunRecord`). `run`, `apply_plan`, `compare` and `report` are loaded on first
use: `run` and `apply_plan` import torch, which reading and reporting a finished run (`trainplan
report`) does not need, and `compare`/`report` import pandas, matplotlib and scipy, which a
training process launched by torchrun (`trainplan.executor.worker`, whose imports run this file first) does not need.
"""

from trainplan.executor.record import RunRecord

__all__ = ["AppliedPlan", "RunRecord", "apply_plan", "compare", "report", "run"]  # noqa: F822 (module __getattr__ below)


def __getattr__(name: str):
    # loaded on first use, as `trainplan.planner.solve` is
    if name == "run":
        from trainplan.executor.train import run

        return run
    if name in ("apply_plan", "AppliedPlan"):
        from trainplan.executor.apply import applied

        return getattr(applied, name)
    if name == "compare":
        from trainplan.executor.reporting.compare import compare

        return compare
    if name == "report":
        from trainplan.executor.reporting.report import report

        return report
    raise AttributeError(f"module 'trainplan.executor' has no attribute {name!r}")
