"""Why a budget is infeasible, and the smallest change that makes it feasible.

When `trainplan.planner.joint.solver.solve_joint` finds no plan, `explain_infeasible` names the binding
constraint with both numbers, then re-solves the same CP-SAT model with one thing changed at
a time and keeps each change that the re-solve confirms:

- per-device memory: the lightest plan of the search space (every SP degree, ZeRO stage,
  micro-batch and optimizer width, each block on the same checkpoint entry; predicted by
  `StepModel.evaluate`) needs more bytes than the device (or the memory cap) has;
- the compute budget: the cheapest step of any plan that fits memory costs more than the
  budget (device-hours, wall-clock seconds or FLOPs);
- neither alone: each fits by itself but the solver's joint constraints do not (rare: its
  memory model is `StepModel.evaluate`'s with each term rounded up to 64 KiB, and the cheapest
  step and the lightest plan may be different plans).

A search that the solver's time limit ends before any plan is found is not explained: nothing
is known to bind, and its message asks for a longer limit (`explain_infeasible`).

Changes tried, each confirmed by a re-solve (named checkpoint entries only, which is quick and
loses no feasibility: `full` is on every menu):

- more devices: x2, x4, ... up to 1024 (same budget; SP stays inside a node);
- a shorter sequence: halved down to `MIN_SEQ_LEN`;
- more memory per device: from the lightest plan's peak up (a raised cap, or a device with
  that much usable memory; known profiles that have it are named);
- a larger budget: from the cheapest fitting step up;
- when no single change fits and memory binds: more devices and a shorter sequence together.

The smallest change is the one with the smallest factor (new / old, or old / new for the
sequence), more memory than any known device has ranked last. The message is one line (the CLI
prints it); the error carries `explanation` (`Explanation`) and `suggestions` (tuple of
`Suggestion`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass
from types import EllipsisType

from trainplan.costmodels.step.model import Choice, StepModel
from trainplan.errors import InfeasibleError, TrainplanError
from trainplan.hardware_profiles import known_names, load
from trainplan.planner.budget import Budget
from trainplan.planner.joint.problem import Problem, solve_problem
from trainplan.planner.joint.remat_menu import BlockMenus, named_entries
from trainplan.planner.joint.space import shapes
from trainplan.planner.plan import Plan

MAX_DEVICES = 1024
MIN_SEQ_LEN = 64
CONFIRM_TIME_S = 5.0
"""CP-SAT time limit of one confirming re-solve (feasibility is found far sooner)."""
DEADLINE_S = 90.0
"""Stop trying further changes after this many seconds."""
MEMORY_STEPS = (1.0, 1.02, 1.05, 1.1, 1.25, 1.5, 2.0)
BUDGET_STEPS = (1.01, 1.1, 1.5, 2.0, 4.0, 10.0)
GIB = 2**30
UNITS = {"device_hours": "device-hours", "wall_clock_s": "s", "flops": "FLOPs"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Suggestion:
    """One change that makes the budget feasible, confirmed by a re-solve."""

    change: str
    """`devices`, `seq_len`, `memory`, `budget` or `devices+seq_len`."""
    value: float
    """The new value: devices, tokens, usable bytes per device, or the budget in its unit;
    for `devices+seq_len`, the devices (the sequence is in `text`)."""
    current: float
    factor: float
    """Size of the change, >= 1: new / old (old / new for a shorter sequence)."""
    practical: bool = True
    """False for more memory than any known device has: ranked after the others."""
    text: str
    predicted_loss: float
    """Predicted final loss of the re-solved plan, nats/token."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Explanation:
    binding: str
    """`memory`, `budget` or `memory and budget`."""
    needed: float
    """Bytes per device (memory) or the budget unit (budget) the cheapest way needs."""
    available: float
    unit: str
    """`bytes`, or the budget's kind (`device_hours`, `wall_clock_s`, `flops`)."""
    text: str
    """One line: the diagnosis, then the smallest change and the others."""
    suggestions: tuple[Suggestion, ...]


def _budget_value(budget: Budget) -> float:
    return float(getattr(budget, budget.kind))


