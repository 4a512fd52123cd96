"""trainplan's executor: applies a Plan to a real torch training run and measures it.

    >>> record = executor.run(plan, model, data, out="runs/r1")   # real torch training
    >>> executor.compare(plan, record)                            # DataFrame: term, predicted, measured, unit, rel_err
    >>> executor.report(plan, record, out="runs/r1")              # CSV, JSON, PNG figure and report.html

The public API: `run` (`executor.train.run`), `compare` (`executor.reporting.compare.compare`),
`report` (`executor.reporting.report.report`) and the `RunRecord` they read and write
(`executor.record.RunRecord`). `run` is loaded on first use: it imports torch, which reading
and reporting a finished run (`trainplan report`) does not need.
"""

from executor.record import RunRecord
from executor.reporting.compare import compare
from executor.reporting.report import report

__all__ = ["RunRecord", "compare", "report", "run"]  # noqa: F822 (`run`: module __getattr__ below)


def __getattr__(name: str):
    # `run` imports torch (the training loop): loaded on first use, as `planner.solve` is
    if name == "run":
        from executor.train import run

        return run
    raise AttributeError(f"module 'executor' has no attribute {name!r}")
