"""The Pareto frontier of plans over per-device memory, cost and predicted loss.

Method: solve the joint CP-SAT model (`trainplan.planner.joint.solver.solve_joint`) once at the full budget on
the device's memory (the chosen plan, the same as `trainplan.planner.solve` returns), then again under a
ladder of budget fractions (default x {0.1, 0.25, 0.5, 1}) and memory caps (geometric from just
above the lightest plan's peak to the device's usable bytes), and keep the plans no other plan
beats on all three at once: peak bytes per device (`memory_bytes`), device-hours
(`cost_device_hours`; `time_s` beside it) and predicted final loss (`loss`, nats/token). Each
plan is the lowest-loss plan under its cap and budget, so the ladder traces the frontier from
its cheap, small end to the chosen plan. The re-solves share one step model and each block
shape's checkpoint menu (solved once, at the first cap that needs it), with a shorter time
limit per solve.

The command line writes the table as `frontier.csv` (read by `trainplan.executor.reporting.figures.frontier_frame`
and the run report) and draws `frontier.png` (`trainplan.planner.cli.frontier_files.write_frontier`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import pandas as pd
from torch import nn

from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.step.model import Choice
from trainplan.errors import InfeasibleError, TrainplanError
from trainplan.hardware_profiles import HardwareProfile
from trainplan.planner.budget import Budget
from trainplan.planner.joint.explain import explain_infeasible
from trainplan.planner.joint.problem import Problem, prepare, solve_problem
from trainplan.planner.joint.remat_menu import BlockMenus, Targets
from trainplan.planner.joint.remat_solver import Menu
from trainplan.planner.joint.space import shapes
from trainplan.planner.pilots import calibrated, with_calibration
from trainplan.planner.plan import Plan

BUDGET_FRACTIONS = (0.1, 0.25, 0.5, 1.0)
MEMORY_STEPS = 2
"""Memory caps below the device's (the device's own is always solved too)."""
LADDER_TIME_S = 0.5
"""CP-SAT time limit of each ladder solve, s."""
OBJECTIVES = ("memory_bytes", "cost_device_hours", "loss")
REL_TOL = 1e-9
"""Relative tolerance of the dominance test (float noise, not a modelling margin)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Frontier:
    plan: Plan
    """The chosen plan: the full budget on the device's memory (or the caller's cap)."""
    table: pd.DataFrame
    """One row per plan kept: the non-dominated plans (`dominated` False) and the chosen plan
    (`chosen` True; `dominated` True only if another plan beats it, e.g. the same loss and cost
    with less memory), sorted by cost."""
    solved: int
    """Plans solved (feasible) over the ladder, the chosen one included."""
    wall_s: float