def _with(budget: Budget, *, devices: int | None = None, value: float | None = None) -> Budget:
    return Budget(devices=budget.devices if devices is None else devices,
                  **{budget.kind: _budget_value(budget) if value is None else value})


def survey(pr: Problem, budget: Budget, *, seq_len: int, memory_limit_bytes: float | None
           ) -> tuple[float, tuple[float, str], tuple[float, str] | None]:
    """Over the search space with every block on one named checkpoint entry: the lightest plan
    (peak bytes per device, its description) and the cheapest step (in the budget's unit) of the
    plans that fit the limit, or None when none fits. With a global batch, the SP degrees and
    micro-batches that divide it, each at its gradient accumulation (`trainplan.planner.joint.space.shapes`).

    Returns (limit_bytes, (need_bytes, text), (step_cost, text) | None).

    Raises:
        BudgetError: a global batch no SP degree and micro-batch divides."""
    sm, hw, L = pr.step_model, pr.profile, len(pr.step_model.blocks)
    limit = hw.usable_bytes if memory_limit_bytes is None else min(memory_limit_bytes, hw.usable_bytes)
    space = pr.space(budget.devices, seq_len)
    entries = named_entries(space.policies)
    lightest: tuple[float, str] | None = None
    cheapest: tuple[float, str] | None = None
    for (sp, mb, ga), zero, bits, ab in itertools.product(shapes(space, devices=budget.devices, seq_len=seq_len),
                                                          space.zero_stages, space.optimizer_bits,
                                                          space.activation_bits):
        accum = f"grad_accum={ga}, " if ga > 1 else ""
        for e in entries:
            c = Choice(sp_degree=sp, zero_stage=zero, micro_batch=mb, seq_len=seq_len,
                       policies=(e,) * L, precision=space.precision, optimizer_bits=bits,
                       devices=budget.devices, activation_bits=ab, grad_accum=ga)
            cost = sm.evaluate(c)
            desc = (f"sp_degree={sp}, zero_stage={zero}, micro_batch={mb}, {accum}{bits}-bit optimizer, "
                    f"{ab}-bit saved activations, every block on {e}")
            if lightest is None or cost.memory.total < lightest[0]:
                lightest = (cost.memory.total, desc)
            if cost.memory.total <= limit:
                step = {"device_hours": cost.time_s * budget.devices / 3600.0,
                        "wall_clock_s": cost.time_s, "flops": cost.flops * budget.devices}[budget.kind]
                if cheapest is None or step < cheapest[0]:
                    cheapest = (step, desc)
    assert lightest is not None, "a search space has at least one plan"
    return limit, lightest, cheapest


class _Search:
    """Re-solves with one change, within a deadline."""

    def __init__(self, pr: Problem, budget: Budget, seq_len: int, memory_limit_bytes: float | None,
                 deadline_s: float):
        self.pr, self.budget, self.seq_len, self.cap = pr, budget, seq_len, memory_limit_bytes
        self.named = tuple(named_entries(pr.options["policies"]))
        self.t_end = time.perf_counter() + deadline_s
        self.timed_out = False

    def feasible(self, *, budget: Budget | None = None, seq_len: int | None = None,
                 cap: float | None | EllipsisType = ..., pr: Problem | None = None) -> Plan | None:
        """The re-solved plan, or None (infeasible, or past the deadline). `cap`: a memory cap
        in bytes, None for none; default the caller's."""
        if time.perf_counter() > self.t_end:
            self.timed_out = True
            return None
        try:
            return solve_problem(pr or self.pr, budget or self.budget,
                                      seq_len=seq_len or self.seq_len,
                                      memory_limit_bytes=self.cap if cap is ... else cap,
                                      time_limit_s=CONFIRM_TIME_S, policies=self.named,
                                      diagnose=False)
        except TrainplanError:  # InfeasibleError, or a space with no SP degree
            return None


def _device_ladder(devices: int) -> list[int]:
    out, d = [], devices * 2
    while d <= MAX_DEVICES:
        out.append(d)
        d *= 2
    return out


