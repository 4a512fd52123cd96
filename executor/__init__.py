"""trainplan's executor: applies a Plan to a real torch training run and measures it.

    >>> record = executor.run(plan, model, data, out="runs/r1")   # real torch training
    >>> executor.compare(plan, record)                            # DataFrame: term, predicted, measured, unit, rel_err
    >>> executor.report(plan, record, out="runs/r1")              # CSV, JSON and PNG figure

`executor.reporting.report` is the function; the module stays importable as `executor.reporting.report` through
`from executor.reporting.report import ...`.
"""

from executor.record import RunRecord


def run(plan, model=None, data=None, out="runs/run", **kwargs):
    """See `executor.train.run`."""
    from executor.train import run as _run

    return _run(plan, model, data, out=out, **kwargs)


def compare(plan, record):
    """See `executor.reporting.report.compare`."""
    from executor.reporting.report import compare as _compare

    return _compare(plan, record)


def report(plan, record, out):
    """See `executor.reporting.report.report`."""
    import importlib

    return importlib.import_module("executor.reporting.report").report(plan, record, out)


__all__ = ["RunRecord", "compare", "report", "run"]
