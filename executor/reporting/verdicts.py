"""Whether each prediction held: a verdict per term of `trainplan.executor.reporting.compare.compare`, and the
one line that sums them up (`summary_line`, e.g. "7 of 8 predictions held; step time off by +23%").

A term is **held** when |rel_err| is within the term's tolerance (`TOLERANCES`), **not held**
otherwise, **not measured** when the run has no measurement, **no prediction** when the plan has
none. A measurement of 0 holds only a prediction of exactly 0. Pure: no I/O, no drawing (the HTML
report, `trainplan.executor.reporting.html`, and the command line print them).
"""

from __future__ import annotations

import math

import pandas as pd

from trainplan.costmodels.loss.law import BOUND
from trainplan.executor.reporting.compare import format_value

__all__ = ["BOUND_ONLY", "CUT_SHORT", "HELD", "NOT_HELD", "NOT_MEASURED", "NO_PREDICTION", "TOLERANCES",
           "VERDICT_COLUMNS", "is_bound_plan", "summary_line", "term_label", "tolerance", "verdict_frame"]

TOLERANCES: dict[str, float] = {
    "memory": 0.03,
    "flops_per_step": 0.03,
    "step_time": 0.10,
    "tokens": 0.01,
    "final_loss": 0.05,
    "end_step": 0.15,
    "final_loss_at": 0.02,
}
"""Largest |rel_err| at which a prediction still holds, per term (fractions).

- `memory` (every `memory_<category>` and `peak_memory`) and `flops_per_step`: 3%. Both are
  counts the cost models derive from the same graph the run executes; a larger gap is a bug.
- `step_time`: 10%, and only when the run ran on the plan's hardware (DESIGN.md, Measuring).
- `tokens`: 1%: the run stopped where the plan said (a governor stop or a crash shows here).
- `end_step` (governed plans: the step the run ended at, after the governor's cooldown if it
  ran one, against the plan's prediction): 15%, the compute governor's target for its stop
  step (issue #8), applied to the end.
- `final_loss`: 5%, the scatter of a scaling-law fit at one model size.
- `final_loss_at` (every `final_loss_at_<N>pct`: the run's own forecast of its final loss made at
  N% of its steps, `trainplan.executor.reporting.forecast`): 2%, issue #37's worst case at 30%.
"""

VERDICT_COLUMNS = ("run", "term", "label", "predicted", "measured", "unit", "rel_err",
                   "tolerance", "verdict")
"""Columns of `verdict_frame`."""

HELD, NOT_HELD, NOT_MEASURED, NO_PREDICTION = "held", "not held", "not measured", "no prediction"
BOUND_ONLY = "a bound, not judged"
"""The verdict of `final_loss` when the plan's loss law gave a bound near ln(V), not a prediction
(`verdict_frame(..., bound=True)`, `is_bound_plan`)."""
"""The verdicts of `verdict_frame` (module docstring)."""
CUT_SHORT = "cut short"
"""The verdict of the `steps` row of a run stopped before its plan's end (`compare`): no
prediction missed, the run was stopped; its tokens and loss are compared at the steps it ran."""

_LABELS = {"peak_memory": "peak memory", "flops_per_step": "FLOPs per step",
           "step_time": "step time", "tokens": "tokens", "final_loss": "final loss",
           "end_step": "governed end step", "steps": "steps"}


def tolerance(term: str) -> float:
    """The tolerance of `term` from `TOLERANCES` (`memory_*` and `peak_memory` share `memory`);
    NaN for a term without one."""
    key = ("memory" if term.startswith("memory_") or term == "peak_memory"
           else "final_loss_at" if term.startswith("final_loss_at_") else term)
    return TOLERANCES.get(key, math.nan)


def term_label(term: str) -> str:
    """A reader's name for a term: `memory_params` -> `memory: params`."""
    if term.startswith("final_loss_at_") and term.endswith("pct"):
        return f"final loss forecast at {term[len('final_loss_at_'):-3]}%"
    return f"memory: {term[len('memory_'):]}" if term.startswith("memory_") else _LABELS.get(term, term)