def _seq_ladder(seq_len: int) -> list[int]:
    out, s = [], seq_len // 2
    while s >= MIN_SEQ_LEN:
        out.append(s)
        s //= 2
    return out


def _devices_change(s: _Search) -> Suggestion | None:
    for d in _device_ladder(s.budget.devices):
        plan = s.feasible(budget=_with(s.budget, devices=d))
        if plan is not None:
            return Suggestion(change="devices", value=d, current=s.budget.devices,
                              factor=d / s.budget.devices, predicted_loss=plan.predictions.final_loss,
                              text=f"{d} devices (now {s.budget.devices}, same {s.budget.kind})")
    return None


def _seq_change(s: _Search) -> Suggestion | None:
    for q in _seq_ladder(s.seq_len):
        plan = s.feasible(seq_len=q)
        if plan is not None:
            return Suggestion(change="seq_len", value=q, current=s.seq_len, factor=s.seq_len / q,
                              predicted_loss=plan.predictions.final_loss,
                              text=f"seq_len {q} (now {s.seq_len})")
    return None


def _devices_and_seq(s: _Search) -> Suggestion | None:
    for d in _device_ladder(s.budget.devices):
        for q in _seq_ladder(s.seq_len):
            plan = s.feasible(budget=_with(s.budget, devices=d), seq_len=q)
            if plan is not None:
                return Suggestion(change="devices+seq_len", value=d, current=s.budget.devices,
                                  factor=d / s.budget.devices * s.seq_len / q,
                                  predicted_loss=plan.predictions.final_loss,
                                  text=f"{d} devices and seq_len {q} together (now "
                                       f"{s.budget.devices} and {s.seq_len})")
    return None


def _memory_change(s: _Search, need: float, limit: float) -> Suggestion | None:
    """More usable bytes per device: a raised cap while the device has them, else the same
    device with more memory (a re-built step model on a copy of the profile, with its own menus)."""
    hw, sm = s.pr.profile, s.pr.step_model
    for f in MEMORY_STEPS:
        value, have = need * f, []
        if s.cap is not None and value <= hw.usable_bytes:
            plan = s.feasible(cap=value)
            how = f"a memory cap of {value / GIB:.3g} GiB per device (now {limit / GIB:.3g})"
        else:
            bigger = dataclasses.replace(hw, hbm_bytes=int(math.ceil(value)) + hw.memory_reserve_bytes)
            sm2 = StepModel(sm.regions, sm.blocks, sm.param_numels, bigger, n_heads=sm.n_heads,
                            n_kv_heads=sm.n_kv_heads, head_dim=sm.head_dim)
            plan = s.feasible(pr=dataclasses.replace(s.pr, profile=bigger, step_model=sm2, menus=BlockMenus(sm2)),
                              cap=None)
            have = sorted({load(n).name for n in known_names() if n != "cpu" and load(n).usable_bytes >= value})
            how = (f"{value / GIB:.3g} GiB usable per device (now {limit / GIB:.3g}; "
                   + (f"{', '.join(have)} {'has' if len(have) == 1 else 'have'} it)" if have
                      else "no known device has it)"))
        if plan is not None:
            return Suggestion(change="memory", value=value, current=limit, factor=value / limit,
                              predicted_loss=plan.predictions.final_loss, text=how,
                              practical=value <= hw.usable_bytes or bool(have))
    return None


def _budget_change(s: _Search, need: float) -> Suggestion | None:
    have, kind = _budget_value(s.budget), s.budget.kind
    for f in BUDGET_STEPS:
        value = need * f
        plan = s.feasible(budget=_with(s.budget, value=value))
        if plan is not None:
            return Suggestion(change="budget", value=value, current=have, factor=value / have,
                              predicted_loss=plan.predictions.final_loss,
                              text=f"a budget of {kind}={value:.3g} (now {have:g})")
    return None