class _SharedMenus:
    """A problem's block menus solved once per block shape: the first request (with that
    solve's per-budget targets) is kept for every later cap."""

    def __init__(self, menus: BlockMenus) -> None:
        self._inner = menus
        self._menus: dict[tuple, Menu] = {}

    def menu(self, c: Choice, i: int = 0, targets: Targets = ()) -> Menu:
        sm = self._inner.step_model
        key = (sm.blocks[i], c.micro_batch, c.seq_len // c.sp_degree, c.sp_degree, c.precision)
        if key not in self._menus:
            self._menus[key] = self._inner.menu(c, i, targets)
        return self._menus[key]


def non_dominated(frame: pd.DataFrame, columns: tuple[str, ...] = OBJECTIVES) -> pd.Series:
    """True for each row no other row dominates (no worse in every column of `columns`, all to
    be minimised, and better in one, beyond a relative `REL_TOL`). Of rows equal in every column
    only the first is kept."""
    vals = frame[list(columns)].to_numpy(dtype=float)
    keep = []
    for i, a in enumerate(vals):
        tol = REL_TOL * abs(a) + 1e-300
        dominated = False
        for j, b in enumerate(vals):
            if j == i:
                continue
            no_worse = (b <= a + tol).all()
            better = (b < a - tol).any()
            same = not better and (abs(b - a) <= tol).all()
            if no_worse and (better or (same and j < i)):
                dominated = True
                break
        keep.append(not dominated)
    return pd.Series(keep, index=frame.index)


def _row(plan: Plan, *, fraction: float, cap: float | None, chosen: bool) -> dict[str, Any]:
    d, p = plan.decisions, plan.predictions
    ck = ", ".join(f"{d.activation_checkpoint.count(e)} x {e}" for e in dict.fromkeys(d.activation_checkpoint))
    return dict(memory_bytes=p.memory_bytes["total"], cost_device_hours=p.device_hours,
                time_s=p.step_time_s * d.max_steps, loss=p.final_loss, chosen=chosen,
                budget_fraction=fraction, memory_cap_bytes=math.nan if cap is None else cap,
                sp_degree=d.sp_degree, dp_degree=d.dp_degree, zero_stage=d.zero_stage,
                micro_batch=d.micro_batch, grad_accum=d.grad_accum, optimizer_bits=d.optimizer_bits,
                activation_bits=d.activation_bits,
                data_fraction=d.data_fraction, checkpoint=ck, max_steps=d.max_steps,
                total_tokens=p.total_tokens, step_time_s=p.step_time_s)


def _lightest_bytes(pr: Problem, budget: Budget) -> float:
    """Peak bytes per device of a light plan: full checkpointing, the smallest micro-batch (that
    divides the global batch, if any, at its gradient accumulation) and optimizer width, the
    highest ZeRO stage, the lightest SP degree (a floor for the caps)."""
    space = pr.space(budget.devices)
    L = len(pr.step_model.blocks)
    smallest: dict[int, tuple[int, int]] = {}  # SP degree -> (micro-batch, grad_accum)
    for sp, mb, ga in shapes(space, devices=budget.devices, seq_len=pr.seq_len):
        smallest[sp] = min(smallest.get(sp, (mb, ga)), (mb, ga))
    return min(pr.step_model.evaluate(Choice(
        sp_degree=sp, zero_stage=max(space.zero_stages), micro_batch=mb, grad_accum=ga,
        seq_len=pr.seq_len, policies=("full",) * L, precision=space.precision,
        optimizer_bits=min(space.optimizer_bits), devices=budget.devices,
        activation_bits=min(space.activation_bits))).memory.total
        for sp, (mb, ga) in smallest.items())


def frontier_for(pr: Problem, budget: Budget, *, memory_limit_bytes: float | None = None,
                 budget_fractions: tuple[float, ...] = BUDGET_FRACTIONS, memory_steps: int = MEMORY_STEPS,
                 time_limit_s: float = 10.0, ladder_time_limit_s: float = LADDER_TIME_S,
                 seed: int = 0, lr: float = 3e-3) -> Frontier:
    """The frontier of a prepared problem (`trainplan.planner.joint.problem.prepare`) at `budget`.

    Raises:
        InfeasibleError: the chosen (full-budget) plan is infeasible (unexplained: see `frontier`).
    """
    t0 = time.perf_counter()
    menus = _SharedMenus(pr.menus)
    chosen = solve_problem(pr, budget, memory_limit_bytes=memory_limit_bytes, diagnose=False,
                           time_limit_s=time_limit_s, seed=seed, lr=lr, menus=menus)
    rows = [_row(chosen, fraction=1.0, cap=memory_limit_bytes, chosen=True)]
    top = min(pr.profile.usable_bytes, memory_limit_bytes or math.inf)
    lo = min(1.05 * _lightest_bytes(pr, budget), top)
    caps = [lo * (top / lo) ** (i / memory_steps) for i in range(memory_steps)] if memory_steps else []
    caps = [c for c in caps if c < top] + [memory_limit_bytes]
    value = float(getattr(budget, budget.kind))
    ladder_s = min(time_limit_s, ladder_time_limit_s)
    for fraction in sorted(budget_fractions):
        b = Budget(devices=budget.devices, **{budget.kind: value * fraction})
        for cap in caps:
            if fraction == 1.0 and cap == memory_limit_bytes:
                continue  # the chosen plan
            try:
                plan = solve_problem(pr, b, memory_limit_bytes=cap, diagnose=False,
                                     time_limit_s=ladder_s, seed=seed, lr=lr, menus=menus)
            except (InfeasibleError, TrainplanError):
                continue
            rows.append(_row(plan, fraction=fraction, cap=cap, chosen=False))
    frame = pd.DataFrame(rows)
    # the chosen plan first, so that of equal rows it is the one kept
    frame["dominated"] = ~non_dominated(frame)
    table = frame[~frame["dominated"] | frame["chosen"]]
    table = table.sort_values(["cost_device_hours", "loss"], kind="stable").reset_index(drop=True)
    return Frontier(plan=chosen, table=table, solved=len(rows), wall_s=time.perf_counter() - t0)


def frontier(model: nn.Module | str, hw: str | HardwareProfile, budget: Budget, *, seq_len: int = 2048,
             data_tokens: int | None = None, vocab_size: int | None = None, precision: str | None = None,
             law: LossLaw | None = None, memory_limit_bytes: float | None = None,
             budget_fractions: tuple[float, ...] = BUDGET_FRACTIONS, memory_steps: int = MEMORY_STEPS,
             time_limit_s: float = 10.0, ladder_time_limit_s: float = LADDER_TIME_S, seed: int = 0,
             lr: float = 3e-3, data=None, calibrate: bool = True, bytes_per_token: float | None = None,
             cache_dir=None, progress: bool = False, **space_options: Any) -> Frontier:
    """The Pareto frontier over (peak memory per device, device-hours, predicted loss) of the
    plans for `model` on `hw` at up to `budget` (arguments as `trainplan.planner.solve`'s; `space_options`:
    micro_batches, optimizer_bits, activation_bits, policies, data_fractions, global_batch_tokens).
    With `data` on the cpu profile the law is calibrated on pilots first, as `trainplan.planner.solve`
    does (`trainplan.planner.pilots.calibrated`): the budget the frontier spans is what they leave.

    Raises:
        UnknownNameError: unknown hardware or preset.
        TrainplanError: bad sequence length or option.
        InfeasibleError: no plan fits the full budget (explained as by `trainplan.planner.solve`).
    """
    pr = prepare(model, hw, seq_len=seq_len, data_tokens=data_tokens, vocab_size=vocab_size,
                 precision=precision, law=law, bytes_per_token=bytes_per_token, **space_options)
    pr, budget, calibration = calibrated(pr, model, budget, data, enabled=calibrate and law is None, lr=lr,
                                         seed=seed, bytes_per_token=bytes_per_token, cache_dir=cache_dir,
                                         progress=progress)
    try:
        fr = frontier_for(pr, budget, memory_limit_bytes=memory_limit_bytes,
                          budget_fractions=budget_fractions, memory_steps=memory_steps,
                          time_limit_s=time_limit_s, ladder_time_limit_s=ladder_time_limit_s,
                          seed=seed, lr=lr)
        return dataclasses.replace(fr, plan=with_calibration(fr.plan, calibration))
    except InfeasibleError as e:
        raise explain_infeasible(pr, budget, e, memory_limit_bytes=memory_limit_bytes) from e


def format_frontier(table: pd.DataFrame) -> str:
    """The frontier as a text table: GiB per device, device-hours, loss and the knobs."""
    t = pd.DataFrame({
        "": table["chosen"].map({True: "*", False: ""}),
        "GiB/device": table["memory_bytes"] / 2**30,
        "device_hours": table["cost_device_hours"],
        "loss": table["loss"],
        "sp": table["sp_degree"], "zero": table["zero_stage"], "mb": table["micro_batch"],
        "ga": table["grad_accum"],
        "opt_bits": table["optimizer_bits"], "data": table["data_fraction"],
        "tokens": table["total_tokens"], "checkpoint": table["checkpoint"],
    })
    return t.to_string(index=False, float_format=lambda v: f"{v:.4g}")
