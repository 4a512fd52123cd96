"""trainplan: a planner and cost-model optimizer for training LLMs under hard memory, compute and
data limits.

    >>> import trainplan
    >>> plan = trainplan.solve("llama3-8b", hw="h100", budget=trainplan.Budget(device_hours=200, devices=8),
    ...                        seq_len=8192)
    >>> record = trainplan.run(plan, model, trainplan.load_corpus(...), out="runs/r1")  # real torch training
    >>> trainplan.report(plan, record, out="runs/r1")             # CSV, JSON, PNG figures, report.html

The public API, each name re-exported from the module that defines it:

- `solve` (`trainplan.planner.api.solve`) and its options, `SolveOptions`
  (`trainplan.planner.options`); `Budget`; the plan file's `Plan`, `Decisions`,
  `Predictions`, `SolverFacts` (`trainplan.planner.plan`);
- `run` (`trainplan.executor.train.run`), `apply_plan` (`trainplan.executor.apply.applied`, your own
  loop), `compare` and `report` (`trainplan.executor.reporting`), `RunRecord`;
- `load_corpus` (`trainplan.executor.data.batches.load_corpus`): the default corpus or your text;
- `errors` (`trainplan.errors`): every typed error; `TrainplanError` is their base class.

`solve`, `run`, `apply_plan`, `load_corpus`, `compare` and `report` are loaded on first use (PEP
562 module `__getattr__`): they import torch, pandas or matplotlib, which `import trainplan` (and the
`trainplan` command, whose modules live under this package) does not need.

The subpackages `planner`, `executor`, `costmodels`, `modeling`, `hardware_profiles` are the
repository's top-level folders of the same names, linked here (docs/architecture.md, "One
namespace", says why); `errors` lives here.
"""

from importlib import import_module as _import_module
from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from trainplan import errors
from trainplan.errors import TrainplanError
from trainplan.planner.budget import Budget
from trainplan.planner.options import SolveOptions
from trainplan.planner.plan import Decisions, Plan, Predictions, SolverFacts

try:
    __version__ = _version("trainplan")
except _PackageNotFoundError:  # a source tree that was never installed (`pip install -e .` installs it)
    __version__ = "0+unknown"

_LAZY = {
    "solve": "trainplan.planner.api",
    "run": "trainplan.executor.train",
    "apply_plan": "trainplan.executor.apply.applied",
    "AppliedPlan": "trainplan.executor.apply.applied",
    "compare": "trainplan.executor.reporting.compare",
    "report": "trainplan.executor.reporting.report",
    "RunRecord": "trainplan.executor.record",
    "load_corpus": "trainplan.executor.data.batches",
}
"""Public name -> the module that defines it, imported on first access."""

__all__ = ["AppliedPlan", "Budget", "Decisions", "Plan", "Predictions", "RunRecord",  # noqa: F822
           "SolveOptions", "SolverFacts", "TrainplanError", "__version__", "apply_plan", "compare",
           "errors", "load_corpus", "report", "run", "solve"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(_import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