def explain(pr: Problem, budget: Budget, *, seq_len: int | None = None, memory_limit_bytes: float | None = None,
            deadline_s: float = DEADLINE_S) -> Explanation:
    """Diagnose an infeasible (problem, budget) and find the smallest changes that fit.

    `pr` is a `trainplan.planner.joint.problem.Problem`. Each suggestion is confirmed by re-solving the joint model.
    Raises:
        TrainplanError: the problem's search space is invalid at these sizes.
    """
    seq_len = pr.seq_len if seq_len is None else seq_len
    limit, (need, light_desc), cheapest = survey(pr, budget, seq_len=seq_len,
                                                 memory_limit_bytes=memory_limit_bytes)
    have, kind = _budget_value(budget), budget.kind
    where = "the memory cap allows" if memory_limit_bytes is not None and memory_limit_bytes < pr.profile.usable_bytes \
        else f"{pr.profile.name} has"
    if need > limit or cheapest is None:
        binding, needed, available, unit = "memory", need, limit, "bytes"
        text = (f"per-device memory binds: the lightest plan ({light_desc}, seq_len {seq_len}, "
                f"{budget.devices} device(s)) needs {need / GIB:.3g} GiB but {where} "
                f"{limit / GIB:.3g} GiB usable")
    elif cheapest[0] > have:
        binding, needed, available, unit = "budget", cheapest[0], have, kind
        text = (f"the compute budget binds: one step of the cheapest plan that fits memory "
                f"({cheapest[1]}) costs {cheapest[0]:.3g} {UNITS[kind]} but the budget is "
                f"{kind}={have:g} on {budget.devices} device(s)")
    else:
        binding, needed, available, unit = "memory and budget", need, limit, "bytes"
        text = (f"memory and budget bind together: the lightest plan fits alone ({need / GIB:.3g} "
                f"of {limit / GIB:.3g} GiB) and so does one step ({cheapest[0]:.3g} of {have:g} "
                f"{UNITS[kind]}), but the solver finds no plan within both")
    s = _Search(pr, budget, seq_len, memory_limit_bytes, deadline_s)
    tried = [_devices_change(s), _seq_change(s)]
    if binding != "budget":
        tried.append(_memory_change(s, need, limit))
    if binding != "memory":
        assert cheapest is not None  # the budget binds only where some plan fits memory
        tried.append(_budget_change(s, cheapest[0]))
    found = [x for x in tried if x is not None]
    if binding == "memory" and not any(x.change in ("devices", "seq_len") for x in found):
        both = _devices_and_seq(s)
        found += [both] if both else []
    found.sort(key=lambda x: (not x.practical, x.factor))
    if found:
        text += f"; smallest change that fits (re-solved): {found[0].text}"
        if len(found) > 1:
            text += "; also " + "; ".join(x.text for x in found[1:])
    else:
        text += (f"; no change tried fits (up to {MAX_DEVICES} devices, seq_len down to "
                 f"{MIN_SEQ_LEN}, more memory or budget)")
    if s.timed_out:
        text += f" (search stopped after {deadline_s:g} s)"
    return Explanation(binding=binding, needed=float(needed), available=float(available), unit=unit,
                       text=text, suggestions=tuple(found))


def explain_infeasible(pr: Problem, budget: Budget, err: InfeasibleError, *,
                       memory_limit_bytes: float | None = None, seq_len: int | None = None,
                       deadline_s: float = DEADLINE_S) -> InfeasibleError:
    """`err` explained: a new InfeasibleError whose message is `explain`'s line, with
    `explanation`, `suggestions` and `binding` attributes (the solver's message is kept as
    `solver_message`). Falls back to `err` when the explanation itself fails, beyond
    `MAX_DEVICES` devices (the survey's exact replays grow with the device count), and when the
    solver's time limit ended the search before any plan was found (its `binding` is
    "time limit": its message asks for a longer limit; nothing is known to bind)."""
    if budget.devices > MAX_DEVICES or getattr(err, "binding", None) == "time limit":
        return err  # a search cut short by the time limit: no constraint binds
    try:
        ex = explain(pr, budget, seq_len=seq_len, memory_limit_bytes=memory_limit_bytes,
                     deadline_s=deadline_s)
    except TrainplanError:
        return err
    out = InfeasibleError(ex.text)
    out.explanation, out.suggestions, out.binding = ex, ex.suggestions, ex.binding
    out.solver_message = str(err)
    return out
