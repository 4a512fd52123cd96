"""trainplan's executor: applies a Plan to a real torch training run and measures it.

    >>> record = executor.run(plan, model, data, out="runs/r1")   # real torch training
    >>> executor.compare(plan, record)                            # DataFrame: term, predicted, measured, unit, rel_err
    >>> executor.report(plan, record, out="runs/r1")              # CSV, JSON, PNG figure and report.html

The public API: `run` (`executor.train.run`), `compare` (`executor.reporting.compare.compare`),
`report` (`executor.reporting.report.report`) and the `RunRecord` they read and write
(`executor.record.RunRecord`). Importing the package imports torch; `trainplan`'s command line
imports the executor inside the commands that need it, so that it starts without torch.
"""

from executor.record import RunRecord
from executor.reporting.compare import compare
from executor.reporting.report import report
from executor.train import run

__all__ = ["RunRecord", "compare", "report", "run"]
