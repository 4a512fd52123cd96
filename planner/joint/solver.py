"""The joint CP-SAT model: every knob of a Plan in one OR-Tools model.

Written in the OR-Tools sample order: data, variables, constraints, objective, solve, read
the solution. The cost models are nonlinear in the knobs (activation bytes scale with
micro-batch x sequence / SP degree; time with the checkpoint mix), so the model enumerates
the small product of discrete "shape" knobs as one-hot `combo` literals and keeps everything
linear given a combo: the checkpoint choice is a count of blocks per menu entry (identical
blocks are interchangeable), the stopping budget a one-hot over geometric token levels, the
data fraction a one-hot, and the objective a table lookup of the scaling law.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from trainplan.costmodels.checkpoint_sets import BUILTIN, MENU, resolve
from trainplan.costmodels.loss.bits import bits_loss_penalty
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.planned import run_loss
from trainplan.costmodels.step.model import Choice, StepModel
from trainplan.errors import InfeasibleError
from trainplan.hardware_profiles import HardwareProfile
from trainplan.planner.budget import Budget
from trainplan.planner.joint.combos import (
    BYTES_PER_UNIT,
    Combo,
    combo_memory,
    fits_uniform,
    long_context_combos,
    make_combo,
    memory_rows,
    phase_peaks,
    units,
)
from trainplan.planner.joint.polish import best_spent
from trainplan.planner.joint.remat_menu import (
    BlockMenus,
    MenuSource,
    add_menus,
    by_recompute,
    menu_index,
    named_entries,
)
from trainplan.planner.joint.search import (
    budget_cap,
    budget_infeasible,
    budget_terms,
    lightest_uniform,
    memory_infeasible,
    prune_narrower,
    spent,
    undominated,
    uniform_start,
)
from trainplan.planner.joint.space import SearchSpace, shapes
from trainplan.planner.plan import relative_gap

LOSS_PER_UNIT = 1e-5            # objective resolution, nats
TOKEN_LEVELS = 48
POLISH_LEVELS = 10**6            # resolution of the step cost in the polish solve
POLISH_TIME_S = 0.5               # deterministic seconds of each polish solve, at most
WORK_PER_S = 1.0
"""CP-SAT deterministic time per second of a time limit (`_deterministic`): its units are about
a second of one core's work (CP-SAT calibrates them so)."""
WALL_SAFETY = 10.0
"""A solve's wall-clock cap, as a multiple of its time limit (plus as many seconds): only a
machine far slower or busier than CP-SAT's calibration reaches it, where the result again
depends on machine load."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Solution:
    choice: Choice
    data_fraction: float
    total_tokens: int
    max_steps: int
    tokens_per_step: int
    predicted_loss: float
    status: str
    objective: float
    bound: float
    wall_s: float
    n_variables: int
    n_constraints: int
    memory_phases: dict[str, float] = field(default_factory=dict)
    """The joint model's bytes per device at each phase kind for the plan (`trainplan.planner.joint.combos.
    phase_peaks`): exactly what `StepModel.evaluate(choice).memory` predicts there."""

    @property
    def peak_bytes(self) -> float:
        """The joint model's predicted peak bytes per device of the plan."""
        return max(self.memory_phases.values(), default=0.0)


def solve_joint(step_model: StepModel, hw: HardwareProfile, budget: Budget, *, seq_len: int,
                space: SearchSpace, n_params: int, data_tokens: int, law: LossLaw,
                memory_limit_bytes: float | None = None, time_limit_s: float = 10.0, seed: int = 0,
                workers: int = 1, export_path: str | None = None, diagnose: bool = True,
                menus: MenuSource | None = None) -> Solution:
    """Choose all knobs jointly to minimise predicted final loss, ties broken by cost.

    time_limit_s: the search's limit in deterministic seconds (`_deterministic`: the same plan
        under any machine load; wall time varies); `workers`: CP-SAT workers (more than one
        interleave, still deterministic).
    diagnose: when nothing fits memory, find the lightest plan for the message (an exact
        replay of every dropped combo; `trainplan.planner.joint.explain` passes False and surveys itself).
    menus: where each block shape's solved menu comes from when the space has `remat` (default:
        menus solved for this call alone; a `Problem`'s own `BlockMenus` keep them across solves).

    The plan's tokens per step are those of one optimizer step: with `space.global_batch_tokens`
    every combo's (`trainplan.planner.joint.space.shapes` sets each one's gradient accumulation); its step
    count is the optimizer steps that reach the chosen token level.

    Raises:
        BudgetError: a global batch that no SP degree and micro-batch of the space divides.
        InfeasibleError: nothing fits memory, or the budget buys no step; the message names the
            binding term with both numbers and what to relax. When the time limit ends the
            search before any plan is found, the message says so and asks for a longer limit
            (the error's `binding` is "time limit").
    """
    t0 = time.perf_counter()
    # ---- data -------------------------------------------------------------------------
    devices = budget.devices
    L = len(step_model.blocks)
    limit = hw.usable_bytes if memory_limit_bytes is None else min(memory_limit_bytes, hw.usable_bytes)
    named = named_entries(space.policies)
    combos: list[Combo] = []
    dropped: list[Choice] = []
    # gradient accumulation: set by the global batch per SP degree and micro-batch (1 without one)
    accum = {(sp, mb): ga for sp, mb, ga in shapes(space, devices=devices, seq_len=seq_len)}
    for sp, zero, mb, ob, ab in itertools.product(space.sp_degrees, space.zero_stages, space.micro_batches,
                                                  space.optimizer_bits, space.activation_bits):
        if (sp, mb) not in accum:
            continue  # the global batch is not a whole number of these micro-steps
        base = Choice(sp_degree=sp, zero_stage=zero, micro_batch=mb, seq_len=seq_len,
                      policies=("none",) * L, precision=space.precision, optimizer_bits=ob,
                      devices=devices, activation_bits=ab, grad_accum=accum[(sp, mb)])
        memory = combo_memory(step_model, base)  # bytes per device, as StepModel.evaluate composes them
        # head forward / backward, root reduce-scatter, optimizer
        if max(memory.fixed_phase_bytes.values()) > limit:
            dropped.append(base)
            continue
        combos.append(make_combo(step_model, base, {e: resolve(e) for e in named}, memory))
    if not space.long_context_when_needed or not any(fits_uniform(c, e, L, limit) for c in combos for e in named):
        combos += [v for c in list(combos) for v in long_context_combos(step_model, c, space, named, limit)]
    if not combos and not diagnose:
        raise InfeasibleError(f"per-device memory binds: no plan fits {limit / 2**30:.3g} GiB")
    if not combos:
        raise memory_infeasible(lightest_uniform(step_model, dropped, named), limit, hw, seq_len,
                                 capped=memory_limit_bytes is not None)
    bits_pen = {(ob, ab): bits_loss_penalty(ob, ab, precision=space.precision, penalty=law.bits)
                for ob in space.optimizer_bits for ab in space.activation_bits}
    wall = budget.wall_s_for(devices)
    combos = prune_narrower(combos, L, int(limit // BYTES_PER_UNIT), bits_pen, wall)
    if MENU in space.policies:
        combos = add_menus(step_model, combos, limit, BlockMenus(step_model) if menus is None else menus)
    combos = undominated(combos)
    # checkpoint entries: the named ones, then solved `remat:k` (absent from a combo's menu: 0 blocks,
    # its costs read as `full`'s, `Combo.cost_of`)
    entries = named + sorted({e for c in combos for e in c.menu} - set(named), key=menu_index)
    # token levels: from one step of the smallest batch to the most the budget could buy
    best_rate = max(c.tokens_per_step / (c.fixed_s + L * min(x.block_s for x in c.menu.values()))
                    for c in combos)
    if wall is not None:
        max_tokens = best_rate * wall
    else:
        max_tokens = max(c.tokens_per_step / (min(x.step_flops for x in c.menu.values()) * devices)
                         for c in combos) * budget_cap(budget, wall)
    min_tokens = min(c.tokens_per_step for c in combos)
    if max_tokens < min_tokens:
        raise InfeasibleError(
            f"budget {budget.kind}={getattr(budget, budget.kind):g} buys less than one step: the "
            f"fastest plan needs {min_tokens / best_rate:.3g} s per step on {devices} device(s); "
            "raise the budget or shorten the sequence")
    levels = sorted({int(min_tokens * (max_tokens / min_tokens) ** (k / (TOKEN_LEVELS - 1)))
                     for k in range(TOKEN_LEVELS)})
    # loss at each (token level, data fraction, global batch): the batch term (critical batch,
    # `trainplan.costmodels.loss.batch`) and the warmup make the loss depend on the tokens per step
    batches = sorted({c.tokens_per_step for c in combos})
    loss = {(k, f, g): run_loss(law, n_params, steps=max(1.0, levels[k] / g), tokens_per_step=g,
                                unique_tokens=max(1.0, f * data_tokens))
            for k in range(len(levels)) for f in space.data_fractions for g in batches}
    # a fraction no better than the whole corpus at every level never wins (ties go to more data)
    full = max(space.data_fractions)
    fractions = [f for f in space.data_fractions if f == full or any(
        loss[(k, f, g)] < loss[(k, full, g)] for k in range(len(levels)) for g in batches)]
    loss = {kfg: v for kfg, v in loss.items() if kfg[1] in fractions}

    # ---- variables --------------------------------------------------------------------
    m = cp_model.CpModel()
    z = [m.new_bool_var(f"combo_sp{c.choice.sp_degree}_z{c.choice.zero_stage}_mb{c.choice.micro_batch}"
                        f"_ga{c.choice.grad_accum}_b{c.bits[0]}_a{c.bits[1]}_l{c.choice.loss_chunks}"
                        f"_m{c.choice.mlp_chunks}_o{int(c.choice.offload)}") for c in combos]  # shape knobs
    n = {e: m.new_int_var(0, L, f"blocks_{e}") for e in entries}  # blocks per checkpoint entry
    y = [m.new_bool_var(f"tokens_{t}") for t in levels]  # stopping budget level
    x = {f: m.new_bool_var(f"fraction_{f}") for f in fractions}  # data fraction
    w = {kfg: m.new_bool_var(f"loss_{kfg[0]}_{kfg[1]}_{kfg[2]}") for kfg in loss}  # y_k AND x_f AND batch g
    gb = {g: m.new_bool_var(f"batch_{g}") for g in batches}  # the global batch, tokens per step

    # ---- constraints ------------------------------------------------------------------
    m.add_exactly_one(z)
    m.add_exactly_one(y)
    m.add_exactly_one(x.values())
    m.add(sum(n.values()) == L)  # [Constraint] every block has one checkpoint entry
    for g, v in gb.items():  # the chosen combo's global batch (one-hot, as z is)
        m.add(v == sum(zc for zc, c in zip(z, combos, strict=False) if c.tokens_per_step == g))
    for k, yk in enumerate(y):  # w = y_k AND x_f AND batch g: one of level k's cells iff level k
        m.add(sum(v for (k2, _, _), v in w.items() if k2 == k) == yk)
    for f, xf in x.items():
        m.add(sum(v for (_, f2, _), v in w.items() if f2 == f) == xf)
    for g, v_g in gb.items():
        m.add(sum(v for (_, _, g2), v in w.items() if g2 == g) == v_g)
    u = {e: m.new_bool_var(f"uses_{e}") for e in entries}  # some block takes entry e
    for e in entries:
        m.add(n[e] >= u[e])
        m.add(n[e] <= L * u[e])
    mem_cap = int(limit // BYTES_PER_UNIT)
    for zc, c in zip(z, combos, strict=False):
        for e in entries:  # [Constraint] only entries on this combo's menu
            if e not in c.menu:
                m.add(n[e] == 0).only_enforce_if(zc)
        # [Constraint] per-device memory <= HBM - reserve, at every phase of the step
        # (`memory_rows`: blocks in order of retained bytes, each term rounded up to a unit)
        order = sorted(entries, key=lambda e: c.cost_of(e).retained_bytes)
        for _, row_entry, row in memory_rows(c, order, n, lambda v: units(v, BYTES_PER_UNIT)):
            m.add(row <= mem_cap).only_enforce_if([zc] if row_entry is None else [zc, u[row_entry]])
        # [Constraint] compute <= budget, at each token level
        per_step, fixed_cost, cap, scale = budget_terms(c, entries, L, wall, budget, devices)
        for k, tokens in enumerate(levels):
            steps = math.ceil(tokens / c.tokens_per_step)
            m.add(sum(n[e] * units(steps * per_step[e], scale) for e in n)
                  + units(steps * fixed_cost, scale) <= int(cap / scale)).only_enforce_if([zc, y[k]])

    # ---- objective: lowest predicted loss, then fewest device-seconds ------------------
    loss_terms = [v * int(round((loss[kf]) / LOSS_PER_UNIT)) for kf, v in w.items()]
    pen_terms = [zc * int(round(bits_pen[c.bits] / LOSS_PER_UNIT)) for zc, c in zip(z, combos, strict=False)]
    # ties, in order: fewer tokens (cost), more of the corpus (a random subset never helps),
    # less recompute (entries ranked from least to most recomputing; the polish below then
    # takes the cheapest blocks at the chosen knobs)
    fr_rank = {f: i for i, f in enumerate(sorted(fractions, reverse=True))}
    remat_rank = [n[e] * i for i, e in enumerate(by_recompute(entries))]
    # last: of equal loss, the widest bits (no compression work; at equal penalty 32/16-bit
    # saved activations cost quantize passes)
    bits_order = sorted(bits_pen, key=lambda b: (bits_pen[b], -b[0], -b[1]))
    bits_rank = [zc * bits_order.index(c.bits) for zc, c in zip(z, combos, strict=False)]
    w_remat = (len(entries) - 1) * L + len(bits_order)
    tie_terms = [y[k] * k * len(fr_rank) for k in range(len(levels))] + [v * fr_rank[f] for f, v in x.items()]
    w_ties = (len(levels) + 1) * len(fr_rank) * w_remat
    m.minimize(w_ties * (sum(loss_terms) + sum(pen_terms)) + w_remat * sum(tie_terms) + sum(remat_rank)
               + sum(bits_rank))
    # hint: the best plan with every block on one entry that fits (a feasible start), else
    # the plain plan (no checkpointing)
    start = uniform_start(combos, entries, L, mem_cap, levels, fractions,
                          lambda c: budget_terms(c, entries, L, wall, budget, devices),
                          loss=lambda k, f, c: loss[(k, f, c.tokens_per_step)] + bits_pen[c.bits])
    if start is None:
        m.add_hint(n[entries[0]], L)
    else:
        hi, he, hk, hf = start
        for i, zc in enumerate(z):
            m.add_hint(zc, i == hi)
        for e in entries:
            m.add_hint(n[e], L if e == he else 0)
            m.add_hint(u[e], e == he)
        for k2, v in enumerate(y):
            m.add_hint(v, k2 == hk)
        for f2, v in x.items():
            m.add_hint(v, f2 == hf)
        for kfg, v in w.items():
            m.add_hint(v, kfg == (hk, hf, combos[hi].tokens_per_step))
        for g, v in gb.items():
            m.add_hint(v, g == combos[hi].tokens_per_step)

    # ---- solve ------------------------------------------------------------------------
    solver = cp_model.CpSolver()
    _deterministic(solver.parameters, time_limit_s, seed, workers)
    if export_path:
        m.export_to_file(export_path)
    status = solver.solve(m)
    if status == cp_model.INFEASIBLE and start is not None:
        # the start is a complete hint CP-SAT itself checks as feasible ("The solution hint is
        # complete and is feasible"); OR-Tools 9.15's presolve can still end INFEASIBLE on
        # this model with the loss table's global-batch axis (tiny-llama on an H100 at 512
        # tokens, 0.415 device-hours: 'linear: never in domain' after presolve): search without it
        solver.parameters.cp_model_presolve = False
        status = solver.solve(m)
    n_variables, n_constraints = len(m.proto.variables), len(m.proto.constraints)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        # ---- read the solution --------------------------------------------------------
        ci = next(i for i, v in enumerate(z) if solver.value(v))
        k = next(i for i, v in enumerate(y) if solver.value(v))
        f = next(fr for fr, v in x.items() if solver.value(v))
        counts = {e: solver.value(n[e]) for e in n}
        objective, bound, status_name = solver.objective_value, solver.best_objective_bound, solver.status_name(status)
    elif start is not None and status == cp_model.UNKNOWN:  # out of time before a solution: the start
        ci, he, k, f = start
        counts = {e: L if e == he else 0 for e in n}
        objective, bound, status_name = 1.0, 0.0, "START"  # no bound proven: a gap of 100%
    elif status == cp_model.UNKNOWN:  # the limit ended the search: nothing is proven infeasible
        err = InfeasibleError(
            f"no plan found within the solver time limit of {time_limit_s:g} deterministic s (the search stopped "
            "before finding one; memory and the budget may still allow a plan): raise --time-limit "
            "(time_limit_s)")
        err.binding = "time limit"
        raise err
    else:
        raise budget_infeasible(combos, L, mem_cap, wall, budget, devices, levels[0])
    c = combos[ci]
    # ---- polish: the token levels are a grid, so at the chosen token level and data fraction
    # (and optimizer bits: the same loss) take the combo and entries with the least cost per
    # token (seconds under a time budget, FLOPs under a FLOP budget)
    def per_token(c2: Combo) -> tuple[float, dict[str, float]]:
        if wall is not None:
            return c2.fixed_s / c2.tokens_per_step, {e: c2.cost_of(e).block_s / c2.tokens_per_step for e in entries}
        return 0.0, {e: c2.cost_of(e).step_flops / L / c2.tokens_per_step for e in entries}

    costs = [per_token(c2) for c2 in combos]
    unit = max(fx + L * max(bl.values()) for fx, bl in costs) / POLISH_LEVELS
    cost_units = [(units(fx, unit), {e: units(bl[e], unit) for e in entries}) for fx, bl in costs]
    tie_units = None
    if wall is None:  # a FLOP budget: of equal FLOPs per token, the faster tokens
        tunit = max((c2.fixed_s + L * max(x.block_s for x in c2.menu.values())) / c2.tokens_per_step
                    for c2 in combos) / POLISH_LEVELS
        tie_units = [(units(c2.fixed_s / c2.tokens_per_step, tunit),
                      {e: units(c2.cost_of(e).block_s / c2.tokens_per_step, tunit) for e in entries})
                     for c2 in combos]

    def configure(s: cp_model.CpSolver) -> None:
        _deterministic(s.parameters, min(time_limit_s, POLISH_TIME_S), seed, 1)

    # The CP-SAT objective reads the loss table at a grid level, but the plan spends the whole
    # budget (`spent`): a larger global batch that buys more tokens within the same level
    # looked worse there (its batch term) and lost, while its spent loss was lower (issue #40:
    # a 0.49B Qwen2 on 8 x h100, micro-batch 2 at 2.559 nats against micro-batch 8 at 2.547).
    # So every (global batch, width group) is polished and scored by its spent loss, and the
    # data fraction re-chosen by it: exact over every micro-batch and accumulation offered.
    incumbent = (spent(c, counts, L, wall, budget, devices, law, n_params, f, data_tokens, levels[k],
                       bits_pen), c, counts, f)
    (loss_nats, steps), c, counts_read, f = best_spent(
        combos, entries, L, mem_cap, wall, budget, devices, law, n_params, data_tokens, fractions, bits_pen,
        incumbent, cost_units, tie_units, configure)
    counts = dict(counts_read)
    # most-saving entries on the earliest blocks: their activations live the longest
    order = sorted(entries, key=lambda e: c.cost_of(e).retained_bytes)
    policies = tuple(e for e in order for _ in range(counts[e]))
    choice = dataclasses.replace(c.choice, policies=policies,
                                 sets=tuple(c.menu[e].entry for e in entries if counts[e] and e not in BUILTIN))
    return Solution(choice=choice, data_fraction=f, total_tokens=steps * c.tokens_per_step,
                    max_steps=steps, tokens_per_step=c.tokens_per_step,
                    predicted_loss=loss_nats,  # `spent`'s: the law at the steps the budget buys, with the bits penalty
                    status=status_name, objective=loss_nats,
                    bound=loss_nats - relative_gap(status_name, objective, bound) * abs(loss_nats),
                    wall_s=time.perf_counter() - t0,
                    n_variables=n_variables, n_constraints=n_constraints,
                    memory_phases=phase_peaks(c, counts, order))


def _deterministic(params, time_limit_s: float, seed: int, workers: int) -> None:
    """Solver parameters under which the same model, seed and limit give the same result under
    any machine load. The limit is CP-SAT's deterministic time (work counted, not seconds:
    `max_deterministic_time`, `WORK_PER_S` per second); one worker searches sequentially, and
    more interleave their search in fixed batches (`interleave_search`: "the search is
    deterministic (independently of num_workers!)", OR-Tools 9.15 `sat_parameters.proto`); a
    wall-clock cap of `WALL_SAFETY` times the limit stops a solve on a far slower machine.
    One worker is the default: on these models it reaches the optimum with less work than two
    interleaved (measured: llama3-70b at 128K on 8 x mi300, llama3.1-405b on 1024)."""
    params.max_deterministic_time = time_limit_s * WORK_PER_S
    params.max_time_in_seconds = WALL_SAFETY * (time_limit_s + 1.0)
    params.interleave_search = workers > 1
    params.num_workers = workers
    params.random_seed = seed