def _verdict(predicted: float, measured: float, tol: float) -> str:
    if not math.isfinite(measured):
        return NOT_MEASURED
    if not math.isfinite(predicted):
        return NO_PREDICTION
    if measured == 0:
        return HELD if predicted == 0 else NOT_HELD
    return HELD if abs(predicted - measured) <= tol * abs(measured) else NOT_HELD


def is_bound_plan(plan) -> bool:
    """Whether `plan`'s predicted final loss is a bound near ln(V), not a prediction (its regime is
    `trainplan.costmodels.loss.law.BOUND`, `trainplan.costmodels.loss.bounds`)."""
    return plan.predictions.loss_regime == BOUND


def verdict_frame(comparison: pd.DataFrame, run: str = "", *, bound: bool = False) -> pd.DataFrame:
    """`compare`'s table with a verdict per term (pure).

    Adds columns `run` (the given label), `label` (`term_label`), `tolerance` (`tolerance`) and
    `verdict`: `held`, `not held`, `not measured` or `no prediction`; columns in
    `VERDICT_COLUMNS` order. `bound` (`is_bound_plan`): the `final_loss` row is `BOUND_ONLY`,
    shown and not judged.
    """
    df = comparison.copy()
    df["run"] = run
    df["label"] = [term_label(t) for t in df["term"]]
    df["tolerance"] = [tolerance(t) for t in df["term"]]
    df["verdict"] = [CUT_SHORT if term == "steps" else BOUND_ONLY if bound and term == "final_loss"
                     else _verdict(float(p), float(m), float(t))
                     for term, p, m, t in zip(df["term"], df["predicted"], df["measured"], df["tolerance"],
                                              strict=False)]
    return df[list(VERDICT_COLUMNS)].reset_index(drop=True)


def _pct(x: float) -> str:
    return f"{x:+.0%}" if abs(round(x, 4)) >= 0.1 else f"{x:+.1%}"


def summary_line(verdicts: pd.DataFrame, same_hardware: bool = True, most: int = 3) -> str:
    """One line: how many predictions held and the worst misses, e.g.
    "7 of 8 predictions held; step time off by +23%". Up to `most` misses are named, largest
    |rel_err| first; terms not measured and a step time not compared are said at the end."""
    compared = verdicts[verdicts["verdict"].isin([HELD, NOT_HELD])]
    n_held = int((compared["verdict"] == HELD).sum())
    parts = [f"all {len(compared)} predictions held" if n_held == len(compared) and len(compared)
             else f"{n_held} of {len(compared)} predictions held"]
    misses = compared[compared["verdict"] == NOT_HELD].copy()
    misses["size"] = misses["rel_err"].abs().fillna(math.inf)
    misses = misses.sort_values("size", ascending=False, kind="stable")
    said = []
    for r in misses.head(most).itertuples(index=False):
        if math.isfinite(r.rel_err):
            said.append(f"{r.label} off by {_pct(r.rel_err)}")
        else:
            said.append(f"{r.label} predicted {format_value(r.predicted, r.unit)}, measured 0")
    if len(misses) > most:
        said.append(f"{len(misses) - most} more")
    line = parts[0] + ("; " + ", ".join(said) if said else "")
    cut = verdicts[verdicts["verdict"] == CUT_SHORT]
    if len(cut):  # said first: it changes what the rest compares
        r = cut.iloc[0]
        line = (f"run cut short at step {r.measured:,.0f} of {r.predicted:,.0f} (tokens and final loss "
                f"predicted at the steps run); " + line)
    line = line[0].upper() + line[1:]
    for verdict in (NOT_MEASURED, NO_PREDICTION):
        if n := int((verdicts["verdict"] == verdict).sum()):
            line += f"; {n} {verdict}"
    if (verdicts["verdict"] == BOUND_ONLY).any():
        line += "; final loss a bound near ln(V), not judged"
    if not same_hardware:
        line += "; step time not compared (other hardware)"
    return line
